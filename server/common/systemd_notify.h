// The systemd service protocol (sd_notify(3)): readiness, status, watchdog
// and stopping notifications for a daemon run as a Type=notify unit.
//
// Every call is a no-op returning false when $NOTIFY_SOCKET is unset (not
// started by systemd, or started by a test without it), so the daemon calls
// them unconditionally. Thread-safe: each call is one datagram.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/string_view.h"
#include "server/common/mutex.h"

namespace opjit::systemd {

// READY=1: startup finished, the service serves. Send it once.
bool NotifyReady();
// STOPPING=1: shutdown has begun.
bool NotifyStopping();
// STATUS=<text>: one line shown by `systemctl status`.
bool NotifyStatus(absl::string_view text);
// WATCHDOG=1: one keep-alive ping.
bool NotifyWatchdog();

// The interval systemd expects watchdog pings within (WATCHDOG_USEC, when
// WATCHDOG_PID is unset or this process), or 0 when there is no watchdog.
std::chrono::microseconds WatchdogInterval();

// Sends READY=1 once both have happened, in either order: startup finished
// (StartupDone) and the health monitor reported SERVING (SetServing(true)).
// Each health report is also sent as STATUS=. Thread-safe.
class ReadyGate {
 public:
  void StartupDone();
  void SetServing(bool serving, absl::string_view why);

 private:
  void MaybeSendLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool sent_ ABSL_GUARDED_BY(mu_) = false;
};

// Sends WATCHDOG=1 every `interval / 2` from its own thread, but only while
// `healthy()` returns true: a daemon that is wedged (healthy() blocks) or
// unhealthy for longer than the interval misses its pings and systemd
// restarts it. Thread-safe; the destructor stops the thread.
class WatchdogPinger {
 public:
  // nullptr when WatchdogInterval() is 0 (no watchdog asked for).
  static std::unique_ptr<WatchdogPinger> Start(std::function<bool()> healthy);
  ~WatchdogPinger();
  WatchdogPinger(const WatchdogPinger&) = delete;
  WatchdogPinger& operator=(const WatchdogPinger&) = delete;

  std::chrono::microseconds period() const { return period_; }

 private:
  WatchdogPinger(std::chrono::microseconds period, std::function<bool()> healthy);
  void Loop();

  const std::chrono::microseconds period_;
  const std::function<bool()> healthy_;

  Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace opjit::systemd

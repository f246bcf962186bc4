#include "server/common/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <cstdint>
#include <string>
#include <utility>

#include "server/common/logging.h"

namespace opjit::systemd {
namespace {

// sd_notify() answers 0 without $NOTIFY_SOCKET, > 0 once sent, < 0 on error.
bool Send(const std::string& state) {
  const int r = sd_notify(/*unset_environment=*/0, state.c_str());
  if (r < 0) Logger("systemd")->warn("sd_notify({}) failed: errno {}", state, -r);
  return r > 0;
}

}  // namespace

bool NotifyReady() { return Send("READY=1"); }
bool NotifyStopping() { return Send("STOPPING=1"); }
bool NotifyWatchdog() { return Send("WATCHDOG=1"); }

bool NotifyStatus(absl::string_view text) {
  std::string line(text);
  // The protocol is newline-separated assignments: a newline would start one.
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return Send("STATUS=" + line);
}

std::chrono::microseconds WatchdogInterval() {
  uint64_t usec = 0;
  // Checks WATCHDOG_PID against getpid(): a child that inherited the
  // variables gets 0.
  if (sd_watchdog_enabled(/*unset_environment=*/0, &usec) <= 0) return std::chrono::microseconds(0);
  return std::chrono::microseconds(usec);
}

void ReadyGate::StartupDone() {
  MutexLock lock(&mu_);
  started_ = true;
  MaybeSendLocked();
}

void ReadyGate::SetServing(bool serving, absl::string_view why) {
  NotifyStatus(serving ? std::string("serving") : "not serving: " + std::string(why));
  MutexLock lock(&mu_);
  serving_ = serving;
  MaybeSendLocked();
}

void ReadyGate::MaybeSendLocked() {
  if (sent_ || !started_ || !serving_) return;
  sent_ = true;
  if (NotifyReady()) Logger("systemd")->info("READY=1 sent");
}

std::unique_ptr<WatchdogPinger> WatchdogPinger::Start(std::function<bool()> healthy) {
  const std::chrono::microseconds interval = WatchdogInterval();
  if (interval.count() <= 0) return nullptr;
  return std::unique_ptr<WatchdogPinger>(new WatchdogPinger(interval / 2, std::move(healthy)));
}

WatchdogPinger::WatchdogPinger(std::chrono::microseconds period, std::function<bool()> healthy)
    : period_(period), healthy_(std::move(healthy)), thread_([this] { Loop(); }) {}

WatchdogPinger::~WatchdogPinger() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void WatchdogPinger::Loop() {
  auto log = Logger("systemd");
  bool was_healthy = true;
  MutexLock lock(&mu_);
  while (!stop_) {
    lock.Unlock();
    const bool healthy = healthy_();
    if (healthy) NotifyWatchdog();
    if (healthy != was_healthy) {
      if (healthy) {
        log->info("healthy again: watchdog pings resume");
      } else {
        log->warn("not healthy: watchdog pings withheld (systemd restarts the daemon after {} ms)",
                  std::chrono::duration_cast<std::chrono::milliseconds>(period_ * 2).count());
      }
      was_healthy = healthy;
    }
    lock.Lock();
    // cv.wait_for(lock, period_, pred): until stop_ or the period passed.
    const auto wake = std::chrono::steady_clock::now() + period_;
    while (!stop_ && cv_.WaitUntil(&mu_, wake)) {
    }
  }
}

}  // namespace opjit::systemd

// One named spdlog logger per subsystem ("rpc", "registry", "compiler",
// "cache", "loader", "exec", "autograd", "main"). Loggers are created on first
// use and share the process-wide sink and level.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace opjit {

// Returns the logger for `subsystem`, creating it on first use.
std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem);

// Sets the level of every existing and future logger. `level` is one of
// trace, debug, info, warn, error, critical, off. Unknown names keep "info".
void SetLogLevel(const std::string& level);

// Lets one message through per interval, for logs an attacker can trigger at
// will (undecodable requests, ...). Thread-safe, lock-free.
class LogLimiter {
 public:
  explicit LogLimiter(int64_t interval_ms = 1000) : interval_ns_(interval_ms * 1000000) {}
  // True when this call may log. `*suppressed` is then the number of calls
  // refused since the last one that logged.
  bool Allow(uint64_t* suppressed);

 private:
  const int64_t interval_ns_;
  std::atomic<int64_t> next_ns_{0};
  std::atomic<uint64_t> suppressed_{0};
};

}  // namespace opjit

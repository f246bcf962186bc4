#include "server/common/logging.h"

#include <chrono>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "server/common/mutex.h"

namespace opjit {
namespace {

Mutex& Mu() {
  static Mutex mu;
  return mu;
}

// The level new loggers get; set by SetLogLevel.
spdlog::level::level_enum& Level() ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
  static spdlog::level::level_enum level = spdlog::level::info;
  return level;
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem) {
  if (auto existing = spdlog::get(subsystem)) return existing;
  MutexLock lock(&Mu());
  if (auto existing = spdlog::get(subsystem)) return existing;
  // Logs go to stderr so stdout stays free for tools that print results.
  auto logger = spdlog::stderr_color_mt(subsystem);
  logger->set_level(Level());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ [%n] %v");
  return logger;
}

void SetLogLevel(const std::string& level) {
  MutexLock lock(&Mu());
  auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") parsed = spdlog::level::info;
  Level() = parsed;
  spdlog::apply_all([parsed](const std::shared_ptr<spdlog::logger>& l) { l->set_level(parsed); });
}

}  // namespace opjit

namespace opjit {

bool LogLimiter::Allow(uint64_t* suppressed) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  int64_t next = next_ns_.load(std::memory_order_relaxed);
  if (now < next || !next_ns_.compare_exchange_strong(next, now + interval_ns_)) {
    suppressed_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *suppressed = suppressed_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace opjit

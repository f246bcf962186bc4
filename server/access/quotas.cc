#include "server/access/quotas.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/common/error_info.h"

namespace opjit::access {

QuotaManager::CompileTicket::~CompileTicket() { owner_->EndCompile(ns_, start_, charge_); }

double QuotaManager::UsedLocked(Space& space, Clock::time_point now) {
  while (!space.recent.empty() && now - space.recent.front().first > std::chrono::seconds(60)) {
    space.recent.pop_front();
  }
  double used = 0;
  for (const auto& [t, s] : space.recent) used += s;
  return used;
}

absl::StatusOr<std::unique_ptr<QuotaManager::CompileTicket>> QuotaManager::BeginCompile(
    const std::string& ns) {
  const Clock::time_point now = clock_->Now();
  absl::MutexLock lock(&mu_);
  Space& space = spaces_[ns];
  if (options_.concurrent_compiles > 0 && space.compiling >= options_.concurrent_compiles) {
    return QuotaExceeded("concurrent_compiles", absl::StrCat(options_.concurrent_compiles), ns,
                         "that many compiles of this namespace are running; retry when one ends");
  }
  if (options_.compile_seconds_per_minute > 0) {
    const double used = UsedLocked(space, now);
    if (used >= options_.compile_seconds_per_minute) {
      return QuotaExceeded(
          "compile_seconds_per_minute", absl::StrFormat("%g", options_.compile_seconds_per_minute),
          ns,
          absl::StrFormat("the namespace compiled for %.1f s in the last minute; retry later",
                          used));
    }
  }
  ++space.compiling;
  return std::make_unique<CompileTicket>(this, ns, now);
}

void QuotaManager::EndCompile(const std::string& ns, Clock::time_point start, double charge) {
  const Clock::time_point now = clock_->Now();
  absl::MutexLock lock(&mu_);
  Space& space = spaces_[ns];
  space.compiling = std::max(0, space.compiling - 1);
  space.recent.emplace_back(
      now, charge >= 0 ? charge : std::chrono::duration<double>(now - start).count());
  UsedLocked(space, now);
}

absl::Status QuotaManager::AdmitCall(const std::string& ns) {
  return AdmitCalls(ns, 1).status();
}

absl::StatusOr<uint64_t> QuotaManager::AdmitCalls(const std::string& ns, uint64_t n) {
  if (calls_per_second_.load(std::memory_order_relaxed) <= 0 || n == 0) return n;
  const Clock::time_point now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (options_.calls_per_second <= 0) return n;  // lifted by a reload meanwhile
  Space& space = spaces_[ns];
  const double burst = std::max(1.0, options_.calls_per_second);
  if (space.tokens < 0) {
    space.tokens = burst;
  } else {
    const double dt = std::chrono::duration<double>(now - space.refilled).count();
    space.tokens = std::min(burst, space.tokens + dt * options_.calls_per_second);
  }
  space.refilled = now;
  if (space.tokens < 1) {
    return QuotaExceeded("calls_per_second", absl::StrFormat("%g", options_.calls_per_second), ns,
                         "slow down, or ask the operator for a higher quota");
  }
  const uint64_t granted =
      std::min<uint64_t>(n, static_cast<uint64_t>(std::floor(space.tokens)));
  space.tokens -= static_cast<double>(granted);
  return granted;
}

uint64_t QuotaManager::CallCreditBatch() const {
  const double rate = calls_per_second_.load(std::memory_order_relaxed);
  if (rate <= 0) return 4096;
  return static_cast<uint64_t>(std::clamp(std::floor(rate / 50), 1.0, 64.0));
}

QuotaOptions QuotaManager::options() const {
  absl::MutexLock lock(&mu_);
  return options_;
}

void QuotaManager::SetOptions(const QuotaOptions& options) {
  absl::MutexLock lock(&mu_);
  options_ = options;
  calls_per_second_.store(options.calls_per_second, std::memory_order_relaxed);
  // A full bucket is the new second's worth: a lowered rate takes effect at
  // once, not after the old burst drains.
  const double burst = std::max(1.0, options.calls_per_second);
  for (auto& [ns, space] : spaces_) {
    if (space.tokens > burst) space.tokens = burst;
  }
}

}  // namespace opjit::access

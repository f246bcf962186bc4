// Per-namespace rate and concurrency quotas that no single subsystem owns:
// concurrent compiles, compile seconds per minute, calls per second.
// (Shared memory, context bytes, executor processes and ops/versions are
// bounded where they live: RegionManager, Autograd, ProcessRunner, Registry.)
//
// Exceeding one is RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED naming the
// quota and its value. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/clock.h"

namespace opjit::access {

struct QuotaOptions {
  // Compiles (bare or at registration, cache hits included) in flight at
  // once per namespace. 0: no bound. Default: 8.
  int concurrent_compiles = 8;
  // Seconds of compiling per namespace in any 60 s window: the compile
  // workers' own time (a worker is single-threaded, so this is its CPU
  // time); cache hits cost nothing, a failed compile its wall time. A
  // compile that starts under the budget finishes; the next one is refused
  // until the window has room. 0: no bound. Default: 120 (two workers' full
  // minute).
  double compile_seconds_per_minute = 120;
  // Forward, Backward and GradCheck calls per second per namespace (a token
  // bucket holding one second's worth). 0: no bound. Default: 20000.
  double calls_per_second = 20000;
};

class QuotaManager {
 public:
  using Clock = opjit::Clock;

  // `clock`: where the compile window and the call bucket read the time
  // (tests pass a FakeClock). Never null.
  explicit QuotaManager(QuotaOptions options, const Clock* clock = SteadyClock())
      : clock_(clock), calls_per_second_(options.calls_per_second), options_(options) {}

  // Holds one compile slot of a namespace; its destructor gives the slot back
  // and charges the elapsed time to the namespace's compile budget.
  class CompileTicket {
   public:
    CompileTicket(QuotaManager* owner, std::string ns, Clock::time_point start)
        : owner_(owner), ns_(std::move(ns)), start_(start) {}
    ~CompileTicket();
    // The seconds to charge when the ticket ends (default: its wall time).
    void Charge(double seconds) { charge_ = seconds; }
    CompileTicket(const CompileTicket&) = delete;
    CompileTicket& operator=(const CompileTicket&) = delete;

   private:
    QuotaManager* owner_;
    std::string ns_;
    Clock::time_point start_;
    double charge_ = -1;
  };

  // A compile slot, or QUOTA_EXCEEDED "concurrent_compiles" /
  // "compile_seconds_per_minute".
  absl::StatusOr<std::unique_ptr<CompileTicket>> BeginCompile(const std::string& ns);

  // OK, or QUOTA_EXCEEDED "calls_per_second".
  absl::Status AdmitCall(const std::string& ns);

  // Up to `n` calls at once from the namespace's bucket: the call credit a
  // fast channel's executor asks for (server/exec/channels.h). Returns how
  // many were granted, from 1 to n (all n when calls_per_second is 0), or
  // QUOTA_EXCEEDED "calls_per_second" with AdmitCall's message when the
  // bucket holds less than one call. n == 0 grants nothing and returns 0.
  absl::StatusOr<uint64_t> AdmitCalls(const std::string& ns, uint64_t n);

  // How many calls a fast channel asks for at once: a fiftieth of a second's
  // worth of calls_per_second (so credit a channel holds, unused, is at most
  // ~20 ms of the namespace's budget), at least 1 and at most 64; 4096 when
  // calls_per_second is 0 (no bound).
  uint64_t CallCreditBatch() const;

  // The quotas in force.
  QuotaOptions options() const;

  // Replaces the quotas (a config reload). What is in flight keeps going:
  // running compiles finish and are charged; a namespace's call bucket keeps
  // its tokens, capped at the new second's worth.
  void SetOptions(const QuotaOptions& options);

 private:
  struct Space {
    int compiling = 0;
    // (end time, seconds) of compiles in the last minute.
    std::deque<std::pair<Clock::time_point, double>> recent;
    double tokens = -1;  // < 0: full bucket
    Clock::time_point refilled;
  };

  void EndCompile(const std::string& ns, Clock::time_point start, double charge);
  double UsedLocked(Space& space, Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* const clock_;
  // Read without the lock on every call: 0 (no bound) costs no lock at all.
  std::atomic<double> calls_per_second_;
  mutable absl::Mutex mu_;
  QuotaOptions options_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Space> spaces_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opjit::access

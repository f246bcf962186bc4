// Evaluator: kernels evaluated as a service (the Evaluator RPCs).
//
// Verify runs a candidate op and a reference op (or reference outputs the
// caller gives) on inputs generated per case and compares the results:
//
//   cases: dtype rows x shapes x (seeds random + 1 special) ─▶ per case, in
//   one region per side of the caller's namespace (never shared between
//   candidate and reference; reused across cases with new values): inputs
//   written, outputs poisoned ─▶ the
//   reference once, the candidate twice (poison A, then poison B) through
//   the Executor ─▶ inputs unchanged? outputs written (not the poison in both
//   runs)? unchanged after `settle_ms`? the same bits twice? within the
//   tolerance of the reference? ─▶ a report per case.
//
// Why a kernel cannot cheat it (README "Verifying and benchmarking kernels"):
// every case has new random input values (nothing to cache, no stale output
// that fits); an output element that holds the poison pattern in both runs
// was not written;
// outputs are read when the call returns and compared again after the settle
// time, so work a thread does after return either is missing or shows as a
// change; shapes include sizes no test would single out.
//
// Benchmark times an op (and a reference in alternation) on one input set:
// warm-up, then repetitions until `min_time_ms` and `min_reps`; per run the
// kernel time the executor measures (GPU: CUDA events around the launch)
// and the time of the whole call in the daemon. With `flush_cache` every run
// asks the executor to flush caches right before the kernel
// (exec::ForwardCall::flush_caches: a sweep of the host's caches, or a fill
// of the GPU's L2); the flush counts in the call's time, not the kernel's.
//
// Both run on the evaluator's own threads (one by default), under the
// caller's namespace: its executors, its region quota (the case regions
// count against it) and the deadline. Scheduling is fair between
// namespaces: a queue per namespace (at most `max_queue_per_namespace`
// waiting; more is RESOURCE_EXHAUSTED for that namespace only), served
// round-robin, so one tenant's queue delays another tenant's first request
// by at most the one evaluation running (itself bounded by
// `max_evaluation_ms`). Every phase (warm-up, repetitions, each case's
// runs) checks between runs: the deadline (the caller's, at most
// `max_evaluation_ms` from the start), the caller's `cancelled` (a client
// that hung up: CANCELLED, dropped from the queue if still waiting) and
// Stop() (UNAVAILABLE). Verify generates each case's inputs just before it
// runs and frees them after; the request's bytes are checked up front.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/exec/executor.h"

namespace opjit::registry {
class Registry;
}
namespace opjit::tensor {
class RegionManager;
}

namespace opjit::evaluate {

// Limits (each has a test): more is RESOURCE_EXHAUSTED before anything runs.
inline constexpr size_t kMaxCases = 512;
inline constexpr int64_t kMaxElementsPerTensor = int64_t{1} << 24;
inline constexpr uint32_t kMaxSettleMs = 1000;
inline constexpr uint32_t kMaxReps = 100000;
inline constexpr uint32_t kMaxTimeMs = 60000;
// Benchmark warm-up runs: more is INVALID_ARGUMENT.
inline constexpr uint32_t kMaxWarmup = 1000;
// The longest one evaluation runs (a request with no deadline, or a later
// one, gets this): DEADLINE_EXCEEDED past it.
inline constexpr int64_t kMaxEvaluationMs = 90000;
// Verify's input bytes (candidate and reference side): of one case, and of
// all cases of a request together. More is RESOURCE_EXHAUSTED before
// anything runs; a case's outputs count against kMaxCaseBytes too.
inline constexpr uint64_t kMaxCaseBytes = uint64_t{1} << 30;
inline constexpr uint64_t kMaxVerifyBytes = uint64_t{4} << 30;

struct Tolerance {
  std::optional<double> atol, rtol;
  std::optional<int64_t> ulps;
};

using ShapeSet = std::vector<std::vector<int64_t>>;  // one shape per declared input

// Inputs and the outputs they must give (Verify without a reference op). The
// bytes are the caller's and must outlive the call.
struct GivenCase {
  std::vector<exec::TensorArg> inputs;   // inline, one per declared input
  std::vector<exec::TensorArg> outputs;  // inline, one per output
};

struct VerifyCall {
  std::string ns = "default";
  std::string principal;  // as exec::ForwardCall::principal
  runner::Caller quarantine_caller;  // as exec::ForwardCall::quarantine_caller
  std::string candidate;
  int64_t candidate_version = 0;
  std::string reference;  // empty: `given`
  int64_t reference_version = 0;
  std::vector<GivenCase> given;
  std::map<std::string, exec::AttrArg> attrs;
  std::vector<ShapeSet> shapes;     // empty: the edge-case list
  std::vector<std::string> dtypes;  // empty: every row
  uint32_t seeds = 2;
  uint64_t seed = 0;  // 0: a fresh one
  double low = 0, high = 0;
  bool special_values = true;
  Tolerance tolerance;
  bool fp64_reference = false;
  std::vector<std::string> inplace_inputs;
  uint32_t settle_ms = 10;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // True once the caller is gone (its client cancelled or hung up): polled
  // while queued and between runs. Empty: never.
  std::function<bool()> cancelled;
};

struct CaseReport {
  int index = 0;
  std::string kind;  // random, special, given
  std::string dtype;
  std::string shapes;
  uint64_t seed = 0;
  bool passed = false, skipped = false, deterministic = true;
  double max_abs_error = 0, max_rel_error = 0, max_ulp_error = 0;
  int worst_output = -1;
  int64_t worst_index = -1;
  double candidate_value = 0, reference_value = 0;
  std::string message;
  double candidate_kernel_ms = 0;
};

struct VerifyResult {
  bool passed = false, deterministic = true;
  uint64_t seed = 0;
  int passed_cases = 0, failed_cases = 0, skipped_cases = 0;
  std::vector<CaseReport> cases;
  std::vector<std::string> tolerances;
  std::string reproduce;
};

struct BenchmarkCall {
  std::string ns = "default";
  std::string principal;
  runner::Caller quarantine_caller;  // as exec::ForwardCall::quarantine_caller
  std::string op;
  int64_t version = 0;
  std::string reference;  // empty: none
  int64_t reference_version = 0;
  std::map<std::string, exec::AttrArg> attrs;
  ShapeSet shape;     // empty: every input [1048576]
  std::string dtype;  // empty: the first row
  uint64_t seed = 0;
  uint32_t warmup = 5, min_reps = 10, max_reps = 1000, min_time_ms = 500;
  bool flush_cache = false;  // see above
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<bool()> cancelled;  // as VerifyCall::cancelled
};

struct TimingStats {
  uint32_t reps = 0;
  double median_ms = 0, p10_ms = 0, p90_ms = 0;
  double kernel_median_ms = 0, kernel_p10_ms = 0, kernel_p90_ms = 0;
  double spread = 0;
};

struct BenchmarkResult {
  TimingStats op;
  std::optional<TimingStats> reference;
  double ratio = 0, ratio_p10 = 0, ratio_p90 = 0;
  // With flush_cache: the bytes the executor flushed before each measured
  // run (the least of them: twice the host's last-level cache, at most
  // 64 MiB, for a CPU op; the L2's size for a GPU op). 0 without
  // flush_cache, or when some run could not be flushed (the executor's
  // memory limit, a driver that does not tell its L2).
  uint64_t flush_bytes = 0;
  std::string shapes;
  std::string reproduce;
};

struct EvaluatorOptions {
  int threads = 1;         // verifies and benchmarks at once
  size_t max_queue = 64;   // waiting in all namespaces: more is RESOURCE_EXHAUSTED
  size_t max_queue_per_namespace = 2;  // waiting in one namespace: likewise
  int64_t max_evaluation_ms = kMaxEvaluationMs;
  int64_t region_lease_ms = 600000;
};

class Evaluator {
 public:
  using VerifyCallback = std::function<void(absl::StatusOr<VerifyResult>)>;
  using BenchmarkCallback = std::function<void(absl::StatusOr<BenchmarkResult>)>;

  // None of the pointers is owned; all must outlive the evaluator.
  Evaluator(const EvaluatorOptions& options, registry::Registry* registry,
            exec::Executor* executor, tensor::RegionManager* regions);
  ~Evaluator();

  // Errors: NOT_FOUND (an op or version), INVALID_ARGUMENT (the request:
  // shapes, dtypes, a reference whose inputs or outputs differ in count, no
  // dtype row the reference accepts, warm-up over kMaxWarmup),
  // RESOURCE_EXHAUSTED (the limits above, the queues, the region quota),
  // DEADLINE_EXCEEDED, CANCELLED (the caller), UNAVAILABLE (Stop). Failing cases are in
  // the result, not errors.
  void VerifyAsync(VerifyCall call, VerifyCallback done);
  void BenchmarkAsync(BenchmarkCall call, BenchmarkCallback done);

  // Shutdown: queued requests are answered UNAVAILABLE now, running ones
  // stop at their next run and answer UNAVAILABLE; later ones are refused.
  // Returns at once (the destructor joins).
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit::evaluate

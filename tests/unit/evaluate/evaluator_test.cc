// Verify and Benchmark over a real registry, compiler and executor, with
// kernels in this process (the sandboxed path is tests/python/test_verify.py):
// a correct candidate passes every generated case; wrong ones and each cheat
// fail with their worst case; every limit answers before anything runs.
#include "server/evaluate/evaluator.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/cache_flush.h"
#include "server/common/error_info.h"
#include "server/runner/in_process_runner.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::evaluate {
namespace {

// y = 2x + 1 and its variants, one entry each (float32 x -> y).
constexpr char kKernels[] = R"(
#include <cmath>
#include <cstdint>
#include <cstring>
static int64_t Count(int* nd, int64_t** s) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  return k;
}
#define KERNEL(name) extern "C" int name(int, void** p, int* nd, int64_t** s, const char** d, void*, void*)
#define XY const float* x = static_cast<const float*>(p[0]); float* y = static_cast<float*>(p[1]); const int64_t k = Count(nd, s)
KERNEL(Ref) { XY; for (int64_t i = 0; i < k; ++i) y[i] = 2.0f * x[i] + 1.0f; return 0; }
KERNEL(Good) { XY; for (int64_t i = 0; i < k; ++i) y[i] = (x[i] + x[i]) + 1.0f; return 0; }
KERNEL(Off) { XY; for (int64_t i = 0; i < k; ++i) y[i] = 2.0f * x[i] + 1.001f; return 0; }
KERNEL(Ulp3) {
  XY;
  for (int64_t i = 0; i < k; ++i) {
    float v = 2.0f * x[i] + 1.0f;
    if (std::isfinite(v) && v != 0.0f) for (int j = 0; j < 3; ++j) v = std::nextafter(v, INFINITY);
    y[i] = v;
  }
  return 0;
}
KERNEL(NanToZero) { XY; for (int64_t i = 0; i < k; ++i) y[i] = x[i] == x[i] ? 2.0f * x[i] + 1.0f : 0.0f; return 0; }
KERNEL(SkipLast) { XY; for (int64_t i = 0; i + 1 < k; ++i) y[i] = 2.0f * x[i] + 1.0f; return 0; }
KERNEL(Nothing) { return 0; }
KERNEL(Mutate) {
  XY;
  for (int64_t i = 0; i < k; ++i) y[i] = 2.0f * x[i] + 1.0f;
  if (k > 0) const_cast<float*>(x)[0] = 42.0f;
  return 0;
}
// Keeps the previous call's output and returns it (computes only the first).
KERNEL(Stale) {
  XY;
  static float kept[1 << 17];
  static int64_t kept_n = -1;
  if (kept_n < 0) {
    for (int64_t i = 0; i < k; ++i) y[i] = 2.0f * x[i] + 1.0f;
  } else {
    for (int64_t i = 0; i < k; ++i) y[i] = i < kept_n ? kept[i] : 0.0f;
  }
  kept_n = k < (1 << 17) ? k : (1 << 17);
  std::memcpy(kept, y, kept_n * sizeof(float));
  return 0;
}
// Computes once per size, then replays that result for the size.
KERNEL(Cached) {
  XY;
  static float cache[8][1 << 17];
  static int64_t sizes[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
  for (int c = 0; c < 8; ++c) {
    if (sizes[c] == k && k <= (1 << 17)) { std::memcpy(y, cache[c], k * sizeof(float)); return 0; }
  }
  for (int64_t i = 0; i < k; ++i) y[i] = 2.0f * x[i] + 1.0f;
  for (int c = 0; c < 8; ++c) {
    if (sizes[c] < 0 && k <= (1 << 17)) { sizes[c] = k; std::memcpy(cache[c], y, k * sizeof(float)); break; }
  }
  return 0;
}
// Right only on the shape a test suite would use.
KERNEL(OnlyTestShape) { XY; for (int64_t i = 0; i < k; ++i) y[i] = k == 1024 ? 2.0f * x[i] + 1.0f : 2.0f * x[i]; return 0; }
KERNEL(Fails) { return 3; }
// One ULP up on every other call: within the float32 tolerance, not the same bits.
KERNEL(Flaky) {
  XY;
  static int calls = 0;
  const bool bump = calls++ % 2 == 1;
  for (int64_t i = 0; i < k; ++i) {
    const float v = 2.0f * x[i] + 1.0f;
    y[i] = bump && std::isfinite(v) && v != 0.0f ? std::nextafter(v, INFINITY) : v;
  }
  return 0;
}
// y = 2x + 1 in float32 or float64, whichever the call has.
KERNEL(Ref2) {
  const int64_t k = Count(nd, s);
  if (std::strcmp(d[0], "float64") == 0) {
    for (int64_t i = 0; i < k; ++i) static_cast<double*>(p[1])[i] = 2.0 * static_cast<const double*>(p[0])[i] + 1.0;
  } else {
    for (int64_t i = 0; i < k; ++i) static_cast<float*>(p[1])[i] = 2.0f * static_cast<const float*>(p[0])[i] + 1.0f;
  }
  return 0;
}
)";

// (x, w) -> y: a reference with another input count.
constexpr char kTwoInputs[] = R"(
#include <cstdint>
extern "C" int Add(int, void** p, int* nd, int64_t** s, const char**, void*, void*) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  for (int64_t i = 0; i < k; ++i) static_cast<float*>(p[2])[i] = static_cast<const float*>(p[0])[i] + static_cast<const float*>(p[1])[i];
  return 0;
}
)";

class EvaluatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto stack = opjit::testing::CoreStack::Create("evaluator-test");
    ASSERT_TRUE(stack.ok()) << stack.status();
    stack_ = *std::move(stack);
    ASSERT_TRUE(stack_->AddExecutor().ok());
    executor_ = stack_->executor.get();
    evaluator_ = std::make_unique<Evaluator>(EvaluatorOptions{}, stack_->registry.get(),
                                             executor_, stack_->regions.get());
    for (const char* entry : {"Ref", "Good", "Off", "Ulp3", "NanToZero", "SkipLast", "Nothing",
                              "Mutate", "Stale", "Cached", "OnlyTestShape", "Fails", "Flaky"}) {
      ASSERT_TRUE(stack_->registry
                      ->Register(opjit::testing::FloatOp(entry, {"x"}, {"y"}, kKernels, entry))
                      .ok());
    }
    registry::OpDef both = opjit::testing::FloatOp("Ref2", {"x"}, {"y"}, kKernels, "Ref2");
    both.dtype_formats.push_back({{{"float64", "DefaultFormat"}, {"float64", "DefaultFormat"}}});
    ASSERT_TRUE(stack_->registry->Register(both).ok());
    ASSERT_TRUE(stack_->registry
                    ->Register(opjit::testing::FloatOp("Add", {"x", "w"}, {"y"}, kTwoInputs, "Add"))
                    .ok());
  }
  void TearDown() override {
    evaluator_.reset();
    stack_.reset();
  }

  VerifyCall Call(const std::string& candidate) {
    VerifyCall c;
    c.candidate = candidate;
    c.reference = "Ref";
    c.seed = 7;
    c.settle_ms = 1;
    return c;
  }
  absl::StatusOr<VerifyResult> Verify(VerifyCall c) {
    std::promise<absl::StatusOr<VerifyResult>> p;
    evaluator_->VerifyAsync(std::move(c),
                            [&p](absl::StatusOr<VerifyResult> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }
  absl::StatusOr<BenchmarkResult> Bench(BenchmarkCall c) {
    std::promise<absl::StatusOr<BenchmarkResult>> p;
    evaluator_->BenchmarkAsync(
        std::move(c), [&p](absl::StatusOr<BenchmarkResult> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }
  // The first failing case (the test fails when there is none).
  CaseReport FirstFailure(const VerifyResult& r) {
    for (const CaseReport& c : r.cases) {
      if (!c.passed && !c.skipped) return c;
    }
    ADD_FAILURE() << "no case failed";
    return {};
  }
  // No region of the verify is left behind.
  void ExpectNoRegionsLeft() { EXPECT_TRUE(stack_->regions->List("default").empty()); }

  std::unique_ptr<opjit::testing::CoreStack> stack_;
  exec::Executor* executor_ = nullptr;  // stack_'s
  std::unique_ptr<Evaluator> evaluator_;
};

TEST_F(EvaluatorTest, CorrectCandidatePassesEveryGeneratedCase) {
  absl::StatusOr<VerifyResult> r = Verify(Call("Good"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);
  EXPECT_TRUE(r->deterministic);
  // 7 edge shapes x (2 seeds + 1 special).
  EXPECT_EQ(r->cases.size(), 21u);
  EXPECT_EQ(r->passed_cases, 21);
  bool empty = false, large = false, special = false;
  for (const CaseReport& c : r->cases) {
    EXPECT_TRUE(c.passed) << c.index << " " << c.shapes << ": " << c.message;
    empty |= c.shapes == "float32[0]";
    large |= c.shapes == "float32[65537]";
    special |= c.kind == "special";
  }
  EXPECT_TRUE(empty && large && special);
  EXPECT_NE(r->reproduce.find("opjit verify default/Good --against default/Ref --seed 7"),
            std::string::npos)
      << r->reproduce;
  // The tolerances, then how each side was compiled for floating point.
  ASSERT_EQ(r->tolerances.size(), 3u);
  EXPECT_EQ(r->tolerances[0], "float32: atol=1e-05 rtol=1.3e-06 ulps=0");
  EXPECT_EQ(r->tolerances[1],
            "candidate Good (cpu): -O3 -march=native, fp-contract=on, no fast-math");
  EXPECT_EQ(r->tolerances[2], "reference Ref (cpu): -O3 -march=native, fp-contract=on, no fast-math");
  ExpectNoRegionsLeft();
}

TEST_F(EvaluatorTest, SameSeedSameCases) {
  absl::StatusOr<VerifyResult> a = Verify(Call("Off")), b = Verify(Call("Off"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->cases.size(), b->cases.size());
  for (size_t i = 0; i < a->cases.size(); ++i) {
    EXPECT_EQ(a->cases[i].seed, b->cases[i].seed);
    const double x = a->cases[i].candidate_value, y = b->cases[i].candidate_value;
    EXPECT_TRUE(x == y || (std::isnan(x) && std::isnan(y))) << i << ": " << x << " " << y;
  }
  VerifyCall fresh = Call("Good");
  fresh.seed = 0;
  absl::StatusOr<VerifyResult> f = Verify(fresh);
  ASSERT_TRUE(f.ok());
  EXPECT_NE(f->seed, 0u);  // reported, to reproduce
}

TEST_F(EvaluatorTest, WrongValueFailsWithItsWorstElement) {
  absl::StatusOr<VerifyResult> r = Verify(Call("Off"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  const CaseReport c = FirstFailure(*r);
  EXPECT_GE(c.worst_index, 0);
  EXPECT_NEAR(c.candidate_value - c.reference_value, 0.001, 1e-4);
  EXPECT_NE(c.message.find("outside the tolerance"), std::string::npos) << c.message;
}

TEST_F(EvaluatorTest, UlpTolerance) {
  VerifyCall c = Call("Ulp3");
  c.tolerance = {0.0, 0.0, 2};
  absl::StatusOr<VerifyResult> r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  EXPECT_EQ(FirstFailure(*r).max_ulp_error, 3);
  c.tolerance = {0.0, 0.0, 3};
  r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);
}

TEST_F(EvaluatorTest, WrongOnNanFailsOnlyOnSpecialValues) {
  absl::StatusOr<VerifyResult> r = Verify(Call("NanToZero"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  for (const CaseReport& c : r->cases) {
    if (c.kind == "random") EXPECT_TRUE(c.passed) << c.message;
    if (c.kind == "special" && c.shapes != "float32[0]") {
      EXPECT_FALSE(c.passed);
      EXPECT_TRUE(std::isnan(c.reference_value)) << c.message;
      EXPECT_EQ(c.candidate_value, 0);
    }
  }
}

TEST_F(EvaluatorTest, OffByOneIsCaughtAtTheLastElement) {
  absl::StatusOr<VerifyResult> r = Verify(Call("SkipLast"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  for (const CaseReport& c : r->cases) {
    if (c.passed) continue;
    // Of one element, the whole output is unwritten; of n, one element.
    EXPECT_EQ(c.message,
              c.shapes == "float32[1]"
                  ? "output y was never written: it still holds the poison pattern it starts with"
                  : absl::StrCat("output y: 1 of ", c.shapes.substr(8, c.shapes.size() - 9),
                                 " element(s) were never written (first: element ",
                                 c.worst_index, "): they still hold the poison pattern outputs "
                                 "start with"));
    EXPECT_EQ(c.max_abs_error, 0);  // no value was compared
  }
}

TEST_F(EvaluatorTest, CheatsAreCaught) {
  for (const char* cheat : {"Nothing", "Stale", "Cached", "OnlyTestShape"}) {
    absl::StatusOr<VerifyResult> r = Verify(Call(cheat));
    ASSERT_TRUE(r.ok()) << cheat << ": " << r.status();
    EXPECT_FALSE(r->passed) << cheat;
    EXPECT_GT(r->failed_cases, 0) << cheat;
  }
  absl::StatusOr<VerifyResult> r = Verify(Call("Nothing"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(FirstFailure(*r).message,
            "output y was never written: it still holds the poison pattern it starts with");
  ExpectNoRegionsLeft();
}

TEST_F(EvaluatorTest, ChangedInputFailsUnlessDeclaredInPlace) {
  absl::StatusOr<VerifyResult> r = Verify(Call("Mutate"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  EXPECT_NE(FirstFailure(*r).message.find("changed input 'x'"), std::string::npos);
  VerifyCall c = Call("Mutate");
  c.inplace_inputs = {"x"};
  r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);
}

TEST_F(EvaluatorTest, FailingKernelIsAFailedCaseNotAnError) {
  absl::StatusOr<VerifyResult> r = Verify(Call("Fails"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  EXPECT_NE(FirstFailure(*r).message.find("the call failed"), std::string::npos);
}

TEST_F(EvaluatorTest, NondeterminismIsReported) {
  absl::StatusOr<VerifyResult> r = Verify(Call("Flaky"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);  // one ULP is within float32's default tolerance
  EXPECT_FALSE(r->deterministic);
  r = Verify(Call("Good"));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->deterministic);
}

TEST_F(EvaluatorTest, Float64Reference) {
  VerifyCall c = Call("Good");
  c.reference = "Ref2";
  c.fp64_reference = true;
  absl::StatusOr<VerifyResult> r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);
  EXPECT_NE(std::find(r->tolerances.begin(), r->tolerances.end(), "float32: reference in float64"),
            r->tolerances.end());
  // A reference without a float64 row runs in the candidate's dtype.
  c.reference = "Ref";
  r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::find(r->tolerances.begin(), r->tolerances.end(), "float32: reference in float64"),
            r->tolerances.end());
}

TEST_F(EvaluatorTest, GivenOutputs) {
  const std::string x = opjit::testing::Bytes({1, 2, 3}), y = opjit::testing::Bytes({3, 5, 7});
  const std::string wrong = opjit::testing::Bytes({3, 5, 8});
  VerifyCall c;
  c.candidate = "Good";
  c.settle_ms = 1;
  const runner::TensorDesc d{"float32", {3}};
  c.given.push_back({{exec::TensorArg::Inline(d, x)}, {exec::TensorArg::Inline(d, y)}});
  absl::StatusOr<VerifyResult> r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed);
  ASSERT_EQ(r->cases.size(), 1u);
  EXPECT_EQ(r->cases[0].kind, "given");
  c.given[0].outputs[0] = exec::TensorArg::Inline(d, wrong);
  r = Verify(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed);
  EXPECT_EQ(r->cases[0].worst_index, 2);
  EXPECT_EQ(r->cases[0].reference_value, 8);
}

TEST_F(EvaluatorTest, RequestErrors) {
  VerifyCall c = Call("NoSuchOp");
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kNotFound);
  c = Call("Good");
  c.reference = "Add";
  absl::Status s = Verify(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("takes 2 input(s)"), std::string::npos) << s;
  c = Call("Good");
  c.reference.clear();
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Call("Good");
  c.shapes = {{{3}, {3}}};  // two shapes for one input
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Call("Good");
  c.dtypes = {"float64"};
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Call("Good");
  c.inplace_inputs = {"nope"};
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EvaluatorTest, Limits) {
  VerifyCall c = Call("Good");
  c.settle_ms = kMaxSettleMs + 1;
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = Call("Good");
  c.seeds = kMaxCases;  // x 7 shapes
  absl::Status s = Verify(c).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetReason(s)->reason, reason::kQuotaExceeded);
  c = Call("Good");
  c.shapes = {{{kMaxElementsPerTensor + 1}}};
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kResourceExhausted);
  c = Call("Good");
  c.deadline = std::chrono::steady_clock::now();
  EXPECT_EQ(Verify(c).status().code(), absl::StatusCode::kDeadlineExceeded);
  BenchmarkCall b;
  b.op = "Good";
  b.max_reps = kMaxReps + 1;
  EXPECT_EQ(Bench(b).status().code(), absl::StatusCode::kResourceExhausted);
  b.max_reps = 10;
  b.min_time_ms = kMaxTimeMs + 1;
  EXPECT_EQ(Bench(b).status().code(), absl::StatusCode::kResourceExhausted);
  ExpectNoRegionsLeft();
}

TEST_F(EvaluatorTest, RegionQuotaApplies) {
  // The case regions are the caller's namespace's: past its quota, the
  // verify is RESOURCE_EXHAUSTED, and what it made is gone.
  tensor::RegionManagerOptions ro;
  ro.instance_tag = absl::StrCat("evaluator-quota", ::getpid());
  ro.namespace_quota_bytes = 1 << 20;
  auto regions = tensor::RegionManager::Create(ro);
  ASSERT_TRUE(regions.ok()) << regions.status();
  auto ex = exec::Executor::Create({}, stack_->registry.get(), stack_->compiler.get(),
                                   regions->get(), stack_->runner.get());
  ASSERT_TRUE(ex.ok()) << ex.status();
  Evaluator small({}, stack_->registry.get(), ex->get(), regions->get());
  VerifyCall c = Call("Good");
  c.shapes = {{{1 << 10}}, {{1 << 20}}};  // 4 KiB fits; 4 MiB does not
  std::promise<absl::StatusOr<VerifyResult>> p;
  small.VerifyAsync(c, [&p](absl::StatusOr<VerifyResult> r) { p.set_value(std::move(r)); });
  absl::Status s = p.get_future().get().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE((*regions)->List("default").empty());
}

TEST_F(EvaluatorTest, BenchmarkAgainstItselfIsWithinNoiseOfOne) {
  BenchmarkCall b;
  b.op = "Good";
  b.reference = "Good";
  b.shape = {{1 << 16}};
  b.min_reps = 30;
  b.min_time_ms = 100;
  absl::StatusOr<BenchmarkResult> r = Bench(b);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->reference.has_value());
  EXPECT_GE(r->op.reps, 30u);
  EXPECT_EQ(r->op.reps, r->reference->reps);
  EXPECT_LE(r->ratio_p10, 1.0);
  EXPECT_GE(r->ratio_p90, 1.0);
  EXPECT_GT(r->op.median_ms, 0);
  EXPECT_LE(r->op.p10_ms, r->op.median_ms);
  EXPECT_LE(r->op.median_ms, r->op.p90_ms);
  EXPECT_EQ(r->shapes, "float32[65536]");
  EXPECT_NE(r->reproduce.find("opjit bench default/Good --against default/Good --shape 65536"),
            std::string::npos)
      << r->reproduce;
  EXPECT_EQ(r->flush_bytes, 0u);
  // With a flush before every run: what the executor swept (here, in this
  // process) comes back, and the ratio stays about one.
  b.flush_cache = true;
  b.min_reps = 5;
  b.min_time_ms = 1;
  r = Bench(b);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->flush_bytes, CacheFlushBytes());
  EXPECT_GT(r->op.kernel_median_ms, 0);
  EXPECT_GT(r->ratio, 0.5);
  EXPECT_LT(r->ratio, 2.0);
  ExpectNoRegionsLeft();
}

// --- Fair, bounded, cancellable (issue 41) ---


// A benchmark that runs until `release` (its `cancelled`), on a small input;
// `started` is set when the evaluator first polls it, i.e. once it left the queue.
struct Blocker {
  std::atomic<bool> release{false}, started{false};
  BenchmarkCall Call() {
    BenchmarkCall b;
    b.op = "Good";
    b.shape = {{64}};
    b.warmup = kMaxWarmup;
    b.min_reps = kMaxReps;
    b.max_reps = kMaxReps;
    b.min_time_ms = kMaxTimeMs;
    b.cancelled = [this] {
      started = true;
      return release.load();
    };
    return b;
  }
  void WaitStarted() {
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
};

TEST_F(EvaluatorTest, WarmupIsCapped) {
  BenchmarkCall b;
  b.op = "Good";
  b.warmup = 4294967295u;
  absl::Status s = Bench(b).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "warmup")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat(kMaxWarmup))) << s;
}

TEST_F(EvaluatorTest, BenchmarkWithNoDeadlineGetsTheServerMaximum) {
  EvaluatorOptions o;
  o.max_evaluation_ms = 300;
  Evaluator ev(o, stack_->registry.get(), executor_, stack_->regions.get());
  Blocker never;  // never released: only the maximum ends it (else this waits forever)
  std::promise<absl::Status> p;
  ev.BenchmarkAsync(never.Call(), [&p](absl::StatusOr<BenchmarkResult> r) { p.set_value(r.status()); });
  absl::Status s = p.get_future().get();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  ExpectNoRegionsLeft();
}

TEST_F(EvaluatorTest, CancellationStopsRunningWorkAndDropsQueuedWork) {
  Blocker running;
  std::promise<absl::Status> first, queued;
  evaluator_->BenchmarkAsync(running.Call(), [&](absl::StatusOr<BenchmarkResult> r) {
    first.set_value(r.status());
  });
  running.WaitStarted();
  // A queued verify whose caller hung up never runs.
  std::atomic<bool> ran{false};
  VerifyCall v = Call("Good");
  v.cancelled = [] { return true; };
  evaluator_->VerifyAsync(v, [&](absl::StatusOr<VerifyResult> r) {
    ran = r.ok();
    queued.set_value(r.status());
  });
  running.release = true;
  EXPECT_EQ(first.get_future().get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(queued.get_future().get().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(ran);
  ExpectNoRegionsLeft();
}

TEST_F(EvaluatorTest, OneNamespaceQueueNeverDelaysAnotherBeyondOneEvaluation) {
  Blocker running;
  std::promise<absl::Status> first;
  evaluator_->BenchmarkAsync(running.Call(), [&](absl::StatusOr<BenchmarkResult> r) {
    first.set_value(r.status());
  });
  running.WaitStarted();
  std::mutex mu;
  std::vector<std::string> order;
  std::atomic<int> answered{0};
  auto verify = [&](const std::string& ns, const std::string& tag) {
    VerifyCall c = Call("Good");
    c.ns = ns;  // no such op there: NOT_FOUND as soon as it is served
    evaluator_->VerifyAsync(c, [&, tag](absl::StatusOr<VerifyResult> r) {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(absl::StrCat(tag, ":", absl::StatusCodeToString(r.status().code())));
      ++answered;
    });
  };
  const EvaluatorOptions defaults;
  for (size_t i = 0; i < defaults.max_queue_per_namespace; ++i) verify("hog", "hog");
  // Past its share, the hog is refused at once; nobody else is.
  std::promise<absl::Status> refused;
  VerifyCall extra = Call("Good");
  extra.ns = "hog";
  evaluator_->VerifyAsync(extra, [&](absl::StatusOr<VerifyResult> r) { refused.set_value(r.status()); });
  absl::Status s = refused.get_future().get();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_TRUE(GetReason(s).has_value());
  EXPECT_EQ(GetReason(s)->reason, reason::kQuotaExceeded);
  EXPECT_EQ(GetReason(s)->metadata.at("limit"), "evaluations per namespace");
  verify("tenant", "tenant");
  running.release = true;
  EXPECT_EQ(first.get_future().get().code(), absl::StatusCode::kCancelled);
  while (answered < static_cast<int>(defaults.max_queue_per_namespace) + 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(mu);
  // Round-robin: the other tenant's first request is served right after the
  // hog's first queued one, before the hog's queue drains.
  ASSERT_EQ(order.size(), defaults.max_queue_per_namespace + 1);
  EXPECT_EQ(order[1], "tenant:NOT_FOUND") << absl::StrJoin(order, " ");
}

TEST_F(EvaluatorTest, StopEndsRunningAndQueuedEvaluations) {
  Blocker running;
  std::promise<absl::Status> first, queued;
  evaluator_->BenchmarkAsync(running.Call(), [&](absl::StatusOr<BenchmarkResult> r) {
    first.set_value(r.status());
  });
  running.WaitStarted();
  evaluator_->VerifyAsync(Call("Good"), [&](absl::StatusOr<VerifyResult> r) {
    queued.set_value(r.status());
  });
  evaluator_->Stop();  // a Stop that waited on the blocker would never return
  EXPECT_EQ(queued.get_future().get().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(first.get_future().get().code(), absl::StatusCode::kUnavailable);
  std::promise<absl::Status> later;
  evaluator_->VerifyAsync(Call("Good"), [&](absl::StatusOr<VerifyResult> r) {
    later.set_value(r.status());
  });
  EXPECT_EQ(later.get_future().get().code(), absl::StatusCode::kUnavailable);
  ExpectNoRegionsLeft();
}

TEST_F(EvaluatorTest, VerifyBytesAreCheckedBeforeAnyCaseIsGenerated) {
  // 40 seeds + 1 special case of 2^24 float32 per side: 5.1 GiB of inputs
  // if generated; refused before one is.
  VerifyCall c = Call("Good");
  c.shapes = {{{kMaxElementsPerTensor}}};
  c.seeds = 40;
  rusage before{};
  ::getrusage(RUSAGE_SELF, &before);
  absl::Status s = Verify(c).status();
  rusage after{};
  ::getrusage(RUSAGE_SELF, &after);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_TRUE(GetReason(s).has_value());
  EXPECT_EQ(GetReason(s)->metadata.at("limit"), "verify bytes");
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat(kMaxVerifyBytes))) << s;
  // One generated case would be 64 MiB per tensor: the peak did not move.
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 48 * 1024) << "KiB";
  ExpectNoRegionsLeft();
}

}  // namespace
}  // namespace opjit::evaluate

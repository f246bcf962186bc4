// ForwardCall::flush_caches on CPU kernels, through the executor and both
// runners: the runner sweeps the host's caches right before the kernel
// (server/common/cache_flush.h) and reports the bytes in
// ForwardResult::flushed_bytes. In an executor process the kernel itself
// sees the sweep: its buffer, written on the first flushed call, raises the
// process's peak resident memory, which the kernel reads (getrusage).
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "server/common/cache_flush.h"
#include "server/common/status_macros.h"
#include "server/exec/executor.h"
#include "server/runner/in_process_runner.h"
#include "server/runner/process_runner.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::runner {
namespace {

// y[0] = the process's peak resident memory in KiB.
constexpr char kPeakRss[] = R"(
#include <cstdint>
#include <sys/resource.h>
extern "C" int PeakRss(int, void** p, int*, int64_t**, const char**, void*, void*) {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  static_cast<float*>(p[1])[0] = static_cast<float>(u.ru_maxrss);
  return 0;
}
)";

// Every call of the test in one executor process, or in this process.
absl::StatusOr<std::unique_ptr<KernelRunner>> MakeRunner(bool process) {
  if (!process) {
    OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<InProcessRunner> in_daemon, InProcessRunner::Create({}));
    return std::unique_ptr<KernelRunner>(std::move(in_daemon));
  }
  ProcessRunnerOptions o;
  o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-exec-worker";
  o.workers_per_namespace = 1;
  o.namespace_memory_bytes = 0;  // no cgroup
  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<ProcessRunner> pool, ProcessRunner::Create(o));
  return std::unique_ptr<KernelRunner>(std::move(pool));
}

class CpuFlushRunnerTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto stack = opjit::testing::CoreStack::Create("cpu-flush-test");
    ASSERT_TRUE(stack.ok()) << stack.status();
    stack_ = *std::move(stack);
    absl::StatusOr<std::unique_ptr<KernelRunner>> runner = MakeRunner(process());
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = *std::move(runner);
    absl::StatusOr<std::unique_ptr<exec::Executor>> executor =
        exec::Executor::Create({}, stack_->registry.get(), stack_->compiler.get(),
                               stack_->regions.get(), runner_.get());
    ASSERT_TRUE(executor.ok()) << executor.status();
    executor_ = *std::move(executor);
    registry::OpDef def = opjit::testing::FloatOp("PeakRss", {"x"}, {"y"}, kPeakRss, "PeakRss");
    def.output_rules = {registry::OutputRule{}};  // same as x
    ASSERT_TRUE(stack_->registry->Register(def).ok());
  }
  void TearDown() override {
    executor_.reset();
    runner_.reset();
    stack_.reset();
  }
  bool process() const { return std::string(GetParam()) == "process"; }

  // The kernel's answer (peak RSS in bytes) and the call's result.
  absl::StatusOr<exec::ForwardResult> Call(bool flush, uint64_t* peak_rss) {
    // The input's bytes live as long as the call: TensorArg views them.
    const std::string x(4, '\0');
    exec::ForwardCall c;
    c.op = "PeakRss";
    c.inputs = {{exec::TensorArg::Inline({"float32", {1}}, x)}};
    c.flush_caches = flush;
    absl::StatusOr<exec::ForwardResult> r = executor_->Forward(std::move(c));
    if (r.ok()) {
      const std::vector<float> y = opjit::testing::Floats(r->outputs[0].inline_bytes()->bytes);
      *peak_rss = static_cast<uint64_t>(y.at(0)) * 1024;
    }
    return r;
  }

  std::unique_ptr<opjit::testing::CoreStack> stack_;
  std::unique_ptr<KernelRunner> runner_;
  std::unique_ptr<exec::Executor> executor_;
};

TEST_P(CpuFlushRunnerTest, FlushedCallsSweepRightBeforeTheKernel) {
  uint64_t plain_peak = 0, flushed_peak = 0;
  absl::StatusOr<exec::ForwardResult> plain = Call(false, &plain_peak);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->flushed_bytes, 0u);
  absl::StatusOr<exec::ForwardResult> flushed = Call(true, &flushed_peak);
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(flushed->flushed_bytes, CacheFlushBytes());
  EXPECT_GT(flushed->kernel_ms, 0.0);
  // The executor's own peak grew by the sweep's buffer (this process's need
  // not: it may have been higher before).
  if (process()) {
    EXPECT_GE(flushed_peak, plain_peak + CacheFlushBytes() / 2)
        << "peak RSS " << plain_peak << " -> " << flushed_peak;
  }
  // Later calls sweep again (the same buffer) only when they ask.
  EXPECT_EQ(Call(true, &flushed_peak)->flushed_bytes, CacheFlushBytes());
  EXPECT_EQ(Call(false, &flushed_peak)->flushed_bytes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Runners, CpuFlushRunnerTest, ::testing::Values("process", "in-daemon"));

}  // namespace
}  // namespace opjit::runner

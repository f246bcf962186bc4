// GPU calls through both runners against the test suite's stand-in CUDA
// driver (tests/unit/gpu/fake_cuda.cc, where work queued on a stream runs at
// once and a launch can be made to take a while): CUDA events around the
// launch give kernel_ms (not the copies, nor the stream's sync), a flushed
// call fills a scratch buffer of the L2's size on the kernel's stream right
// before the start event, and a driver whose events fail leaves the host's
// clock around the whole call. The process runner's executors load the
// stand-in too (OPJIT_CUDA_DRIVER), so the flag and what was flushed cross
// the process boundary.
#include <dlfcn.h>
#include <stdlib.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/compiler/kernel_compiler.h"
#include "server/runner/in_process_runner.h"
#include "server/runner/process_runner.h"

namespace opjit::runner {
namespace {

constexpr uint64_t kFakeL2Bytes = 4 << 20;  // the stand-in's L2

// Every CudaDriver::Get() of this binary opens the stand-in.
class FakeDriverEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { ::setenv("OPJIT_CUDA_DRIVER", OPJIT_FAKE_CUDA_PATH, 1); }
};
[[maybe_unused]] const auto* const kFakeDriver =
    ::testing::AddGlobalTestEnvironment(new FakeDriverEnvironment);

// The stand-in's controls (the library the driver opened: one copy).
struct Fake {
  void* lib = dlopen(OPJIT_FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
  void (*configure)(int, int, size_t, int) =
      reinterpret_cast<decltype(configure)>(dlsym(lib, "FakeCudaConfigure"));
  void (*timing)(int, int, int) = reinterpret_cast<decltype(timing)>(dlsym(lib, "FakeCudaTiming"));
  void (*live)(int*, int*, int*, int*) =
      reinterpret_cast<decltype(live)>(dlsym(lib, "FakeCudaLive"));
  void (*take_trace)(char*, size_t) =
      reinterpret_cast<decltype(take_trace)>(dlsym(lib, "FakeCudaTakeTrace"));

  std::string Trace() const {
    char buf[4096];
    take_trace(buf, sizeof(buf));
    return buf;
  }
  int LiveBuffers() const {
    int b, s, m, c;
    live(&b, &s, &m, &c);
    return b;
  }
};

// y = scale(x) over 8 floats: PTX that names its entry is all the stand-in
// needs of a kernel.
InstanceSpec GpuSpec() {
  auto def = std::make_shared<registry::OpDef>();
  def->name = "gpu_scale";
  def->inputs.push_back({0, "x", registry::ParamType::kRequired});
  def->outputs.push_back({0, "y", registry::ParamType::kRequired});
  registry::Implementation impl;
  impl.target = registry::Target::kGpu;
  impl.language = "cuda";
  impl.entry = "scale";
  impl.launch.grid = {"1"};
  impl.launch.block = {"32"};
  impl.launch.args = {"x", "y", "numel(x)"};
  def->implementations.push_back(impl);
  auto kernel = std::make_shared<compiler::CompiledKernel>();
  kernel->target = registry::Target::kGpu;
  kernel->cache_key = std::string(64, 'c');
  compiler::GpuBinary binary;
  binary.ptx = ".version 8.0\n.target sm_90\n.entry scale(\n)\n{\n}\n";
  kernel->artifact = binary;
  InstanceSpec spec;
  spec.ns = "default";
  spec.label = "default/gpu_scale v1";
  spec.kernel = kernel;
  spec.def = def;
  spec.entry = "scale";
  spec.inputs = {{"float32", {8}}};
  spec.input_names = {"x"};
  spec.outputs = {{"float32", {8}}};
  return spec;
}

struct Outcome {
  absl::Status status;
  double kernel_ms = -1;
  uint64_t flushed = 0;
  double wall_ms = 0;
};

Outcome RunOnce(KernelInstance& inst, bool flush) {
  std::vector<float> x(8, 1.0f), y(8, 0.0f);
  const TensorLoc in = TensorLoc::Memory({"float32", {8}}, 32, reinterpret_cast<char*>(x.data()));
  const TensorLoc out = TensorLoc::Memory({"float32", {8}}, 32, reinterpret_cast<char*>(y.data()));
  Outcome o;
  RunArgs args;
  args.inputs = {&in, 1};
  args.outputs = {&out, 1};
  args.kernel_ms = &o.kernel_ms;
  args.flush_caches = flush;
  args.flushed_bytes = &o.flushed;
  const auto t0 = std::chrono::steady_clock::now();
  o.status = inst.Run(args);
  o.wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

class GpuRunnerTimingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(fake_.lib, nullptr) << dlerror();
    ASSERT_TRUE(fake_.configure && fake_.timing && fake_.live && fake_.take_trace);
    fake_.configure(0, 1, size_t{1} << 30, 0);
    auto r = InProcessRunner::Create({});
    ASSERT_TRUE(r.ok()) << r.status();
    runner_ = *std::move(r);
    auto inst = runner_->Instance(GpuSpec());
    ASSERT_TRUE(inst.ok()) << inst.status();
    inst_ = *std::move(inst);
  }

  Fake fake_;
  std::unique_ptr<InProcessRunner> runner_;
  std::shared_ptr<KernelInstance> inst_;
};

// The launch "runs" 30 ms and the stream's sync takes 60 ms: kernel_ms is
// the events' 30, not the call's 90.
TEST_F(GpuRunnerTimingTest, EventsTimeTheLaunchAlone) {
  fake_.timing(30, 60, 0);
  fake_.Trace();
  const Outcome o = RunOnce(*inst_, false);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_GE(o.kernel_ms, 29.0);
  EXPECT_LT(o.kernel_ms, 60.0);
  EXPECT_GE(o.wall_ms, 89.0);
  EXPECT_EQ(o.flushed, 0u);
  const std::string trace = fake_.Trace();
  EXPECT_NE(trace.find("record launch record"), std::string::npos) << trace;
  EXPECT_EQ(trace.find("memset:" + std::to_string(kFakeL2Bytes)), std::string::npos) << trace;
}

// A flushed call fills L2's worth of scratch on the stream, then records the
// start event; the scratch buffer is allocated once.
TEST_F(GpuRunnerTimingTest, FlushFillsL2BeforeTheStartEvent) {
  const int before = fake_.LiveBuffers();
  for (int i = 0; i < 2; ++i) {
    fake_.Trace();
    const Outcome o = RunOnce(*inst_, true);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.flushed, kFakeL2Bytes);
    EXPECT_GE(o.kernel_ms, 0.0);
    const std::string trace = fake_.Trace();
    EXPECT_NE(trace.find("memset:" + std::to_string(kFakeL2Bytes) + " record launch record"),
              std::string::npos)
        << trace;
    EXPECT_EQ(fake_.LiveBuffers(), before + 1);  // the scratch buffer, kept
  }
}

// cuEventCreate fails: the call still runs, timed on the host's clock
// around all of it (launch and sync).
TEST_F(GpuRunnerTimingTest, FailedEventsFallBackToTheHostClock) {
  fake_.timing(30, 60, 2 /* CUDA_ERROR_OUT_OF_MEMORY */);
  const Outcome o = RunOnce(*inst_, false);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_GE(o.kernel_ms, 89.0);
  EXPECT_LE(o.kernel_ms, o.wall_ms);
}

// Through an executor process: the flag reaches it, and what it flushed and
// its kernel time come back.
TEST_F(GpuRunnerTimingTest, ExecutorProcessFlushesAndTimesWithEvents) {
  ProcessRunnerOptions o;
  o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-exec-worker";
  o.workers_per_namespace = 1;
  o.namespace_memory_bytes = 0;
  auto runner = ProcessRunner::Create(o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  auto inst = (*runner)->Instance(GpuSpec());
  ASSERT_TRUE(inst.ok()) << inst.status();
  const Outcome plain = RunOnce(**inst, false);
  ASSERT_TRUE(plain.status.ok()) << plain.status;
  EXPECT_EQ(plain.flushed, 0u);
  const Outcome flushed = RunOnce(**inst, true);
  ASSERT_TRUE(flushed.status.ok()) << flushed.status;
  EXPECT_EQ(flushed.flushed, kFakeL2Bytes);
  EXPECT_GE(flushed.kernel_ms, 0.0);
  EXPECT_LE(flushed.kernel_ms, flushed.wall_ms);
}

}  // namespace
}  // namespace opjit::runner

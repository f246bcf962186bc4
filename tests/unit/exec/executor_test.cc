// The executor (server/exec/executor.cc) on its own: a real registry and
// compiler, and a fake KernelRunner in place of executor processes, so each
// test sees exactly what the executor hands a runner (the instance spec,
// tensor locations, the deadline) and what it makes of the runner's answer.
#include "server/exec/executor.h"


#include <atomic>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/compiler/kernel_compiler.h"
#include "server/registry/registry.h"
#include "server/runner/kernel_runner.h"
#include "server/tensor/region_manager.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::exec {
namespace {

using runner::InstanceSpec;
using runner::KernelInstance;
using runner::RunArgs;

// What the fake runner saw and how it answers. Its kernel writes
// y[i] = 2 * x[i] (float32), after checking that the output came zeroed.
struct FakeState {
  std::mutex mu;
  std::vector<InstanceSpec> specs;  // one per Instance()
  std::vector<std::chrono::steady_clock::time_point> deadlines;
  std::vector<std::string> input_bytes;
  bool output_was_zeroed = true;
  std::atomic<int> runs{0};
  absl::Status answer;         // what Run returns
  double kernel_ms = 1.5;      // what Run reports through RunArgs::kernel_ms
  std::vector<bool> flush_caches;  // RunArgs::flush_caches, per Run
  std::promise<void>* running = nullptr;  // set when a Run starts, if given
  std::shared_future<void> release;      // a Run waits on it, if valid
};

class FakeInstance : public KernelInstance {
 public:
  explicit FakeInstance(FakeState* s) : s_(s) {}
  absl::StatusOr<std::vector<int64_t>> InferShape() override {
    return absl::FailedPreconditionError("no InferShape");
  }
  absl::Status Run(const RunArgs& a) override {
    s_->runs.fetch_add(1);
    if (s_->running != nullptr) s_->running->set_value();
    if (s_->release.valid()) s_->release.wait();
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->deadlines.push_back(a.deadline);
      s_->flush_caches.push_back(a.flush_caches);
      const runner::TensorLoc& in = a.inputs[0];
      if (in.in_memory() == nullptr || a.outputs[0].in_memory() == nullptr) {
        return absl::InternalError("the fake runner takes inline tensors only");
      }
      s_->input_bytes.emplace_back(in.in_memory()->data, in.nbytes);
      const runner::TensorLoc& out = a.outputs[0];
      for (uint64_t i = 0; i < out.nbytes; ++i) {
        if (out.in_memory()->data[i] != 0) s_->output_was_zeroed = false;
      }
    }
    if (!s_->answer.ok()) return s_->answer;
    const auto* x = reinterpret_cast<const float*>(a.inputs[0].in_memory()->data);
    auto* y = reinterpret_cast<float*>(a.outputs[0].in_memory()->data);
    for (uint64_t i = 0; i < a.outputs[0].nbytes / 4; ++i) y[i] = 2 * x[i];
    if (a.kernel_ms != nullptr) *a.kernel_ms = s_->kernel_ms;
    // What a runner that flushed would say (a sweep of 3 KiB).
    if (a.flushed_bytes != nullptr && a.flush_caches) *a.flushed_bytes = 3072;
    return absl::OkStatus();
  }

 private:
  FakeState* s_;
};

class FakeRunner : public runner::KernelRunner {
 public:
  explicit FakeRunner(FakeState* s) : s_(s) {}
  absl::StatusOr<std::shared_ptr<KernelInstance>> Instance(const InstanceSpec& spec) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->specs.push_back(spec);
    return std::make_shared<FakeInstance>(s_);
  }
  runner::RunnerStats Stats() const override { return {}; }
  const char* mode() const override { return "fake"; }

 private:
  FakeState* s_;
};

using opjit::testing::Bytes;

class ExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto stack = opjit::testing::CoreStack::Create("executor-test", 1);
    ASSERT_TRUE(stack.ok()) << stack.status();
    stack_ = *std::move(stack);
    runner_ = std::make_unique<FakeRunner>(&state_);
    Register();
  }
  void TearDown() override {
    executor_.reset();
    runner_.reset();
    stack_.reset();
  }

  // Op "twice": (x float32) -> (y, same shape), attr scale (optional, 2).
  void Register() {
    registry::OpDef d = opjit::testing::FloatOp("twice", {"x"}, {"y"}, R"(#include <cstdint>
extern "C" int K(int, void**, int*, int64_t**, const char**, void*, void*) { return 0; })",
                                                 "K");
    registry::AttrDef scale;
    scale.name = "scale";
    scale.param_type = registry::ParamType::kOptional;
    scale.value_type = registry::ValueType::kFloat;
    scale.default_value = "2";
    d.attrs.push_back(scale);
    auto r = stack_->registry->Register(std::move(d));
    ASSERT_TRUE(r.ok()) << r.status();
  }

  void Start(ExecutorOptions o = {}) {
    auto ex = Executor::Create(o, stack_->registry.get(), stack_->compiler.get(),
                               stack_->regions.get(), runner_.get());
    ASSERT_TRUE(ex.ok()) << ex.status();
    executor_ = *std::move(ex);
  }

  // A call of `twice` on `bytes`. The TensorArg views its bytes, so they are
  // kept here for the test's life: a call run later (ForwardAsync) or kept in
  // a variable never reads a destroyed temporary.
  ForwardCall Call(std::string bytes) {
    const std::string& kept = owned_bytes_.emplace_back(std::move(bytes));
    ForwardCall c;
    c.op = "twice";
    c.inputs = {{TensorArg::Inline({"float32", {static_cast<int64_t>(kept.size() / 4)}}, kept)}};
    return c;
  }
  std::deque<std::string> owned_bytes_;  // deque: references stay valid as it grows

  FakeState state_;
  std::unique_ptr<opjit::testing::CoreStack> stack_;
  std::unique_ptr<FakeRunner> runner_;
  std::unique_ptr<Executor> executor_;
};

TEST_F(ExecutorTest, TheRunnerGetsTheCheckedCallAndItsOutputsComeBack) {
  Start();
  const std::string x = Bytes({1, 2, 3});
  auto r = executor_->Forward(Call(x));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(state_.specs.size(), 1u);
  const InstanceSpec& spec = state_.specs[0];
  EXPECT_EQ(spec.ns, "default");
  EXPECT_EQ(spec.entry, "K");
  EXPECT_NE(spec.label.find("twice v1"), std::string::npos) << spec.label;
  ASSERT_EQ(spec.inputs.size(), 1u);
  EXPECT_EQ(spec.inputs[0], (TensorDesc{"float32", {3}}));
  EXPECT_EQ(spec.input_names, std::vector<std::string>{"x"});
  ASSERT_EQ(spec.outputs.size(), 1u) << "a declarative output rule: outputs known at creation";
  EXPECT_EQ(spec.outputs[0], (TensorDesc{"float32", {3}}));
  EXPECT_EQ(spec.attrs.count("scale"), 1u) << "the default of an optional attr is filled in";
  ASSERT_NE(spec.kernel, nullptr);
  EXPECT_EQ(state_.input_bytes, std::vector<std::string>{x});
  EXPECT_TRUE(state_.output_was_zeroed);
  ASSERT_EQ(r->outputs.size(), 1u);
  EXPECT_EQ(r->outputs[0].desc, (TensorDesc{"float32", {3}}));
  EXPECT_EQ(r->outputs[0].shm(), nullptr);
  ASSERT_NE(r->outputs[0].inline_bytes(), nullptr);
  EXPECT_EQ(r->outputs[0].inline_bytes()->bytes, Bytes({2, 4, 6}));
  EXPECT_EQ(r->kernel_ms, 1.5) << "the runner's own measure of the kernel";
  EXPECT_EQ(r->version, 1);
  EXPECT_TRUE(r->ran_inline);
  EXPECT_EQ(executor_->Stats().calls, 1u);
}

// ForwardCall::flush_caches reaches the runner, and what it flushed comes back.
TEST_F(ExecutorTest, ACacheFlushIsAskedOfTheRunner) {
  Start();
  auto plain = executor_->Forward(Call(Bytes({1})));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->flushed_bytes, 0u);
  ForwardCall c = Call(Bytes({1}));
  c.flush_caches = true;
  auto flushed = executor_->Forward(std::move(c));
  ASSERT_TRUE(flushed.ok()) << flushed.status();
  EXPECT_EQ(flushed->flushed_bytes, 3072u);
  EXPECT_EQ(state_.flush_caches, (std::vector<bool>{false, true}));
}

TEST_F(ExecutorTest, AnInstanceIsCreatedOncePerShape) {
  Start();
  ASSERT_TRUE(executor_->Forward(Call(Bytes({1, 2}))).ok());
  ASSERT_TRUE(executor_->Forward(Call(Bytes({3, 4}))).ok());
  EXPECT_EQ(state_.specs.size(), 1u);
  EXPECT_EQ(executor_->Stats().instance_hits, 1u);
  ASSERT_TRUE(executor_->Forward(Call(Bytes({1, 2, 3}))).ok());
  EXPECT_EQ(state_.specs.size(), 2u) << "another shape is another instance";
  EXPECT_EQ(state_.runs.load(), 3);
}

TEST_F(ExecutorTest, ARunnerErrorReachesTheCallerWithTheOpNamed) {
  Start();
  state_.answer = absl::AbortedError("the kernel returned 3");
  auto r = executor_->Forward(Call(Bytes({1})));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(r.status().message().find("the kernel returned 3"), absl::string_view::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("twice"), absl::string_view::npos) << r.status();
  EXPECT_EQ(executor_->Stats().failures, 1u);
}

TEST_F(ExecutorTest, CallsOverTheInlineLimitRunOnThePool) {
  Start({.inline_max_bytes = 4});
  auto small = executor_->Forward(Call(Bytes({1})));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(small->ran_inline);
  auto big = executor_->Forward(Call(Bytes({1, 2})));
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_FALSE(big->ran_inline);
  ASSERT_NE(big->outputs[0].inline_bytes(), nullptr);
  EXPECT_EQ(big->outputs[0].inline_bytes()->bytes, Bytes({2, 4}));
  EXPECT_EQ(executor_->Stats().pool_runs, 1u);
  EXPECT_EQ(executor_->Stats().inline_runs, 1u);
}

TEST_F(ExecutorTest, AFullQueueIsRefusedWithoutRunning) {
  Start({.pool_threads = 1, .max_queue = 1, .inline_max_bytes = 0});
  std::promise<void> running, release;
  state_.running = &running;
  state_.release = release.get_future().share();
  std::promise<absl::Status> first, second, third;
  executor_->ForwardAsync(Call(Bytes({1})), [&](auto r) { first.set_value(r.status()); });
  running.get_future().wait();  // the pool's one thread is busy
  state_.running = nullptr;
  executor_->ForwardAsync(Call(Bytes({2})), [&](auto r) { second.set_value(r.status()); });
  executor_->ForwardAsync(Call(Bytes({3})), [&](auto r) { third.set_value(r.status()); });
  const absl::Status refused = third.get_future().get();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("queue is full"), absl::string_view::npos) << refused;
  release.set_value();
  EXPECT_TRUE(first.get_future().get().ok());
  EXPECT_TRUE(second.get_future().get().ok());
  EXPECT_EQ(state_.runs.load(), 2);
  EXPECT_EQ(executor_->Stats().rejected, 1u);
}

TEST_F(ExecutorTest, OutputsPastTheInlineLimitAreRefusedBeforeTheKernel) {
  Start({.max_inline_output_bytes = 8});
  auto r = executor_->Forward(Call(Bytes({1, 2, 3})));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(state_.runs.load(), 0);
}

TEST_F(ExecutorTest, TheDeadlineReachesTheRunnerAndAPassedOneNeverRuns) {
  Start();
  ForwardCall c = Call(Bytes({1}));
  c.deadline = std::chrono::steady_clock::now() + std::chrono::hours(1);
  ASSERT_TRUE(executor_->Forward(c).ok());
  ASSERT_EQ(state_.deadlines.size(), 1u);
  EXPECT_EQ(state_.deadlines[0], c.deadline);
  c.deadline = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  auto late = executor_->Forward(c);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_EQ(state_.runs.load(), 1);
}

TEST_F(ExecutorTest, BadCallsNeverReachTheRunner) {
  Start();
  ForwardCall wrong_dtype = Call(Bytes({1}));
  wrong_dtype.inputs[0][0].desc.dtype = "int32";
  EXPECT_EQ(executor_->Forward(wrong_dtype).status().code(), absl::StatusCode::kInvalidArgument);
  ForwardCall short_bytes = Call(Bytes({1}));
  short_bytes.inputs[0][0].desc.shape = {4};
  EXPECT_EQ(executor_->Forward(short_bytes).status().code(), absl::StatusCode::kInvalidArgument);
  ForwardCall unknown = Call(Bytes({1}));
  unknown.op = "nope";
  EXPECT_EQ(executor_->Forward(unknown).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(state_.runs.load(), 0);
  EXPECT_EQ(executor_->Stats().failures, 3u);
}

// Tensors are sum types: each holds one kind of data, named by its
// constructor, and the accessors of the other kinds give nullptr.
TEST(TensorTypesTest, EachTensorHoldsExactlyOneKindOfData) {
  const std::string bytes = Bytes({1, 2});
  const TensorArg in = TensorArg::Inline({"float32", {2}}, bytes);
  ASSERT_NE(in.inline_bytes(), nullptr);
  EXPECT_EQ(in.inline_bytes()->bytes.data(), bytes.data()) << "a view of the caller's bytes";
  EXPECT_EQ(in.shm(), nullptr);
  EXPECT_FALSE(in.is_null());

  const TensorArg shm = TensorArg::Shm({"float32", {2}}, "r1", 64);
  ASSERT_NE(shm.shm(), nullptr);
  EXPECT_EQ(shm.shm()->region, "r1");
  EXPECT_EQ(shm.shm()->offset, 64u);
  EXPECT_EQ(shm.inline_bytes(), nullptr);
  EXPECT_FALSE(shm.is_null());

  const TensorArg null = TensorArg::Null("float32");
  EXPECT_TRUE(null.is_null());
  EXPECT_EQ(null.desc, (TensorDesc{"float32", {}})) << "its dtype, rank 0";
  EXPECT_EQ(null.inline_bytes(), nullptr);
  EXPECT_EQ(null.shm(), nullptr);

  const TensorArg empty;
  ASSERT_NE(empty.inline_bytes(), nullptr) << "default: no inline bytes";
  EXPECT_TRUE(empty.inline_bytes()->bytes.empty());

  std::string buf(8, '\0');
  const runner::TensorLoc mem = runner::TensorLoc::Memory({"float32", {2}}, 8, buf.data());
  ASSERT_NE(mem.in_memory(), nullptr);
  EXPECT_EQ(mem.in_memory()->data, buf.data());
  EXPECT_EQ(mem.in_region(), nullptr);
  EXPECT_FALSE(mem.is_null());
  const runner::TensorLoc none = runner::TensorLoc::Null({"float32", {}});
  EXPECT_TRUE(none.is_null());
  EXPECT_EQ(none.nbytes, 0u);
  EXPECT_EQ(none.in_memory(), nullptr);
  EXPECT_EQ(none.in_region(), nullptr);

  OutputResult out;
  out.data = ShmRef{"r2", 128};
  EXPECT_EQ(out.inline_bytes(), nullptr);
  ASSERT_NE(out.shm(), nullptr);
  EXPECT_EQ(out.shm()->offset, 128u);
}

}  // namespace
}  // namespace opjit::exec

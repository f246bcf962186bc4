// Autograd over a real executor: the bprop's parameter positions (tensors
// not saved are null slots in MindSpore's positions), null tensors in the
// executor, and requires_grad on ops without a backward. Runs with kernels in
// this process and in sandboxed executor processes (the null pointers cross
// the worker boundary).
#include "server/autograd/autograd.h"

#include <unistd.h>

#include <future>

#include "gtest/gtest.h"
#include "server/common/error_info.h"
#include "server/compiler/kernel_compiler.h"
#include "server/exec/executor.h"
#include "server/registry/registry.h"
#include "server/runner/in_process_runner.h"
#include "server/runner/process_runner.h"
#include "server/tensor/region_manager.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::autograd {
namespace {

using exec::TensorArg;

using opjit::testing::Bytes;
using opjit::testing::ExampleSource;
using opjit::testing::Floats;

// (x, w) -> (y = x * w, z = x + w); its bprop checks MindSpore's positions
// (x, w, y, z, dy, dz, dx, dw) with x and y not saved, and returns a code
// naming what was wrong.
const std::string kPos2 = ExampleSource("mul_add.cc");

// kernels/examples/square.cc (Square: y = x * x), then probes: the bprop
// SqGrad (x, y, dy) -> dx saves only x; its bprop SqGradGrad (x, y, dy, dx,
// ddx) -> (gx, gy, gdy) saves everything, so the null y of the first bprop is
// saved as null and dx with its data. Each returns a code naming what was
// wrong.
const std::string kSquare = ExampleSource("square.cc") + R"(
extern "C" int SqGrad(int nparam, void** params, int* ndims, int64_t** shapes, const char**,
                      void*, void*) {
  if (nparam != 4) return 10;
  if (params[1] != nullptr || ndims[1] != 0) return 11;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* dy = static_cast<const float*>(params[2]);
  float* dx = static_cast<float*>(params[3]);
  for (int64_t i = 0; i < n; ++i) dx[i] = 2.0f * x[i] * dy[i];
  return 0;
}
extern "C" int SqGradGrad(int nparam, void** params, int* ndims, int64_t** shapes, const char**,
                          void*, void*) {
  if (nparam != 8) return 20;
  if (params[1] != nullptr || ndims[1] != 0) return 21;  // y: null, saved as null
  if (params[3] == nullptr) return 22;                    // dx: saved with its data
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* dy = static_cast<const float*>(params[2]);
  const float* ddx = static_cast<const float*>(params[4]);
  float* gx = static_cast<float*>(params[5]);
  float* gy = static_cast<float*>(params[6]);
  float* gdy = static_cast<float*>(params[7]);
  for (int64_t i = 0; i < n; ++i) {
    gx[i] = 2.0f * dy[i] * ddx[i];
    gy[i] = 0.0f;
    gdy[i] = 2.0f * x[i] * ddx[i];
  }
  return 0;
}
// What the kernel got for input 0: 1 = a null pointer of rank 0, 2 = data.
extern "C" int IsNull(int nparam, void** params, int* ndims, int64_t**, const char**, void*,
                      void*) {
  if (nparam != 2) return 1;
  float* out = static_cast<float*>(params[1]);
  out[0] = params[0] == nullptr ? 1.0f + 10.0f * ndims[0] : 2.0f;
  return 0;
}
)";

registry::OpDef Def(const std::string& name, const std::vector<std::string>& inputs,
                    const std::vector<std::string>& outputs, const std::string& source,
                    const std::string& entry) {
  return opjit::testing::FloatOp(name, inputs, outputs, source, entry);
}

registry::OutputRule SameAs(int input) {
  registry::OutputRule r;
  r.input = input;
  return r;
}

// An output's inline bytes as floats (a failure when it is in shared memory).
std::vector<float> Floats(const exec::OutputResult& o) {
  const exec::OwnedBytes* b = o.inline_bytes();
  if (b == nullptr) {
    ADD_FAILURE() << "the output is not inline";
    return {};
  }
  return Floats(b->bytes);
}

TensorArg Arg(const std::string& bytes) {
  return TensorArg::Inline({"float32", {static_cast<int64_t>(bytes.size() / 4)}}, bytes);
}

TensorArg NullArg() { return TensorArg::Null("float32"); }

class AutogradTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto stack = opjit::testing::CoreStack::Create("autograd-test");
    ASSERT_TRUE(stack.ok()) << stack.status();
    stack_ = *std::move(stack);
    registry_ = stack_->registry.get();
    std::unique_ptr<runner::KernelRunner> runner;  // null: in this process
    if (std::string(GetParam()) == "process") {
      runner::ProcessRunnerOptions po;
      po.worker_path = OPJIT_BINARY_DIR "/bin/opjit-exec-worker";
      po.workers_per_namespace = 1;
      auto r = runner::ProcessRunner::Create(po);
      ASSERT_TRUE(r.ok()) << r.status();
      runner = *std::move(r);
    }
    ASSERT_TRUE(stack_->AddExecutor(std::move(runner)).ok());
    executor_ = stack_->executor.get();
    auto ag = Autograd::Create({}, registry_, executor_);
    ASSERT_TRUE(ag.ok()) << ag.status();
    autograd_ = *std::move(ag);
  }
  void TearDown() override {
    autograd_.reset();
    stack_.reset();
  }

  void Register(registry::OpDef def) {
    auto r = registry_->Register(std::move(def));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  void RegisterPos2(const std::string& name, bool materialize) {
    auto grad = Def(name + "_grad", {"x", "w", "y", "z", "dy", "dz"}, {"dx", "dw"}, kPos2,
                    "MulAddGrad");
    grad.output_rules = {SameAs(1), SameAs(1)};
    Register(grad);
    auto fwd = Def(name, {"x", "w"}, {"y", "z"}, kPos2, "MulAdd");
    fwd.backward.op = name + "_grad";
    fwd.backward.save_for_backward = {"w", "z"};
    fwd.backward.materialize_grads = materialize;
    Register(fwd);
  }

  absl::StatusOr<GradForwardResult> Forward(exec::ForwardCall call, std::vector<bool> rg) {
    std::promise<absl::StatusOr<GradForwardResult>> p;
    autograd_->ForwardAsync(std::move(call), std::move(rg),
                            [&p](absl::StatusOr<GradForwardResult> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }
  absl::StatusOr<BackwardResult> Backward(BackwardCall call) {
    std::promise<absl::StatusOr<BackwardResult>> p;
    autograd_->BackwardAsync(std::move(call),
                             [&p](absl::StatusOr<BackwardResult> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }

  std::unique_ptr<opjit::testing::CoreStack> stack_;
  registry::Registry* registry_ = nullptr;  // the stack's
  exec::Executor* executor_ = nullptr;  // stack_'s
  std::unique_ptr<Autograd> autograd_;
};

TEST_P(AutogradTest, NotSavedTensorsAreNullSlotsInMindSporePositions) {
  RegisterPos2("pos2", /*materialize=*/true);
  const std::string x = Bytes({1, 2, -3}), w = Bytes({4, 0.5f, 2});
  exec::ForwardCall call;
  call.op = "pos2";
  call.inputs = {{Arg(x)}, {Arg(w)}};
  auto fwd = Forward(call, {true, true});
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_FALSE(fwd->context_id.empty());
  // Only w and z are kept: the null placeholders cost nothing.
  EXPECT_EQ(autograd_->BytesByNamespace()["default"], 2u * 3 * 4);

  const std::string dy = Bytes({1, 2, 3}), dz = Bytes({0.5f, 0.5f, 0.5f});
  BackwardCall b;
  b.context_id = fwd->context_id;
  b.grad_outputs = {Arg(dy), Arg(dz)};
  auto bwd = Backward(b);
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  ASSERT_EQ(bwd->grad_inputs.size(), 2u);
  ASSERT_EQ(bwd->grad_inputs[0].size(), 1u);
  EXPECT_EQ(Floats(bwd->grad_inputs[0][0]), (std::vector<float>{4.5f, 1.5f, 6.5f}));
  EXPECT_EQ(Floats(bwd->grad_inputs[1][0]), (std::vector<float>{1.5f, 4.5f, -8.5f}));
  EXPECT_EQ(autograd_->LiveContexts(), 0u);
}

TEST_P(AutogradTest, AMissingGradWithoutMaterializeIsANullSlot) {
  RegisterPos2("pos2n", /*materialize=*/false);
  const std::string x = Bytes({1, 2, -3}), w = Bytes({4, 0.5f, 2});
  exec::ForwardCall call;
  call.op = "pos2n";
  call.inputs = {{Arg(x)}, {Arg(w)}};
  auto fwd = Forward(call, {true, true});
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const std::string dy = Bytes({1, 2, 3});
  BackwardCall b;
  b.context_id = fwd->context_id;
  b.grad_outputs = {Arg(dy), std::nullopt};
  auto bwd = Backward(b);
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  EXPECT_EQ(Floats(bwd->grad_inputs[0][0]), (std::vector<float>{4, 1, 6}));
  EXPECT_EQ(Floats(bwd->grad_inputs[1][0]), (std::vector<float>{1, 4, -9}));
}

TEST_P(AutogradTest, DoubleBackwardSavesANullSlotAsNull) {
  auto gg = Def("sq_grad_grad", {"x", "y", "dy", "dx", "ddx"}, {"gx", "gy", "gdy"}, kSquare,
                "SqGradGrad");
  gg.output_rules = {SameAs(0), SameAs(0), SameAs(0)};
  Register(gg);
  auto g = Def("sq_grad", {"x", "y", "dy"}, {"dx"}, kSquare, "SqGrad");
  g.backward.op = "sq_grad_grad";  // saves everything
  Register(g);
  auto f = Def("sq", {"x"}, {"y"}, kSquare, "Square");
  f.backward.op = "sq_grad";
  f.backward.save_for_backward = {"x"};
  Register(f);

  const std::string x = Bytes({3});
  exec::ForwardCall call;
  call.op = "sq";
  call.inputs = {{Arg(x)}};
  auto fwd = Forward(call, {true});
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const std::string dy = Bytes({2});
  BackwardCall b;
  b.context_id = fwd->context_id;
  b.grad_outputs = {Arg(dy)};
  b.create_graph = true;
  auto first = Backward(b);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Floats(first->grad_inputs[0][0]), (std::vector<float>{12}));
  ASSERT_FALSE(first->context_id.empty());
  const std::string ddx = Bytes({1});
  BackwardCall b2;
  b2.context_id = first->context_id;
  b2.grad_outputs = {Arg(ddx)};
  auto second = Backward(b2);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->grad_inputs.size(), 3u);
  EXPECT_EQ(Floats(second->grad_inputs[0][0]), (std::vector<float>{4}));
  EXPECT_TRUE(second->grad_inputs[1].empty());  // the null y gets no grad
  EXPECT_EQ(Floats(second->grad_inputs[2][0]), (std::vector<float>{6}));
}

TEST_P(AutogradTest, RequiresGradOnAnOpWithoutBackwardRunsAndItsBackwardFails) {
  Register(Def("nodiff", {"x"}, {"y"}, kSquare, "Square"));
  const std::string x = Bytes({1, 4});
  exec::ForwardCall call;
  call.op = "nodiff";
  call.inputs = {{Arg(x)}};
  auto fwd = Forward(call, {true});
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(Floats(fwd->forward.outputs[0]), (std::vector<float>{1, 16}));
  ASSERT_FALSE(fwd->context_id.empty());
  EXPECT_EQ(autograd_->BytesByNamespace()["default"], 0u);  // nothing saved

  const std::string dy = Bytes({1, 1});
  BackwardCall b;
  b.context_id = fwd->context_id;
  b.grad_outputs = {Arg(dy)};
  auto bwd = Backward(b);
  ASSERT_EQ(bwd.status().code(), absl::StatusCode::kFailedPrecondition) << bwd.status();
  auto reason = GetReason(bwd.status());
  ASSERT_TRUE(reason.has_value()) << bwd.status();
  EXPECT_EQ(reason->reason, reason::kNotDifferentiable);
  EXPECT_EQ(reason->metadata["op"], "default/nodiff");
  EXPECT_NE(bwd.status().message().find("default/nodiff"), std::string::npos) << bwd.status();
  EXPECT_EQ(autograd_->LiveContexts(), 0u);  // released like any context
}

// The executor side of null tensors, called directly.
TEST_P(AutogradTest, ExecutorNullTensors) {
  auto probe = Def("isnull", {"x"}, {"flag"}, kSquare, "IsNull");
  registry::OutputRule one;
  one.kind = registry::OutputRule::Kind::kExplicit;
  one.shape = {1};
  one.dtype = "float32";
  probe.output_rules = {one};
  Register(probe);
  auto run = [&](TensorArg a) -> absl::StatusOr<float> {
    exec::ForwardCall call;
    call.op = "isnull";
    call.inputs = {{a}};
    auto r = executor_->Forward(std::move(call));
    if (!r.ok()) return r.status();
    return Floats(r->outputs[0])[0];
  };
  // A null slot, then a real scalar of the same dtype (same descriptor:
  // they share a kernel instance but are different call shapes), then null.
  auto null1 = run(NullArg());
  ASSERT_TRUE(null1.ok()) << null1.status();
  EXPECT_EQ(*null1, 1.0f);
  const std::string scalar = Bytes({7});
  auto data = run(TensorArg::Inline({"float32", {}}, scalar));
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(*data, 2.0f);
  auto null2 = run(NullArg());
  ASSERT_TRUE(null2.ok()) << null2.status();
  EXPECT_EQ(*null2, 1.0f);

  // A null tensor has rank 0 (and no bytes: a TensorArg cannot hold both).
  TensorArg shaped = NullArg();
  shaped.desc.shape = {3};
  EXPECT_EQ(run(shaped).status().code(), absl::StatusCode::kInvalidArgument);

  // A shape rule cannot take its shape from a null slot.
  Register(Def("same", {"x"}, {"y"}, kSquare, "Square"));
  exec::ForwardCall call;
  call.op = "same";
  call.inputs = {{NullArg()}};
  auto r = executor_->Forward(std::move(call));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("no data"), std::string::npos) << r.status();
}

// y = x * b with b broadcast along x's rows, x (rows, n) and b (n); its bprop
// BMulGrad (x, b, dy) -> (dx, db) writes db in dy's full shape, as a bprop
// that leaves the reduction to the framework does (torch's engine sums it,
// MindSpore's auto_reduce).
const std::string kBroadcastMul = R"(
#include <cstdint>
static int64_t Numel(int nd, const int64_t* s) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= s[i];
  return n;
}
extern "C" int BMul(int nparam, void** params, int* ndims, int64_t** shapes, const char**, void*,
                    void*) {
  if (nparam != 3) return 1;
  const int64_t n = Numel(ndims[1], shapes[1]), total = Numel(ndims[0], shapes[0]);
  const float* x = static_cast<const float*>(params[0]);
  const float* b = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < total; ++i) y[i] = x[i] * b[i % n];
  return 0;
}
extern "C" int BMulGrad(int nparam, void** params, int* ndims, int64_t** shapes, const char**,
                        void*, void*) {
  if (nparam != 5) return 1;
  const int64_t n = Numel(ndims[1], shapes[1]), total = Numel(ndims[0], shapes[0]);
  const float* x = static_cast<const float*>(params[0]);
  const float* b = static_cast<const float*>(params[1]);
  const float* dy = static_cast<const float*>(params[2]);
  float* dx = static_cast<float*>(params[3]);
  float* db = static_cast<float*>(params[4]);  // dy's shape: summed by the daemon
  for (int64_t i = 0; i < total; ++i) {
    dx[i] = dy[i] * b[i % n];
    db[i] = dy[i] * x[i];
  }
  return 0;
}
// Writes nothing: the shapes are what a test looks at.
extern "C" int Nothing(int, void**, int*, int64_t**, const char**, void*, void*) { return 0; }
)";

TEST_P(AutogradTest, AGradThatBroadcastsIsSummedToItsInputsShape) {
  auto g = Def("bmul_grad", {"x", "b", "dy"}, {"dx", "db"}, kBroadcastMul, "BMulGrad");
  g.output_rules = {SameAs(2), SameAs(2)};
  Register(g);
  auto f = Def("bmul", {"x", "b"}, {"y"}, kBroadcastMul, "BMul");
  f.output_rules = {SameAs(0)};
  f.backward.op = "bmul_grad";
  f.backward.inputs = {"x", "b", "dout"};
  Register(f);
  // Inline tensors are views: their bytes outlive the calls.
  const std::string x = Bytes({1, 2, 3, 4, 5, 6}), bias = Bytes({10, 20, 30});
  const std::string dy = Bytes({1, 1, 1, 2, 2, 2});
  exec::ForwardCall call;
  call.op = "bmul";
  call.inputs = {{TensorArg::Inline({"float32", {2, 3}}, x)},
                 {TensorArg::Inline({"float32", {3}}, bias)}};
  auto fwd = Forward(call, {true, true});
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  BackwardCall b;
  b.context_id = fwd->context_id;
  b.grad_outputs = {TensorArg::Inline({"float32", {2, 3}}, dy)};
  auto bwd = Backward(b);
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  EXPECT_EQ(Floats(bwd->grad_inputs[0][0]), (std::vector<float>{10, 20, 30, 20, 40, 60}));
  EXPECT_EQ(bwd->grad_inputs[0][0].desc.shape, (std::vector<int64_t>{2, 3}));
  // db = sum over rows of dy * x: [1 + 8, 2 + 10, 3 + 12].
  EXPECT_EQ(bwd->grad_inputs[1][0].desc.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(Floats(bwd->grad_inputs[1][0]), (std::vector<float>{9, 12, 15}));
}

TEST_P(AutogradTest, AGradThatCannotBeSummedToItsInputIsRefusedNamingIt) {
  auto g = Def("odd_grad", {"x", "b", "dy"}, {"dx", "db"}, kBroadcastMul, "Nothing");
  g.output_rules = {SameAs(1), SameAs(1)};  // dx in b's shape (3): not x's (2)
  Register(g);
  auto f = Def("odd", {"x", "b"}, {"y"}, kBroadcastMul, "Nothing");
  f.output_rules = {SameAs(1)};
  f.backward.op = "odd_grad";
  f.backward.inputs = {"x", "b", "dout"};
  Register(f);
  exec::ForwardCall call;
  const std::string x = Bytes({1, 2}), bias = Bytes({1, 2, 3}), dy = Bytes({1, 1, 1});
  call.op = "odd";
  call.inputs = {{Arg(x)}, {Arg(bias)}};
  auto fwd = Forward(call, {true, true});
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  BackwardCall b;
  b.context_id = fwd->context_id;
  b.grad_outputs = {Arg(dy)};
  auto bwd = Backward(b);
  EXPECT_EQ(bwd.status().code(), absl::StatusCode::kInvalidArgument) << bwd.status();
  auto why = GetReason(bwd.status());
  ASSERT_TRUE(why.has_value());
  EXPECT_EQ(why->reason, reason::kGradShape);
  EXPECT_NE(bwd.status().message().find("input x"), std::string::npos) << bwd.status();
  EXPECT_NE(bwd.status().message().find("float32[3]"), std::string::npos) << bwd.status();
  EXPECT_NE(bwd.status().message().find("float32[2]"), std::string::npos) << bwd.status();
}

INSTANTIATE_TEST_SUITE_P(Runners, AutogradTest, ::testing::Values("in_daemon", "process"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace opjit::autograd

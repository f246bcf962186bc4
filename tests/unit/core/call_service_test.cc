// The call use case over a real executor and autograd (kernels in this
// process), no gRPC: admission, handle lookup, and the routing of a forward
// to the executor or, when an input requires a grad, to autograd.
#include "server/core/call_service.h"

#include <future>

#include "gtest/gtest.h"
#include "server/access/quotas.h"
#include "server/common/error_info.h"
#include "server/compiler/kernel_compiler.h"
#include "server/registry/registry.h"
#include "server/runner/in_process_runner.h"
#include "server/tensor/region_manager.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::core {
namespace {

using opjit::testing::Bytes;
using opjit::testing::Floats;

// kernels/examples/square.cc: Square (y = x * x) and its bprop SquareGrad;
// one output, shaped as input 0.
registry::OpDef Def(const std::string& name, const std::vector<std::string>& inputs,
                    const std::string& output, const std::string& entry) {
  registry::OpDef d = opjit::testing::FloatOp(name, inputs, {output},
                                              opjit::testing::ExampleSource("square.cc"), entry);
  d.output_rules.push_back({});  // the shape and dtype of input 0
  return d;
}

exec::TensorArg Arg(const std::string& bytes) {
  return exec::TensorArg::Inline({"float32", {static_cast<int64_t>(bytes.size() / 4)}}, bytes);
}

// An output's inline bytes ("" when it is in shared memory).
std::string InlineOf(const exec::OutputResult& o) {
  const exec::OwnedBytes* b = o.inline_bytes();
  return b != nullptr ? b->bytes : std::string();
}

// What ForwardAsync's callback got.
struct Answer {
  absl::Status status;
  std::vector<float> y;
  std::string context_id;
};

class CallServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto stack = opjit::testing::CoreStack::Create("call-service-test");
    ASSERT_TRUE(stack.ok()) << stack.status();
    stack_ = *std::move(stack);
    registry_ = stack_->registry.get();
    ASSERT_TRUE(stack_->AddExecutor().ok());
    executor_ = stack_->executor.get();
    auto ag = autograd::Autograd::Create({}, registry_, executor_);
    ASSERT_TRUE(ag.ok()) << ag.status();
    autograd_ = *std::move(ag);
    handles_ = std::make_unique<exec::HandleTable>(exec::HandleTableOptions{}, registry_);
    calls_ = std::make_unique<CallService>(executor_, autograd_.get(), handles_.get(),
                                           nullptr, nullptr);

    ASSERT_TRUE(registry_->Register(Def("square_grad", {"x", "y", "dy"}, "dx", "SquareGrad")).ok());
    registry::OpDef square = Def("square", {"x"}, "y", "Square");
    square.backward.op = "square_grad";
    square.backward.save_for_backward = {"x"};
    ASSERT_TRUE(registry_->Register(square).ok());
  }
  void TearDown() override {
    calls_.reset();
    handles_.reset();
    autograd_.reset();
    stack_.reset();
  }

  exec::ForwardCall Square(const std::string& x) {
    exec::ForwardCall call;
    call.op = "square";
    call.inputs = {{Arg(x)}};
    return call;
  }

  Answer Forward(const CallService& calls, exec::ForwardCall call,
                 std::initializer_list<bool> requires_grad) {
    std::promise<Answer> p;
    calls.ForwardAsync(std::move(call), absl::MakeConstSpan(requires_grad.begin(), requires_grad.size()),
                       [&p](const absl::Status& s, exec::ForwardResult* r,
                            const std::string& context_id) {
                         Answer a{s, {}, context_id};
                         if (r != nullptr) a.y = Floats(InlineOf(r->outputs.at(0)));
                         p.set_value(std::move(a));
                       });
    return p.get_future().get();
  }

  absl::StatusOr<std::shared_ptr<const exec::Handle>> Prepare(const CallService& calls,
                                                             exec::ForwardCall call,
                                                             const std::string& owner) {
    std::promise<absl::StatusOr<std::shared_ptr<const exec::Handle>>> p;
    calls.PrepareAsync(std::move(call), owner,
                       [&p](absl::StatusOr<std::shared_ptr<const exec::Handle>> h) {
                         p.set_value(std::move(h));
                       });
    return p.get_future().get();
  }

  absl::StatusOr<autograd::BackwardResult> Backward(autograd::BackwardCall call) {
    std::promise<absl::StatusOr<autograd::BackwardResult>> p;
    calls_->BackwardAsync(std::move(call), [&p](absl::StatusOr<autograd::BackwardResult> r) {
      p.set_value(std::move(r));
    });
    return p.get_future().get();
  }

  std::unique_ptr<opjit::testing::CoreStack> stack_;
  registry::Registry* registry_ = nullptr;  // the stack's
  exec::Executor* executor_ = nullptr;  // stack_'s
  std::unique_ptr<autograd::Autograd> autograd_;
  std::unique_ptr<exec::HandleTable> handles_;
  std::unique_ptr<CallService> calls_;
};

TEST_F(CallServiceTest, AForwardWithoutRequiresGradRunsOnTheExecutor) {
  const std::string x = Bytes({1, 2, 3});
  for (Answer a : {Forward(*calls_, Square(x), {}), Forward(*calls_, Square(x), {false})}) {
    ASSERT_TRUE(a.status.ok()) << a.status;
    EXPECT_EQ(a.y, (std::vector<float>{1, 4, 9}));
    EXPECT_EQ(a.context_id, "");
  }
  EXPECT_EQ(autograd_->LiveContexts(), 0u);
  EXPECT_EQ(executor_->Stats().calls, 2u);
}

TEST_F(CallServiceTest, AForwardWithRequiresGradGoesThroughAutograd) {
  const std::string x = Bytes({1, 2, 3});
  Answer a = Forward(*calls_, Square(x), {true});
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.y, (std::vector<float>{1, 4, 9}));
  ASSERT_NE(a.context_id, "");
  EXPECT_EQ(autograd_->LiveContexts(), 1u);

  autograd::BackwardCall b;
  b.context_id = a.context_id;
  const std::string dy = Bytes({1, 1, 1});
  b.grad_outputs.push_back(Arg(dy));
  auto grads = Backward(b);
  ASSERT_TRUE(grads.ok()) << grads.status();
  ASSERT_EQ(grads->grad_inputs.size(), 1u);
  EXPECT_EQ(Floats(InlineOf(grads->grad_inputs[0].at(0))), (std::vector<float>{2, 4, 6}));
  EXPECT_EQ(autograd_->LiveContexts(), 0u);  // released after its backward
}

// A backward without its context is refused as a precondition (run the
// forward with requires_grad first); releasing it is NOT_FOUND. Both carry
// reason CONTEXT_NOT_FOUND.
TEST_F(CallServiceTest, UnknownContextsAreRefusedWithTheirReason) {
  autograd::BackwardCall b;
  b.context_id = "no-such-context";
  auto r = Backward(b);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  ASSERT_TRUE(GetReason(r.status()).has_value());
  EXPECT_EQ(GetReason(r.status())->reason, reason::kContextNotFound);
  absl::Status s = calls_->ReleaseContext("default", "no-such-context");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(GetReason(s)->reason, reason::kContextNotFound);
}

TEST_F(CallServiceTest, AdmissionRefusedIsResourceExhausted) {
  EXPECT_TRUE(calls_->Admit("default").ok());  // no quotas: every call
  // A bucket of one call that refills in 1000 s: the second call is refused.
  access::QuotaManager quotas({.calls_per_second = 0.001});
  CallService calls(executor_, autograd_.get(), handles_.get(), nullptr, &quotas);
  EXPECT_TRUE(calls.Admit("a").ok());
  absl::Status s = calls.Admit("a");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_TRUE(GetReason(s).has_value());
  EXPECT_EQ(GetReason(s)->reason, reason::kQuotaExceeded);
  EXPECT_NE(s.message().find("calls_per_second"), std::string::npos) << s;
  EXPECT_TRUE(calls.Admit("b").ok());  // per namespace
}

TEST_F(CallServiceTest, PreparedHandlesRunTheirShapesForTheirOwnerOnly) {
  const std::string x = Bytes({1, 2, 3, 4});
  auto h = Prepare(*calls_, Square(x), "alice/1");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE((*h)->fast);  // no fast channels here
  EXPECT_EQ((*h)->prepared.record->version, 1);
  // The handle keeps shapes, not tensors.
  EXPECT_TRUE((*h)->call.inputs.empty());
  ASSERT_EQ((*h)->prepared.inputs.size(), 1u);
  EXPECT_EQ((*h)->prepared.inputs[0].shape, (std::vector<int64_t>{4}));

  auto found = calls_->FindHandle("default", "alice/1", (*h)->id);
  ASSERT_TRUE(found.ok()) << found.status();
  auto call = CallService::CallFromHandle(**found, {{Arg(x)}});
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->op, "square");
  EXPECT_EQ(call->version, 1);
  Answer a = Forward(*calls_, *std::move(call), {});
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.y, (std::vector<float>{1, 4, 9, 16}));

  const std::string three = Bytes({1, 2, 3});
  auto wrong = CallService::CallFromHandle(**found, {{Arg(three)}});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("(prepare the new shape)"), std::string::npos)
      << wrong.status();
  auto more = CallService::CallFromHandle(**found, {{Arg(x), Arg(x)}});
  EXPECT_EQ(more.status().code(), absl::StatusCode::kInvalidArgument) << more.status();

  // Another owner's handle is answered like a missing one.
  for (const auto& [owner, id] :
       {std::pair<std::string, uint64_t>{"mallory/1", (*h)->id}, {"alice/1", 424242}}) {
    auto other = calls_->FindHandle("default", owner, id);
    EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
    ASSERT_TRUE(GetReason(other.status()).has_value());
    EXPECT_EQ(GetReason(other.status())->reason, reason::kStaleHandle);
  }
  EXPECT_EQ(calls_->ReleaseHandles("default", "alice/1", {(*h)->id}), 1);
  EXPECT_EQ(calls_->FindHandle("default", "alice/1", (*h)->id).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CallServiceTest, WhatTheServerLacksIsUnimplemented) {
  CallService bare(executor_, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(bare.FindHandle("default", "alice/1", 1).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(bare.HandlesAvailable().code(), absl::StatusCode::kUnimplemented);
  const std::string x = Bytes({1});
  EXPECT_EQ(Prepare(bare, Square(x), "alice/1").status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(bare.ReleaseHandles("default", "alice/1", {}), 0);
  EXPECT_EQ(Forward(bare, Square(x), {true}).status.code(), absl::StatusCode::kUnimplemented);
  // Without requires_grad the executor alone is enough.
  EXPECT_TRUE(Forward(bare, Square(x), {false}).status.ok());
}

TEST_F(CallServiceTest, GradCheckShapesAreBounded) {
  autograd::GradCheckCall call;
  call.op = "square";
  call.random_shape = {4097};
  std::promise<absl::StatusOr<autograd::GradCheckResult>> p;
  calls_->GradCheckAsync(std::move(call), [&p](absl::StatusOr<autograd::GradCheckResult> r) {
    p.set_value(std::move(r));
  });
  auto r = p.get_future().get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("random_shape"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace opjit::core

// Backward end to end: the seed scenarios (MindSpore bprop, Paddle PyLayer
// semantics), double backward and gradcheck, through the real opjitd.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "client/cpp/npy.h"
#include "server/common/error_info.h"
#include "tests/integration/daemon_harness.h"

namespace opjit::testing {
namespace {

using client::InlineTensor;

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

class AutogradIT : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(tmp_.path() + "/state");
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
    c_ = daemon_->NewClient();
  }
  void Register(const std::string& example) {
    auto spec = client::LoadOpSpec(SourceDir() + "/kernels/examples/" + example + ".json");
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto r = c_->Register(*spec);
    ASSERT_TRUE(r.ok()) << example << ": " << r.status();
  }
  v1::ForwardRequest Call(const std::string& op, const std::vector<std::vector<float>>& inputs,
                          const std::vector<bool>& requires_grad) {
    v1::ForwardRequest req;
    req.set_op(op);
    for (const auto& x : inputs) {
      *req.add_inputs()->add_tensors() =
          InlineTensor("float32", {static_cast<int64_t>(x.size())}, Bytes(x));
    }
    for (bool b : requires_grad) req.add_requires_grad(b);
    return req;
  }
  v1::BackwardRequest Grad(const std::string& context, const std::vector<std::vector<float>>& dys) {
    v1::BackwardRequest req;
    req.set_context_id(context);
    for (const auto& dy : dys) {
      if (dy.empty()) {
        req.add_grad_outputs();  // missing
      } else {
        *req.add_grad_outputs() = InlineTensor("float32", {static_cast<int64_t>(dy.size())}, Bytes(dy));
      }
    }
    return req;
  }

  TempDir tmp_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> c_;
};

TEST_F(AutogradIT, SquareWithBpropOp) {
  Register("square_grad");
  Register("square");
  auto fwd = c_->Forward(Call("square", {{1, 4, 9}}, {true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(Floats(fwd->outputs(0).inline_data()), (std::vector<float>{1, 16, 81}));
  ASSERT_FALSE(fwd->context_id().empty());
  auto bwd = c_->Backward(Grad(fwd->context_id(), {{1, 1, 1}}));
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  ASSERT_EQ(bwd->grad_inputs_size(), 1);
  EXPECT_EQ(Floats(bwd->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{2, 8, 18}));

  // The context is gone after its backward.
  auto again = c_->Backward(Grad(fwd->context_id(), {{1, 1, 1}}));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
}

TEST_F(AutogradIT, TanhUsesTheSavedOutput) {
  Register("tanh_grad");
  Register("tanh");
  std::vector<float> x = {-1.0f, 0.0f, 0.5f, 2.0f};
  auto fwd = c_->Forward(Call("tanh", {x}, {true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto bwd = c_->Backward(Grad(fwd->context_id(), {{1, 2, 3, 4}}));
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  auto dx = Floats(bwd->grad_inputs(0).tensors(0).inline_data());
  for (size_t i = 0; i < x.size(); ++i) {
    const float y = std::tanh(x[i]);
    EXPECT_NEAR(dx[i], (i + 1) * (1 - y * y), 1e-6) << i;
  }
}

TEST_F(AutogradIT, ThreeOutputsTwoGradsAndStopGradient) {
  Register("arith3_grad");
  Register("arith3");
  std::vector<float> x = {1, 2}, y = {4, 5};
  auto fwd = c_->Forward(Call("arith3", {x, y}, {true, true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  // d(sum) = 1, d(prod) = 1, d(quot) missing -> zero-filled.
  auto bwd = c_->Backward(Grad(fwd->context_id(), {{1, 1}, {1, 1}, {}}));
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  ASSERT_EQ(bwd->grad_inputs_size(), 2);
  EXPECT_EQ(Floats(bwd->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{5, 6}));
  EXPECT_EQ(Floats(bwd->grad_inputs(1).tensors(0).inline_data()), (std::vector<float>{2, 3}));

  // y with requires_grad false gets no grad.
  fwd = c_->Forward(Call("arith3", {x, y}, {true, false}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  bwd = c_->Backward(Grad(fwd->context_id(), {{0, 0}, {0, 0}, {1, 1}}));
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  EXPECT_EQ(bwd->grad_inputs(0).tensors_size(), 1);
  EXPECT_EQ(bwd->grad_inputs(1).tensors_size(), 0);
  EXPECT_FLOAT_EQ(Floats(bwd->grad_inputs(0).tensors(0).inline_data())[0], 0.25f);
}

TEST_F(AutogradIT, NoInputRequiresGradMeansNoContextAndNoBackward) {
  Register("square_grad");
  Register("square");
  auto fwd = c_->Forward(Call("square", {{1, 2}}, {false}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(fwd->context_id().empty());
  auto plain = c_->Forward(Call("square", {{1, 2}}, {}));
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->context_id().empty());
  auto bwd = c_->Backward(Grad("0123456789abcdef", {{1, 1}}));
  EXPECT_EQ(bwd.status().code(), absl::StatusCode::kFailedPrecondition) << bwd.status();
  EXPECT_NE(bwd.status().message().find("requires_grad"), std::string::npos) << bwd.status();
}

TEST_F(AutogradIT, RetainAndDoubleBackward) {
  Register("square_grad_grad");
  Register("square_grad");
  Register("square");
  auto fwd = c_->Forward(Call("square", {{3}}, {true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto req = Grad(fwd->context_id(), {{2}});
  req.set_retain_context(true);
  req.set_create_graph(true);
  auto first = c_->Backward(req);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Floats(first->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{12}));
  ASSERT_FALSE(first->context_id().empty());
  // d/dx of (dx = 2 * x * dy) with ddx = 1: grad_x = 2 * dy = 4, grad_dy = 2 * x = 6.
  auto second = c_->Backward(Grad(first->context_id(), {{1}}));
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->grad_inputs_size(), 3);
  EXPECT_EQ(Floats(second->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{4}));
  EXPECT_EQ(second->grad_inputs(1).tensors_size(), 0);  // y had no data (a null slot)
  EXPECT_EQ(Floats(second->grad_inputs(2).tensors(0).inline_data()), (std::vector<float>{6}));
  // The retained forward context still works.
  auto third = c_->Backward(Grad(fwd->context_id(), {{1}}));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(Floats(third->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{6}));
}

// GradCheck's work is bounded by a quota and by the call's deadline.
TEST_F(AutogradIT, GradCheckIsBoundedByAQuotaAndTheDeadline) {
  Register("tanh_grad");
  Register("tanh");
  v1::GradCheckRequest big;
  big.set_op("tanh");
  big.add_random_shape(4096);
  big.add_random_shape(64);
  auto r = c_->GradCheck(big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  // Under the quota, but far more work than 20 ms allow (8,192 forwards of
  // 4,096 tanh each).
  v1::GradCheckRequest slow;
  slow.set_op("tanh");
  slow.add_random_shape(4096);
  auto quick = client::Client::Connect(
      {.address = daemon_->address(), .timeout = std::chrono::milliseconds(20)});
  ASSERT_TRUE(quick.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto late = (*quick)->GradCheck(slow);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  // The server stopped too: a small check right after is answered at once.
  v1::GradCheckRequest small;
  small.set_op("tanh");
  auto ok = c_->GradCheck(small);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // (Stopped between evaluations, or inside one: in-daemon at the next
  // check, with executor processes by killing the call's executor.)
}

TEST_F(AutogradIT, GradCheckPassesForCorrectBackwardsAndCatchesAWrongOne) {
  Register("tanh_grad");
  Register("tanh");
  Register("arith3_grad");
  Register("arith3");
  for (const std::string op : {"tanh", "arith3"}) {
    auto check = daemon_->Cli({"gradcheck", op, "--shape", "3,2", "--json"});
    EXPECT_EQ(check.exit_code, 0) << op << check.out << check.err;
    EXPECT_NE(check.out.find("\"passed\": true"), std::string::npos) << check.out;
  }
  // tanh (float64 available): the check runs in the widest dtype.
  v1::GradCheckRequest req;
  req.set_op("tanh");
  auto r = c_->GradCheck(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dtype(), "float64");
  EXPECT_LT(r->inputs(0).max_abs_error(), 1e-6);

  // A bprop that forgets the factor 2 fails the check.
  auto bad = client::LoadOpSpec(SourceDir() + "/kernels/examples/square_grad.json");
  ASSERT_TRUE(bad.ok());
  bad->set_name("half_grad");
  bad->mutable_backward()->Clear();
  auto* src = bad->mutable_implementations(0)->mutable_source();
  const auto pos = src->find("dx[i] = 2.0f * x[i] * dy[i];");
  ASSERT_NE(pos, std::string::npos);
  src->replace(pos, 28, "dx[i] = x[i] * dy[i];       ");
  ASSERT_TRUE(c_->Register(*bad).ok());
  auto sq = client::LoadOpSpec(SourceDir() + "/kernels/examples/square.json");
  ASSERT_TRUE(sq.ok());
  sq->set_name("square_bad");
  sq->mutable_backward()->set_op("half_grad");
  ASSERT_TRUE(c_->Register(*sq).ok());
  auto fail = daemon_->Cli({"gradcheck", "square_bad"});
  EXPECT_EQ(fail.exit_code, 3) << fail.out << fail.err;
  EXPECT_NE(fail.out.find("FAIL"), std::string::npos) << fail.out;
}

// MindSpore's bprop positions: (x, w, y, z, dy, dz) -> (dx, dw), whatever
// save_for_backward keeps. Only w and z are saved, so x and y reach the bprop
// as null slots in their own positions; the kernel checks nparam and reads
// params[k] at MindSpore's index k (and fails with a code naming what was
// wrong otherwise).
const std::string kPos2Source = [] {
  std::ifstream in(SourceDir() + "/kernels/examples/mul_add.cc");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}();

// `text` as the inside of a JSON string.
std::string JsonEscaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

std::string Pos2Spec(const std::string& name, bool materialize) {
  const std::string src = JsonEscaped(kPos2Source);
  return absl::StrCat(R"({"name": ")", name, R"(",
    "inputs": [{"index": 0, "name": "x"}, {"index": 1, "name": "w"}],
    "outputs": [{"index": 0, "name": "y"}, {"index": 1, "name": "z"}],
    "dtype_formats": [{"dtypes": ["float32", "float32", "float32", "float32"]}],
    "implementations": [{"target": "CPU", "source": ")", src, R"(", "entry": "MulAdd"}],
    "backward": {"op": "pos2_grad", "save_for_backward": ["w", "z"], "materialize_grads": )",
                      materialize ? "true" : "false", "}}");
}

std::string Pos2GradSpec() {
  const std::string src = JsonEscaped(kPos2Source);
  return absl::StrCat(R"({"name": "pos2_grad",
    "inputs": [{"index": 0, "name": "x"}, {"index": 1, "name": "w"}, {"index": 2, "name": "y"},
               {"index": 3, "name": "z"}, {"index": 4, "name": "dy"}, {"index": 5, "name": "dz"}],
    "outputs": [{"index": 0, "name": "dx"}, {"index": 1, "name": "dw"}],
    "dtype_formats": [{"dtypes": ["float32", "float32", "float32", "float32", "float32", "float32",
                                  "float32", "float32"]}],
    "implementations": [{"target": "CPU", "source": ")", src, R"(", "entry": "MulAddGrad"}],
    "output_rules": [{"kind": "same_as", "input": 1}, {"kind": "same_as", "input": 1}]})");
}

TEST_F(AutogradIT, BpropParamsKeepMindSporePositionsWithAPartialSave) {
  for (const std::string& json :
       {Pos2GradSpec(), Pos2Spec("pos2", true), Pos2Spec("pos2_nomat", false)}) {
    auto spec = client::ParseOpSpec(json, tmp_.path());
    ASSERT_TRUE(spec.ok()) << spec.status() << json;
    auto r = c_->Register(*spec);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  const std::vector<float> x = {1, 2, -3}, w = {4, 0.5f, 2};
  auto fwd = c_->Forward(Call("pos2", {x, w}, {true, true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(Floats(fwd->outputs(0).inline_data()), (std::vector<float>{4, 1, -6}));
  EXPECT_EQ(Floats(fwd->outputs(1).inline_data()), (std::vector<float>{5, 2.5f, -1}));
  auto bwd = c_->Backward(Grad(fwd->context_id(), {{1, 2, 3}, {0.5f, 0.5f, 0.5f}}));
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  ASSERT_EQ(bwd->grad_inputs_size(), 2);
  EXPECT_EQ(Floats(bwd->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{4.5f, 1.5f, 6.5f}));
  EXPECT_EQ(Floats(bwd->grad_inputs(1).tensors(0).inline_data()), (std::vector<float>{1.5f, 4.5f, -8.5f}));

  // A missing grad with materialize_grads false is a null slot too (dz at
  // params[5]), not a shift of dx and dw.
  fwd = c_->Forward(Call("pos2_nomat", {x, w}, {true, false}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  bwd = c_->Backward(Grad(fwd->context_id(), {{1, 2, 3}, {}}));
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  EXPECT_EQ(Floats(bwd->grad_inputs(0).tensors(0).inline_data()), (std::vector<float>{4, 1, 6}));
  EXPECT_EQ(bwd->grad_inputs(1).tensors_size(), 0);  // w: requires_grad false

  // GradCheck runs the same bprop.
  v1::GradCheckRequest check;
  check.set_op("pos2");
  auto gc = c_->GradCheck(check);
  ASSERT_TRUE(gc.ok()) << gc.status();
  EXPECT_TRUE(gc->passed()) << gc->message();
}

// requires_grad on an op without a backward: the forward runs, its outputs
// are not differentiable, and a backward through them names the op.
TEST_F(AutogradIT, RequiresGradOnAnOpWithoutBackwardRunsAndBackwardNamesIt) {
  auto spec = client::LoadOpSpec(SourceDir() + "/kernels/examples/square.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->set_name("square_nodiff");
  spec->mutable_backward()->Clear();
  ASSERT_TRUE(c_->Register(*spec).ok());
  auto fwd = c_->Forward(Call("square_nodiff", {{1, 4, 9}}, {true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(Floats(fwd->outputs(0).inline_data()), (std::vector<float>{1, 16, 81}));
  ASSERT_FALSE(fwd->context_id().empty());
  auto bwd = c_->Backward(Grad(fwd->context_id(), {{1, 1, 1}}));
  ASSERT_EQ(bwd.status().code(), absl::StatusCode::kFailedPrecondition) << bwd.status();
  auto reason = GetReason(bwd.status());
  ASSERT_TRUE(reason.has_value()) << bwd.status();
  EXPECT_EQ(reason->reason, "NOT_DIFFERENTIABLE");
  EXPECT_EQ(reason->metadata["op"], "default/square_nodiff");
  EXPECT_NE(bwd.status().message().find("default/square_nodiff"), std::string::npos) << bwd.status();

  // GradCheck of it says the same.
  v1::GradCheckRequest check;
  check.set_op("square_nodiff");
  auto gc = c_->GradCheck(check);
  EXPECT_EQ(gc.status().code(), absl::StatusCode::kFailedPrecondition) << gc.status();
  ASSERT_TRUE(GetReason(gc.status()).has_value()) << gc.status();
  EXPECT_EQ(GetReason(gc.status())->reason, "NOT_DIFFERENTIABLE");

  // create_graph through a bprop without a backward of its own (tanh_grad):
  // the first backward runs; the second names tanh_grad.
  Register("tanh_grad");
  Register("tanh");
  fwd = c_->Forward(Call("tanh", {{0.5f}}, {true}));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto req = Grad(fwd->context_id(), {{1}});
  req.set_create_graph(true);
  auto first = c_->Backward(req);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_NEAR(Floats(first->grad_inputs(0).tensors(0).inline_data())[0],
              1 - std::tanh(0.5f) * std::tanh(0.5f), 1e-6);
  ASSERT_FALSE(first->context_id().empty());
  auto second = c_->Backward(Grad(first->context_id(), {{1}}));
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  ASSERT_TRUE(GetReason(second.status()).has_value()) << second.status();
  EXPECT_EQ(GetReason(second.status())->reason, "NOT_DIFFERENTIABLE");
  EXPECT_EQ(GetReason(second.status())->metadata["op"], "default/tanh_grad");
}

TEST_F(AutogradIT, CliGrad) {
  Register("square_grad");
  Register("square");
  const std::string dir = tmp_.path();
  ASSERT_TRUE(client::WriteNpy(dir + "/x.npy", {"float32", {3}, Bytes(std::vector<float>{1, 4, 9})}).ok());
  ASSERT_TRUE(client::WriteNpy(dir + "/dy.npy", {"float32", {3}, Bytes(std::vector<float>{1, 1, 1})}).ok());
  auto r = daemon_->Cli({"grad", "square", "--in", dir + "/x.npy", "--grad-out", dir + "/dy.npy",
                         "--out", dir + "/dx.npy"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto dx = client::ReadNpy(dir + "/dx.npy");
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_EQ(Floats(dx->data), (std::vector<float>{2, 8, 18}));
}

}  // namespace
}  // namespace opjit::testing

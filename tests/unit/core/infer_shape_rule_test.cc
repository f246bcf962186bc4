// Issue 29 item 2, InferShape without a rule: an op registered without
// output_rules whose CPU kernel exports <entry>InferShape (MindSpore's aot
// infer entry) takes its output shapes from it; without one, registration
// warns that outputs take the shape of input 0; explicit rules are untouched.
// OpService (real compiler) stores the op, a real executor (kernels in this
// process) runs it.
#include <future>

#include "gtest/gtest.h"
#include "server/core/op_service.h"
#include "server/exec/executor.h"
#include "server/registry/canonical.h"
#include "server/runner/in_process_runner.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::core {
namespace {

using opjit::testing::Bytes;
using opjit::testing::Floats;
using registry::OutputRule;

// A MindSpore-style reduce: y[i] = sum_j x[i, j]; InferShape drops the last dim.
constexpr char kReduce[] = R"(
#include <cstdint>
#include <vector>
#include "custom_aot_extra.h"
extern "C" std::vector<int64_t> RowSumInferShape(int* ndims, int64_t** shapes, AotExtra*) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0] - 1);
}
extern "C" int RowSum(int, void** p, int* ndims, int64_t** s, const char**, void*, void*) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < ndims[0]; ++d) rows *= s[0][d];
  const int64_t cols = s[0][ndims[0] - 1];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0; i < rows; ++i) {
    y[i] = 0;
    for (int64_t j = 0; j < cols; ++j) y[i] += x[i * cols + j];
  }
  return 0;
}
)";

// Elementwise y = 2x; `with_infer` adds a TwiceInferShape that answers [1]
// (wrong on purpose: an explicit rule must win over it).
std::string Twice(bool with_infer) {
  std::string src = R"(
#include <cstdint>
#include <vector>
#include "custom_aot_extra.h"
extern "C" int Twice(int, void** p, int* ndims, int64_t** s, const char**, void*, void*) {
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= s[0][d];
  for (int64_t i = 0; i < n; ++i) static_cast<float*>(p[1])[i] = 2 * static_cast<const float*>(p[0])[i];
  return 0;
}
)";
  if (with_infer) {
    src += "extern \"C\" std::vector<int64_t> TwiceInferShape(int*, int64_t**, AotExtra*) "
           "{ return {1}; }\n";
  }
  return src;
}

registry::OpDef Def(const std::string& name, const std::string& source, const std::string& entry) {
  registry::OpDef d = opjit::testing::FloatOp(name, {"x"}, {"y"}, source, entry);
  d.ns = "default";
  return d;  // no output_rules
}

class InferShapeRuleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto stack = opjit::testing::CoreStack::Create("infer-shape-rule-test");
    ASSERT_TRUE(stack.ok()) << stack.status();
    stack_ = *std::move(stack);
    ASSERT_TRUE(stack_->AddExecutor().ok());
    service_ = std::make_unique<OpService>(stack_->registry.get(), stack_->compiler.get());
  }
  void TearDown() override {
    service_.reset();
    stack_.reset();
  }
  absl::StatusOr<RegisterOutcome> Register(registry::OpDef def) {
    std::promise<absl::StatusOr<RegisterOutcome>> p;
    service_->RegisterAsync(std::move(def), 1,
                            [&p](absl::StatusOr<RegisterOutcome> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }
  // Runs `op` on a 4x5 float32 input 0..19.
  absl::StatusOr<exec::ForwardResult> Run4x5(const std::string& op) {
    std::vector<float> x(20);
    for (int i = 0; i < 20; ++i) x[i] = static_cast<float>(i);
    const std::string bytes = Bytes(x);  // the call views it
    exec::ForwardCall call;
    call.op = op;
    call.inputs = {{exec::TensorArg::Inline({"float32", {4, 5}}, bytes)}};
    return stack_->executor->Forward(std::move(call));
  }
  std::vector<std::string> Warnings(const std::string& op) {
    auto rec = stack_->registry->Get("default", op, 0);
    EXPECT_TRUE(rec.ok()) << rec.status();
    return rec.ok() ? stack_->registry->Warnings(rec->def) : std::vector<std::string>{};
  }

  std::unique_ptr<opjit::testing::CoreStack> stack_;
  std::unique_ptr<OpService> service_;
};

TEST_F(InferShapeRuleTest, NoRuleAndAnInferShapeTakesTheKernelsShape) {
  auto r = Register(Def("row_sum", kReduce, "RowSum"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->result.created);
  // The decision is stored: one infer_shape rule per output, in the hash too.
  const registry::OpDef& stored = r->result.record.def;
  ASSERT_EQ(stored.output_rules.size(), 1u);
  EXPECT_EQ(stored.output_rules[0].kind, OutputRule::Kind::kInferShape);
  EXPECT_TRUE(stored.output_rules[0].dtype.empty());
  EXPECT_EQ(r->result.record.content_hash, registry::ContentHash(stored));
  EXPECT_TRUE(Warnings("row_sum").empty());

  auto y = Run4x5("row_sum");
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(y->outputs.size(), 1u);
  EXPECT_EQ(y->outputs[0].desc.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(y->outputs[0].desc.dtype, "float32");
  ASSERT_NE(y->outputs[0].inline_bytes(), nullptr);
  EXPECT_EQ(Floats(y->outputs[0].inline_bytes()->bytes), (std::vector<float>{10, 35, 60, 85}));

  // The same submission again resolves the same way: no new version.
  auto again = Register(Def("row_sum", kReduce, "RowSum"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->result.created);
  EXPECT_EQ(again->result.record.version, 1);
}

TEST_F(InferShapeRuleTest, NeitherRuleNorInferShapeWarnsAndTakesInput0) {
  registry::OpDef def = Def("twice", Twice(false), "Twice");
  const std::string submitted_hash = registry::ContentHash(def);
  auto r = Register(def);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->result.record.def.output_rules.empty());
  EXPECT_EQ(r->result.record.content_hash, submitted_hash);  // stored as submitted
  EXPECT_EQ(Warnings("twice"),
            (std::vector<std::string>{
                "output_rules: none given, and the CPU kernel exports no \"TwiceInferShape\", so "
                "every output takes the shape of input 0 (\"x\") and its dtype from dtype_formats; "
                "give output_rules to say so (e.g. [{\"kind\": \"same_as\", \"input\": 0}])"}));
  auto y = Run4x5("twice");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->outputs[0].desc.shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(Floats(y->outputs[0].inline_bytes()->bytes)[19], 38.0f);

  // A GPU-only op (never compiled here: the registry alone) says why too.
  registry::OpDef gpu = Def("gpu_only", "", "k");
  gpu.implementations[0].target = registry::Target::kGpu;
  gpu.implementations[0].language = "cuda";
  auto w = stack_->registry->Warnings(gpu);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("none given, and GPU kernels have no InferShape, so every output takes the "
                      "shape of input 0 (\"x\")"),
            std::string::npos)
      << w[0];
}

TEST_F(InferShapeRuleTest, ExplicitRulesAreKeptAsGiven) {
  // The kernel exports an InferShape, but the op's rule says same_as input 0.
  registry::OpDef def = Def("twice_ruled", Twice(true), "Twice");
  def.output_rules.push_back({});
  const std::string submitted_hash = registry::ContentHash(def);
  auto r = Register(def);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->result.record.def, def);
  EXPECT_EQ(r->result.record.content_hash, submitted_hash);
  EXPECT_TRUE(Warnings("twice_ruled").empty());
  auto y = Run4x5("twice_ruled");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->outputs[0].desc.shape, (std::vector<int64_t>{4, 5}));
}

}  // namespace
}  // namespace opjit::core

// backward.inputs: which forward inputs, outputs and output grads a bprop
// takes (ResolveBpropArgs), and the check of a bprop against the forward op
// that names it (CheckBpropSignature, Registry::CheckBackwardLinks).
#include "server/registry/bprop_args.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/registry/canonical.h"
#include "server/registry/registry.h"
#include "server/registry/validate.h"
#include "tests/unit/registry/test_util.h"

namespace opjit::registry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Kind = BpropArg::Kind;

// y0, y1 = f(x, w): two inputs, two outputs, float32 and float64 rows.
OpDef Forward(std::vector<std::string> bprop_inputs = {}) {
  OpDef def = testing::ValidDef("f");
  def.attrs.clear();
  def.inputs = {{0, "x", ParamType::kRequired}, {1, "w", ParamType::kRequired}};
  def.outputs = {{0, "y0", ParamType::kRequired}, {1, "y1", ParamType::kRequired}};
  def.dtype_formats.clear();
  for (const char* d : {"float32", "float64"}) {
    def.dtype_formats.push_back({{{d, ""}, {d, ""}, {d, ""}, {d, ""}}});
  }
  def.backward.op = "f_grad";
  def.backward.inputs = std::move(bprop_inputs);
  return def;
}

// A bprop with `n_in` inputs and two outputs (dx, dw), in `dtypes` rows.
OpDef Bprop(size_t n_in, std::vector<std::string> dtypes = {"float32", "float64"}) {
  OpDef def = testing::ValidDef("f_grad");
  def.attrs.clear();
  def.inputs.clear();
  for (size_t i = 0; i < n_in; ++i) {
    def.inputs.push_back({static_cast<int>(i), "a" + std::to_string(i), ParamType::kRequired});
  }
  def.outputs = {{0, "dx", ParamType::kRequired}, {1, "dw", ParamType::kRequired}};
  def.dtype_formats.clear();
  for (const auto& d : dtypes) {
    DtypeFormat row;
    for (size_t i = 0; i < n_in + 2; ++i) row.io.push_back({d, ""});
    def.dtype_formats.push_back(row);
  }
  return def;
}

TEST(BpropArgsTest, EmptyMeansInputsThenOutputsThenGrads) {
  auto args = ResolveBpropArgs(Forward());
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_THAT(*args, ElementsAre(BpropArg{Kind::kInput, 0}, BpropArg{Kind::kInput, 1},
                                 BpropArg{Kind::kOutput, 0}, BpropArg{Kind::kOutput, 1},
                                 BpropArg{Kind::kGrad, 0}, BpropArg{Kind::kGrad, 1}));
}

TEST(BpropArgsTest, NamesPrefixesAndOutDoutResolveInOrder) {
  auto args = ResolveBpropArgs(Forward({"w", "dout", "y1", "in:x", "grad:y0", "dout:y1", "out"}));
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_THAT(*args, ElementsAre(BpropArg{Kind::kInput, 1}, BpropArg{Kind::kGrad, 0},
                                 BpropArg{Kind::kGrad, 1}, BpropArg{Kind::kOutput, 1},
                                 BpropArg{Kind::kInput, 0}, BpropArg{Kind::kGrad, 0},
                                 BpropArg{Kind::kGrad, 1}, BpropArg{Kind::kOutput, 0},
                                 BpropArg{Kind::kOutput, 1}));
  EXPECT_EQ(BpropArgName(Forward(), {Kind::kGrad, 1}), "grad:y1");
  EXPECT_EQ(BpropArgName(Forward(), {Kind::kOutput, 0}), "out:y0");
}

TEST(BpropArgsTest, ATensorNamedOutIsThatTensorNotEveryOutput) {
  OpDef def = Forward({"out"});
  def.outputs[1].name = "out";
  auto args = ResolveBpropArgs(def);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_THAT(*args, ElementsAre(BpropArg{Kind::kOutput, 1}));
}

TEST(BpropArgsTest, UnknownEntriesAreRefusedNamingThePosition) {
  for (const auto& [entry, want] : std::vector<std::pair<std::string, std::string>>{
           {"z", "is not an input or output"},
           {"grad:x", "names no output"},
           {"in:y0", "names no input"},
           {"d:x", "unknown prefix"}}) {
    auto args = ResolveBpropArgs(Forward({"x", entry}));
    ASSERT_FALSE(args.ok()) << entry;
    EXPECT_EQ(args.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(args.status().message(), HasSubstr("backward.inputs[1]")) << entry;
    EXPECT_THAT(args.status().message(), HasSubstr(want)) << entry;
    // ValidateOpDef refuses it too, before anything compiles.
    EXPECT_FALSE(ValidateOpDef(Forward({"x", entry})).ok()) << entry;
  }
}

TEST(BpropArgsTest, ValidateRefusesInputsWithoutABpropAndTooManyEntries) {
  OpDef def = Forward({"x"});
  def.backward.op.clear();
  EXPECT_THAT(ValidateOpDef(def).message(), HasSubstr("backward.op names no bprop"));
  EXPECT_THAT(ValidateOpDef(Forward(std::vector<std::string>(7, "x"))).message(),
              HasSubstr("has 7 entries"));
  EXPECT_TRUE(ValidateOpDef(Forward(std::vector<std::string>(6, "x"))).ok());
}

TEST(BpropArgsTest, SignatureChecksArityOutputsAndDtypes) {
  EXPECT_TRUE(CheckBpropSignature(Forward(), Bprop(6)).ok());
  EXPECT_TRUE(CheckBpropSignature(Forward({"x", "w", "dout"}), Bprop(4)).ok());

  absl::Status s = CheckBpropSignature(Forward(), Bprop(4));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetReason(s)->reason, reason::kBpropMismatch);
  EXPECT_THAT(s.message(), HasSubstr("(x, w, out:y0, out:y1, grad:y0, grad:y1) = 6 input(s)"));
  EXPECT_THAT(s.message(), HasSubstr("declares 4"));

  OpDef one_out = Bprop(4);
  one_out.outputs.pop_back();
  for (auto& row : one_out.dtype_formats) row.io.pop_back();
  s = CheckBpropSignature(Forward({"x", "w", "dout"}), one_out);
  EXPECT_THAT(s.message(), HasSubstr("one grad per forward input (2)"));

  s = CheckBpropSignature(Forward({"x", "w", "dout"}), Bprop(4, {"float32"}));
  EXPECT_EQ(GetReason(s)->reason, reason::kBpropMismatch);
  EXPECT_THAT(s.message(), HasSubstr("(float64, float64, float64, float64) -> (float64, float64)"));

  // An empty dtype (None_None) in the bprop's row matches any.
  OpDef any = Bprop(4, {""});
  EXPECT_TRUE(CheckBpropSignature(Forward({"x", "w", "dout"}), any).ok());
}

TEST(BpropArgsTest, CanonicalJsonKeepsTheMappingAndOldHashesStay) {
  OpDef plain = Forward();
  OpDef mapped = Forward({"x", "dout"});
  mapped.backward.stop_gradient_grads = Backward::StopGradientGrads::kError;
  EXPECT_EQ(ToJson(plain).find("\"inputs\":[\"x\""), std::string::npos);
  EXPECT_EQ(ToJson(plain).find("stop_gradient_grads"), std::string::npos);
  auto back = FromJson(ToJson(mapped));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->backward, mapped.backward);
  EXPECT_NE(ContentHash(plain), ContentHash(mapped));
}

class BackwardLinksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetLogLevel("warn");
    auto reg = Registry::Create({.db_path = dir_.File("r.db")});
    ASSERT_TRUE(reg.ok()) << reg.status();
    reg_ = std::move(*reg);
  }
  testing::TempDir dir_;
  std::unique_ptr<Registry> reg_;
};

TEST_F(BackwardLinksTest, AForwardNamingAMismatchedBpropIsRefused) {
  ASSERT_TRUE(reg_->Register(Bprop(3)).ok());
  auto r = reg_->Register(Forward());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetReason(r.status())->reason, reason::kBpropMismatch);
  EXPECT_EQ(reg_->Size(), 1u);  // nothing stored
  EXPECT_TRUE(reg_->Register(Forward({"x", "w", "dout:y0"})).ok());
}

TEST_F(BackwardLinksTest, ABpropRegisteredLaterIsCheckedAgainstItsForward) {
  ASSERT_TRUE(reg_->Register(Forward({"x", "dout"})).ok());  // its bprop not yet there
  auto r = reg_->Register(Bprop(4));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(GetReason(r.status())->reason, reason::kBpropMismatch);
  EXPECT_THAT(r.status().message(), HasSubstr("op default/f names default/f_grad"));
  EXPECT_TRUE(reg_->Register(Bprop(3)).ok());
  // Another namespace's forward with the same names is not this bprop's.
  OpDef other = Forward({"x"});
  other.ns = "other";
  ASSERT_TRUE(reg_->Register(other).ok());
  EXPECT_TRUE(reg_->Register(Bprop(3)).ok());
}

}  // namespace
}  // namespace opjit::registry

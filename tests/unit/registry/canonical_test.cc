#include "server/registry/canonical.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/common/sha256.h"
#include "tests/unit/registry/test_util.h"

namespace opjit::registry {
namespace {

using ::testing::HasSubstr;
using testing::ValidDef;

OpDef RichDef() {
  OpDef def = ValidDef("reduce_sum");
  def.ns = "team-a";
  def.inputs.push_back({1, "extra", ParamType::kDynamic});
  def.attrs.push_back({"axis", ParamType::kRequired, ValueType::kListInt, "[0, 1]"});
  def.attrs.push_back({"keep", ParamType::kOptional, ValueType::kBool, ""});
  def.dtype_formats = {{{{"float32", ""}, {"int64", "ND"}, {"float32", "NCHW"}}}};
  Implementation gpu;
  gpu.target = Target::kGpu;
  gpu.language = "cuda";
  gpu.entry = "K";
  gpu.source = "__global__ void K() {}\n// ünïcødé \"quoted\" \\ \t";
  gpu.compile_options = {"--use_fast_math", "-arch=sm_90"};
  gpu.libraries = {"libcublas.so.12"};
  gpu.attr_names = {"alpha", "axis", "keep"};
  def.implementations.push_back(gpu);
  def.output_rules = {{.kind = OutputRule::Kind::kReduce,
                       .input = 0,
                       .inputs = {0, 1},
                       .axis_attr = "axis",
                       .keep_dim = true,
                       .keep_dim_attr = "keep",
                       .shape = {1, -2, 3},
                       .dtype = "float16"}};
  def.backward.op = "reduce_sum_grad";
  def.backward.save_for_backward = {"x"};
  def.backward.non_differentiable = {"y"};
  def.backward.materialize_grads = false;
  def.doc = "sums\nover axes";
  return def;
}

TEST(CanonicalTest, RoundTrip) {
  for (const OpDef& def : {ValidDef(), RichDef(), OpDef()}) {
    std::string json = ToJson(def);
    auto back = FromJson(json);
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << json;
    EXPECT_EQ(*back, def) << json;
    EXPECT_EQ(ToJson(*back), json);
  }
}

TEST(CanonicalTest, AllOutputRuleKindsRoundTrip) {
  for (auto kind :
       {OutputRule::Kind::kSameAsInput, OutputRule::Kind::kBroadcast, OutputRule::Kind::kReduce,
        OutputRule::Kind::kExplicit, OutputRule::Kind::kInferShape}) {
    OpDef def = ValidDef();
    def.output_rules = {{.kind = kind}};
    auto back = FromJson(ToJson(def));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->output_rules[0].kind, kind);
    EXPECT_EQ(ParseOutputRuleKind(OutputRuleKindName(kind)), kind);
  }
}

TEST(CanonicalTest, FixedKeyOrderAndDeterministic) {
  std::string json = ToJson(ValidDef());
  EXPECT_EQ(json, ToJson(ValidDef()));
  EXPECT_EQ(json.rfind("{\"ns\":\"default\",\"name\":\"leaky_relu\",\"inputs\":[{\"index\":0,", 0),
            0u)
      << json;
  size_t last = 0;
  for (const char* key :
       {"\"ns\"", "\"name\"", "\"inputs\"", "\"outputs\"", "\"attrs\"", "\"dtype_formats\"",
        "\"implementations\"", "\"output_rules\"", "\"backward\"", "\"doc\""}) {
    size_t pos = json.find(key, last);
    ASSERT_NE(pos, std::string::npos) << key;
    last = pos;
  }
  EXPECT_EQ(json.find("\": "), std::string::npos) << json;  // compact: no padding
  EXPECT_EQ(json.find('\n'), std::string::npos) << json;
}

TEST(CanonicalTest, HashIsSha256OfJsonAndSensitive) {
  OpDef def = ValidDef();
  EXPECT_EQ(ContentHash(def), Sha256Hex(ToJson(def)));
  EXPECT_EQ(ContentHash(def).size(), 64u);
  OpDef changed = def;
  changed.implementations[0].source += " ";
  EXPECT_NE(ContentHash(changed), ContentHash(def));
  changed = def;
  changed.dtype_formats[0].io[0].second = "";
  EXPECT_NE(ContentHash(changed), ContentHash(def));  // not normalised
  changed = def;
  changed.backward.materialize_grads = false;
  EXPECT_NE(ContentHash(changed), ContentHash(def));
}

TEST(CanonicalTest, FromJsonMissingKeysTakeDefaults) {
  auto def = FromJson(R"({"name": "foo", "outputs": [{"index": 0, "name": "y"}]})");
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->ns, "default");
  EXPECT_EQ(def->name, "foo");
  ASSERT_EQ(def->outputs.size(), 1u);
  EXPECT_EQ(def->outputs[0].param_type, ParamType::kRequired);
  EXPECT_TRUE(def->backward.materialize_grads);
}

TEST(CanonicalTest, FromJsonErrorsNameThePath) {
  struct Case {
    const char* json;
    const char* want;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {"[]", "expected an object"},
      {R"({"nmae": "x"})", "nmae: unknown key"},
      {R"({"name": 3})", "name: expected a string, got an int"},
      {R"({"inputs": [{"index": "0"}]})", "inputs[0].index: expected an integer"},
      {R"({"inputs": [{"index": 99999999999}]})", "inputs[0].index: integer out of range"},
      {R"({"outputs": [{"param_type": "sometimes"}]})",
       "outputs[0].param_type: expected required, optional or dynamic, got \"sometimes\""},
      {R"({"attrs": [{"value_type": "double"}]})", "attrs[0].value_type"},
      {R"({"dtype_formats": [[["float32"]]]})", "dtype_formats[0][0]: expected a [dtype, format]"},
      {R"({"implementations": [{"target": "TPU"}]})",
       "implementations[0].target: expected CPU or GPU, got \"TPU\""},
      {R"({"implementations": [{"compile_options": ["-O2", 1]}]})",
       "implementations[0].compile_options[1]: expected a string"},
      {R"({"output_rules": [{"kind": "magic"}]})", "output_rules[0].kind"},
      {R"({"output_rules": [{"shape": [1.5]}]})", "output_rules[0].shape[0]: expected an integer"},
      {R"({"backward": {"materialize_grads": 1}})", "backward.materialize_grads: expected a bool"},
      {R"({"backward": {"op": "x", "extra": 1}})", "backward.extra: unknown key"},
  };
  for (const Case& c : cases) {
    auto def = FromJson(c.json);
    ASSERT_FALSE(def.ok()) << c.json;
    EXPECT_EQ(def.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(def.status().message()), HasSubstr(c.want)) << c.json;
  }
}

}  // namespace
}  // namespace opjit::registry

// CheckInputs against dtype_formats with MindSpore's DataType.None_None
// (an empty dtype): any dtype at a required or dynamic input, an absent
// optional input, and at an output the rule's dtype or the first input's
// (issue 29). Pure functions: no registry, no kernel.
#include "server/exec/checks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace opjit::exec {
namespace {

using ::testing::HasSubstr;
using registry::OpDef;
using registry::ParamType;

OpDef AddDef() {
  OpDef d;
  d.ns = "default";
  d.name = "add";
  d.inputs = {{0, "x1", ParamType::kRequired}, {1, "x2", ParamType::kRequired}};
  d.outputs = {{0, "y", ParamType::kRequired}};
  d.dtype_formats = {{{{"", ""}, {"", ""}, {"", ""}}}};  // MindSpore's add_cpu_info
  return d;
}

TensorArg Arg(const std::string& dtype) { return TensorArg::Inline({dtype, {2}}, ""); }

ForwardCall Call(std::vector<std::vector<TensorArg>> inputs) {
  ForwardCall call;
  call.op = "add";
  call.inputs = std::move(inputs);
  return call;
}

absl::StatusOr<std::vector<std::string>> OutDtypes(const OpDef& def, const ForwardCall& call) {
  Checked c;
  absl::Status s = CheckInputs(call, def, &c);
  if (!s.ok()) return s;
  std::vector<std::string> out;
  for (const std::string* d : c.output_dtypes) out.push_back(*d);
  return out;
}

TEST(ChecksTest, AllNoneRowMatchesAnyDtypeAndTheOutputTakesTheFirstInputs) {
  const OpDef def = AddDef();
  for (const char* dtype : {"float32", "float64", "int32", "bool"}) {
    auto out = OutDtypes(def, Call({{Arg(dtype)}, {Arg(dtype)}}));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, std::vector<std::string>{dtype});
  }
  // Mixed dtypes match too: the kernel checks what it gets.
  auto out = OutDtypes(def, Call({{Arg("int8")}, {Arg("float16")}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, std::vector<std::string>{"int8"});
  // Counts are still checked.
  EXPECT_FALSE(OutDtypes(def, Call({{Arg("float32")}, {}})).ok());
}

TEST(ChecksTest, TheOutputDtypeOutlivesTheCall) {
  // A Checked is shared by later calls of the same shape: the output dtype
  // must not point into the call it was found for.
  const OpDef def = AddDef();
  Checked c;
  {
    ForwardCall call = Call({{Arg("float64")}, {Arg("float64")}});
    ASSERT_TRUE(CheckInputs(call, def, &c).ok());
  }
  std::vector<std::string> garbage(64, std::string(64, 'x'));  // reuse the freed memory
  ASSERT_EQ(c.output_dtypes.size(), 1u);
  EXPECT_EQ(*c.output_dtypes[0], "float64");
}

TEST(ChecksTest, OutputRuleDtypeWins) {
  OpDef def = AddDef();
  registry::OutputRule r;
  r.dtype = "int64";
  def.output_rules = {r};
  auto out = OutDtypes(def, Call({{Arg("float32")}, {Arg("float32")}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, std::vector<std::string>{"int64"});
}

TEST(ChecksTest, NonePerPositionAndRowOrder) {
  OpDef def = AddDef();
  // (float32, any) -> float16 first, then (any, any) -> None.
  def.dtype_formats = {{{{"float32", ""}, {"", ""}, {"float16", ""}}},
                       {{{"", ""}, {"", ""}, {"", ""}}}};
  auto out = OutDtypes(def, Call({{Arg("float32")}, {Arg("int32")}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, std::vector<std::string>{"float16"});
  out = OutDtypes(def, Call({{Arg("int32")}, {Arg("float32")}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, std::vector<std::string>{"int32"});
  // Without the any row, a row with a real dtype still refuses, naming None.
  def.dtype_formats.pop_back();
  out = OutDtypes(def, Call({{Arg("int32")}, {Arg("float32")}}));
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("does not accept input dtypes (int32, float32); accepted combinations: "
                        "(float32, None) -> (float16)"));
}

TEST(ChecksTest, NoneAtAnOptionalInputStillMeansAbsent) {
  OpDef def = AddDef();
  def.inputs[1].param_type = ParamType::kOptional;
  def.dtype_formats = {{{{"", ""}, {"", ""}, {"", ""}}}};
  auto out = OutDtypes(def, Call({{Arg("float64")}, {}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, std::vector<std::string>{"float64"});
  EXPECT_FALSE(OutDtypes(def, Call({{Arg("float64")}, {Arg("float64")}})).ok());
}

TEST(ChecksTest, DynamicInputMatchesAnyDtype) {
  OpDef def = AddDef();
  def.inputs = {{0, "xs", ParamType::kDynamic}};
  def.dtype_formats = {{{{"", ""}, {"", ""}}}};
  auto out = OutDtypes(def, Call({{Arg("uint8"), Arg("uint8"), Arg("uint8")}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, std::vector<std::string>{"uint8"});
  // One dtype per dynamic group still holds.
  EXPECT_FALSE(OutDtypes(def, Call({{Arg("uint8"), Arg("int8")}})).ok());
}

TEST(ChecksTest, AnOutputWithNoInputToTakeADtypeFromIsRefused) {
  OpDef def = AddDef();
  def.inputs = {{0, "x", ParamType::kOptional}};
  def.dtype_formats = {{{{"", ""}, {"", ""}}}};
  auto out = OutDtypes(def, Call({{}}));
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(),
            "op default/add: output 0 (y) takes the dtype of the call's first input (its "
            "dtype_format is None and its output rule gives no dtype), but the call gives no "
            "input");
}

}  // namespace
}  // namespace opjit::exec

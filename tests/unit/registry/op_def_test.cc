#include "server/registry/op_def.h"

#include <gtest/gtest.h>

namespace opjit::registry {
namespace {

TEST(OpDefTest, ParamTypeNamesRoundTrip) {
  for (ParamType t : {ParamType::kRequired, ParamType::kOptional, ParamType::kDynamic}) {
    EXPECT_EQ(ParseParamType(ParamTypeName(t)), t);
  }
  EXPECT_STREQ(ParamTypeName(ParamType::kDynamic), "dynamic");
  EXPECT_FALSE(ParseParamType("Required").has_value());
  EXPECT_FALSE(ParseParamType("").has_value());
}

TEST(OpDefTest, ValueTypeNamesRoundTrip) {
  const char* names[] = {"bool",     "int",     "float",       "str",           "listInt", "listFloat",
                         "listBool", "listStr", "listListInt", "listListFloat", "all"};
  for (int i = 0; i < 11; ++i) {
    auto t = ParseValueType(names[i]);
    ASSERT_TRUE(t.has_value()) << names[i];
    EXPECT_EQ(static_cast<int>(*t), i);
    EXPECT_STREQ(ValueTypeName(*t), names[i]);
  }
  EXPECT_FALSE(ParseValueType("listint").has_value());
  EXPECT_FALSE(ParseValueType("double").has_value());
  EXPECT_FALSE(ParseValueType("All").has_value());
  EXPECT_FALSE(ParseValueType("any").has_value());
}

TEST(OpDefTest, TargetAcceptsBothCases) {
  EXPECT_EQ(ParseTarget("CPU"), Target::kCpu);
  EXPECT_EQ(ParseTarget("cpu"), Target::kCpu);
  EXPECT_EQ(ParseTarget("GPU"), Target::kGpu);
  EXPECT_EQ(ParseTarget("gpu"), Target::kGpu);
  EXPECT_FALSE(ParseTarget("Gpu").has_value());
  EXPECT_FALSE(ParseTarget("TPU").has_value());
  EXPECT_STREQ(TargetName(Target::kGpu), "GPU");
}

TEST(OpDefTest, KnownDtypesInAbiOrderWithSizes) {
  const std::vector<std::string> want = {"float16", "float32", "float64", "int8",
                                         "int16",   "int32",   "int64",   "uint8",
                                         "uint16",  "uint32",  "uint64",  "bool"};
  EXPECT_EQ(KnownDtypes(), want);
  EXPECT_EQ(DtypeSize("float16"), 2u);
  EXPECT_EQ(DtypeSize("float32"), 4u);
  EXPECT_EQ(DtypeSize("float64"), 8u);
  EXPECT_EQ(DtypeSize("int8"), 1u);
  EXPECT_EQ(DtypeSize("uint64"), 8u);
  EXPECT_EQ(DtypeSize("bool"), 1u);
  EXPECT_EQ(DtypeSize("float"), 0u);  // legacy spelling is not a registry dtype
  EXPECT_EQ(DtypeSize("bfloat16"), 0u);
  EXPECT_TRUE(IsKnownDtype("int32"));
  EXPECT_FALSE(IsKnownDtype(""));
}

}  // namespace
}  // namespace opjit::registry

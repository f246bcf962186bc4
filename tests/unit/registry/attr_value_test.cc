#include "server/registry/attr_value.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace opjit::registry {
namespace {

using ::testing::HasSubstr;

AttrValue MustParse(ValueType t, const std::string& s) {
  auto v = ParseAttrValue(t, s);
  EXPECT_TRUE(v.ok()) << s << ": " << v.status();
  return v.ok() ? *v : AttrValue(false);
}

std::string ParseError(ValueType t, const std::string& s) {
  auto v = ParseAttrValue(t, s);
  EXPECT_FALSE(v.ok()) << s << " parsed unexpectedly";
  if (v.ok()) return "";
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(v.status().message());
}

TEST(AttrValueTest, ParsesScalars) {
  EXPECT_EQ(MustParse(ValueType::kBool, "true"), AttrValue(true));
  EXPECT_EQ(MustParse(ValueType::kBool, "False"), AttrValue(false));
  EXPECT_EQ(MustParse(ValueType::kInt, "3"), AttrValue(int64_t{3}));
  EXPECT_EQ(MustParse(ValueType::kInt, " -42 "), AttrValue(int64_t{-42}));
  EXPECT_EQ(MustParse(ValueType::kInt, "+7"), AttrValue(int64_t{7}));
  EXPECT_EQ(MustParse(ValueType::kFloat, "0.1"), AttrValue(0.1));
  EXPECT_EQ(MustParse(ValueType::kFloat, "3"), AttrValue(3.0));
  EXPECT_EQ(MustParse(ValueType::kFloat, "1e-3"), AttrValue(1e-3));
  EXPECT_EQ(MustParse(ValueType::kFloat, "-inf"),
            AttrValue(-std::numeric_limits<double>::infinity()));
  EXPECT_EQ(MustParse(ValueType::kStr, " relu "), AttrValue(std::string(" relu ")));
  EXPECT_EQ(MustParse(ValueType::kStr, ""), AttrValue(std::string()));
}

TEST(AttrValueTest, ParsesLists) {
  EXPECT_EQ(MustParse(ValueType::kListInt, "[1, 2]"), AttrValue(std::vector<int64_t>{1, 2}));
  EXPECT_EQ(MustParse(ValueType::kListInt, "[]"), AttrValue(std::vector<int64_t>{}));
  EXPECT_EQ(MustParse(ValueType::kListFloat, "[0.5, 1]"), AttrValue(std::vector<double>{0.5, 1}));
  EXPECT_EQ(MustParse(ValueType::kListBool, "[true,false]"),
            AttrValue(std::vector<bool>{true, false}));
  EXPECT_EQ(MustParse(ValueType::kListStr, R"(["a", "b\"c"])"),
            AttrValue(std::vector<std::string>{"a", "b\"c"}));
  EXPECT_EQ(MustParse(ValueType::kListListInt, "[[1,2],[3]]"),
            AttrValue(std::vector<std::vector<int64_t>>{{1, 2}, {3}}));
  EXPECT_EQ(MustParse(ValueType::kListListFloat, "[[0.5], [1, 2.5], []]"),
            AttrValue(std::vector<std::vector<double>>{{0.5}, {1, 2.5}, {}}));
}

TEST(AttrValueTest, RejectsWithClearMessages) {
  EXPECT_THAT(ParseError(ValueType::kInt, "1.5"), HasSubstr("expected an int, got a float"));
  EXPECT_THAT(ParseError(ValueType::kInt, "99999999999999999999"), HasSubstr("out of"));
  EXPECT_THAT(ParseError(ValueType::kInt, "abc"), HasSubstr("expected an int"));
  EXPECT_THAT(ParseError(ValueType::kInt, ""), HasSubstr("expected an int"));
  EXPECT_THAT(ParseError(ValueType::kFloat, "x1"), HasSubstr("expected a float"));
  EXPECT_THAT(ParseError(ValueType::kFloat, "1e999"), HasSubstr("out of"));
  EXPECT_THAT(ParseError(ValueType::kBool, "1"), HasSubstr("expected a bool"));
  EXPECT_THAT(ParseError(ValueType::kListInt, "[1, 2.5]"),
              HasSubstr("element [1] is a float (2.5), expected an int"));
  EXPECT_THAT(ParseError(ValueType::kListInt, "[1, \"2\"]"),
              HasSubstr("element [1] is a string, expected an int"));
  EXPECT_THAT(ParseError(ValueType::kListInt, "[9223372036854775808]"),
              HasSubstr("out of the int64 range"));
  EXPECT_THAT(ParseError(ValueType::kListInt, "1, 2"), HasSubstr("expected listInt"));
  EXPECT_THAT(ParseError(ValueType::kListInt, "{\"a\": 1}"),
              HasSubstr("expected listInt, got an object"));
  EXPECT_THAT(ParseError(ValueType::kListBool, "[1]"), HasSubstr("expected a bool"));
  EXPECT_THAT(ParseError(ValueType::kListStr, "[\"a\", 1]"),
              HasSubstr("element [1] is an int, expected a string"));
  EXPECT_THAT(ParseError(ValueType::kListListInt, "[1, 2]"),
              HasSubstr("element [0] is an int, expected a list"));
  EXPECT_THAT(ParseError(ValueType::kListListInt, "[[1], [2, 0.5]]"),
              HasSubstr("element [1][1] is a float"));
}

TEST(AttrValueTest, FormatRoundTrips) {
  const std::vector<AttrValue> values = {
      AttrValue(true),
      AttrValue(false),
      AttrValue(int64_t{-5}),
      AttrValue(std::numeric_limits<int64_t>::min()),
      AttrValue(0.1),
      AttrValue(3.0),
      AttrValue(1e300),
      AttrValue(-2.5e-7),
      AttrValue(std::numeric_limits<double>::infinity()),
      AttrValue(std::string("hello world")),
      AttrValue(std::string("[1, 2]")),
      AttrValue(std::vector<int64_t>{1, -2, 3}),
      AttrValue(std::vector<double>{0.1, 2, 1e-9}),
      AttrValue(std::vector<bool>{true, false, true}),
      AttrValue(std::vector<std::string>{"a", "quote\"", "back\\slash", "n\nl", "ünï"}),
      AttrValue(std::vector<std::vector<int64_t>>{{1, 2}, {}, {3}}),
      AttrValue(std::vector<std::vector<double>>{{0.5, 0.25}, {1}}),
      AttrValue(std::vector<std::string>{}),
      // Negative zero (found by fuzz_attr): "[-0]" would read back as int 0.
      AttrValue(-0.0),
      AttrValue(std::vector<double>{-0.0, 0.0}),
      AttrValue(std::vector<std::vector<double>>{{-0.0}}),
  };
  for (const AttrValue& v : values) {
    std::string text = FormatAttrValue(v);
    auto back = ParseAttrValue(ValueTypeOf(v), text);
    ASSERT_TRUE(back.ok()) << text << ": " << back.status();
    EXPECT_EQ(*back, v) << text;
    EXPECT_EQ(FormatAttrValue(*back), text);  // the text is stable too
  }
  EXPECT_EQ(FormatAttrValue(AttrValue(std::vector<double>{-0.0, 1})), "[-0.0, 1]");
  EXPECT_EQ(FormatAttrValue(AttrValue(3.0)), "3.0");
  EXPECT_EQ(FormatAttrValue(AttrValue(0.1)), "0.1");
  EXPECT_EQ(FormatAttrValue(AttrValue(std::vector<int64_t>{1, 2})), "[1, 2]");
  EXPECT_EQ(FormatAttrValue(AttrValue(std::vector<std::vector<int64_t>>{{1, 2}, {3}})),
            "[[1, 2], [3]]");
  EXPECT_EQ(FormatAttrValue(AttrValue(std::vector<std::string>{"a", "b"})), R"(["a", "b"])");
  double nan = std::nan("");
  auto back = ParseAttrValue(ValueType::kFloat, FormatAttrValue(AttrValue(nan)));
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(std::isnan(std::get<double>(*back)));
}

TEST(AttrValueTest, ValueTypeOf) {
  EXPECT_EQ(ValueTypeOf(AttrValue(true)), ValueType::kBool);
  EXPECT_EQ(ValueTypeOf(AttrValue(int64_t{1})), ValueType::kInt);
  EXPECT_EQ(ValueTypeOf(AttrValue(1.0)), ValueType::kFloat);
  EXPECT_EQ(ValueTypeOf(AttrValue(std::string())), ValueType::kStr);
  EXPECT_EQ(ValueTypeOf(AttrValue(std::vector<std::vector<double>>{})), ValueType::kListListFloat);
}

TEST(AttrValueTest, MatchesAllowsWidening) {
  EXPECT_TRUE(AttrValueMatches(ValueType::kFloat, AttrValue(int64_t{2})));
  EXPECT_TRUE(AttrValueMatches(ValueType::kListFloat, AttrValue(std::vector<int64_t>{1})));
  EXPECT_TRUE(AttrValueMatches(ValueType::kListListFloat,
                               AttrValue(std::vector<std::vector<int64_t>>{{1}})));
  EXPECT_TRUE(AttrValueMatches(ValueType::kListStr, AttrValue(std::vector<int64_t>{})));
  EXPECT_FALSE(AttrValueMatches(ValueType::kInt, AttrValue(2.0)));
  EXPECT_FALSE(AttrValueMatches(ValueType::kListInt, AttrValue(std::vector<double>{1})));
  EXPECT_FALSE(AttrValueMatches(ValueType::kStr, AttrValue(true)));
  EXPECT_FALSE(AttrValueMatches(ValueType::kListListInt, AttrValue(std::vector<int64_t>{})));
  EXPECT_FALSE(AttrValueMatches(ValueType::kInt, AttrValue(true)));
}

TEST(AttrValueTest, CoerceWidens) {
  auto f = CoerceAttrValue(ValueType::kFloat, AttrValue(int64_t{2}));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, AttrValue(2.0));
  auto lf = CoerceAttrValue(ValueType::kListFloat, AttrValue(std::vector<int64_t>{1, 2}));
  ASSERT_TRUE(lf.ok());
  EXPECT_EQ(*lf, AttrValue(std::vector<double>{1, 2}));
  auto llf = CoerceAttrValue(ValueType::kListListFloat,
                             AttrValue(std::vector<std::vector<int64_t>>{{1}, {2, 3}}));
  ASSERT_TRUE(llf.ok());
  EXPECT_EQ(*llf, AttrValue(std::vector<std::vector<double>>{{1}, {2, 3}}));
  auto empty = CoerceAttrValue(ValueType::kListStr, AttrValue(std::vector<double>{}));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, AttrValue(std::vector<std::string>{}));
  auto same = CoerceAttrValue(ValueType::kStr, AttrValue(std::string("x")));
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, AttrValue(std::string("x")));
  auto bad = CoerceAttrValue(ValueType::kInt, AttrValue(1.5));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "expected int, got float");
}

// "all" (MindSpore's any kind): the text's form picks the kind.
TEST(AttrValueTest, AllReadsTextByItsForm) {
  EXPECT_EQ(MustParse(ValueType::kAll, "true"), AttrValue(true));
  EXPECT_EQ(MustParse(ValueType::kAll, "False"), AttrValue(false));
  EXPECT_EQ(MustParse(ValueType::kAll, " 3 "), AttrValue(int64_t{3}));
  EXPECT_EQ(MustParse(ValueType::kAll, "-42"), AttrValue(int64_t{-42}));
  EXPECT_EQ(MustParse(ValueType::kAll, "0.5"), AttrValue(0.5));
  EXPECT_EQ(MustParse(ValueType::kAll, "1e-3"), AttrValue(1e-3));
  EXPECT_EQ(MustParse(ValueType::kAll, "3.0"), AttrValue(3.0));
  EXPECT_EQ(MustParse(ValueType::kAll, "relu"), AttrValue(std::string("relu")));
  EXPECT_EQ(MustParse(ValueType::kAll, " two words "), AttrValue(std::string(" two words ")));
  EXPECT_EQ(MustParse(ValueType::kAll, "[1, 2]"), AttrValue(std::vector<int64_t>{1, 2}));
  EXPECT_EQ(MustParse(ValueType::kAll, "[1, 2.5]"), AttrValue(std::vector<double>{1, 2.5}));
  EXPECT_EQ(MustParse(ValueType::kAll, "[true, false]"), AttrValue(std::vector<bool>{true, false}));
  EXPECT_EQ(MustParse(ValueType::kAll, R"(["a", "b"])"),
            AttrValue(std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(MustParse(ValueType::kAll, "[[1, 1], [2, 2]]"),
            AttrValue(std::vector<std::vector<int64_t>>{{1, 1}, {2, 2}}));
  EXPECT_EQ(MustParse(ValueType::kAll, "[[0.5], [], [1]]"),
            AttrValue(std::vector<std::vector<double>>{{0.5}, {}, {1}}));
  EXPECT_EQ(MustParse(ValueType::kAll, "[]"), AttrValue(std::vector<int64_t>{}));
  // Not JSON: a str.
  EXPECT_EQ(MustParse(ValueType::kAll, "[abc"), AttrValue(std::string("[abc")));
  EXPECT_EQ(ParseError(ValueType::kAll, R"([1, "a"])"),
            "expected a value of any kind (bool, int, float, str or a list of one kind), got a "
            R"(list that mixes kinds "[1, "a"]")");
  EXPECT_THAT(ParseError(ValueType::kAll, "[1, true]"), HasSubstr("mixes kinds"));
  EXPECT_THAT(ParseError(ValueType::kAll, "[[1], 2]"), HasSubstr("mixes kinds"));
  EXPECT_THAT(ParseError(ValueType::kAll, "[18446744073709551615]"), HasSubstr("int64 range"));
}

TEST(AttrValueTest, AllMatchesAndKeepsEveryKind) {
  for (const AttrValue& v :
       {AttrValue(true), AttrValue(int64_t{1}), AttrValue(1.5), AttrValue(std::string("s")),
        AttrValue(std::vector<int64_t>{1}), AttrValue(std::vector<double>{}),
        AttrValue(std::vector<std::vector<double>>{{1.5}})}) {
    EXPECT_TRUE(AttrValueMatches(ValueType::kAll, v));
    auto c = CoerceAttrValue(ValueType::kAll, v);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(*c, v);
    EXPECT_NE(ValueTypeOf(*c), ValueType::kAll);
    // The worker protocol sends (ValueTypeOf, FormatAttrValue): it reads back the same.
    auto back = ParseAttrValue(ValueTypeOf(v), FormatAttrValue(v));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, v);
  }
}

}  // namespace
}  // namespace opjit::registry

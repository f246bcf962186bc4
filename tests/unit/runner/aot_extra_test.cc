// AotExtraImpl's conversions of attribute values to what a kernel reads
// (AotExtra::Attr<T>), MindSpore's way (issue 29): a float reads as an integer
// when it is a whole number, a bool as 0 or 1, an int 0 or 1 as a bool; a
// lossy read is the call's error, never a silent truncation.
#include "server/runner/aot_extra_impl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace opjit::runner {
namespace {

using registry::AttrValue;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

AotExtraImpl Extra(AttrValue v) { return AotExtraImpl({{"a", std::move(v)}}); }

TEST(AotExtraTest, WholeFloatsReadAsIntegers) {
  // MindSpore's reduce.cc: reduce_axis declared "float", read as int64_t.
  auto e = Extra(AttrValue(1.0));
  EXPECT_EQ(e.Attr<int64_t>("a"), 1);
  EXPECT_EQ(e.Attr<int>("a"), 1);
  EXPECT_FLOAT_EQ(e.Attr<float>("a"), 1.0f);
  EXPECT_THAT(e.TakeErrors(), IsEmpty());
  auto neg = Extra(AttrValue(-3.0));
  EXPECT_EQ(neg.Attr<int64_t>("a"), -3);
  EXPECT_THAT(neg.TakeErrors(), IsEmpty());
  auto lists = AotExtraImpl({{"l", AttrValue(std::vector<double>{0, 2, -1})},
                             {"ll", AttrValue(std::vector<std::vector<double>>{{1}, {2, 3}})}});
  EXPECT_THAT(lists.Attr<std::vector<int64_t>>("l"), ElementsAre(0, 2, -1));
  EXPECT_EQ(lists.Attr<std::vector<std::vector<int64_t>>>("ll"),
            (std::vector<std::vector<int64_t>>{{1}, {2, 3}}));
  EXPECT_THAT(lists.TakeErrors(), IsEmpty());
}

TEST(AotExtraTest, LossyFloatsAreAnError) {
  for (double d : {0.5, -1e-9, 1e19, -1e19, std::numeric_limits<double>::infinity(),
                   std::nan("")}) {
    auto e = Extra(AttrValue(d));
    EXPECT_EQ(e.Attr<int64_t>("a"), 0) << d;
    auto errors = e.TakeErrors();
    ASSERT_EQ(errors.size(), 1u) << d;
    EXPECT_EQ(errors[0],
              "kernel read attr 'a' as int64_t but it is float (a float reads as an integer only "
              "when it is a whole number)");
  }
  auto l = Extra(AttrValue(std::vector<double>{1, 2.5}));
  EXPECT_THAT(l.Attr<std::vector<int64_t>>("a"), IsEmpty());
  EXPECT_THAT(l.TakeErrors(), ElementsAre(HasSubstr("as std::vector<int64_t> but it is listFloat")));
  auto ll = Extra(AttrValue(std::vector<std::vector<double>>{{1}, {0.25}}));
  EXPECT_THAT((ll.Attr<std::vector<std::vector<int64_t>>>("a")), IsEmpty());
  EXPECT_THAT(ll.TakeErrors(), ElementsAre(HasSubstr("but it is listListFloat")));
}

TEST(AotExtraTest, BoolsAndZeroOneInts) {
  auto t = Extra(AttrValue(true));
  EXPECT_EQ(t.Attr<int64_t>("a"), 1);
  EXPECT_TRUE(t.Attr<bool>("a"));
  auto f = Extra(AttrValue(false));
  EXPECT_EQ(f.Attr<int>("a"), 0);
  auto one = Extra(AttrValue(int64_t{1}));
  EXPECT_TRUE(one.Attr<bool>("a"));
  auto zero = Extra(AttrValue(int64_t{0}));
  EXPECT_FALSE(zero.Attr<bool>("a"));
  for (auto* e : {&t, &f, &one, &zero}) EXPECT_THAT(e->TakeErrors(), IsEmpty());
  // 2 is not a bool; a float is not a bool either.
  auto two = Extra(AttrValue(int64_t{2}));
  EXPECT_FALSE(two.Attr<bool>("a"));
  EXPECT_THAT(two.TakeErrors(), ElementsAre("kernel read attr 'a' as bool but it is int"));
  auto half = Extra(AttrValue(1.0));
  EXPECT_FALSE(half.Attr<bool>("a"));
  EXPECT_THAT(half.TakeErrors(), ElementsAre("kernel read attr 'a' as bool but it is float"));
}

TEST(AotExtraTest, OtherMismatchesKeepTheirMessages) {
  auto s = Extra(AttrValue(std::string("x")));
  EXPECT_EQ(s.Attr<int64_t>("a"), 0);
  EXPECT_THAT(s.TakeErrors(), ElementsAre("kernel read attr 'a' as int64_t but it is str"));
  auto i = Extra(AttrValue(int64_t{3}));
  EXPECT_EQ(i.Attr<std::string>("a"), "");
  EXPECT_THAT(i.TakeErrors(), ElementsAre("kernel read attr 'a' as std::string but it is int"));
}

}  // namespace
}  // namespace opjit::runner

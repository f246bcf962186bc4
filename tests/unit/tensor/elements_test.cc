#include "server/tensor/elements.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace opjit::tensor {
namespace {

TEST(ElementsTest, RoundTripsEveryDtype) {
  for (const char* name : {"float16", "float32", "float64", "int8", "int16", "int32", "int64",
                           "uint8", "uint16", "uint32", "uint64", "bool"}) {
    const Dtype d = DtypeOf(name);
    ASSERT_NE(d.kind, Dtype::Kind::kUnknown) << name;
    char buf[16] = {};
    WriteElement(d, buf, 1, 1.0);
    EXPECT_EQ(ReadElement(d, buf, 1), 1.0) << name;
    EXPECT_EQ(ReadElement(d, buf, 0), 0.0) << name;
  }
  EXPECT_EQ(DtypeOf("complex64").kind, Dtype::Kind::kUnknown);
}

TEST(ElementsTest, IntegersClampAndHalfRoundsToNearest) {
  EXPECT_EQ(RoundTo(DtypeOf("int8"), 300), 127);
  EXPECT_EQ(RoundTo(DtypeOf("uint8"), -5), 0);
  EXPECT_EQ(RoundTo(DtypeOf("int32"), std::nan("")), 0);
  EXPECT_EQ(RoundTo(DtypeOf("bool"), 0.25), 1);
  // 1 + 2^-11 is halfway between two float16 values: ties go to even (1.0);
  // 1 + 3 * 2^-12 rounds up to 1 + 2^-10.
  EXPECT_EQ(RoundTo(DtypeOf("float16"), 1 + std::ldexp(1.0, -11)), 1.0);
  EXPECT_EQ(RoundTo(DtypeOf("float16"), 1 + 3 * std::ldexp(1.0, -12)), 1 + std::ldexp(1.0, -10));
  EXPECT_TRUE(std::isnan(RoundTo(DtypeOf("float16"), std::nan(""))));
  EXPECT_TRUE(std::isinf(RoundTo(DtypeOf("float16"), 1e6)));
}

TEST(ElementsTest, UlpDistance) {
  const Dtype f = DtypeOf("float32");
  const float one = 1.0f;
  const float up3 = std::nextafter(std::nextafter(std::nextafter(one, 2.0f), 2.0f), 2.0f);
  EXPECT_EQ(UlpDistance(f, one, up3), 3);
  EXPECT_EQ(UlpDistance(f, -0.0, 0.0), 0);
  // Across zero: the smallest denormals on each side are 2 apart.
  const double tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(UlpDistance(f, -tiny, tiny), 2);
  EXPECT_TRUE(std::isinf(UlpDistance(f, std::nan(""), 1.0)));
  EXPECT_EQ(UlpDistance(f, std::nan(""), std::nan("")), 0);
  EXPECT_EQ(UlpDistance(DtypeOf("float16"), 1.0, 1 + std::ldexp(1.0, -10)), 1);
  EXPECT_EQ(UlpDistance(DtypeOf("int32"), 5, 9), 4);
  // float64: exact counts, even where the bit patterns are near 2^62.
  const Dtype g = DtypeOf("float64");
  const double x = 1.2345;
  EXPECT_EQ(UlpDistance(g, x, std::nextafter(x, 2.0)), 1);
  EXPECT_EQ(UlpDistance(g, x, std::nextafter(std::nextafter(std::nextafter(x, 2.0), 2.0), 2.0)), 3);
  EXPECT_EQ(UlpDistance(g, -1e300, -std::nextafter(1e300, 0.0)), 1);
}

TEST(ElementsTest, SpecialValuesPerDtype) {
  for (const char* name : {"float16", "float32", "float64"}) {
    const Dtype d = DtypeOf(name);
    const std::vector<double> v = SpecialValues(d);
    ASSERT_EQ(v.size(), 11u) << name;
    EXPECT_TRUE(std::isnan(v[0]));
    EXPECT_EQ(v[1], INFINITY);
    EXPECT_EQ(v[2], -INFINITY);
    EXPECT_TRUE(std::signbit(v[3]) && v[3] == 0);
    // Each is exactly representable: it survives the dtype.
    for (size_t i = 1; i < v.size(); ++i) EXPECT_EQ(RoundTo(d, v[i]), v[i]) << name << " " << i;
    // The smallest denormal is not zero in its dtype.
    EXPECT_GT(RoundTo(d, v[5]), 0) << name;
  }
  EXPECT_TRUE(SpecialValues(DtypeOf("int32")).empty());
}

TEST(ElementsTest, DefaultTolerances) {
  EXPECT_EQ(DefaultTolerance("float32").rtol, 1.3e-6);
  EXPECT_EQ(DefaultTolerance("float16").rtol, 1e-3);
  EXPECT_EQ(DefaultTolerance("float64").atol, 1e-7);
  EXPECT_EQ(DefaultTolerance("int64").atol, 0);
  EXPECT_EQ(DefaultTolerance("int64").rtol, 0);
}

}  // namespace
}  // namespace opjit::tensor

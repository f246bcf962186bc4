// Elements of a tensor as numbers, for comparing a candidate's outputs with a
// reference's: reading and writing one element of any opjit dtype as a
// double, rounding to a dtype, distances in units in the last place, the
// special values of a floating dtype, and default tolerances.
//
// Dtypes are the registry's (registry::KnownDtypes): float16 float32 float64
// int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool. 64-bit integers
// read as doubles lose bits past 2^53; comparisons of integers are exact on
// the raw bits instead (SameBits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace opjit::tensor {

// A dtype's element layout, or kind kUnknown.
struct Dtype {
  enum class Kind { kUnknown, kFloat, kSigned, kUnsigned, kBool };
  Kind kind = Kind::kUnknown;
  size_t size = 0;  // bytes per element
  bool is_float() const { return kind == Kind::kFloat; }
};
Dtype DtypeOf(const std::string& name);

// Element `i` of `data` (a tensor of `dtype`) as a double.
double ReadElement(const Dtype& dtype, const void* data, size_t i);
// Writes `value` as element `i`, rounded to nearest (floats) or truncated and
// clamped to the dtype's range (integers); bool: value != 0.
void WriteElement(const Dtype& dtype, void* data, size_t i, double value);
// `value` as the dtype holds it (WriteElement then ReadElement).
double RoundTo(const Dtype& dtype, double value);

// Units in the last place between two finite values of a floating dtype
// (after rounding both to it): 0 for equal values and for -0.0 and +0.0.
// Integers: the absolute difference.
double UlpDistance(const Dtype& dtype, double a, double b);

// NaN, +Inf, -Inf, -0.0, +0.0, the smallest denormal, the smallest normal,
// the largest finite value, the lowest, 1 and -1, as the dtype holds them.
// Empty for a dtype that is not floating.
std::vector<double> SpecialValues(const Dtype& dtype);

// The tolerance a comparison uses when the caller gives none (README
// "Verify"): torch.testing's defaults for floats, exact for the rest.
struct ToleranceValues {
  double atol = 0, rtol = 0;
  int64_t ulps = 0;
};
ToleranceValues DefaultTolerance(const std::string& dtype);

}  // namespace opjit::tensor

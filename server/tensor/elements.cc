#include "server/tensor/elements.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace opjit::tensor {
namespace {

// float16 through the compiler's _Float16 (round to nearest even, NaN kept).
using Half = _Float16;

template <typename T>
T Load(const void* data, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(data) + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void Store(void* data, size_t i, T v) {
  std::memcpy(static_cast<char*>(data) + i * sizeof(T), &v, sizeof(T));
}

// A double clamped into integer type T (NaN: 0).
template <typename T>
T ClampTo(double v) {
  if (std::isnan(v)) return 0;
  if (v <= static_cast<double>(std::numeric_limits<T>::lowest())) {
    return std::numeric_limits<T>::lowest();
  }
  if (v >= static_cast<double>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return static_cast<T>(v);
}

// The bits of a floating value mapped onto a line where adjacent values are
// adjacent integers (-0.0 and +0.0 both at 0).
int64_t OrderedBits(const Dtype& d, double v) {
  int64_t bits = 0, sign = 0;
  if (d.size == 2) {
    const Half h = static_cast<Half>(v);
    uint16_t u;
    std::memcpy(&u, &h, 2);
    sign = u >> 15;
    bits = u & 0x7fff;
  } else if (d.size == 4) {
    const float f = static_cast<float>(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    sign = u >> 31;
    bits = u & 0x7fffffff;
  } else {
    uint64_t u;
    std::memcpy(&u, &v, 8);
    sign = static_cast<int64_t>(u >> 63);
    bits = static_cast<int64_t>(u & 0x7fffffffffffffffull);
  }
  return sign ? -bits : bits;
}

template <typename T>
std::vector<double> SpecialsOf() {
  using L = std::numeric_limits<T>;
  return {std::nan(""), INFINITY, -INFINITY, -0.0, 0.0,
          static_cast<double>(L::denorm_min()), static_cast<double>(L::min()),
          static_cast<double>(L::max()), static_cast<double>(L::lowest()), 1.0, -1.0};
}

}  // namespace

Dtype DtypeOf(const std::string& n) {
  using K = Dtype::Kind;
  if (n == "float16") return {K::kFloat, 2};
  if (n == "float32") return {K::kFloat, 4};
  if (n == "float64") return {K::kFloat, 8};
  if (n == "int8") return {K::kSigned, 1};
  if (n == "int16") return {K::kSigned, 2};
  if (n == "int32") return {K::kSigned, 4};
  if (n == "int64") return {K::kSigned, 8};
  if (n == "uint8") return {K::kUnsigned, 1};
  if (n == "uint16") return {K::kUnsigned, 2};
  if (n == "uint32") return {K::kUnsigned, 4};
  if (n == "uint64") return {K::kUnsigned, 8};
  if (n == "bool") return {K::kBool, 1};
  return {};
}

double ReadElement(const Dtype& d, const void* data, size_t i) {
  switch (d.kind) {
    case Dtype::Kind::kFloat:
      if (d.size == 2) return static_cast<double>(Load<Half>(data, i));
      if (d.size == 4) return Load<float>(data, i);
      return Load<double>(data, i);
    case Dtype::Kind::kSigned:
      if (d.size == 1) return Load<int8_t>(data, i);
      if (d.size == 2) return Load<int16_t>(data, i);
      if (d.size == 4) return Load<int32_t>(data, i);
      return static_cast<double>(Load<int64_t>(data, i));
    case Dtype::Kind::kUnsigned:
      if (d.size == 1) return Load<uint8_t>(data, i);
      if (d.size == 2) return Load<uint16_t>(data, i);
      if (d.size == 4) return Load<uint32_t>(data, i);
      return static_cast<double>(Load<uint64_t>(data, i));
    case Dtype::Kind::kBool:
      return Load<uint8_t>(data, i) != 0 ? 1.0 : 0.0;
    case Dtype::Kind::kUnknown:
      break;
  }
  return 0;
}

void WriteElement(const Dtype& d, void* data, size_t i, double v) {
  switch (d.kind) {
    case Dtype::Kind::kFloat:
      if (d.size == 2) return Store<Half>(data, i, static_cast<Half>(v));
      if (d.size == 4) return Store<float>(data, i, static_cast<float>(v));
      return Store<double>(data, i, v);
    case Dtype::Kind::kSigned:
      if (d.size == 1) return Store<int8_t>(data, i, ClampTo<int8_t>(v));
      if (d.size == 2) return Store<int16_t>(data, i, ClampTo<int16_t>(v));
      if (d.size == 4) return Store<int32_t>(data, i, ClampTo<int32_t>(v));
      return Store<int64_t>(data, i, ClampTo<int64_t>(v));
    case Dtype::Kind::kUnsigned:
      if (d.size == 1) return Store<uint8_t>(data, i, ClampTo<uint8_t>(v));
      if (d.size == 2) return Store<uint16_t>(data, i, ClampTo<uint16_t>(v));
      if (d.size == 4) return Store<uint32_t>(data, i, ClampTo<uint32_t>(v));
      return Store<uint64_t>(data, i, ClampTo<uint64_t>(v));
    case Dtype::Kind::kBool:
      return Store<uint8_t>(data, i, v != 0 ? 1 : 0);
    case Dtype::Kind::kUnknown:
      break;
  }
}

double RoundTo(const Dtype& d, double v) {
  if (d.kind == Dtype::Kind::kUnknown || d.size > 8) return v;
  char buf[8];
  WriteElement(d, buf, 0, v);
  return ReadElement(d, buf, 0);
}

double UlpDistance(const Dtype& d, double a, double b) {
  if (!d.is_float()) return std::fabs(a - b);
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0 : INFINITY;
  // As integers first: two doubles near 2^62 differ by less than their own
  // precision.
  const __int128 diff = static_cast<__int128>(OrderedBits(d, a)) - OrderedBits(d, b);
  return static_cast<double>(diff < 0 ? -diff : diff);
}

std::vector<double> SpecialValues(const Dtype& d) {
  if (!d.is_float()) return {};
  if (d.size == 2) {
    // float16: denorm 2^-24, min normal 2^-14, max 65504.
    return {std::nan(""), INFINITY, -INFINITY, -0.0, 0.0, std::ldexp(1.0, -24),
            std::ldexp(1.0, -14), 65504.0, -65504.0, 1.0, -1.0};
  }
  return d.size == 4 ? SpecialsOf<float>() : SpecialsOf<double>();
}

ToleranceValues DefaultTolerance(const std::string& dtype) {
  if (dtype == "float16") return {1e-5, 1e-3, 0};
  if (dtype == "float32") return {1e-5, 1.3e-6, 0};
  if (dtype == "float64") return {1e-7, 1e-7, 0};
  return {0, 0, 0};
}

}  // namespace opjit::tensor

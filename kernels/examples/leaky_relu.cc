// leaky_relu: y = x > 0 ? x : alpha * x, for float32 and float16.
// Written for MindSpore's aot ABI; runs unchanged on opjit.
#include <cstdint>
#include <cstring>

#include "custom_aot_extra.h"

namespace {

// IEEE half <-> float, enough for an elementwise kernel without <cuda_fp16.h>.
float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = (x >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  if (exp >= 31) return sign | 0x7c00;
  if (exp <= 0) {
    if (exp < -10) return sign;
    mant |= 0x800000;
    const int shift = 14 - exp;
    uint16_t h = static_cast<uint16_t>(mant >> shift);
    if ((mant >> (shift - 1)) & 1) ++h;  // round half up
    return sign | h;
  }
  uint16_t h = sign | static_cast<uint16_t>(exp << 10) | static_cast<uint16_t>(mant >> 13);
  if (mant & 0x1000) ++h;  // round half up (carries into the exponent correctly)
  return h;
}

}  // namespace

extern "C" int CustomLeakyRelu(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  (void)stream;
  if (nparam != 2) return 1;
  auto* kernel_extra = static_cast<AotExtra*>(extra);
  const float alpha = kernel_extra->Attr<float>("alpha");
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  if (std::strcmp(dtypes[0], "float32") == 0) {
    const float* x = static_cast<const float*>(params[0]);
    float* y = static_cast<float*>(params[1]);
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : alpha * x[i];
    return 0;
  }
  if (std::strcmp(dtypes[0], "float16") == 0) {
    const uint16_t* x = static_cast<const uint16_t*>(params[0]);
    uint16_t* y = static_cast<uint16_t*>(params[1]);
    for (int64_t i = 0; i < n; ++i) {
      const float v = HalfToFloat(x[i]);
      y[i] = FloatToHalf(v > 0.0f ? v : alpha * v);
    }
    return 0;
  }
  return 2;  // unsupported dtype: the registry's dtype_formats should have refused it
}

// scale_bias: y = scale * x (+ b when the optional input b is given).
#include <cstdint>

#include "custom_aot_extra.h"

extern "C" int ScaleBias(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream;
  const float scale = static_cast<AotExtra*>(extra)->Attr<float>("scale");
  const bool has_bias = nparam == 3;  // x, [b], y
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* b = has_bias ? static_cast<const float*>(params[1]) : nullptr;
  float* y = static_cast<float*>(params[nparam - 1]);
  for (int64_t i = 0; i < n; ++i) y[i] = scale * x[i] + (b ? b[i] : 0.0f);
  return 0;
}

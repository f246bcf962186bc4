// y = x1 + x2 * scale * paddings[0] + paddings[0] + paddings[1] (float32), with
// attrs scale (float) and paddings (a list of two floats): MindSpore's
// add_with_attr registrations (scale 0.7, paddings [2, 2]) expect x1 + x2*1.4 + 4.
// Written for opjit in MindSpore's aot ABI; the entry is named as MindSpore's
// test names it (add_with_attr.cc:CustomAdd).
#include <cstdint>
#include <cstring>
#include <vector>

#include "custom_aot_extra.h"

extern "C" int CustomAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra_ptr) {
  (void)stream;
  if (nparam != 3) return 1;
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 2;
  }
  AotExtra* extra = static_cast<AotExtra*>(extra_ptr);
  const float scale = extra->Attr<float>("scale");
  const std::vector<float> paddings = extra->Attr<std::vector<float>>("paddings");
  if (paddings.size() != 2) return 3;
  int64_t n = 1;
  for (int d = 0; d < ndims[2]; ++d) n *= shapes[2][d];
  const float* x1 = static_cast<const float*>(params[0]);
  const float* x2 = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  const float shift = paddings[0] + paddings[1];
  for (int64_t i = 0; i < n; ++i) y[i] = x1[i] + x2[i] * scale * paddings[0] + shift;
  return 0;
}

// y = sum of a 2-D float32 x over axis reduce_axis (0 or 1), keeping it as size 1
// when keep_dim. reduce_axis is declared "float" in MindSpore's registration and
// read as int64_t here (a whole float converts). CustomReduceInferShape gives the
// output shape, so Custom(..., out_shape=None) works. Written for opjit in
// MindSpore's aot ABI (reduce.cc:CustomReduce).
#include <cstdint>
#include <cstring>
#include <vector>

#include "custom_aot_extra.h"

extern "C" std::vector<int64_t> CustomReduceInferShape(int* ndims, int64_t** shapes,
                                                       AotExtra* extra) {
  if (ndims[0] == 1 && shapes[0][0] == -2) return {-2};  // unknown rank stays unknown
  const int64_t axis = extra->Attr<int64_t>("reduce_axis");
  const bool keep_dim = extra->Attr<bool>("keep_dim");
  std::vector<int64_t> out;
  for (int d = 0; d < ndims[0]; ++d) {
    if (d != axis) {
      out.push_back(shapes[0][d]);
    } else if (keep_dim) {
      out.push_back(1);
    }
  }
  return out;
}

extern "C" int CustomReduce(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra_ptr) {
  (void)stream;
  AotExtra* extra = static_cast<AotExtra*>(extra_ptr);
  const int64_t axis = extra->Attr<int64_t>("reduce_axis");
  if (nparam != 2 || ndims[0] != 2 || axis < 0 || axis > 1) return 1;
  if (std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "float32") != 0) return 2;
  const int64_t rows = shapes[0][0];
  const int64_t cols = shapes[0][1];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  const int64_t n = axis == 0 ? cols : rows;
  for (int64_t i = 0; i < n; ++i) y[i] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[axis == 0 ? c : r] += x[r * cols + c];
  }
  return 0;
}

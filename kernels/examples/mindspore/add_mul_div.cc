// Three outputs from two float32 inputs: x + y, x * y, x / y; and the backward
// taking (x, y, dout0, dout1, dout2) and giving (dx, dy). Both entries live in one
// file (one compile). The shape of MindSpore's multi-output aot bprop test;
// written for opjit in MindSpore's aot ABI.
#include <cstdint>
#include <cstring>

namespace {

int64_t Elems(int* ndims, int64_t** shapes, int i) {
  int64_t n = 1;
  for (int d = 0; d < ndims[i]; ++d) n *= shapes[i][d];
  return n;
}

bool AllF32(int nparam, const char** dtypes) {
  for (int i = 0; i < nparam; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int CustomAddMulDiv(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 5) return 1;
  if (!AllF32(nparam, dtypes)) return 2;
  const float* x = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  float* sum = static_cast<float*>(params[2]);
  float* prod = static_cast<float*>(params[3]);
  float* quot = static_cast<float*>(params[4]);
  const int64_t n = Elems(ndims, shapes, 2);
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = x[i] + y[i];
    prod[i] = x[i] * y[i];
    quot[i] = x[i] / y[i];
  }
  return 0;
}

extern "C" int CustomAddMulDivBprop(int nparam, void** params, int* ndims, int64_t** shapes,
                                    const char** dtypes, void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 7) return 1;  // x, y, d_sum, d_prod, d_quot, dx, dy
  if (!AllF32(nparam, dtypes)) return 2;
  const float* x = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  const float* d_sum = static_cast<const float*>(params[2]);
  const float* d_prod = static_cast<const float*>(params[3]);
  const float* d_quot = static_cast<const float*>(params[4]);
  float* dx = static_cast<float*>(params[5]);
  float* dy = static_cast<float*>(params[6]);
  const int64_t n = Elems(ndims, shapes, 5);
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = d_sum[i] + d_prod[i] * y[i] + d_quot[i] / y[i];
    dy[i] = d_sum[i] + d_prod[i] * x[i] - d_quot[i] * x[i] / (y[i] * y[i]);
  }
  return 0;
}

// mul: y = x * w, elementwise, and its bprop.
#include <cstdint>

namespace {
int64_t Numel(const int* ndims, int64_t** shapes, int i) {
  int64_t n = 1;
  for (int d = 0; d < ndims[i]; ++d) n *= shapes[i][d];
  return n;
}
}  // namespace

extern "C" int Mul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                   void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 3) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * w[i];
  return 0;
}

// The bprop (MindSpore convention): inputs (x, w, y, dy), outputs (dx, dw)
// = (dy * w, dy * x), so params = x, w, y, dy, dx, dw (nparam 6). y is not
// needed: when it is not saved its slot is null.
extern "C" int MulGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                       const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 6 || params[0] == nullptr || params[1] == nullptr || params[3] == nullptr) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  const float* dy = static_cast<const float*>(params[3]);
  float* dx = static_cast<float*>(params[4]);
  float* dw = static_cast<float*>(params[5]);
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = dy[i] * w[i];
    dw[i] = dy[i] * x[i];
  }
  return 0;
}

// tanh forward and its bprop, which uses the saved forward output:
// dx = dy * (1 - y^2).
//
// The forward goes through opjit/vmath.h: clang vectorizes a loop over
// std::exp by itself (-fveclib=libmvec) but not one over std::tanh, which
// stays a scalar call per element (about 18 ns each here, ~30x libmvec's
// vector tanhf). The bprop is plain arithmetic and vectorizes as written.
#include <cstdint>
#include <cstring>

#include "opjit/vmath.h"

namespace {
int64_t Numel(int* ndims, int64_t** shapes, int i) {
  int64_t n = 1;
  for (int d = 0; d < ndims[i]; ++d) n *= shapes[i][d];
  return n;
}
}  // namespace

extern "C" int Tanh(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                    void* stream, void* extra) {
  (void)nparam, (void)stream, (void)extra;
  const int64_t n = Numel(ndims, shapes, 0);
  if (std::strcmp(dtypes[0], "float64") == 0) {
    opjit::vmath::Tanh(static_cast<const double*>(params[0]), static_cast<double*>(params[1]), n);
  } else {
    opjit::vmath::Tanh(static_cast<const float*>(params[0]), static_cast<float*>(params[1]), n);
  }
  return 0;
}

// The bprop (MindSpore convention): inputs (x, y, dy), output dx, so params
// = x, y, dy, dx (nparam 4). Only y is saved: x's slot is null (params[0] ==
// nullptr, ndims[0] == 0, dtypes[0] its dtype). Called directly as an op, x
// (declared optional) may be left out: then params = y, dy, dx.
extern "C" int TanhGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                        const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 4 && nparam != 3) return 1;
  const int y_at = nparam - 3;  // 1 in a bprop call
  if (params[y_at] == nullptr || params[y_at + 1] == nullptr) return 2;
  const int64_t n = Numel(ndims, shapes, y_at);
  if (std::strcmp(dtypes[y_at], "float64") == 0) {
    const double* y = static_cast<const double*>(params[y_at]);
    const double* dy = static_cast<const double*>(params[y_at + 1]);
    double* dx = static_cast<double*>(params[y_at + 2]);
    for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (1.0 - y[i] * y[i]);
  } else {
    const float* y = static_cast<const float*>(params[y_at]);
    const float* dy = static_cast<const float*>(params[y_at + 1]);
    float* dx = static_cast<float*>(params[y_at + 2]);
    for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * (1.0f - y[i] * y[i]);
  }
  return 0;
}

// MindSpore's bprop positions with a partial save_for_backward.
// Forward (x, w) -> (y = x * w, z = x + w). Its bprop gets
// (x, w, y, z, dy, dz) -> (dx, dw): nparam 8, whatever is saved. When only w
// and z are saved, x and y are null slots in their own positions:
// params[k] == nullptr, ndims[k] == 0, shapes[k] -> {0}, dtypes[k] set.
// A missing dz (materialize_grads: false) is a null slot too. The bprop
// checks all of it and returns a code naming what was wrong; the tests use it.
#include <cstdint>
#include <cstring>

namespace {
int64_t Numel(int nd, const int64_t* s) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= s[i];
  return n;
}
}  // namespace

extern "C" int MulAdd(int nparam, void** params, int* ndims, int64_t** shapes, const char**,
                      void*, void*) {
  if (nparam != 4) return 1;
  const int64_t n = Numel(ndims[0], shapes[0]);
  const float* x = static_cast<const float*>(params[0]);
  const float* w = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  float* z = static_cast<float*>(params[3]);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = x[i] * w[i];
    z[i] = x[i] + w[i];
  }
  return 0;
}

extern "C" int MulAddGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void*, void*) {
  if (nparam != 8) return 10;  // inputs..., outputs..., output grads..., input grads
  const int nulls[] = {0, 2};  // x and y: not saved
  for (int k : nulls) {
    if (params[k] != nullptr) return 11;
    if (ndims[k] != 0 || shapes[k] == nullptr || shapes[k][0] != 0) return 12;
    if (std::strcmp(dtypes[k], "float32") != 0) return 13;
  }
  if (params[1] == nullptr || params[3] == nullptr || params[4] == nullptr) return 14;
  const float* dz = static_cast<const float*>(params[5]);  // null: missing, not materialized
  if (dz == nullptr && (ndims[5] != 0 || std::strcmp(dtypes[5], "float32") != 0)) return 15;
  const int64_t n = Numel(ndims[1], shapes[1]);
  if (Numel(ndims[3], shapes[3]) != n || Numel(ndims[4], shapes[4]) != n) return 16;
  const float* w = static_cast<const float*>(params[1]);
  const float* z = static_cast<const float*>(params[3]);
  const float* dy = static_cast<const float*>(params[4]);
  float* dx = static_cast<float*>(params[6]);
  float* dw = static_cast<float*>(params[7]);
  for (int64_t i = 0; i < n; ++i) {
    const float g = dz != nullptr ? dz[i] : 0.0f;
    const float x = z[i] - w[i];  // x itself was not saved
    dx[i] = dy[i] * w[i] + g;
    dw[i] = dy[i] * x + g;
  }
  return 0;
}

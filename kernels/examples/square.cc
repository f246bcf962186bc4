// square: y = x * x (the seed's intended op; it must not read y before writing it).
#include <cstdint>

extern "C" int Square(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                      void* stream, void* extra) {
  (void)nparam, (void)dtypes, (void)stream, (void)extra;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * x[i];
  return 0;
}

// The bprop (MindSpore convention): inputs (x, y, dy), output dx = 2 * x * dy,
// so params = x, y, dy, dx and nparam is 4 whatever is saved. y is not saved
// (save_for_backward lists only x): its slot is null (params[1] == nullptr,
// ndims[1] == 0, dtypes[1] "float32").
extern "C" int SquareGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 4 || params[0] == nullptr || params[2] == nullptr) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* dy = static_cast<const float*>(params[2]);
  float* dx = static_cast<float*>(params[3]);
  for (int64_t i = 0; i < n; ++i) dx[i] = 2.0f * x[i] * dy[i];
  return 0;
}

// The bprop of SquareGrad, for double backward: inputs (x, y, dy, dx, ddx),
// outputs (d_x, d_y, d_dy) = (2 * dy * ddx, 0, 2 * x * ddx), so params = x,
// y, dy, dx, ddx, d_x, d_y, d_dy (nparam 8). Only x and dy are saved: the
// slots of y and dx are null.
extern "C" int SquareGradGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                              const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 8 || params[0] == nullptr || params[2] == nullptr || params[4] == nullptr) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* dy = static_cast<const float*>(params[2]);
  const float* ddx = static_cast<const float*>(params[4]);
  float* gx = static_cast<float*>(params[5]);
  float* gy = static_cast<float*>(params[6]);
  float* gdy = static_cast<float*>(params[7]);
  for (int64_t i = 0; i < n; ++i) {
    gx[i] = 2.0f * dy[i] * ddx[i];
    gy[i] = 0.0f;
    gdy[i] = 2.0f * x[i] * ddx[i];
  }
  return 0;
}

// MindSpore's own square_grad(x, dout) (seed 001): a bprop that takes only
// the forward input and the output grad, named in the forward's
// backward.inputs as ["x", "dout"]. params = x, dout, dx (nparam 3).
extern "C" int SquareGradXDout(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 3 || params[0] == nullptr || params[1] == nullptr) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* dout = static_cast<const float*>(params[1]);
  float* dx = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) dx[i] = 2.0f * x[i] * dout[i];
  return 0;
}

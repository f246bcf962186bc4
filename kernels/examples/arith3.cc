// arith3: three outputs from two inputs: x + y, x * y, x / y (float32).
#include <cstdint>

extern "C" int Arith3(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                      void* stream, void* extra) {
  (void)nparam, (void)dtypes, (void)stream, (void)extra;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  float* sum = static_cast<float*>(params[2]);
  float* prod = static_cast<float*>(params[3]);
  float* quot = static_cast<float*>(params[4]);
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = x[i] + y[i];
    prod[i] = x[i] * y[i];
    quot[i] = x[i] / y[i];
  }
  return 0;
}

// The bprop of Arith3: inputs (x, y, sum, prod, quot, dsum, dprod, dquot),
// outputs (dx, dy), so params = x, y, sum, prod, quot, dsum, dprod, dquot,
// dx, dy (nparam 10). Only x and y are saved: the slots of the forward
// outputs sum, prod and quot (params[2..4]) are null.
extern "C" int Arith3Grad(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 10) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  const float* ds = static_cast<const float*>(params[5]);
  const float* dp = static_cast<const float*>(params[6]);
  const float* dq = static_cast<const float*>(params[7]);
  float* dx = static_cast<float*>(params[8]);
  float* dy = static_cast<float*>(params[9]);
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = ds[i] + dp[i] * y[i] + dq[i] / y[i];
    dy[i] = ds[i] + dp[i] * x[i] - dq[i] * x[i] / (y[i] * y[i]);
  }
  return 0;
}

// MindSpore's add_mul_div_bprop(x, y, dout): the bprop of Arith3 without the
// forward outputs, named in the forward's backward.inputs as ["x", "y",
// "dout"] ("dout": every output grad). params = x, y, dsum, dprod, dquot,
// dx, dy (nparam 7).
extern "C" int Arith3GradXYDout(int nparam, void** params, int* ndims, int64_t** shapes,
                                const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  if (nparam != 7) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  const float* y = static_cast<const float*>(params[1]);
  const float* ds = static_cast<const float*>(params[2]);
  const float* dp = static_cast<const float*>(params[3]);
  const float* dq = static_cast<const float*>(params[4]);
  float* dx = static_cast<float*>(params[5]);
  float* dy = static_cast<float*>(params[6]);
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = ds[i] + dp[i] * y[i] + dq[i] / y[i];
    dy[i] = ds[i] + dp[i] * x[i] - dq[i] * x[i] / (y[i] * y[i]);
  }
  return 0;
}

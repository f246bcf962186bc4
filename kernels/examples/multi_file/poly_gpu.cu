// poly on the GPU (NVRTC), with the CPU kernel's header: y = a*x^2 + b*x + c.
#include "poly_coeffs.h"

__global__ void poly(const float* x, float* y, long long n) {
  long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = (kPolyA * x[i] + kPolyB) * x[i] + kPolyC + kPolyBias;
}

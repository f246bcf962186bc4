// A MindSpore aot GPU kernel: a __global__ kernel plus a host launcher with
// the aot entry signature. opjit compiles it with nvcc into a shared object
// and calls it like a CPU aot kernel, with `stream` set.
#include <cstdint>

#include "custom_aot_extra.h"

__global__ void AddKernel(const float* x, const float* y, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

extern "C" int CustomAddGpu(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra) {
  (void)dtypes, (void)extra;
  if (nparam != 3) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const int block = 256;
  const int64_t grid = (n + block - 1) / block;
  AddKernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
      static_cast<float*>(params[2]), n);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

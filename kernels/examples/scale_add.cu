// scale_add on the GPU, compiled by NVRTC: y = alpha * x + b.
// The launch spec in scale_add_gpu.json binds the kernel's parameters.
template <typename T>
__global__ void scale_add(const T* x, const T* b, T* y, long long n, float alpha) {
  long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = static_cast<T>(alpha) * x[i] + b[i];
}

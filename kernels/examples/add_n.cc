// add_n: y = x[0] + x[1] + ... (a dynamic input, AddN-style), float32.
#include <cstdint>

extern "C" int AddN(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                    void* stream, void* extra) {
  (void)dtypes, (void)stream, (void)extra;
  const int n_in = nparam - 1;  // inputs, then the one output
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  float* y = static_cast<float*>(params[n_in]);
  for (int64_t i = 0; i < n; ++i) y[i] = 0.0f;
  for (int k = 0; k < n_in; ++k) {
    const float* x = static_cast<const float*>(params[k]);
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
  }
  return 0;
}

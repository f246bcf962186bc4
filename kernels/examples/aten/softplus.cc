// A second ATen kernel with the same includes as leaky_relu.cc: it reuses
// that kernel's precompiled preamble. Uses the non-`_out` form and copies.
#include <string.h>
#include <torch/extension.h>
#include "ms_ext.h"

extern "C" int Softplus(int nparam, void** params, int* ndims, int64_t** shapes,
                        const char** dtypes, void* stream, void* extra) {
  auto tensors = get_torch_tensors(nparam, params, ndims, shapes, dtypes, c10::kCPU);
  tensors[1].copy_(torch::softplus(tensors[0]));
  return 0;
}

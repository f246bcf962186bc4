// A PyTorch ATen kernel, written as MindSpore's guide to third-party operator
// libraries shows: the aot entry wraps its parameters as ATen tensors and
// calls an ATen `_out` function on them.
#include <string.h>
#include <torch/extension.h>
#include "ms_ext.h"

extern "C" int LeakyRelu(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  auto tensors = get_torch_tensors(nparam, params, ndims, shapes, dtypes, c10::kCPU);
  auto at_input = tensors[0];
  auto at_output = tensors[1];
  torch::leaky_relu_out(at_output, at_input);
  return 0;
}

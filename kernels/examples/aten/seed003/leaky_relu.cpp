// The CPU kernel of MindSpore's guide to third-party operator libraries
// (seed 003), as the guide writes it: the aot entry wraps its parameters as
// ATen tensors (ms_ext.h) and calls torch::leaky_relu_out on them.
#include <string.h>
#include <torch/extension.h>  // the header part
#include "ms_ext.h"

extern "C" int LeakyRelu(
    int nparam,
    void** params,
    int* ndims,
    int64_t** shapes,
    const char** dtypes,
    void* stream,
    void* extra) {
  auto tensors = get_torch_tensors(nparam, params, ndims, shapes, dtypes, c10::kCPU);
  auto at_input = tensors[0];
  auto at_output = tensors[1];
  torch::leaky_relu_out(at_output, at_input);
  // Without the `_out` form:
  // torch::Tensor output = torch::leaky_relu(at_input);
  // at_output.copy_(output);
  return 0;
}

// The conversion API of MindSpore's guide to third-party operator libraries
// (seed 003), laid out as the guide lays it out: declarations here, the code
// in ms_ext.cpp, both shipped with the kernel as its extra files. Compiled
// with the "aten" toolchain profile (README, "ATen kernels").
#ifndef OPJIT_EXAMPLE_MS_EXT_H_
#define OPJIT_EXAMPLE_MS_EXT_H_

#include <cstdint>
#include <vector>
#include <torch/extension.h>

// The kernel's aot parameters (inputs, then outputs) as ATen tensors on
// `device` that share the kernel's memory (no copies).
std::vector<at::Tensor> get_torch_tensors(int nparam, void** params, int* ndims,
                                          int64_t** shapes, const char** dtypes,
                                          c10::Device device);

#endif  // OPJIT_EXAMPLE_MS_EXT_H_

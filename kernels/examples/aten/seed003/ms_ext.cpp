// get_torch_tensors(): MindSpore's aot parameters as ATen tensors (see
// ms_ext.h). A translation unit of its own, linked with the kernel.
#include "ms_ext.h"

#include <stdexcept>
#include <string>

namespace {

c10::ScalarType ScalarTypeOf(const char* dtype) {
  const std::string d = dtype == nullptr ? "" : dtype;
  if (d == "float32") return c10::kFloat;
  if (d == "float16") return c10::kHalf;
  if (d == "bfloat16") return c10::kBFloat16;
  if (d == "float64") return c10::kDouble;
  if (d == "int8") return c10::kChar;
  if (d == "int16") return c10::kShort;
  if (d == "int32") return c10::kInt;
  if (d == "int64") return c10::kLong;
  if (d == "uint8") return c10::kByte;
  if (d == "bool") return c10::kBool;
  throw std::invalid_argument("no ATen type for dtype " + d);
}

}  // namespace

std::vector<at::Tensor> get_torch_tensors(int nparam, void** params, int* ndims,
                                          int64_t** shapes, const char** dtypes,
                                          c10::Device device) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(nparam);
  for (int i = 0; i < nparam; ++i) {
    std::vector<int64_t> size(shapes[i], shapes[i] + ndims[i]);
    auto options = torch::TensorOptions().dtype(ScalarTypeOf(dtypes[i])).device(device);
    tensors.push_back(torch::from_blob(params[i], size, options));
  }
  return tensors;
}

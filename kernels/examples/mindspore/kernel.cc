// A fused add + reduce-sum: tmp = x1 + x2 (in a workspace the kernel asks for in
// CustomKernelInit), y = sum of tmp over attr axis (0 or 1) of the 2-D float32
// inputs, kept as size 1 when keep_dim. Attrs are read once, in Init, into kernel
// data; CustomKernelInferShape gives the output shape. The shape of MindSpore's
// fused aot example (kernel.cc:CustomKernel, registered with
// .input(0, "x1").input(0, "x2")); written for opjit in that ABI.
#include <cstdint>
#include <cstring>
#include <vector>

#include "custom_aot_extra.h"

namespace {

class AddReduceData : public AotKernelData {
 public:
  int64_t axis = 0;
  bool keep_dim = false;
};

}  // namespace

extern "C" int CustomKernelInit(int* ndims, int64_t** shapes, const char** dtypes,
                                AotExtra* extra) {
  (void)dtypes;
  size_t elems = 1;
  for (int d = 0; d < ndims[0]; ++d) elems *= static_cast<size_t>(shapes[0][d]);
  extra->SetWorkSpace({elems * sizeof(float)});  // tmp: one float per element of x1
  AddReduceData* data = new AddReduceData;
  data->axis = extra->Attr<int64_t>("axis");
  data->keep_dim = extra->Attr<bool>("keep_dim");
  extra->SetKernelData(data);
  return 0;
}

extern "C" std::vector<int64_t> CustomKernelInferShape(int* ndims, int64_t** shapes,
                                                       AotExtra* extra) {
  if (ndims[0] == 1 && shapes[0][0] == -2) return {-2};
  const int64_t axis = extra->Attr<int64_t>("axis");
  const bool keep_dim = extra->Attr<bool>("keep_dim");
  std::vector<int64_t> out;
  for (int d = 0; d < ndims[0]; ++d) {
    if (d != axis) {
      out.push_back(shapes[0][d]);
    } else if (keep_dim) {
      out.push_back(1);
    }
  }
  return out;
}

extern "C" int CustomKernel(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra_ptr) {
  (void)stream;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 2) return 1;  // x1, x2, y, workspace
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 2;
  }
  const int64_t rows = shapes[0][0];
  const int64_t cols = shapes[0][1];
  if (shapes[1][0] != rows || shapes[1][1] != cols) return 3;
  AotExtra* extra = static_cast<AotExtra*>(extra_ptr);
  const AddReduceData* data = static_cast<const AddReduceData*>(extra->KernelData());
  if (data == nullptr || data->axis < 0 || data->axis > 1) return 4;
  const float* x1 = static_cast<const float*>(params[0]);
  const float* x2 = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  float* tmp = static_cast<float*>(params[3]);
  for (int64_t i = 0; i < rows * cols; ++i) tmp[i] = x1[i] + x2[i];
  const int64_t n = data->axis == 0 ? cols : rows;
  for (int64_t i = 0; i < n; ++i) y[i] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[data->axis == 0 ? c : r] += tmp[r * cols + c];
  }
  return 0;
}

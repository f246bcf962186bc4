// reduce_sum: sums a float32 or float64 tensor over one axis (attr `axis`,
// negative counts from the end). The output shape comes from the kernel's own
// InferShape, and Init checks the axis once per instance.
#include <cstdint>
#include <cstring>
#include <vector>

#include "custom_aot_extra.h"

namespace {

int64_t NormAxis(int64_t axis, int rank) { return axis < 0 ? axis + rank : axis; }

}  // namespace

extern "C" std::vector<int64_t> ReduceSumInferShape(int* ndims, int64_t** shapes,
                                                    AotExtra* extra) {
  const int rank = ndims[0];
  const int64_t axis = NormAxis(extra->Attr<int64_t>("axis"), rank);
  std::vector<int64_t> out;
  for (int i = 0; i < rank; ++i) {
    if (i != axis) out.push_back(shapes[0][i]);
  }
  return out;
}

extern "C" int ReduceSumInit(int* ndims, int64_t** shapes, const char** dtypes, AotExtra* extra) {
  (void)shapes, (void)dtypes;
  const int64_t axis = NormAxis(extra->Attr<int64_t>("axis"), ndims[0]);
  return axis >= 0 && axis < ndims[0] ? 0 : 3;  // 3: axis out of range
}

template <typename T>
void Reduce(const T* x, T* y, int64_t outer, int64_t len, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      T acc = 0;
      for (int64_t k = 0; k < len; ++k) acc += x[(o * len + k) * inner + i];
      y[o * inner + i] = acc;
    }
  }
}

extern "C" int ReduceSum(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  (void)nparam, (void)stream;
  const int rank = ndims[0];
  const int64_t axis = NormAxis(static_cast<AotExtra*>(extra)->Attr<int64_t>("axis"), rank);
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= shapes[0][i];
  for (int i = axis + 1; i < rank; ++i) inner *= shapes[0][i];
  const int64_t len = shapes[0][axis];
  if (std::strcmp(dtypes[0], "float64") == 0) {
    Reduce(static_cast<const double*>(params[0]), static_cast<double*>(params[1]), outer, len, inner);
  } else {
    Reduce(static_cast<const float*>(params[0]), static_cast<float*>(params[1]), outer, len, inner);
  }
  return 0;
}

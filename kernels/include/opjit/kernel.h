// opjit/kernel.h: a small typed layer over the aot kernel ABI of
// custom_aot_extra.h. Optional; kernels that use it keep the same entry
// signature and stay callable by anything that speaks the aot ABI.
//
//   #include "opjit/kernel.h"
//   extern "C" int CustomScale(int nparam, void** params, int* ndims, int64_t** shapes,
//                              const char** dtypes, void* stream, void* extra) {
//     opjit::KernelArgs args(nparam, params, ndims, shapes, dtypes, extra);
//     auto x = args.Tensor<float>(0);
//     auto y = args.Tensor<float>(1);
//     float alpha = args.extra()->Attr<float>("alpha");
//     for (int64_t i = 0; i < x.size(); ++i) y[i] = alpha * x[i];
//     return 0;
//   }
#ifndef OPJIT_KERNEL_H_
#define OPJIT_KERNEL_H_

#include <cstdint>
#include <cstring>

#include "custom_aot_extra.h"

namespace opjit {

// A non-owning view of one tensor argument: data pointer and shape.
template <typename T>
class TensorView {
 public:
  TensorView(void* data, int ndim, const int64_t* shape)
      : data_(static_cast<T*>(data)), ndim_(ndim), shape_(shape) {}

  T* data() const { return data_; }
  int ndim() const { return ndim_; }
  int64_t dim(int i) const { return shape_[i < 0 ? i + ndim_ : i]; }
  // Number of elements (1 for a scalar).
  int64_t size() const {
    int64_t n = 1;
    for (int i = 0; i < ndim_; ++i) n *= shape_[i];
    return n;
  }
  T& operator[](int64_t i) const { return data_[i]; }
  T* begin() const { return data_; }
  T* end() const { return data_ + size(); }

 private:
  T* data_;
  int ndim_;
  const int64_t* shape_;
};

// The arguments of one aot call, with typed access.
class KernelArgs {
 public:
  KernelArgs(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
             void* extra)
      : nparam_(nparam),
        params_(params),
        ndims_(ndims),
        shapes_(shapes),
        dtypes_(dtypes),
        extra_(static_cast<AotExtra*>(extra)) {}

  int size() const { return nparam_; }
  const char* dtype(int i) const { return dtypes_[i]; }
  bool IsDtype(int i, const char* dtype) const { return std::strcmp(dtypes_[i], dtype) == 0; }
  // params[i] viewed as T; the caller checks the dtype when it matters.
  template <typename T>
  TensorView<T> Tensor(int i) const {
    return TensorView<T>(params_[i], ndims_[i], shapes_[i]);
  }
  AotExtra* extra() const { return extra_; }

 private:
  int nparam_;
  void** params_;
  int* ndims_;
  int64_t** shapes_;
  const char** dtypes_;
  AotExtra* extra_;
};

}  // namespace opjit

#endif  // OPJIT_KERNEL_H_

// custom_aot_extra.h: opjit's implementation of the MindSpore `aot` custom-op
// kernel interface. Kernels written for MindSpore's aot custom ops compile and
// run on opjit unchanged. Written for opjit from the published description of
// the API; it shares no code with MindSpore.
//
// A kernel defines, for an entry name F (e.g. CustomAdd):
//
//   extern "C" int F(int nparam, void** params, int* ndims, int64_t** shapes,
//                    const char** dtypes, void* stream, void* extra);
//     Required. params holds the inputs, then the outputs, then one buffer per
//     workspace size set with AotExtra::SetWorkSpace; nparam counts them all.
//     ndims[i] / shapes[i] / dtypes[i] describe params[i] (workspaces are 1-D
//     "uint8" buffers of their size in bytes). Dtype strings: float16 float32
//     float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool. On the
//     CPU `stream` is null and `extra` points to an AotExtra (C++ kernels:
//     `static_cast<AotExtra*>(extra)`). Returns 0 on success; any other value
//     is reported to the caller as a kernel error.
//
//   extern "C" int FInit(int* ndims, int64_t** shapes, const char** dtypes,
//                        AotExtra* extra);
//     Optional. Called once per kernel instance before the first run with the
//     inputs' and outputs' shapes and dtypes. Reads attributes, sets
//     workspaces and kernel data. Returns 0 on success.
//
//   extern "C" std::vector<int64_t> FInferShape(int* ndims, int64_t** shapes,
//                                               AotExtra* extra);
//     Optional. Returns the output shape computed from the input shapes and
//     attributes: -1 for a dimension not known yet, {-2} for an unknown rank.
//
// Memory and ABI: the kernel (clang + libstdc++) and the daemon (g++ +
// libstdc++) share the Itanium C++ ABI, so std::string / std::vector values
// and the virtual calls below cross the boundary. The order of the virtual
// functions in AotExtra is part of opjit's kernel ABI (OPJIT_AOT_ABI_VERSION):
// never reorder them, only append.
//
// Included from C, this header only provides <stdint.h>; a C kernel receives
// `void* extra` and does not use it.
#ifndef OPJIT_CUSTOM_AOT_EXTRA_H_
#define OPJIT_CUSTOM_AOT_EXTRA_H_

#define OPJIT_AOT_ABI_VERSION 1

#ifdef __cplusplus

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// Base class of per-instance data a kernel keeps between calls (set in FInit
// with AotExtra::SetKernelData). The daemon deletes it through this virtual
// destructor when the kernel instance is destroyed, before the kernel's code
// is unloaded.
class AotKernelData {
 public:
  AotKernelData() = default;
  virtual ~AotKernelData() = default;
};

// What a kernel sees of the daemon: attributes, workspaces and kernel data.
// The daemon subclasses it and implements the Get* hooks; a kernel never
// creates one.
class AotExtra {
 public:
  AotExtra() = default;
  AotExtra(const AotExtra&) = delete;
  AotExtra& operator=(const AotExtra&) = delete;
  virtual ~AotExtra() { DestructKernelData(); }

  // True when the op instance carries attribute `name`.
  bool HasAttr(std::string name) const { return HasAttrImpl(name); }

  // The value of attribute `name` as T: bool, int64_t, float, std::string,
  // std::vector<int64_t>, std::vector<float>, std::vector<std::vector<int64_t>>,
  // std::vector<std::vector<float>> (and, beyond MindSpore's list, int, double,
  // std::vector<bool>, std::vector<std::string>). A missing attribute or one
  // of another type yields a zero value here and fails the call afterwards
  // with an error naming the attribute.
  template <typename T>
  T Attr(std::string name) const {
    if constexpr (std::is_same_v<T, bool>) {
      return GetAttrBool(name);
    } else if constexpr (std::is_same_v<T, int64_t>) {
      return GetAttrInt(name);
    } else if constexpr (std::is_same_v<T, int>) {
      return static_cast<int>(GetAttrInt(name));
    } else if constexpr (std::is_same_v<T, float>) {
      return GetAttrFloat(name);
    } else if constexpr (std::is_same_v<T, double>) {
      return GetAttrDouble(name);
    } else if constexpr (std::is_same_v<T, std::string>) {
      return GetAttrStr(name);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      return GetAttrListInt(name);
    } else if constexpr (std::is_same_v<T, std::vector<float>>) {
      return GetAttrListFloat(name);
    } else if constexpr (std::is_same_v<T, std::vector<bool>>) {
      return GetAttrListBool(name);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      return GetAttrListStr(name);
    } else if constexpr (std::is_same_v<T, std::vector<std::vector<int64_t>>>) {
      return GetAttrListListInt(name);
    } else if constexpr (std::is_same_v<T, std::vector<std::vector<float>>>) {
      return GetAttrListListFloat(name);
    } else {
      static_assert(sizeof(T) == 0, "AotExtra::Attr: unsupported attribute type");
    }
  }

  // Sizes in bytes of the workspace buffers appended to `params` (after the
  // outputs) on every run. Call from FInit.
  void SetWorkSpace(std::vector<size_t> sizes) { workspace_ = std::move(sizes); }
  const std::vector<size_t>& WorkSpace() const { return workspace_; }

  // Per-instance kernel data; the AotExtra owns it from here on and deletes it
  // in DestructKernelData (replacing it does not delete the old one).
  void SetKernelData(AotKernelData* data) { kernel_data_ = data; }
  AotKernelData* KernelData() const { return kernel_data_; }
  // Deletes the kernel data (if any) and forgets it.
  void DestructKernelData() {
    AotKernelData* data = kernel_data_;
    kernel_data_ = nullptr;
    delete data;
  }

 protected:
  // Implemented by the daemon. Each getter returns a zero value (false, 0,
  // empty) for a missing attribute or a type mismatch and records the error.
  // ABI: keep this order; append new hooks at the end.
  virtual bool HasAttrImpl(const std::string& name) const = 0;
  virtual bool GetAttrBool(const std::string& name) const = 0;
  virtual int64_t GetAttrInt(const std::string& name) const = 0;
  virtual float GetAttrFloat(const std::string& name) const = 0;
  virtual double GetAttrDouble(const std::string& name) const = 0;
  virtual std::string GetAttrStr(const std::string& name) const = 0;
  virtual std::vector<int64_t> GetAttrListInt(const std::string& name) const = 0;
  virtual std::vector<float> GetAttrListFloat(const std::string& name) const = 0;
  virtual std::vector<bool> GetAttrListBool(const std::string& name) const = 0;
  virtual std::vector<std::string> GetAttrListStr(const std::string& name) const = 0;
  virtual std::vector<std::vector<int64_t>> GetAttrListListInt(const std::string& name) const = 0;
  virtual std::vector<std::vector<float>> GetAttrListListFloat(const std::string& name) const = 0;

 private:
  std::vector<size_t> workspace_;
  AotKernelData* kernel_data_ = nullptr;
};

#else  // C

#include <stddef.h>
#include <stdint.h>

#endif  // __cplusplus

#endif  // OPJIT_CUSTOM_AOT_EXTRA_H_

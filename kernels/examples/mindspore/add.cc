// y = x1 + x2, elementwise, for float32, float64 and int32 (any other dtype, or
// mixed dtypes, is the kernel's error 2). Written for opjit in MindSpore's aot
// ABI; the entry is named as in MindSpore's aot tests (add.cc:CustomAdd), which
// tests/python/test_mindspore_custom.py runs through opjit.mindspore.ops.Custom.
#include <cstdint>
#include <cstring>

namespace {

template <typename T>
void AddAll(void** params, int64_t n) {
  const T* a = static_cast<const T*>(params[0]);
  const T* b = static_cast<const T*>(params[1]);
  T* y = static_cast<T*>(params[2]);
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

bool Is(const char* dtype, const char* name) { return std::strcmp(dtype, name) == 0; }

}  // namespace

extern "C" int CustomAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 3) return 1;
  if (!Is(dtypes[0], dtypes[1]) || !Is(dtypes[0], dtypes[2])) return 2;
  int64_t n = 1;
  for (int d = 0; d < ndims[2]; ++d) n *= shapes[2][d];
  if (Is(dtypes[0], "float32")) {
    AddAll<float>(params, n);
  } else if (Is(dtypes[0], "float64")) {
    AddAll<double>(params, n);
  } else if (Is(dtypes[0], "int32")) {
    AddAll<int32_t>(params, n);
  } else {
    return 2;
  }
  return 0;
}

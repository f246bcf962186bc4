// Kernels for opjit.torch's semantics tests (tests/python/test_torch_semantics.py):
// tanh, exp and cube whose backwards read a saved *output*, a mul whose
// second input broadcasts, each with its bprop and the bprop's own bprop, so
// double backward runs through registered ops only. float32 and float64
// rows: each entry picks its element type from dtypes[0].
//
// The bprops follow the MindSpore convention (params = inputs, then
// outputs); the JSON specs name their inputs with backward.inputs.
#include <cstdint>
#include <cmath>
#include <cstring>

namespace {

int64_t Numel(const int* ndims, int64_t** shapes, int i) {
  int64_t n = 1;
  for (int d = 0; d < ndims[i]; ++d) n *= shapes[i][d];
  return n;
}

bool IsF64(const char** dtypes) { return std::strcmp(dtypes[0], "float64") == 0; }

template <typename T>
T* P(void** params, int i) {
  return static_cast<T*>(params[i]);
}

// Runs body<T>(n) for the call's element type.
#define SEM_DISPATCH(BODY)                                     \
  if (IsF64(dtypes)) {                                         \
    BODY(double);                                              \
  } else {                                                     \
    BODY(float);                                               \
  }                                                            \
  return 0

}  // namespace

// ---- tanh: y = tanh(x); saves y -------------------------------------------------------

extern "C" int SemTanh(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                       void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 2) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T) for (int64_t i = 0; i < n; ++i) P<T>(params, 1)[i] = std::tanh(P<T>(params, 0)[i])
  SEM_DISPATCH(BODY);
#undef BODY
}

// (y, dy) -> dx = dy * (1 - y^2)
extern "C" int SemTanhGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T)                                                    \
  for (int64_t i = 0; i < n; ++i) {                                \
    const T y = P<T>(params, 0)[i];                                \
    P<T>(params, 2)[i] = P<T>(params, 1)[i] * (T(1) - y * y);      \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// (y, dy, g) -> (gy, gdy) = (-2 y dy g, (1 - y^2) g)
extern "C" int SemTanhGradGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T)                                                     \
  for (int64_t i = 0; i < n; ++i) {                                 \
    const T y = P<T>(params, 0)[i], dy = P<T>(params, 1)[i];        \
    const T g = P<T>(params, 2)[i];                                 \
    P<T>(params, 3)[i] = T(-2) * y * dy * g;                        \
    P<T>(params, 4)[i] = (T(1) - y * y) * g;                        \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// ---- exp: y = exp(x); saves y ---------------------------------------------------------

extern "C" int SemExp(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                      void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 2) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T) for (int64_t i = 0; i < n; ++i) P<T>(params, 1)[i] = std::exp(P<T>(params, 0)[i])
  SEM_DISPATCH(BODY);
#undef BODY
}

// (y, dy) -> dx = dy * y. The same product is its own bprop's core:
// (y, dy, g) -> (gy, gdy) = (dy g, y g).
extern "C" int SemExpGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T) \
  for (int64_t i = 0; i < n; ++i) P<T>(params, 2)[i] = P<T>(params, 1)[i] * P<T>(params, 0)[i]
  SEM_DISPATCH(BODY);
#undef BODY
}

extern "C" int SemExpGradGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                              const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T)                                                  \
  for (int64_t i = 0; i < n; ++i) {                              \
    const T g = P<T>(params, 2)[i];                              \
    P<T>(params, 3)[i] = P<T>(params, 1)[i] * g;                 \
    P<T>(params, 4)[i] = P<T>(params, 0)[i] * g;                 \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// ---- cube: (y, d) = (x^3, 3 x^2); saves x and the output d ----------------------------
// (torch's autograd_function_db pattern: backward reads a saved output.)

extern "C" int SemCube(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                       void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T)                                  \
  for (int64_t i = 0; i < n; ++i) {              \
    const T x = P<T>(params, 0)[i];              \
    P<T>(params, 1)[i] = x * x * x;              \
    P<T>(params, 2)[i] = T(3) * x * x;           \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// (x, d, dy, dd) -> dx = dy d + 6 x dd
extern "C" int SemCubeGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T)                                                                   \
  for (int64_t i = 0; i < n; ++i) {                                               \
    P<T>(params, 4)[i] = P<T>(params, 2)[i] * P<T>(params, 1)[i] +                \
                         T(6) * P<T>(params, 0)[i] * P<T>(params, 3)[i];          \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// (x, d, dy, dd, g) -> (gx, gd, gdy, gdd) = (6 dd g, dy g, d g, 6 x g)
extern "C" int SemCubeGradGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 9) return 1;
  const int64_t n = Numel(ndims, shapes, 0);
#define BODY(T)                                                        \
  for (int64_t i = 0; i < n; ++i) {                                    \
    const T x = P<T>(params, 0)[i], d = P<T>(params, 1)[i];            \
    const T dy = P<T>(params, 2)[i], dd = P<T>(params, 3)[i];          \
    const T g = P<T>(params, 4)[i];                                    \
    P<T>(params, 5)[i] = T(6) * dd * g;                                \
    P<T>(params, 6)[i] = dy * g;                                       \
    P<T>(params, 7)[i] = d * g;                                        \
    P<T>(params, 8)[i] = T(6) * x * g;                                 \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// ---- bmul: z = a * b, b broadcast along a's leading axes (b's shape a suffix of a's) --
// Elementwise, so it may write z over a (an in-place op: z aliases a).

extern "C" int SemBmul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                       void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return 1;
  const int64_t n = Numel(ndims, shapes, 0), nb = Numel(ndims, shapes, 1);
  if (nb == 0 || n % nb != 0) return 2;
#define BODY(T) \
  for (int64_t i = 0; i < n; ++i) P<T>(params, 2)[i] = P<T>(params, 0)[i] * P<T>(params, 1)[i % nb]
  SEM_DISPATCH(BODY);
#undef BODY
}

// (a, b, dz) -> (da, db_full) = (dz b, dz a): db comes back at a's shape, for
// the caller to sum to b's (torch's sum_to, MindSpore's auto_reduce).
extern "C" int SemBmulGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 5) return 1;
  const int64_t n = Numel(ndims, shapes, 0), nb = Numel(ndims, shapes, 1);
  if (nb == 0 || n % nb != 0) return 2;
#define BODY(T)                                                           \
  for (int64_t i = 0; i < n; ++i) {                                       \
    const T dz = P<T>(params, 2)[i];                                      \
    P<T>(params, 3)[i] = dz * P<T>(params, 1)[i % nb];                    \
    P<T>(params, 4)[i] = dz * P<T>(params, 0)[i];                         \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

// (a, b, dz, gda, gdb) -> (ga, gb_full, gdz) = (dz gdb, dz gda, b gda + a gdb)
extern "C" int SemBmulGradGrad(int nparam, void** params, int* ndims, int64_t** shapes,
                               const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 8) return 1;
  const int64_t n = Numel(ndims, shapes, 0), nb = Numel(ndims, shapes, 1);
  if (nb == 0 || n % nb != 0) return 2;
#define BODY(T)                                                           \
  for (int64_t i = 0; i < n; ++i) {                                       \
    const T a = P<T>(params, 0)[i], b = P<T>(params, 1)[i % nb];          \
    const T dz = P<T>(params, 2)[i];                                      \
    const T gda = P<T>(params, 3)[i], gdb = P<T>(params, 4)[i];           \
    P<T>(params, 5)[i] = dz * gdb;                                        \
    P<T>(params, 6)[i] = dz * gda;                                        \
    P<T>(params, 7)[i] = b * gda + a * gdb;                               \
  }
  SEM_DISPATCH(BODY);
#undef BODY
}

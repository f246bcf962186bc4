// opjit/vmath.h: element-wise math over arrays through glibc's vector math
// library (libmvec), for the functions clang cannot vectorize by itself.
//
// opjit compiles kernels with -fveclib=libmvec, so a plain loop over
// std::exp, std::log, std::sin, std::cos or std::pow already becomes
// libmvec calls. clang 16's table stops there: a loop over std::tanh (or
// sinh, erf, expm1, ...) stays one scalar call per element, several times
// slower than the vector code PyTorch runs. These functions call libmvec's
// vector variants directly, a full vector at a time, with a padded vector for
// the tail:
//
//   #include "opjit/vmath.h"
//   opjit::vmath::Tanh(x, y, n);      // y[i] = tanh(x[i]); x == y is fine
//
// Accuracy is libmvec's (glibc's manual lists each function's bound; 4 ULPs
// or better for these), special values (NaN, +-Inf, +-0) as the scalar
// functions give them. The vector width follows the compile target
// (opjit uses -march=native): AVX-512, AVX2, AVX or SSE2. Elsewhere (not
// x86-64) the functions are plain loops over <cmath>. Needs glibc 2.35 or
// later; opjit's kernel hosts load libmvec.so.1 for the symbols.
#ifndef OPJIT_VMATH_H_
#define OPJIT_VMATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace opjit {
namespace vmath {
namespace detail {

#if defined(__x86_64__) && defined(__AVX512F__)
constexpr int kFloatLanes = 16, kDoubleLanes = 8;
#define OPJIT_VMATH_F(fn) _ZGVeN16v_##fn##f
#define OPJIT_VMATH_D(fn) _ZGVeN8v_##fn
#elif defined(__x86_64__) && defined(__AVX2__)
constexpr int kFloatLanes = 8, kDoubleLanes = 4;
#define OPJIT_VMATH_F(fn) _ZGVdN8v_##fn##f
#define OPJIT_VMATH_D(fn) _ZGVdN4v_##fn
#elif defined(__x86_64__) && defined(__AVX__)
constexpr int kFloatLanes = 8, kDoubleLanes = 4;
#define OPJIT_VMATH_F(fn) _ZGVcN8v_##fn##f
#define OPJIT_VMATH_D(fn) _ZGVcN4v_##fn
#elif defined(__x86_64__)
constexpr int kFloatLanes = 4, kDoubleLanes = 2;
#define OPJIT_VMATH_F(fn) _ZGVbN4v_##fn##f
#define OPJIT_VMATH_D(fn) _ZGVbN2v_##fn
#endif

#if defined(OPJIT_VMATH_F)
// GCC/clang vector types: passed in one vector register, as libmvec's
// vector function ABI expects, with no intrinsics header to parse.
typedef float VecF __attribute__((vector_size(kFloatLanes * sizeof(float))));
typedef double VecD __attribute__((vector_size(kDoubleLanes * sizeof(double))));

// Applies a vector function to n elements: whole vectors straight from and
// to memory (memcpy, so no alignment is assumed), the tail through a
// zero-padded vector.
template <typename T, typename Vec, int kLanes>
inline void Apply(Vec (*fn)(Vec), const T* x, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec v;
    std::memcpy(&v, x + i, sizeof v);
    v = fn(v);
    std::memcpy(y + i, &v, sizeof v);
  }
  if (i < n) {
    Vec v = {};
    std::memcpy(&v, x + i, (n - i) * sizeof(T));
    v = fn(v);
    std::memcpy(y + i, &v, (n - i) * sizeof(T));
  }
}
#endif

}  // namespace detail

// y[i] = f(x[i]) for i in [0, n), float or double; x may equal y.
#define OPJIT_VMATH_FUNCTIONS(X)                                                 \
  X(Tanh, tanh) X(Sinh, sinh) X(Cosh, cosh) X(Asinh, asinh) X(Acosh, acosh)      \
  X(Atanh, atanh) X(Tan, tan) X(Asin, asin) X(Acos, acos) X(Atan, atan)          \
  X(Erf, erf) X(Erfc, erfc) X(Expm1, expm1) X(Log1p, log1p) X(Exp2, exp2)        \
  X(Log2, log2) X(Log10, log10) X(Cbrt, cbrt) X(Exp, exp) X(Log, log)            \
  X(Sin, sin) X(Cos, cos)

}  // namespace vmath
}  // namespace opjit

#if defined(OPJIT_VMATH_F)
// libmvec's vector variants (glibc's vector function ABI names).
#define OPJIT_VMATH_DECLARE(Name, fn)                                              \
  extern "C" opjit::vmath::detail::VecF OPJIT_VMATH_F(fn)(opjit::vmath::detail::VecF); \
  extern "C" opjit::vmath::detail::VecD OPJIT_VMATH_D(fn)(opjit::vmath::detail::VecD);
OPJIT_VMATH_FUNCTIONS(OPJIT_VMATH_DECLARE)
#undef OPJIT_VMATH_DECLARE
#define OPJIT_VMATH_DEFINE(Name, fn)                                                         \
  inline void Name(const float* x, float* y, int64_t n) {                                    \
    detail::Apply<float, detail::VecF, detail::kFloatLanes>(OPJIT_VMATH_F(fn), x, y, n);     \
  }                                                                                          \
  inline void Name(const double* x, double* y, int64_t n) {                                  \
    detail::Apply<double, detail::VecD, detail::kDoubleLanes>(OPJIT_VMATH_D(fn), x, y, n);   \
  }
#else
#define OPJIT_VMATH_DEFINE(Name, fn)                                          \
  inline void Name(const float* x, float* y, int64_t n) {                     \
    for (int64_t i = 0; i < n; ++i) y[i] = std::fn(x[i]);                     \
  }                                                                           \
  inline void Name(const double* x, double* y, int64_t n) {                   \
    for (int64_t i = 0; i < n; ++i) y[i] = std::fn(x[i]);                     \
  }
#endif

namespace opjit {
namespace vmath {
OPJIT_VMATH_FUNCTIONS(OPJIT_VMATH_DEFINE)
}  // namespace vmath
}  // namespace opjit

#undef OPJIT_VMATH_DEFINE
#undef OPJIT_VMATH_FUNCTIONS
#undef OPJIT_VMATH_F
#undef OPJIT_VMATH_D

#endif  // OPJIT_VMATH_H_

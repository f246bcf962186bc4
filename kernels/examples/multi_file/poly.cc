// poly: y = a*x^2 + b*x + c, a kernel of several files (issue 29 item 6).
// Its coefficients live in its own header, poly_coeffs.h; the evaluation in
// an extra translation unit, poly_eval.cc, declared by detail/eval.h. The
// spec, poly.json, lists both beside the source ("files"); the compiler sees
// them in memory, for this op's compile only.
#include <cstdint>

#include "detail/eval.h"
#include "poly_coeffs.h"

extern "C" int Poly(int nparam, void** params, int* ndims, int64_t** shapes,
                    const char** dtypes, void* stream, void* extra) {
  (void)nparam, (void)dtypes, (void)stream, (void)extra;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = poly_example::Eval(x[i]) + kPolyBias;
  return 0;
}

// poly's evaluation, compiled beside poly.cc and linked into its object.
#include "detail/eval.h"
#include "poly_coeffs.h"

namespace poly_example {
float Eval(float x) { return (kPolyA * x + kPolyB) * x + kPolyC; }
}  // namespace poly_example

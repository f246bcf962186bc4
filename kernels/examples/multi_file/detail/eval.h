// Declared here, defined in poly_eval.cc (a second translation unit).
#pragma once

namespace poly_example {
float Eval(float x);
}  // namespace poly_example

"""Vector math in kernels (issue 30 goal 8): with -fno-math-errno (or
-ffast-math) a loop over expf vectorizes to glibc's libmvec, the daemon's
registration check and the sandboxed executor both resolve its _ZGV*
functions, and the results stay within libmvec's few ULP of numpy's exp.
For the functions clang 16 does not vectorize itself (tanh, erf, expm1,
...), kernels/include/opjit/vmath.h calls libmvec's vector variants
directly: every one of them is checked here against numpy, in float32 and
float64, on a vector's worth of elements and a tail, with NaN, +-Inf and
+-0."""

import numpy as np
import pytest

import opjit

F32 = opjit.DataType.F32_Default

EXP = r"""
#include <cmath>
#include <cstdint>
extern "C" int VmExp(int nparam, void** params, int* ndims, int64_t** shapes,
                     const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
  return 0;
}
"""


@pytest.fixture
def client(daemon):
    with opjit.Client(daemon.unix_address, namespace="vecmath", timeout=120) as c:
        yield c


@pytest.mark.parametrize("options", [["-fno-math-errno"], ["-ffast-math"], []])
def test_exp_kernel_agrees_with_numpy_within_4_ulp(client, options):
    name = "vm_exp_" + "_".join(o.strip("-").replace("-", "_") for o in options)
    client.register(opjit.CustomRegOp(name).input(0, "x").output(0, "y").dtype_format(F32, F32)
                    .target("CPU").impl(source=EXP, entry="VmExp", compile_options=options)
                    .output_rule("same_as", input=0))
    x = np.linspace(-80.0, 80.0, 100_003, dtype=np.float32)  # odd: a scalar tail too
    y = client.op(name)(x)
    want = np.exp(x.astype(np.float64)).astype(np.float32)
    ulps = np.abs(y.astype(np.float64) - want) / np.spacing(np.abs(want)).astype(np.float64)
    assert float(np.max(ulps)) <= 4.0, (options, float(np.max(ulps)))


VMATH = r"""
#include <cstdint>
#include <cstring>
#include "opjit/vmath.h"
extern "C" int Vm(int nparam, void** params, int* ndims, int64_t** shapes,
                  const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  if (std::strcmp(dtypes[0], "float64") == 0) {
    opjit::vmath::NAME(static_cast<const double*>(params[0]), static_cast<double*>(params[1]), n);
  } else {
    opjit::vmath::NAME(static_cast<const float*>(params[0]), static_cast<float*>(params[1]), n);
  }
  return 0;
}
"""

F64 = opjit.DataType.F64_Default

# opjit::vmath name -> (numpy function, the domain sampled)
VMATH_FUNCTIONS = {
    "Tanh": (np.tanh, (-12, 12)), "Sinh": (np.sinh, (-80, 80)), "Cosh": (np.cosh, (-80, 80)),
    "Asinh": (np.arcsinh, (-1e6, 1e6)), "Acosh": (np.arccosh, (1, 1e6)),
    "Atanh": (np.arctanh, (-0.999, 0.999)), "Tan": (np.tan, (-3, 3)),
    "Asin": (np.arcsin, (-1, 1)), "Acos": (np.arccos, (-1, 1)), "Atan": (np.arctan, (-1e4, 1e4)),
    "Erf": (None, (-5, 5)), "Erfc": (None, (-5, 9)), "Expm1": (np.expm1, (-20, 80)),
    "Log1p": (np.log1p, (-0.999, 1e6)), "Exp2": (np.exp2, (-120, 120)), "Log2": (np.log2, (1e-30, 1e30)),
    "Log10": (np.log10, (1e-30, 1e30)), "Cbrt": (np.cbrt, (-1e6, 1e6)), "Exp": (np.exp, (-80, 80)),
    "Log": (np.log, (1e-30, 1e30)), "Sin": (np.sin, (-100, 100)), "Cos": (np.cos, (-100, 100)),
}


def _reference(name, x):
    fn = VMATH_FUNCTIONS[name][0]
    if fn is not None:
        with np.errstate(all="ignore"):
            return fn(x)
    import math
    f = math.erf if name == "Erf" else math.erfc
    return np.array([f(v) if not np.isnan(v) else np.nan for v in x.tolist()], dtype=np.float64)


def _ulps(got, want, dtype):
    want = want.astype(dtype).astype(np.float64)
    got = got.astype(np.float64)
    finite = np.isfinite(want) & np.isfinite(got)
    spacing = np.spacing(np.abs(want[finite]).astype(dtype)).astype(np.float64)
    return np.abs(got[finite] - want[finite]) / spacing


@pytest.mark.parametrize("name", sorted(VMATH_FUNCTIONS))
def test_vmath_function_agrees_with_numpy(client, name):
    op = "vmath_" + name.lower()
    client.register(opjit.CustomRegOp(op).input(0, "x").output(0, "y")
                    .dtype_format(F32, F32).dtype_format(F64, F64).target("CPU")
                    .impl(source=VMATH.replace("NAME", name), entry="Vm")
                    .output_rule("same_as", input=0))
    lo, hi = VMATH_FUNCTIONS[name][1]
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    for dtype, bound in ((np.float32, 4.0), (np.float64, 4.0)):
        # 1,003 values: whole vectors for every width and a tail; the
        # special values sit at the front and in the tail.
        x = np.concatenate([special, np.linspace(lo, hi, 993), special]).astype(dtype)
        got = client.op(op)(x)
        assert got.dtype == dtype
        want = _reference(name, x.astype(np.float64))
        with np.errstate(invalid="ignore", over="ignore"):
            want_t = want.astype(dtype)
        # NaN, +-Inf where the reference has them, in the same places
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want_t), err_msg=name)
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want_t), err_msg=name)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want_t), err_msg=name)
        # +-0 keeps its sign where the function maps 0 to 0
        zeros = (x == 0) & (want_t == 0)
        np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(want_t[zeros]),
                                      err_msg=name)
        worst = float(np.max(_ulps(got, want, dtype)))
        assert worst <= bound, (name, dtype.__name__, worst)

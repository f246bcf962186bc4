"""Vector math in kernels (issue 30 goal 8): with -fno-math-errno (or
-ffast-math) a loop over expf vectorizes to glibc's libmvec, the daemon's
registration check and the sandboxed executor both resolve its _ZGV*
functions, and the results stay within libmvec's few ULP of numpy's exp."""

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

"""MindSpore registrations as written (issue 29 item 1).

The registrations and calls of MindSpore's aot custom-op tests, the way a
porting user writes them with opjit's CustomRegOp: attrs passed positionally
after the inputs, an unnamed CustomRegOp() that takes its name from the
kernel's entry, an attr-only reg_info merged with the op's inputs and
outputs, and DataType.None_None rows (any dtype: the kernel checks).

The kernels here are written for these tests (in opjit's aot ABI, which is
MindSpore's); the expected values are MindSpore's: x + y * 0.7 * 2 + 4 for an
add with scale 0.7 and paddings [2.0, 2.0].
"""

import warnings

import numpy as np
import pytest

import opjit
from opjit.regop import CustomRegOp, DataType

# y = x1 + x2 * scale * paddings[0] + paddings[0] + paddings[1], float32 only:
# any other dtype is the kernel's own error (code 2).
ADD_WITH_ATTRS = r"""
#include <cstdint>
#include <cstring>
#include <vector>
#include "custom_aot_extra.h"

extern "C" int AddWithAttrs(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra) {
  (void)stream;
  if (nparam != 3) return 1;
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 2;
  }
  AotExtra* e = static_cast<AotExtra*>(extra);
  const float scale = e->Attr<float>("scale");
  const std::vector<float> pad = e->Attr<std::vector<float>>("paddings");
  if (pad.size() != 2) return 3;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* a = static_cast<const float*>(params[0]);
  const float* b = static_cast<const float*>(params[1]);
  float* y = static_cast<float*>(params[2]);
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i] * scale * pad[0] + pad[0] + pad[1];
  return 0;
}
"""

# y = x1 + x2 for float32, float64 and int32 (the kernel checks: 2 otherwise),
# named as MindSpore's add.cc names its entry.
CUSTOM_ADD = r"""
#include <cstdint>
#include <cstring>

template <typename T>
static void Add(void** p, int64_t n) {
  const T* a = static_cast<const T*>(p[0]);
  const T* b = static_cast<const T*>(p[1]);
  T* y = static_cast<T*>(p[2]);
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

extern "C" int CustomAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  (void)stream, (void)extra;
  if (nparam != 3) return 1;
  if (std::strcmp(dtypes[0], dtypes[1]) != 0 || std::strcmp(dtypes[0], dtypes[2]) != 0) return 2;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  if (std::strcmp(dtypes[0], "float32") == 0) Add<float>(params, n);
  else if (std::strcmp(dtypes[0], "float64") == 0) Add<double>(params, n);
  else if (std::strcmp(dtypes[0], "int32") == 0) Add<int32_t>(params, n);
  else return 2;
  return 0;
}
"""

F32 = DataType.F32_Default
SHAPE = (4, 5)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 1, SHAPE).astype(np.float32),
            rng.normal(0, 1, SHAPE).astype(np.float32))


def add_with_attrs_info(name):
    """add_with_attr's registration, with float32 rows (the None_None rows are tested below)."""
    return (CustomRegOp(name)
            .input(0, "x1").input(1, "x2").output(0, "y")
            .dtype_format(F32, F32, F32)
            .attr("scale", "required", "float")
            .attr("paddings", "required", "all", value=[2.0, 2.0])
            .target("CPU").impl(source=ADD_WITH_ATTRS, entry="AddWithAttrs"))


# --- (a) attrs positionally after the inputs ------------------------------------------------

def test_attrs_positionally_after_the_inputs(client):
    client.register(add_with_attrs_info("msr_pos_attrs"))
    program = client.op("msr_pos_attrs")
    x, y = inputs()
    expect = x + y * 0.7 * 2 + 4
    # MindSpore's AOTSingleOutputWithAttrNet: self.program(x, y, 0.7)
    np.testing.assert_allclose(program(x, y, 0.7), expect, rtol=1e-5, atol=1e-5)
    # Keyword attrs keep working; positional and keyword attrs mix.
    np.testing.assert_allclose(program(x, y, scale=0.7), expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(program(x, y, 0.7, paddings=[1.0, 0.0]),
                               x + y * 0.7 + 1, rtol=1e-5, atol=1e-5)
    # Every attr positionally, in declaration order (scale, paddings).
    np.testing.assert_allclose(program(x, y, 0.5, [1.0, 1.0]), x + y * 0.5 + 2,
                               rtol=1e-5, atol=1e-5)
    # Positional attrs go through Tensors and requires_grad the same way.
    t = program(opjit.tensor(x), y, 0.7)
    np.testing.assert_allclose(t.data, expect,
                               rtol=1e-5, atol=1e-5)


def test_too_many_positionals_is_a_type_error_naming_the_counts(client):
    client.register(add_with_attrs_info("msr_pos_many"))
    program = client.op("msr_pos_many")
    x, y = inputs()
    with pytest.raises(TypeError) as e:
        program(x, y, 0.7, [2.0, 2.0], 3)
    assert isinstance(e.value, opjit.InvalidArgument)  # one except clause still covers it
    assert e.value.message == (
        "op msr_pos_many takes 2 input(s) (x1, x2) and 2 attr(s) (scale, paddings) "
        "positionally: at most 4 positional arguments, got 5")
    # An attr given both ways is refused, not silently picked.
    with pytest.raises(TypeError, match="attr scale of op msr_pos_many given twice"):
        program(x, y, 0.7, scale=0.5)
    with pytest.raises(TypeError, match="attr scale of op msr_pos_many given twice"):
        program(x, y, 0.7, attrs={"scale": 0.5})


def test_too_many_positionals_without_attrs(client):
    spec = {"name": "msr_pos_noattr", "inputs": [{"index": 0, "name": "x"}],
            "outputs": [{"index": 0, "name": "y"}],
            "dtype_formats": [{"dtypes": ["float32", "float32"]}],
            "implementations": [{"target": "CPU", "source": CUSTOM_ADD.replace(
                "if (nparam != 3) return 1;", "return 0;"), "entry": "CustomAdd"}]}
    client.register(spec)
    x, _ = inputs()
    with pytest.raises(TypeError) as e:
        client.op("msr_pos_noattr")(x, x)
    assert e.value.message == ("op msr_pos_noattr takes 1 input(s) (x) and 0 attr(s) (-) "
                               "positionally: at most 1 positional arguments, got 2")

"""InferShape without a rule (issue 29 item 2), the MindSpore way: a reg_info without
output rules (MindSpore's out_shape=None) and a kernel that exports <entry>InferShape gets
the kernel's shape; with neither, registration warns which rule is assumed."""

import warnings

import numpy as np
import pytest

from opjit.client import OpjitWarning
from opjit.regop import CustomRegOp, DataType

F32 = DataType.F32_Default

# A reduce over attr `axis` written as a MindSpore aot kernel: the entry, and an
# InferShape that drops the reduced dim (for (4, 5) and axis 1: (4,)).
REDUCE = r'''
#include <cstdint>
#include <vector>
#include "custom_aot_extra.h"

extern "C" std::vector<int64_t> IsrReduceInferShape(int* ndims, int64_t** shapes,
                                                    AotExtra* extra) {
  const int64_t axis = extra->Attr<int64_t>("axis");
  std::vector<int64_t> out;
  for (int d = 0; d < ndims[0]; ++d) {
    if (d != axis) out.push_back(shapes[0][d]);
  }
  return out;
}

extern "C" int IsrReduce(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra_ptr) {
  AotExtra* extra = static_cast<AotExtra*>(extra_ptr);
  const int64_t axis = extra->Attr<int64_t>("axis");
  if (ndims[0] != 2 || axis < 0 || axis > 1) return 1;
  const int64_t rows = shapes[0][0], cols = shapes[0][1];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  const int64_t n = axis == 0 ? cols : rows;
  for (int64_t i = 0; i < n; ++i) y[i] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[axis == 0 ? c : r] += x[r * cols + c];
  }
  return 0;
}
'''

# Elementwise y = x + 1, no InferShape.
PLUS_ONE = r'''
#include <cstdint>
extern "C" int IsrPlusOne(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int d = 0; d < ndims[0]; ++d) n *= shapes[0][d];
  for (int64_t i = 0; i < n; ++i)
    static_cast<float*>(params[1])[i] = static_cast<const float*>(params[0])[i] + 1;
  return 0;
}
'''

X = np.arange(20, dtype=np.float32).reshape(4, 5)


def test_no_output_rule_and_an_infer_shape_uses_the_kernels_shape(client):
    reduce_cpu_info = (CustomRegOp("isr_reduce").input(0, "x").output(0, "y")
                       .attr("axis", "required", "int")
                       .dtype_format(F32, F32).target("CPU")
                       .impl(source=REDUCE, entry="IsrReduce").get_op_info())
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpjitWarning)  # nothing to warn about
        r = client.register(reduce_cpu_info)
    assert list(r.warnings) == []
    # The decision is stored with the op: one infer_shape rule per output.
    assert [rule.kind for rule in client.describe("isr_reduce").op.output_rules] == ["infer_shape"]
    y = client.op("isr_reduce")(X, axis=1)
    assert y.shape == (4,)
    np.testing.assert_allclose(y, X.sum(axis=1))
    y0 = client.op("isr_reduce")(X, axis=0)
    assert y0.shape == (5,)
    np.testing.assert_allclose(y0, X.sum(axis=0))
    # Registering it again is the same version.
    assert not client.register(reduce_cpu_info).created


def test_neither_rule_nor_infer_shape_warns_and_takes_input_0(client):
    info = (CustomRegOp("isr_plus_one").input(0, "x").output(0, "y")
            .dtype_format(F32, F32).target("CPU").impl(source=PLUS_ONE, entry="IsrPlusOne"))
    want = ('output_rules: none given, and the CPU kernel exports no "IsrPlusOneInferShape", '
            'so every output takes the shape of input 0 ("x") and its dtype from dtype_formats; '
            'give output_rules to say so (e.g. [{"kind": "same_as", "input": 0}])')
    with pytest.warns(OpjitWarning) as caught:
        r = client.register(info)
    assert list(r.warnings) == [want]
    assert [str(w.message) for w in caught] == ["register default/isr_plus_one: " + want]
    assert list(client.describe("isr_plus_one").warnings) == [want]
    assert list(client.describe("isr_plus_one").op.output_rules) == []
    y = client.op("isr_plus_one")(X)
    assert y.shape == (4, 5)
    np.testing.assert_allclose(y, X + 1)


def test_an_explicit_rule_is_kept_and_wins_over_infer_shape(client):
    info = (CustomRegOp("isr_reduce_ruled").input(0, "x").output(0, "y")
            .attr("axis", "required", "int").output_rule("same_as", input=0)
            .dtype_format(F32, F32).target("CPU").impl(source=REDUCE, entry="IsrReduce"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpjitWarning)
        r = client.register(info)
    assert list(r.warnings) == []
    assert [rule.kind for rule in client.describe("isr_reduce_ruled").op.output_rules] == ["same_as"]
    assert client.op("isr_reduce_ruled")(X, axis=1).shape == (4, 5)

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


# --- (b) an unnamed CustomRegOp() takes its name from the kernel's entry -------------------

def add_cpu_info_f32():
    """MindSpore's add_cpu_info (unnamed), with float32 rows."""
    return (CustomRegOp()
            .input(0, "x1")
            .input(1, "x2")
            .output(0, "y")
            .dtype_format(F32, F32, F32)
            .target("CPU"))


def test_unnamed_op_takes_its_entry_name(client):
    info = add_cpu_info_f32().impl(source=CUSTOM_ADD, entry="CustomAdd")
    assert "name" not in info.get_op_info()  # named when registered
    r = client.register(info)
    assert r.record.op.name == "CustomAdd"
    x, y = inputs()
    np.testing.assert_allclose(client.op("CustomAdd")(x, y), x + y, rtol=1e-6)
    # The same for a dict from get_op_info() and for CustomRegOp(op_name="Custom").
    info = (CustomRegOp(op_name="Custom").input(0, "x1").input(1, "x2").output(0, "y")
            .dtype_format(F32, F32, F32).target("CPU")
            .impl(source=CUSTOM_ADD, entry="CustomAdd"))
    assert client.register(info.get_op_info()).record.op.name == "CustomAdd"
    # The same entry on two targets is one name.
    info = (add_cpu_info_f32().impl(source=CUSTOM_ADD, entry="CustomAdd")
            .target("GPU").impl(source="__global__ void k() {}", entry="CustomAdd"))
    assert opjit.load_spec(info).name == "CustomAdd"


def test_explicit_name_at_register(client):
    info = add_cpu_info_f32().impl(source=CUSTOM_ADD, entry="CustomAdd")
    r = client.register(info, name="msr_named_add")
    assert r.record.op.name == "msr_named_add"
    r = client.register(info, name="msr_team/msr_named_add")
    assert (r.record.op.namespace, r.record.op.name) == ("msr_team", "msr_named_add")
    # name= wins over the info's own name too.
    named = add_with_attrs_info("msr_info_name")
    assert client.register(named, name="msr_renamed").record.op.name == "msr_renamed"


def test_unnamed_without_an_entry_is_refused_clearly(client):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(add_cpu_info_f32())
    assert e.value.message == (
        'CustomRegOp: the op has no name, and it has no implementation entry to take it from. '
        'An unnamed CustomRegOp() ("Custom" is MindSpore\'s placeholder) takes the name of its '
        'implementation\'s entry, as MindSpore names a Custom op after its function; name it: '
        'CustomRegOp("my_op") or client.register(info, name="my_op")')
    two = (add_cpu_info_f32().impl(source=CUSTOM_ADD, entry="CustomAdd")
           .target("GPU").impl(source="__global__ void k() {}", entry="CustomAddGpu"))
    with pytest.raises(opjit.InvalidArgument,
                       match=r"its implementations name different entries \(CustomAdd, "
                             r"CustomAddGpu\)"):
        client.register(two)
    with pytest.raises(opjit.NotFound):
        client.describe("Custom")


# --- (c) an attr-only reg_info merges with the op's inputs and outputs ---------------------

def add_cpu_info_attr_only():
    """MindSpore's add_cpu_info_attr_only, as written."""
    return (CustomRegOp("add_with_attr_kernel_cpu_2")
            .attr("scale", "required", "float", value=0.7)
            .attr("paddings", "required", "all", value=[2.0, 2.0])
            .target("CPU")
            .get_op_info())


def test_attr_only_info_merges_with_the_inputs_and_outputs(client):
    impl = CustomRegOp().target("CPU").impl(source=ADD_WITH_ATTRS, entry="AddWithAttrs")
    r = client.register([add_cpu_info_f32().get_op_info(), add_cpu_info_attr_only(), impl])
    op = r.record.op
    assert op.name == "add_with_attr_kernel_cpu_2"  # the name the attr-only info gives
    assert [p.name for p in op.inputs] == ["x1", "x2"]
    assert [a.name for a in op.attrs] == ["scale", "paddings"]
    assert [a.default_value for a in op.attrs] == ["0.7", "[2.0, 2.0]"]
    # MindSpore's aot_single_output_with_attr_only: self.program(x, y), attrs from value=.
    program = client.op("add_with_attr_kernel_cpu_2")
    x, y = inputs()
    np.testing.assert_allclose(program(x, y), x + y * 0.7 * 2 + 4, rtol=1e-5, atol=1e-5)
    # A tuple works too, with the impl in the io info.
    io = add_cpu_info_f32().impl(source=ADD_WITH_ATTRS, entry="AddWithAttrs")
    r = client.register((io, add_cpu_info_attr_only()), name="msr_merged_tuple")
    assert [a.name for a in r.record.op.attrs] == ["scale", "paddings"]


def test_attr_only_info_alone_says_to_merge(client):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(add_cpu_info_attr_only())
    assert e.value.reason == "INVALID_SPEC"
    assert e.value.message.startswith("outputs: an op needs at least one output")
    assert "client.register([io_info, attr_info])" in e.value.message


def test_merge_conflicts_are_refused(client):
    io = add_cpu_info_f32().impl(source=ADD_WITH_ATTRS, entry="AddWithAttrs")
    other_io = CustomRegOp().input(0, "a").output(0, "b").dtype_format(F32, F32)
    with pytest.raises(opjit.InvalidArgument,
                       match=r"reg_info\[0\] and reg_info\[1\] both declare the op's inputs"):
        client.register([io, other_io])
    # The same io twice is fine (a CPU and a GPU info, as MindSpore lists them).
    op = opjit.load_spec([io, add_cpu_info_f32()])
    assert len(op.inputs) == 2 and len(op.dtype_formats) == 1
    clash = CustomRegOp().attr("scale", "required", "int", value=1)
    with pytest.raises(opjit.InvalidArgument,
                       match=r'attr "scale" is declared differently in reg_info\[2\]'):
        client.register([io, add_cpu_info_attr_only(), clash])
    with pytest.raises(opjit.InvalidArgument,
                       match=r'two names, "add_with_attr_kernel_cpu_2" and "other"'):
        client.register([io, add_cpu_info_attr_only(), CustomRegOp("other")])
    with pytest.raises(opjit.InvalidArgument, match="an empty list of infos"):
        client.register([])


# --- (d) DataType.None_None rows: any dtype, the kernel checks --------------------------

# MindSpore's registrations, as written in test_custom_aot.py (only imports differ).
add_cpu_info = CustomRegOp() \
    .input(0, "x1") \
    .input(1, "x2") \
    .output(0, "y") \
    .dtype_format(DataType.None_None, DataType.None_None, DataType.None_None) \
    .target("CPU") \
    .get_op_info()

add_with_attr_cpu_info = CustomRegOp("add_with_attr_kernel_cpu_1") \
    .input(0, "x1") \
    .input(1, "x2") \
    .output(0, "y") \
    .dtype_format(DataType.None_None, DataType.None_None, DataType.None_None) \
    .attr("scale", "required", "float") \
    .attr("paddings", "required", "all", value=[2.0, 2.0]) \
    .target("CPU") \
    .get_op_info()


def cpu_impl(source, entry):
    """What MindSpore's ops.Custom("file.cc:Entry", ...) names: the kernel, for the CPU."""
    return CustomRegOp().target("CPU").impl(source=source, entry=entry)


def test_add_cpu_info_as_written(client):
    # MindSpore: ops.Custom("add.cc:CustomAdd", (shape,), (mstype.float32,), "aot",
    #                       reg_info=add_cpu_info)
    r = client.register([add_cpu_info, cpu_impl(CUSTOM_ADD, "CustomAdd")])
    assert r.record.op.name == "CustomAdd"  # named after the kernel's entry
    assert [list(d.dtypes) for d in r.record.op.dtype_formats] == [["", "", ""]]
    program = client.op("CustomAdd")
    x, y = inputs()
    out = program(x, y)
    assert out.dtype == np.float32 and out.shape == SHAPE
    np.testing.assert_allclose(out, x + y, rtol=1e-3, atol=1e-3)  # MindSpore's tolerance
    # Any dtype: the output takes the first input's; the kernel checks.
    for dt in (np.float64, np.int32):
        a, b = x.astype(dt), y.astype(dt)
        out = program(a, b)
        assert out.dtype == dt
        np.testing.assert_array_equal(out, a + b)
    with pytest.raises(opjit.OpjitError) as e:
        program(x.astype(np.int64), y.astype(np.int64))  # the kernel refuses int64
    assert "CustomAdd" in e.value.message
    with pytest.raises(opjit.OpjitError):
        program(x, y.astype(np.float64))  # mixed: the kernel refuses too


def test_add_with_attr_cpu_info_as_written(client):
    # MindSpore's AOTSingleOutputWithAttrNet: self.program(x, y, 0.7) with
    # add_with_attr_cpu_info (scale has no value; paddings value=[2.0, 2.0]).
    r = client.register([add_with_attr_cpu_info, cpu_impl(ADD_WITH_ATTRS, "AddWithAttrs")])
    assert r.record.op.name == "add_with_attr_kernel_cpu_1"
    program = client.op("add_with_attr_kernel_cpu_1")
    x, y = inputs()
    np.testing.assert_allclose(program(x, y, 0.7), x + y * 0.7 * 2 + 4, rtol=1e-3, atol=1e-3)
    # The kernel checks dtypes: float64 is its own error, not a refused row.
    with pytest.raises(opjit.OpjitError):
        program(x.astype(np.float64), y.astype(np.float64), 0.7)


def test_add_with_attr_only_as_written(client):
    # MindSpore's aot_single_output_with_attr_only: program(x, y), the attrs from the
    # attr-only info, merged with add_cpu_info's inputs and outputs.
    r = client.register([add_cpu_info, add_cpu_info_attr_only(),
                         cpu_impl(ADD_WITH_ATTRS, "AddWithAttrs")])
    assert r.record.op.name == "add_with_attr_kernel_cpu_2"
    x, y = inputs()
    np.testing.assert_allclose(client.op("add_with_attr_kernel_cpu_2")(x, y),
                               x + y * 0.7 * 2 + 4, rtol=1e-3, atol=1e-3)


def test_none_output_takes_the_rule_dtype(client):
    info = (CustomRegOp("msr_none_rule").input(0, "x1").input(1, "x2").output(0, "y")
            .dtype_format(DataType.None_None, DataType.None_None, DataType.None_None)
            .output_rule("same_as", input=0, dtype="float64")
            .target("CPU").impl(source=CUSTOM_ADD, entry="CustomAdd"))
    client.register(info)
    x, y = inputs()
    a, b = x.astype(np.float64), y.astype(np.float64)
    out = client.op("msr_none_rule")(a, b)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, a + b)


# --- reduce.cc: an attr declared "float" read as int64_t, InferShape without a rule ---------
# MindSpore's reduce_cpu_info declares reduce_axis "float" and keep_dim "bool"; its
# kernel reads reduce_axis as int64_t (a whole float converts, as in MindSpore) and
# exports CustomReduceInferShape, which decides the shape since no output rule is given
# (MindSpore's out_shape=None). The kernel is written for this test in the same ABI.
CUSTOM_REDUCE = r"""
#include <cstdint>
#include <cstring>
#include <vector>
#include "custom_aot_extra.h"

extern "C" std::vector<int64_t> CustomReduceInferShape(int* ndims, int64_t** shapes,
                                                       AotExtra* extra) {
  const int64_t axis = extra->Attr<int64_t>("reduce_axis");
  const bool keep_dim = extra->Attr<bool>("keep_dim");
  std::vector<int64_t> out;
  for (int d = 0; d < ndims[0]; ++d) {
    if (d != axis) out.push_back(shapes[0][d]);
    else if (keep_dim) out.push_back(1);
  }
  return out;
}

extern "C" int CustomReduce(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra_ptr) {
  (void)stream;
  AotExtra* extra = static_cast<AotExtra*>(extra_ptr);
  const int64_t axis = extra->Attr<int64_t>("reduce_axis");
  if (nparam != 2 || ndims[0] != 2 || axis < 0 || axis > 1) return 1;
  if (std::strcmp(dtypes[0], "float32") != 0) return 2;
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
"""

reduce_cpu_info = CustomRegOp("reduce_kernel_cpu") \
    .input(0, "x1") \
    .output(0, "y") \
    .dtype_format(DataType.None_None, DataType.None_None) \
    .attr("reduce_axis", "required", "float") \
    .attr("keep_dim", "required", "bool") \
    .target("CPU") \
    .get_op_info()


def test_reduce_as_written(client):
    # MindSpore: ops.Custom("reduce.cc:CustomReduce", out_shape=None, ms.float32, "aot",
    #                       reg_info=reduce_cpu_info); net(x) calls program(x, 1, False).
    r = client.register([reduce_cpu_info, cpu_impl(CUSTOM_REDUCE, "CustomReduce")])
    assert [rule.kind for rule in r.record.op.output_rules] == ["infer_shape"]
    assert not r.warnings
    program = client.op("reduce_kernel_cpu")
    x = np.arange(20, dtype=np.float32).reshape(SHAPE)
    out = program(x, 1, False)
    assert out.shape == (4,)  # MindSpore's shape, not input 0's (4, 5)
    np.testing.assert_allclose(out, np.sum(x, axis=1), rtol=1e-3, atol=1e-3)
    out = program(x, 0.0, True)  # a float axis that is whole reads as 0
    assert out.shape == (1, 5)
    np.testing.assert_allclose(out.reshape(5), np.sum(x, axis=0), rtol=1e-3, atol=1e-3)
    # A float axis that is not whole is the kernel's read error, named.
    with pytest.raises(opjit.InvalidArgument) as e:
        program(x, 0.5, False)
    assert "reduce_axis" in e.value.message and "whole number" in e.value.message

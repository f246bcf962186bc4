"""MindSpore's Custom as written (issue 40 item 3).

MindSpore's aot custom-op tests (tests/st/ops/graph_kernel/custom/
test_custom_aot.py and test_custom_aot_fused.py), written again for opjit in
their shape: nn.Cell nets calling ops.Custom, MindSpore's registrations, calls
and expected values, with only the imports changed from ``mindspore`` to
``opjit.mindspore``. The kernels are opjit's own (kernels/examples/mindspore,
in MindSpore's aot ABI). MindSpore compiles each source to a .so first; opjit
compiles sources itself, and a ``.so`` name maps to its source (beside it, or
through ``opjit.mindspore.sources``). Then MindSpore's bprop rules
(_Function-like: needs_input_grad, non-Tensor and integer outputs,
auto_reduce, auto_cast, ones as the default sensitivity) and the refusals.
"""

import os

import numpy as np
import pytest

import opjit
from conftest import EXAMPLES

# MindSpore's imports, "mindspore" made "opjit.mindspore":
from opjit.mindspore import context, Tensor
from opjit.mindspore.common import dtype as mstype
from opjit.mindspore.nn import Cell
import opjit.mindspore.ops as ops
from opjit.mindspore.ops import DataType, CustomRegOp
from opjit.mindspore.ops.operations import _inner_ops as inner
import opjit.mindspore as ms

AOT_DIR = os.path.join(EXAMPLES, "mindspore")


@pytest.fixture(autouse=True)
def ms_client(client):
    ms.set_client(client)
    yield client
    ms.set_client(None)


# ---- test_custom_aot.py, as MindSpore writes it (with opjit's kernels) ------------------------

class AOTSingleOutputNet(Cell):
    def __init__(self, func, out_shapes, out_types, reg=None):
        super(AOTSingleOutputNet, self).__init__()

        self.program = ops.Custom(func, out_shapes, out_types, "aot", reg_info=reg)

    def construct(self, x, y):
        return self.program(x, y)


class AOTSingleOutputWithAttrNet(Cell):
    def __init__(self, func, out_shapes, out_types, reg=None):
        super(AOTSingleOutputWithAttrNet, self).__init__()

        self.program = ops.Custom(func, out_shapes, out_types, "aot", reg_info=reg)

    def construct(self, x, y):
        return self.program(x, y, 0.7)


class AOTSingleOutputDynNet(Cell):
    def __init__(self, func, out_types, reg=None):
        super(AOTSingleOutputDynNet, self).__init__()

        self.program = ops.Custom(func, None, out_types, "aot", reg_info=reg)
        self.convert_to_dynamic = inner.ConvertToDynamic(
            is_dynamic_rank=True).add_prim_attr("primitive_target", "CPU")

    def construct(self, x, y):
        x = self.convert_to_dynamic(x)
        return self.program(x, y)


def get_file_path_cpu(cc, so):
    # MindSpore runs g++ here to make the .so; opjit maps the .so to its source
    # (add.so -> add.cc beside it) and compiles that itself.
    func_path = AOT_DIR + "/" + so
    return None, func_path


def aot_single_output(get_file_path, source, execf, reg):
    shape = (4, 5)
    input_x = np.random.normal(0, 1, shape).astype(np.float32)
    input_y = np.random.normal(0, 1, shape).astype(np.float32)
    _, func_path = get_file_path(source, execf)
    test = AOTSingleOutputNet(func_path + ":CustomAdd", (shape,), (mstype.float32,), reg)
    output = test(Tensor(input_x), Tensor(input_y))[0]
    assert np.allclose(input_x + input_y, output.asnumpy(), 0.001, 0.001)


def aot_single_output_auto_compile(source_name, reg):
    shape = (4, 5)
    input_x = np.random.normal(0, 1, shape).astype(np.float32)
    input_y = np.random.normal(0, 1, shape).astype(np.float32)
    func_path = AOT_DIR + "/" + source_name

    test = AOTSingleOutputNet(func_path + ":CustomAdd", (shape,), (mstype.float32,), reg)
    output = test(Tensor(input_x), Tensor(input_y))[0]

    assert np.allclose(input_x + input_y, output.asnumpy(), 0.001, 0.001)


def aot_single_output_dyn_shape(source_name, reg):
    shape = (4, 5)
    input_x = np.random.normal(0, 1, shape).astype(np.float32)
    input_y = np.random.normal(0, 1, shape).astype(np.float32)
    func_path = AOT_DIR + "/" + source_name

    test = AOTSingleOutputDynNet(func_path + ":CustomAdd", mstype.float32, reg)
    output = test(Tensor(input_x), Tensor(input_y))

    assert np.allclose(input_x + input_y, output.asnumpy(), 0.001, 0.001)


def aot_single_output_with_attr(source_name, reg):
    shape = (4, 5)
    input_x = np.random.normal(0, 1, shape).astype(np.float32)
    input_y = np.random.normal(0, 1, shape).astype(np.float32)
    func_path = AOT_DIR + "/" + source_name

    test = AOTSingleOutputWithAttrNet(func_path + ":CustomAdd", (shape,), (mstype.float32,), reg)
    output = test(Tensor(input_x), Tensor(input_y))[0]
    expect = input_x + input_y * 0.7 * 2 + 4

    assert np.allclose(expect, output.asnumpy(), 0.001, 0.001)


def aot_single_output_with_attr_only(source_name, reg):
    shape = (4, 5)
    input_x = np.random.normal(0, 1, shape).astype(np.float32)
    input_y = np.random.normal(0, 1, shape).astype(np.float32)
    func_path = AOT_DIR + "/" + source_name

    test = AOTSingleOutputNet(func_path + ":CustomAdd", (shape,), (mstype.float32,), reg)
    output = test(Tensor(input_x), Tensor(input_y))[0]
    expect = input_x + input_y * 0.7 * 2 + 4

    assert np.allclose(expect, output.asnumpy(), 0.001, 0.001)


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

add_cpu_info_attr_only = CustomRegOp("add_with_attr_kernel_cpu_2") \
    .attr("scale", "required", "float", value=0.7) \
    .attr("paddings", "required", "all", value=[2.0, 2.0]) \
    .target("CPU") \
    .get_op_info()

# A GPU info beside the CPU one, as MindSpore lists them: Custom uses the infos of
# the kernel's target (a .cc kernel: CPU).
add_gpu_info_attr_only = CustomRegOp("add_with_attr_kernel_gpu_2") \
    .attr("scale", "required", "float", value=0.5) \
    .attr("paddings", "required", "all", value=[1.0, 2.0]) \
    .target("GPU") \
    .get_op_info()


def test_aot_single_output_cpu():
    """add, add.so (mapped to add.cc), add_with_attr, the attr-only reg_info alone,
    and the dynamic-shape net, as MindSpore's test_aot_single_output_cpu runs them."""
    context.set_context(mode=context.GRAPH_MODE, device_target='CPU')
    aot_single_output(get_file_path_cpu, "add.cc", "add.so", add_cpu_info)
    aot_single_output_auto_compile("add.cc", add_cpu_info)
    aot_single_output_with_attr("add_with_attr.cc", add_with_attr_cpu_info)
    aot_single_output_with_attr_only("add_with_attr.cc", add_cpu_info_attr_only)
    aot_single_output_with_attr_only("add_with_attr.cc",
                                     [add_gpu_info_attr_only, add_cpu_info_attr_only])
    aot_single_output_dyn_shape("add.cc", add_cpu_info)


def test_aot_single_output_no_reg_info():
    """reg_info=None (MindSpore's GPU test passes None): the dtype row comes from the
    call, one registration per dtype combination, reused."""
    aot_single_output(get_file_path_cpu, "add.cc", "add.so", None)
    aot_single_output_dyn_shape("add.cc", None)
    # The docs' form: out_shape and out_dtype as functions of the inputs'.
    op = ops.Custom(AOT_DIR + "/add.so:CustomAdd", out_shape=lambda x, _: x,
                    out_dtype=lambda x, _: x, func_type="aot")
    client = ms.get_client()
    for dt in (np.float64, np.int32, np.float32):
        x0 = np.array([[0.0, 0.0], [1.0, 1.0]]).astype(dt)
        x1 = np.array([[2.0, 2.0], [3.0, 3.0]]).astype(dt)
        out = op(ms.Tensor(x0), ms.Tensor(x1))
        assert out.dtype == dt and out.shape == (2, 2)
        np.testing.assert_array_equal(out.asnumpy(), x0 + x1)
    rows = sorted(tuple(r.op.dtype_formats[0].dtypes) for r in client.ops()
                  if r.op.doc == "opjit.mindspore.Custom(%r)" % op.func)
    # (with add_cpu_info, the None_None row the earlier test registered for add.so)
    assert [r for r in rows if "" not in r] == [("float32",) * 3, ("float64",) * 3,
                                                ("int32",) * 3]
    before = len(client.ops())
    op(ms.Tensor(np.ones((3, 7), np.int32)), ms.Tensor(np.ones((3, 7), np.int32)))
    assert len(client.ops()) == before  # same row and rule: the op registered already
    # The kernel checks what it gets, as in MindSpore: int64 is its error, named.
    with pytest.raises(opjit.OpjitError, match="CustomAdd"):
        op(ms.Tensor(np.ones(2, np.int64)), ms.Tensor(np.ones(2, np.int64)))


class ReduceDynNet(Cell):
    def __init__(self, func, out_types, axis, keep_dim):
        super(ReduceDynNet, self).__init__()
        reduce_cpu_info = CustomRegOp("reduce_kernel_cpu") \
            .input(0, "x1") \
            .output(0, "y") \
            .dtype_format(DataType.None_None, DataType.None_None) \
            .attr("reduce_axis", "required", "float", value=axis) \
            .attr("keep_dim", "required", "bool", value=keep_dim) \
            .target("CPU") \
            .get_op_info()
        self.program = ops.Custom(func, None, out_types, "aot", reg_info=reduce_cpu_info)
        self.convert_to_dynamic = inner.ConvertToDynamic(
            is_dynamic_rank=True).add_prim_attr("primitive_target", "CPU")

    def construct(self, x):
        x = self.convert_to_dynamic(x)
        return self.program(x)


def aot_reduce_dyn_shape(source_name, axis=1, keep_dim=False):
    shape = (4, 5)
    input_x = np.random.normal(0, 1, shape).astype(np.float32)
    func_path = AOT_DIR + "/" + source_name

    test = ReduceDynNet(func_path + ":CustomReduce", mstype.float32, axis, keep_dim)
    output = test(Tensor(input_x))
    assert output.shape == np.sum(input_x, axis, keepdims=keep_dim).shape
    assert np.allclose(np.sum(input_x, axis, keepdims=keep_dim), output.asnumpy(), 0.001, 0.001)


def test_aot_single_output_cpu_dyn_shape():
    """reduce.cc with out_shape=None: the kernel's CustomReduceInferShape decides."""
    context.set_context(mode=context.GRAPH_MODE, device_target='CPU')
    aot_single_output_dyn_shape("add.cc", add_cpu_info)
    aot_reduce_dyn_shape("reduce.cc")
    aot_reduce_dyn_shape("reduce.cc", axis=0, keep_dim=True)
    # out_shape as a function that is not an input's shape (an explicit rule per call).
    op = ops.Custom(AOT_DIR + "/reduce.cc:CustomReduce", lambda s: [s[0]], mstype.float32,
                    "aot", reg_info=CustomRegOp("r").input(0, "x1").output(0, "y")
                    .dtype_format(DataType.None_None, DataType.None_None)
                    .attr("reduce_axis", "required", "float", value=1)
                    .attr("keep_dim", "required", "bool", value=False).target("CPU"))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(op(Tensor(x)).asnumpy(), x.sum(1))


# ---- test_custom_aot_fused.py: upstream's duplicate input index ----------------------------

class FusedReduceDynNet(Cell):
    def __init__(self, func_path, out_types, axis, keep_dim):
        super(FusedReduceDynNet, self).__init__()
        reduce_cpu_info = CustomRegOp("reduce_kernel_cpu") \
            .input(0, "x1") \
            .input(0, "x2") \
            .output(0, "y") \
            .dtype_format(DataType.None_None, DataType.None_None, DataType.None_None) \
            .attr("axis", "required", "all", value=axis) \
            .attr("keep_dim", "required", "all", value=keep_dim) \
            .target("CPU") \
            .get_op_info()
        self.program = ops.Custom(func_path + "./kernel.cc:CustomKernel", None,
                                  out_types, "aot", reg_info=reduce_cpu_info)

    def construct(self, x, y):
        return self.program(x, y)


def aot_fused_kernel():
    context.set_context(device_target="CPU")

    func_path = AOT_DIR + "/"

    shape = (4, 5)
    axis = 1
    keep_dim = False

    input_x = np.ones(shape).astype(np.float32)
    input_y = np.ones(shape).astype(np.float32)
    expected = np.ones((4,)).astype(np.float32) * 10

    test = FusedReduceDynNet(func_path, mstype.float32, axis, keep_dim)
    dyn_x = Tensor(shape=[4, None], dtype=mstype.float32)
    # set the net to dynamic shape
    test.set_inputs(dyn_x, dyn_x)
    output = test(Tensor(input_x), Tensor(input_y))
    assert np.allclose(expected, output.asnumpy(), 0.001, 0.001)


def test_aot_fused_kernel():
    """.input(0, "x1").input(0, "x2"): positional, as MindSpore takes it; the workspace
    from CustomKernelInit, the shape from CustomKernelInferShape."""
    aot_fused_kernel()
    # The inputs are x1 and x2, in declaration order; another width runs too (set_inputs
    # declared [4, None]), and a call against the declared shape is refused.
    net = FusedReduceDynNet(AOT_DIR + "/", mstype.float32, 0, True)
    net.set_inputs(Tensor(shape=[4, None], dtype=mstype.float32),
                   Tensor(shape=[4, None], dtype=mstype.float32))
    a = np.arange(28, dtype=np.float32).reshape(4, 7)
    out = net(Tensor(a), Tensor(a * 2))
    assert out.shape == (1, 7)
    np.testing.assert_allclose(out.asnumpy(), (a * 3).sum(0, keepdims=True))
    with pytest.raises(opjit.InvalidArgument, match=r"input 0 has shape \[3, 7\]; set_inputs "
                                                    r"declared \[4, None\]"):
        net(Tensor(a[:3]), Tensor(a[:3]))


def test_duplicate_index_is_positional_in_the_builder():
    info = CustomRegOp("dup").input(0, "x1").input(0, "x2").output(0, "y").get_op_info()
    assert [(p["index"], p["name"]) for p in info["inputs"]] == [(0, "x1"), (1, "x2")]
    # MindSpore's aicpu example declares .output(1, "output") as its only output.
    info = CustomRegOp("one").input(0, "x").output(1, "y").get_op_info()
    assert info["outputs"][0]["index"] == 0
    assert info.target is None
    assert CustomRegOp("t").target("GPU").get_op_info().target == "GPU"


# ---- bprop: MindSpore's square and add_mul_div tests (CPU kernels) -------------------------

class SquareGradNet(Cell):
    def __init__(self, func, out_shapes, out_types, bprop, reg):
        super(SquareGradNet, self).__init__()
        self.square = ops.Custom(func, out_shapes, out_types, "aot", bprop, reg)

    def construct(self, x):
        res = self.square(x)
        res2 = self.square(res)
        return res2


def test_square_py_bprop():
    context.set_context(mode=context.GRAPH_MODE, device_target="CPU")
    x = np.array([1.0, 4.0, 9.0]).astype(np.float32)
    sens = np.array([1.0, 1.0, 1.0]).astype(np.float32)
    expect = np.array([4.0, 256.0, 2916.0]).astype(np.float32)
    func_path = AOT_DIR + "/square.cc"

    def bprop(x, out, dout):
        gradient = x * 2
        dx = gradient * dout
        return (dx,)

    net = SquareGradNet(func_path + ":CustomSquare", (3,), mstype.float32, bprop=bprop, reg=None)
    dx = ops.GradOperation(sens_param=True)(net)(Tensor(x), Tensor(sens))
    dx_np = dx.asnumpy()
    assert np.allclose(expect, dx_np, 0.0001, 0.0001)
    # ms.grad: the sensitivity defaults to ones; and a gradient of the gradient
    # (d2/dx2 x^4 = 12 x^2), the bprop's arithmetic recorded on the tape.
    np.testing.assert_allclose(ms.grad(net)(Tensor(x)).asnumpy(), expect, rtol=1e-5)
    np.testing.assert_allclose(ms.grad(ms.grad(net))(Tensor(x)).asnumpy(), 12 * x * x, rtol=1e-5)
    # Without a bprop the op runs, and its gradient is refused when asked for.
    plain = SquareGradNet(func_path + ":CustomSquare", (3,), mstype.float32, bprop=None, reg=None)
    np.testing.assert_allclose(plain(Tensor(x)).asnumpy(), x ** 4)
    with pytest.raises(opjit.FailedPrecondition, match="has no bprop") as e:
        ms.grad(plain)(Tensor(x))
    assert e.value.reason == "NOT_DIFFERENTIABLE"


def test_square_aot_bprop():
    context.set_context(mode=context.GRAPH_MODE, device_target="CPU")
    x = np.array([1.0, 4.0, 9.0]).astype(np.float32)
    sens = np.array([1.0, 1.0, 1.0]).astype(np.float32)
    expect = np.array([4.0, 256.0, 2916.0]).astype(np.float32)
    # MindSpore builds square.so and square_bprop.so from two files; opjit's two
    # entries share square.cc, so the .so names are mapped to it.
    ms.sources["square_bprop.so"] = AOT_DIR + "/square.cc"
    try:
        func_path_bprop = AOT_DIR + "/square_bprop.so"
        aot_bprop = ops.Custom(func_path_bprop + ":CustomSquareBprop",
                               (3,), mstype.float32, "aot", reg_info=None)

        def bprop(x, out, dout):
            res = aot_bprop(x, out, dout)
            return (res,)

        func_path = AOT_DIR + "/square.so"
        net = SquareGradNet(func_path + ":CustomSquare", (3,), mstype.float32, bprop=bprop,
                            reg=None)
        dx = ops.GradOperation(sens_param=True)(net)(Tensor(x), Tensor(sens))
    finally:
        del ms.sources["square_bprop.so"]
    dx_np = dx.asnumpy()
    assert np.allclose(expect, dx_np, 0.0001, 0.0001)


class AOTMultiOutputNet(Cell):
    def __init__(self, func, out_shapes, out_types, bprop=None, reg=None):
        super(AOTMultiOutputNet, self).__init__()

        self.program = ops.Custom(func, out_shapes, out_types, "aot", bprop, reg)
        self.add = ops.Add()
        self.mul = ops.Mul()

    def construct(self, x, y):
        aot = self.program(x, y)
        add_res = self.add(aot[0], aot[1])
        mul_res = self.mul(add_res, aot[2])
        return mul_res


multioutput_cpu_info = CustomRegOp() \
    .input(0, "x1") \
    .input(1, "x2") \
    .output(0, "y1") \
    .output(1, "y2") \
    .output(2, "y3") \
    .dtype_format(DataType.F32_Default, DataType.F32_Default,
                  DataType.F32_Default, DataType.F32_Default, DataType.F32_Default) \
    .target("CPU") \
    .get_op_info()

multioutput_bprop_cpu_info = CustomRegOp() \
    .input(0, "x1") \
    .input(1, "x2") \
    .input(2, "x3") \
    .input(3, "x4") \
    .input(4, "x5") \
    .output(0, "y1") \
    .output(1, "y2") \
    .dtype_format(DataType.F32_Default, DataType.F32_Default, DataType.F32_Default,
                  DataType.F32_Default, DataType.F32_Default, DataType.F32_Default,
                  DataType.F32_Default) \
    .target("CPU") \
    .get_op_info()


def test_add_mul_div_bprop():
    x = np.array([1.0, 4.0, 9.0]).astype(np.float32)
    y = np.array([1.0, 1.0, 1.0]).astype(np.float32)
    sens = np.array([1.0, 1.0, 1.0]).astype(np.float32)
    expect_dx = np.array([5.0, 17.0, 37.0]).astype(np.float32)
    expect_dy = np.array([-1.0, -16.0, -81.0]).astype(np.float32)

    aot_bprop = ops.Custom(AOT_DIR + "/add_mul_div.cc:CustomAddMulDivBprop",
                           ([3], [3]), (mstype.float32, mstype.float32), "aot",
                           reg_info=multioutput_bprop_cpu_info)

    def bprop(x, y, out, dout):
        res = aot_bprop(x, y, dout[0], dout[1], dout[2])
        return res

    net = AOTMultiOutputNet(AOT_DIR + "/add_mul_div.cc:CustomAddMulDiv", ([3], [3], [3]),
                            (mstype.float32, mstype.float32, mstype.float32), bprop=bprop,
                            reg=multioutput_cpu_info)

    dx, dy = ops.GradOperation(sens_param=True, get_all=True)(net)(Tensor(x), Tensor(y),
                                                                   Tensor(sens))
    dx_np = dx.asnumpy()
    dy_np = dy.asnumpy()
    assert np.allclose(expect_dx, dx_np, 0.0001, 0.0001)
    assert np.allclose(expect_dy, dy_np, 0.0001, 0.0001)
    # ms.grad over both positions gives the same (sensitivity ones).
    gx, gy = ms.grad(net, grad_position=(0, 1))(Tensor(x), Tensor(y))
    np.testing.assert_allclose(gx.asnumpy(), expect_dx, rtol=1e-5)
    np.testing.assert_allclose(gy.asnumpy(), expect_dy, rtol=1e-5)


# ---- MindSpore's _Function rules on a Custom bprop (pyfunc kernels: no compile) ------------

def test_bprop_auto_reduce_auto_cast_and_needs_input_grad():
    seen = []

    def bias_add_bprop(x, b, out, dout):
        seen.append(program.needs_input_grad)
        return dout, dout  # dout has x's shape (4, 5); b is (5,) float16

    program = ops.Custom(lambda x, b: x + b, lambda x, b: x, lambda x, b: x, "pyfunc",
                         bprop=bias_add_bprop)
    x = np.random.normal(0, 1, (4, 5)).astype(np.float32)
    b = np.random.normal(0, 1, (5,)).astype(np.float16)
    np.testing.assert_allclose(program(Tensor(x), Tensor(b)).asnumpy(), x + b)
    gx, gb = ms.grad(program, grad_position=(0, 1))(Tensor(x), Tensor(b))
    assert gx.dtype == np.float32 and gx.shape == (4, 5)
    assert gb.dtype == np.float16 and gb.shape == (5,)  # auto_reduce, auto_cast
    np.testing.assert_allclose(gb.asnumpy(), np.full(5, 4.0, np.float16))
    assert seen[-1] == (True, True)
    # Only x needs a gradient: needs_input_grad says so; b's is dropped.
    gx = ms.grad(program, grad_position=0)(Tensor(x), Tensor(b))
    assert seen[-1] == (True, False)
    np.testing.assert_allclose(gx.asnumpy(), np.ones((4, 5)))

    # A gradient that cannot be summed to its input's shape is refused, naming it.
    bad = ops.Custom(lambda x: x * 2, lambda x: x, lambda x: x, "pyfunc",
                     bprop=lambda x, out, dout: (np.ones(3, np.float32),))
    with pytest.raises(opjit.InvalidArgument, match=r"input 0 has shape \[3\], which does not "
                                                    r"match the input's shape \[4, 5\]") as e:
        ms.grad(bad)(Tensor(x))
    assert e.value.reason == "GRAD_SHAPE"
    # One gradient per input.
    two = ops.Custom(lambda x: x * 2, lambda x: x, lambda x: x, "pyfunc",
                     bprop=lambda x, out, dout: (dout, dout))
    with pytest.raises(opjit.InvalidArgument, match=r"returned 2 gradient\(s\); the op was "
                                                    r"called with 1 input\(s\)"):
        ms.grad(two)(Tensor(x))


def test_bprop_non_tensor_and_integer_outputs():
    got = {}

    def forward(x):
        return x * 3, np.argmax(x).astype(np.int32).reshape(1), "label"

    def bprop(x, out, dout):
        got["out"], got["dout"] = out, dout
        return (dout[0] * 3,)

    program = ops.Custom(forward, None, (mstype.float32, mstype.int32, None), "pyfunc",
                         bprop=bprop)
    x = np.array([1.0, 5.0, 2.0], np.float32)
    y, idx, label = program(Tensor(x))
    assert label == "label" and idx.dtype == np.int32 and idx.asnumpy().tolist() == [1]
    g = ms.grad(lambda t: program(t)[0])(Tensor(x))
    np.testing.assert_allclose(g.asnumpy(), [3.0, 3.0, 3.0])
    assert got["out"][2] == "label" and got["dout"][2] is None  # a non-Tensor output: no grad
    # An integer output is not differentiable: its dout is zeros (MindSpore's).
    assert got["dout"][1].dtype == np.int32 and not got["dout"][1].asnumpy().any()
    np.testing.assert_allclose(got["dout"][0].asnumpy(), np.ones(3))
    # GradOperation with a sensitivity for each Tensor output.
    f = ops.GradOperation(sens_param=True)(lambda t: program(t)[:2])
    g = f(Tensor(x), (Tensor(np.full(3, 2.0, np.float32)), Tensor(np.zeros(1, np.int32))))
    np.testing.assert_allclose(g.asnumpy(), [6.0, 6.0, 6.0])


def test_pyfunc_outputs_are_checked():
    program = ops.Custom(lambda x: x.sum(), (), mstype.float64, "pyfunc")
    out = program(Tensor(np.ones((2, 3), np.float32)))
    assert out.dtype == np.float64 and out.shape == () and out.asnumpy() == 6.0
    wrong = ops.Custom(lambda x: x, (2, 2), mstype.float32, "pyfunc")
    with pytest.raises(opjit.InvalidArgument, match=r"output 0 has shape \[3\]; out_shape says "
                                                    r"\[2, 2\]"):
        wrong(Tensor(np.ones(3, np.float32)))


# ---- what cannot work is refused, with the reason ---------------------------------------------

def test_refusals_name_the_reason(tmp_path):
    for ft, needs in (("akg", "AKG compiler"), ("hybrid", "AKG compiler"), ("tbe", "TBE"),
                      ("aicpu", "AI CPU"), ("julia", "Julia runtime")):
        with pytest.raises(ValueError, match=needs) as e:
            ops.Custom(lambda x: x, lambda x: x, lambda x: x, ft)
        assert isinstance(e.value, opjit.InvalidArgument)
        assert e.value.reason == "FUNC_TYPE_UNSUPPORTED" and repr(ft) in e.value.message
    with pytest.raises(opjit.InvalidArgument, match="func_type should be one of aot, pyfunc"):
        ops.Custom("x.cc:F", None, None, "cuda")
    with pytest.raises(TypeError, match="an aot func should be a str"):
        ops.Custom(lambda x: x, None, None, "aot")
    with pytest.raises(opjit.InvalidArgument, match="an aot func is \"path:Function\""):
        ops.Custom(AOT_DIR + "/add.cc", None, None, "aot")
    # A library with no source to map it to: NotFound, saying how to map it.
    with pytest.raises(opjit.NotFound, match=r"sources\['nowhere.so'\]") as e:
        ops.Custom(str(tmp_path / "nowhere.so") + ":CustomAdd", (2,), mstype.float32, "aot")
    assert e.value.reason == "SOURCE_NOT_FOUND"
    # ... found through source_path, or $OPJIT_MS_SOURCE_PATH.
    ms.source_path.append(AOT_DIR)
    try:
        op = ops.Custom(str(tmp_path / "add.so") + ":CustomAdd", (2,), mstype.float32, "aot")
        np.testing.assert_allclose(op(Tensor([1.0, 2.0]), Tensor([3.0, 4.0])).asnumpy(), [4, 6])
    finally:
        ms.source_path.remove(AOT_DIR)
    # Shapes the kernel must know at call time.
    op = ops.Custom(AOT_DIR + "/add.cc:CustomAdd", (-1, 2), mstype.float32, "aot")
    with pytest.raises(opjit.InvalidArgument, match="unknown \\(negative\\) dimension"):
        op(Tensor(np.ones((2, 2), np.float32)), Tensor(np.ones((2, 2), np.float32)))
    op = ops.Custom(AOT_DIR + "/add.cc:CustomAdd", ((2,), (2,)), mstype.float32, "aot")
    with pytest.raises(opjit.InvalidArgument, match="out_shape gives 2 shapes but out_dtype "
                                                    "one dtype"):
        op(Tensor(np.ones(2, np.float32)), Tensor(np.ones(2, np.float32)))
    # A reg_info for another target only.
    with pytest.raises(opjit.InvalidArgument, match="reg_info names only target\\(s\\) GPU"):
        ops.Custom(AOT_DIR + "/add.cc:CustomAdd", None, None, "aot",
                   reg_info=add_gpu_info_attr_only)
    # set_context checks its arguments as MindSpore does.
    with pytest.raises(ValueError, match="device_target 'Ascend' is not served"):
        context.set_context(device_target="Ascend")
    with pytest.raises(ValueError, match="keyword argument no_such_key is not recognized"):
        context.set_context(no_such_key=1)
    with pytest.raises(ValueError, match="mode must be GRAPH_MODE"):
        ms.set_context(mode=7)
    context.set_context(mode=context.PYNATIVE_MODE, device_target="CPU", save_graphs=False)
    assert ms.get_context("device_target") == "CPU"


def test_outputs_counted_from_reg_info_or_the_pyfunc():
    # No out_shape, no out_dtype: the reg_info's three outputs (each input 0's shape
    # and the row's dtype; add_mul_div.cc defines no InferShape).
    program = ops.Custom(AOT_DIR + "/add_mul_div.cc:CustomAddMulDiv", None, None, "aot",
                         reg_info=multioutput_cpu_info)
    x, y = np.array([1.0, 4.0], np.float32), np.array([2.0, 8.0], np.float32)
    s, p, q = program(Tensor(x), Tensor(y))
    np.testing.assert_allclose(s.asnumpy(), x + y)
    np.testing.assert_allclose(p.asnumpy(), x * y)
    np.testing.assert_allclose(q.asnumpy(), x / y)
    # A pyfunc's tuple says how many, when neither does.
    pair = ops.Custom(lambda a: (a + 1, a * 2), None, None, "pyfunc")
    a, b = pair(Tensor(x))
    np.testing.assert_allclose(a.asnumpy(), x + 1)
    np.testing.assert_allclose(b.asnumpy(), x * 2)


def test_bprop_gets_the_attrs_passed_positionally():
    # MindSpore hands bprop every argument of the call, attrs too, and takes one
    # gradient per argument (the attr's is dropped) or one per input.
    def bprop(x, y, scale, out, dout):
        assert scale == 0.5
        return dout, dout * scale * 2.0, 0.0

    program = ops.Custom(AOT_DIR + "/add_with_attr.cc:CustomAdd", lambda x, y: x,
                         lambda x, y: x, "aot", bprop, add_with_attr_cpu_info)
    x = np.random.normal(0, 1, (2, 3)).astype(np.float32)
    y = np.random.normal(0, 1, (2, 3)).astype(np.float32)
    f = lambda a, b: program(a, b, 0.5)  # noqa: E731
    np.testing.assert_allclose(f(Tensor(x), Tensor(y)).asnumpy(), x + y + 4, rtol=1e-5)
    gx, gy = ms.grad(f, grad_position=(0, 1))(Tensor(x), Tensor(y))
    np.testing.assert_allclose(gx.asnumpy(), np.ones((2, 3)))
    np.testing.assert_allclose(gy.asnumpy(), np.ones((2, 3)))
    value, gx = ms.value_and_grad(f)(Tensor(x), Tensor(y))
    np.testing.assert_allclose(value.asnumpy(), x + y + 4, rtol=1e-5)
    np.testing.assert_allclose(gx.asnumpy(), np.ones((2, 3)))

"""bprop argument mapping and stop_gradient grads (issue 29 item 3).

MindSpore's bprops choose their own arguments: the seed 001 document's
``square_grad(x, dout)`` and an ``add_mul_div_bprop(x, y, dout)`` over the
three outputs of arith3. A forward op names them in ``backward.inputs``;
registration checks the pair (arity and dtypes) whichever is registered
first; a nonzero grad returned for an input that needs none is reported
(a warning by default, an error when the spec says so), never dropped
without a word. The kernels are kernels/examples/square.cc
(SquareGradXDout) and arith3.cc (Arith3GradXYDout).
"""

import warnings

import numpy as np
import pytest

import opjit

from conftest import example_source

F32 = opjit.DataType.F32_Default
SQUARE = example_source("square.cc")
ARITH3 = example_source("arith3.cc")


def square_fwd(name, bprop, inputs=None, stop_gradient_grads=None):
    return (opjit.CustomRegOp(name).input(0, "x").output(0, "y").dtype_format(F32, F32)
            .target("CPU").impl(source=SQUARE, entry="Square").output_rule("same_as", input=0)
            .bprop(bprop, inputs=inputs, stop_gradient_grads=stop_gradient_grads))


def square_grad_x_dout(name, dtype=F32):
    # MindSpore: ops.Custom(square_grad, lambda x, _: x, lambda x, _: x)
    return (opjit.CustomRegOp(name).input(0, "x").input(1, "dout").output(0, "dx")
            .dtype_format(dtype, dtype, dtype).target("CPU")
            .impl(source=SQUARE, entry="SquareGradXDout").output_rule("same_as", input=0))


@pytest.fixture
def client(daemon, request):
    ns = "bpm_" + request.node.name[:40].replace("[", "_").replace("]", "")
    with opjit.Client(daemon.unix_address, namespace=ns, timeout=120) as c:
        yield c


def test_seed_001_square_grad_takes_x_and_dout(client):
    client.register(square_grad_x_dout("square_grad"))
    client.register(square_fwd("square", "square_grad", inputs=["x", "dout"]))
    x = opjit.tensor(np.array([1.0, 4.0, 9.0], np.float32), requires_grad=True)
    y = client.op("square")(x)
    y.sum().backward()
    # The document's printed result: [ 2.  8. 18.]
    np.testing.assert_array_equal(x.grad, np.array([2.0, 8.0, 18.0], np.float32))
    # grad with an explicit dout reaches the bprop's second argument.
    x2 = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y2 = client.op("square")(x2)
    g, = opjit.grad(y2, x2, grad_outputs=[np.array([3.0, -1.0], np.float32)])
    np.testing.assert_array_equal(g, np.array([6.0, -4.0], np.float32))


def test_explicit_prefixes_and_grad_name_mean_the_same(client):
    client.register(square_grad_x_dout("sg"))
    client.register(square_fwd("sq", "sg", inputs=["in:x", "grad:y"]))
    x = opjit.tensor(np.array([3.0], np.float32), requires_grad=True)
    client.op("sq")(x).sum().backward()
    np.testing.assert_array_equal(x.grad, np.array([6.0], np.float32))
    rec = client.describe("sq")
    assert list(rec.op.backward.inputs) == ["in:x", "grad:y"]


def test_add_mul_div_bprop_takes_x_y_and_every_dout(client):
    ins = [("x", 0), ("y", 1)]
    outs = ["sum", "prod", "quot"]
    g = opjit.CustomRegOp("add_mul_div_bprop").input(0, "x").input(1, "y")
    for k, n in enumerate(outs):
        g = g.input(2 + k, "d" + n)
    g = (g.output(0, "dx").output(1, "dy").dtype_format(*[F32] * 7).target("CPU")
         .impl(source=ARITH3, entry="Arith3GradXYDout")
         .output_rule("same_as", input=0).output_rule("same_as", input=1))
    client.register(g)
    f = opjit.CustomRegOp("add_mul_div")
    for name, k in ins:
        f = f.input(k, name)
    for k, n in enumerate(outs):
        f = f.output(k, n)
    f = (f.dtype_format(*[F32] * 5).target("CPU").impl(source=ARITH3, entry="Arith3")
         .output_rule("broadcast", inputs=[0, 1]).output_rule("broadcast", inputs=[0, 1])
         .output_rule("broadcast", inputs=[0, 1]).bprop("add_mul_div_bprop", inputs=["x", "y", "dout"]))
    client.register(f)
    xd = np.array([1.0, 2.0, 3.0], np.float32)
    yd = np.array([2.0, 4.0, 5.0], np.float32)
    x = opjit.tensor(xd, requires_grad=True)
    y = opjit.tensor(yd, requires_grad=True)
    s, p, q = client.op("add_mul_div")(x, y)
    (s.sum() + p.sum() + q.sum()).backward()
    np.testing.assert_allclose(x.grad, 1 + yd + 1 / yd, rtol=1e-6)
    np.testing.assert_allclose(y.grad, 1 + xd - xd / (yd * yd), rtol=1e-6)


def test_an_unknown_name_in_backward_inputs_is_refused(client):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(square_fwd("sq", "sg", inputs=["x", "dz"]))
    assert "backward.inputs[1]" in str(e.value) and "dz" in str(e.value)
    assert e.value.reason == "INVALID_SPEC"
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(square_fwd("sq", "sg", inputs=["grad:x"]))
    assert "names no output" in str(e.value)


def test_a_bprop_of_the_wrong_arity_is_refused_at_registration_either_order(client):
    # The bprop first: the forward that names it with the default mapping
    # (x, y, dy) = 3 inputs against its 2 is refused, before anything compiles.
    client.register(square_grad_x_dout("square_grad"))
    with pytest.raises(opjit.FailedPrecondition) as e:
        client.register(square_fwd("square", "square_grad"))
    assert e.value.reason == "BPROP_MISMATCH"
    assert "(x, out:y, grad:y)" in str(e.value) and "declares 2" in str(e.value)
    assert e.value.metadata.get("bprop", "").endswith("/square_grad")
    with pytest.raises(opjit.NotFound):
        client.describe("square")
    # The forward first (a warning: its bprop is not registered yet), then a
    # bprop that does not match what it names: the bprop is refused.
    r = client.register(square_fwd("square2", "square2_grad", inputs=["x", "y", "dout"]))
    assert any("square2_grad" in w for w in r.warnings)
    with pytest.raises(opjit.FailedPrecondition) as e:
        client.register(square_grad_x_dout("square2_grad"))
    assert e.value.reason == "BPROP_MISMATCH" and "square2" in str(e.value)
    # A bprop that matches is accepted, and the warning is gone.
    client.register(square_fwd("square2", "square2_grad", inputs=["x", "dout"]))
    client.register(square_grad_x_dout("square2_grad"))
    assert not client.describe("square2").warnings


def test_a_bprop_without_the_forward_dtypes_is_refused(client):
    client.register(square_grad_x_dout("sg64", dtype=opjit.DataType.F64_Default))
    with pytest.raises(opjit.FailedPrecondition) as e:
        client.register(square_fwd("sq", "sg64", inputs=["x", "dout"]))
    assert e.value.reason == "BPROP_MISMATCH"
    assert "(float32, float32) -> (float32)" in str(e.value)


def mul_ops(client, stop_gradient_grads=None):
    """mul(x, w) -> x*w with its bprop mul_grad(x, w, y, dy) -> (dy*w, dy*x):
    both grads are nonzero, whatever needs them."""
    mul = example_source("mul.cc")
    client.register(opjit.CustomRegOp("mul_grad").input(0, "x").input(1, "w").input(2, "y")
                    .input(3, "dy").output(0, "dx").output(1, "dw").dtype_format(*[F32] * 6)
                    .target("CPU").impl(source=mul, entry="MulGrad")
                    .output_rule("same_as", input=0).output_rule("same_as", input=1))
    client.register(opjit.CustomRegOp("mul").input(0, "x").input(1, "w").output(0, "y")
                    .dtype_format(F32, F32, F32).target("CPU").impl(source=mul, entry="Mul")
                    .output_rule("same_as", input=0)
                    .bprop("mul_grad", stop_gradient_grads=stop_gradient_grads))


def test_a_nonzero_grad_for_a_stop_gradient_input_is_reported(client):
    mul_ops(client)
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    w = opjit.tensor(np.array([3.0, 5.0], np.float32))  # stop_gradient
    assert w.stop_gradient
    y = client.op("mul")(x, w)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y.sum().backward()
    np.testing.assert_array_equal(x.grad, np.array([3.0, 5.0], np.float32))
    assert w.grad is None
    msgs = [str(s.message) for s in seen if issubclass(s.category, opjit.OpjitWarning)]
    assert len(msgs) == 1 and "input w" in msgs[0] and "dropped" in msgs[0], msgs


def test_stop_gradient_grads_error_fails_the_backward(client):
    mul_ops(client, stop_gradient_grads="error")
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    w = opjit.tensor(np.array([3.0, 5.0], np.float32))
    y = client.op("mul")(x, w)
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.sum().backward()
    assert e.value.reason == "STOP_GRADIENT_GRAD" and e.value.metadata.get("input") == "w"
    # A zero grad (here: a zero upstream grad) carries nothing and passes.
    y = client.op("mul")(x, w)
    g, = opjit.grad(y, x, grad_outputs=[np.zeros(2, np.float32)])
    np.testing.assert_array_equal(g, np.zeros(2, np.float32))


def test_stop_gradient_grads_must_be_warn_or_error(client):
    with pytest.raises(opjit.InvalidArgument) as e:
        client.register(square_fwd("sq", "sg", stop_gradient_grads="drop"))
    assert "stop_gradient_grads" in str(e.value)


class Scale(opjit.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return opjit.Tensor(x.data * s.data)

    @staticmethod
    def backward(ctx, dy):
        x, s = ctx.saved_tensor()
        return dy * s.data, dy * x.data  # a grad for s whether or not it needs one


def test_function_grad_for_a_stop_gradient_input_warns():
    x = opjit.tensor(np.array([1.0, 2.0]), requires_grad=True)
    s = opjit.tensor(np.array([3.0, 4.0]))  # stop_gradient
    with pytest.warns(opjit.StopGradientGradWarning, match="input 1"):
        Scale.apply(x, s).sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 4.0])
    assert s.grad is None


def test_function_stop_gradient_grads_error_and_ignore():
    class Strict(Scale):
        stop_gradient_grads = "error"

    class Quiet(Scale):
        stop_gradient_grads = "ignore"

    x = opjit.tensor(np.array([1.0]), requires_grad=True)
    s = opjit.tensor(np.array([3.0]))
    with pytest.raises(opjit.InvalidArgument) as e:
        Strict.apply(x, s).sum().backward()
    assert e.value.reason == "STOP_GRADIENT_GRAD"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Quiet.apply(x, s).sum().backward()
    # None for the stop_gradient input is the documented way: never a warning.

    class Polite(opjit.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(s)
            return opjit.Tensor(x.data * s.data)

        @staticmethod
        def backward(ctx, dy):
            s, = ctx.saved_tensor()
            return dy * s.data, None

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x.grad = None
        Polite.apply(x, s).sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0])

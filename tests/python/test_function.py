"""opjit.Function: PyLayer / torch.autograd.Function semantics, backward run client-side."""

import numpy as np
import pytest

import opjit


@pytest.fixture
def ops(client, grad_ops):
    return {n: client.op(n) for n in ("tanh", "tanh_grad", "mul", "square")}


def make_tanh(ops):
    class CusTanh(opjit.Function):
        forward_calls = 0
        backward_calls = 0

        @staticmethod
        def forward(ctx, x):
            CusTanh.forward_calls += 1
            y = ops["tanh"](x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            CusTanh.backward_calls += 1
            y, = ctx.saved_tensor()
            return ops["tanh_grad"](y, dy)
    return CusTanh


def test_save_for_backward_tanh(ops):
    CusTanh = make_tanh(ops)
    data = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    x = opjit.tensor(data, requires_grad=True)
    z = CusTanh.apply(x)
    assert isinstance(z, opjit.Tensor) and z.grad_fn is not None
    np.testing.assert_allclose(z.numpy(), np.tanh(data), rtol=1e-5)
    dy = np.full(data.shape, 1.0 / data.size, np.float32)  # d mean / dz
    z.backward(dy)
    np.testing.assert_allclose(x.grad, dy * (1 - np.tanh(data) ** 2), rtol=1e-5)
    assert CusTanh.backward_calls == 1


def test_stop_gradient_input_gets_none(ops):
    calls = []

    class Add(opjit.Function):
        @staticmethod
        def forward(ctx, x1, x2):
            return opjit.Tensor(x1.numpy() + x2.numpy())

        @staticmethod
        def backward(ctx, dy):
            calls.append(ctx.needs_input_grad)
            return dy, dy  # a grad for x2 too: it must be dropped

    a = opjit.tensor(np.ones(3, np.float32))
    a.stop_gradient = False
    b = opjit.tensor(np.ones(3, np.float32))  # stop_gradient=True by default
    assert b.stop_gradient
    z = Add.apply(a, b)
    z.backward()
    np.testing.assert_allclose(a.grad, np.ones(3))
    assert b.grad is None
    assert calls == [(True, False)]


def test_backward_not_run_when_no_input_needs_grad(ops):
    counter = {"backward": 0}

    class Add(opjit.Function):
        @staticmethod
        def forward(ctx, x1, x2):
            return opjit.Tensor(x1.numpy() + x2.numpy())

        @staticmethod
        def backward(ctx, dy):
            counter["backward"] += 1
            return dy, None

    d1 = opjit.tensor(np.ones(3, np.float32))
    d2 = opjit.tensor(np.ones(3, np.float32))
    z = Add.apply(d1, d2)
    assert z.grad_fn is None and not z.requires_grad
    z.backward()
    assert counter["backward"] == 0
    assert d1.grad is None and d2.grad is None
    # And under no_grad, even inputs that need grads record nothing.
    d1.requires_grad = True
    with opjit.no_grad():
        z = Add.apply(d1, d2)
    z.backward()
    assert counter["backward"] == 0
    assert Add.apply(d1, d2).grad_fn is not None


def test_non_tensor_ctx_attributes_and_kwargs(ops):
    class Scaled(opjit.Function):
        @staticmethod
        def forward(ctx, x, func, scale=2.0):
            ctx.scale = scale  # a non-tensor attribute
            ctx.func = func
            y = func(x)
            ctx.save_for_backward(y)
            return y, y.shape  # a non-tensor output passes through

        @staticmethod
        def backward(ctx, dy, dshape):  # torch: a grad (None) for the non-tensor output too
            assert dshape is None
            y, = ctx.saved_tensors
            assert ctx.func is ops["tanh"]
            g = ops["tanh_grad"](y, dy)
            return opjit.Tensor(g.numpy() * ctx.scale)

    data = np.linspace(-1, 1, 6, dtype=np.float32)
    x = opjit.tensor(data, requires_grad=True)
    z, shape = Scaled.apply(x, func=ops["tanh"], scale=3.0)
    assert shape == (6,)
    z.backward()
    np.testing.assert_allclose(x.grad, 3.0 * (1 - np.tanh(data) ** 2), rtol=1e-5)


def test_multiple_outputs_materialize_and_non_differentiable(ops):
    seen = []

    class Split(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            a = opjit.Tensor(x.numpy() * 2)
            b = opjit.Tensor(x.numpy() * 3)
            idx = np.argmax(x.numpy())
            mask = opjit.Tensor((x.numpy() > 0).astype(np.float32))
            ctx.mark_non_differentiable(mask)
            ctx.idx = idx
            return a, b, mask

        @staticmethod
        def backward(ctx, da, db, dmask):
            seen.append((da, db, dmask))
            g = da.numpy() * 2 + db.numpy() * 3
            return g

    x = opjit.tensor(np.array([1.0, -2.0], np.float32), requires_grad=True)
    a, b, mask = Split.apply(x)
    assert a.requires_grad and b.requires_grad and not mask.requires_grad and mask.grad_fn is None
    a.backward()  # only a's grad: b's and mask's are zero-filled
    da, db, dmask = seen[0]
    np.testing.assert_allclose(db.numpy(), [0, 0])
    np.testing.assert_allclose(dmask.numpy(), [0, 0])
    np.testing.assert_allclose(x.grad, [2, 2])


def test_set_materialize_grads_false(ops):
    seen = []

    class Two(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return opjit.Tensor(x.numpy()), opjit.Tensor(x.numpy())

        @staticmethod
        def backward(ctx, d1, d2):
            seen.append((d1, d2))
            return d1 if d1 is not None else d2

    x = opjit.tensor(np.ones(2, np.float32), requires_grad=True)
    y1, y2 = Two.apply(x)
    y2.backward()
    assert seen[0][0] is None and seen[0][1] is not None
    np.testing.assert_allclose(x.grad, [1, 1])


def test_chain_accumulates_and_retain_graph(ops):
    CusTanh = make_tanh(ops)
    data = np.array([0.5, -0.25], np.float32)
    x = opjit.tensor(data, requires_grad=True)
    y = CusTanh.apply(CusTanh.apply(x))
    y.backward(retain_graph=True)
    t = np.tanh(data)
    expect = (1 - np.tanh(t) ** 2) * (1 - t ** 2)
    np.testing.assert_allclose(x.grad, expect, rtol=1e-5)
    y.backward()  # accumulates
    np.testing.assert_allclose(x.grad, 2 * expect, rtol=1e-5)
    with pytest.raises(opjit.FailedPrecondition):
        y.backward()  # the graph was freed


def test_diamond_graph_and_grad(ops):
    class Mul2(opjit.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return ops["mul"](a, b)

        @staticmethod
        def backward(ctx, dy):
            a, b = ctx.saved_tensor()
            return ops["mul"](dy, b), ops["mul"](dy, a)

    x = opjit.tensor(np.array([3.0, -1.0], np.float32), requires_grad=True)
    y = Mul2.apply(x, x)  # y = x^2 through two edges
    z = Mul2.apply(y, x)  # z = x^3
    dx, = opjit.grad(z, [x])
    np.testing.assert_allclose(dx, 3 * x.numpy() ** 2)
    assert x.grad is None  # opjit.grad does not accumulate


def test_function_forward_without_a_tensor_output(ops):
    # torch.autograd.Function returns a forward's non-Tensor result as is (nothing is
    # recorded); opjit.PyLayer raises ValueError as Paddle does (test_paddle_pylayer.py).
    class NoTensor(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            return x.shape

        @staticmethod
        def backward(ctx, dy):
            return dy

    assert NoTensor.apply(opjit.tensor(np.ones(2, np.float32), requires_grad=True)) == (2,)


def test_backward_returns_wrong_count(ops):
    class Wrong(opjit.Function):
        @staticmethod
        def forward(ctx, x, y):
            return opjit.Tensor(x.numpy() + y.numpy())

        @staticmethod
        def backward(ctx, dy):
            return dy

    a = opjit.tensor(np.ones(2, np.float32), requires_grad=True)
    z = Wrong.apply(a, opjit.tensor(np.ones(2, np.float32)))
    # torch: RuntimeError "function WrongBackward returned an incorrect number of gradients
    # (expected 2, got 1)".
    with pytest.raises(opjit.GradRuleError, match=r"expected 2, got 1"):
        z.backward()


def test_pylayer_is_a_function_with_paddles_rules():
    assert issubclass(opjit.PyLayer, opjit.Function) and opjit.PyLayer is not opjit.Function
    assert issubclass(opjit.PyLayerContext, opjit.FunctionCtx)

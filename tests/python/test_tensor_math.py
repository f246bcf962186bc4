"""Arithmetic on opjit.Tensor (client-side numpy, recorded on the tape), issue 29 item 4.

Each op's forward is compared with numpy, its backward with central
differences (opjit.gradcheck on a Python function, float64); broadcast
operands get their gradients summed back to their shapes; and daemon ops mix
with the math: y = op(x); y.mean().backward().
"""

import numpy as np
import pytest

import opjit

RNG = np.random.default_rng(29)


def t64(*shape, positive=False, grad=True):
    a = RNG.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.5
    return opjit.tensor(a, requires_grad=grad)


# ---- forward vs numpy --------------------------------------------------------------

def test_forward_matches_numpy():
    a = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    b = np.array([0.5, 2.0, -1.0], np.float32)
    x, y = opjit.Tensor(a), opjit.Tensor(b)
    cases = [
        (x + y, a + b), (x - y, a - b), (x * y, a * b), (x / y, a / b),
        (x + 2, a + 2), (2 + x, 2 + a), (x - 1.5, a - 1.5), (1.5 - x, 1.5 - a),
        (x * 3, a * 3), (3 * x, 3 * a), (x / 4, a / 4), (4 / x, 4 / a),
        (-x, -a), (x ** 2, a ** 2), (x ** 0.5, a ** 0.5), (2 ** y, 2 ** b), (x ** y, a ** b),
        (x + b, a + b), (a + y, a + b), (a * y, a * b), (b - x, b - a),
        (x.sum(), a.sum()), (x.sum(axis=0), a.sum(0)), (x.sum(dim=1, keepdim=True),
                                                         a.sum(1, keepdims=True)),
        (x.sum(axis=(0, 1)), a.sum()), (x.mean(), a.mean()), (x.mean(axis=1), a.mean(1)),
        (x.mean(axis=-1, keepdims=True), a.mean(-1, keepdims=True)),
        (x.reshape(3, 2), a.reshape(3, 2)), (x.reshape([-1]), a.reshape(-1)),
        (x.view(6, 1), a.reshape(6, 1)), (x[1], a[1]), (x[:, 1:], a[:, 1:]),
        (x[..., ::-1], a[..., ::-1]), (x[0, 2], a[0, 2]), (x[[1, 0, 1]], a[[1, 0, 1]]),
        (x[a > 2], a[a > 2]), (opjit.tanh(x), np.tanh(a)), (opjit.exp(y), np.exp(b)),
        (opjit.log(x), np.log(a)), (opjit.sqrt(x), np.sqrt(a)), (opjit.square(y), b * b),
        (x.astype("float64"), a.astype(np.float64)), (x.clone(), a),
    ]
    for got, want in cases:
        assert isinstance(got, opjit.Tensor)
        assert got.shape == np.shape(want)
        assert got.dtype == np.asarray(want).dtype, (got, want)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
        assert got.grad_fn is None and not got.requires_grad  # nothing required a grad


def test_python_scalars_keep_float32():
    x = opjit.tensor(np.ones(3, np.float32), requires_grad=True)
    for y in (x * 2.0, 2.0 * x, x / 3, 1 - x, x ** 2, x.mean(), (x * 0.5).sum()):
        assert y.dtype == np.float32
    y = (x * np.float64(2.0)).mean()
    y.backward()
    assert x.grad.dtype == np.float32


def test_results_record_grad_fn_only_when_needed():
    x = opjit.tensor(np.ones((2, 2)), requires_grad=True)
    c = opjit.tensor(np.ones((2, 2)))
    y = x * c + 1
    assert y.requires_grad and y.grad_fn is not None and not y.is_leaf
    assert y.grad_fn.name() == "AddBackward"
    assert (c * 2).grad_fn is None
    with opjit.no_grad():
        z = (x * 3).mean()
    assert z.grad_fn is None and not z.requires_grad
    assert repr(x.sum()).endswith("grad_fn=<SumBackward>)")


# ---- backward vs finite differences -------------------------------------------------

def _cases():
    a, b = t64(2, 3), t64(3)
    p = t64(2, 3, positive=True)
    col, row = t64(2, 1), t64(1, 3)
    return [
        ("add", lambda x, y: x + y, [a, b]),
        ("sub", lambda x, y: x - y, [a, b]),
        ("mul", lambda x, y: x * y, [a, b]),
        ("div", lambda x, y: x / y, [a, p]),
        ("outer", lambda x, y: x * y - y / (x * x + 1), [col, row]),
        ("scalar", lambda x: 3 * x - x / 2 + 1.5 - 2 / (x * x + 1), [a]),
        ("neg", lambda x: -x, [a]),
        ("pow3", lambda x: x ** 3, [a]),
        ("pow_half", lambda x: x ** 0.5, [p]),
        ("pow_neg", lambda x: x ** -2, [p]),
        ("pow_tensor", lambda x, y: x ** y, [p, t64(2, 3)]),
        ("rpow", lambda y: 2.0 ** y, [b]),
        ("sum", lambda x: x.sum(), [a]),
        ("sum_axis", lambda x: x.sum(axis=0) * x.sum(dim=1, keepdim=True), [a]),
        ("mean", lambda x: x.mean(), [a]),
        ("mean_axis", lambda x: x.mean(axis=1) ** 2, [a]),
        ("mean_keep", lambda x: x * x.mean(axis=(0, 1), keepdims=True), [a]),
        ("reshape", lambda x: x.reshape(3, 2) * x.view(-1)[:2].reshape(1, 2), [a]),
        ("getitem", lambda x: x[1] * x[:, 0:1] + x[0, ::-1] + x[[0, 0, 1]].sum(axis=0), [a]),
        ("tanh", opjit.tanh, [a]),
        ("exp_log_sqrt", lambda x: opjit.exp(x) + opjit.log(x) * opjit.sqrt(x), [p]),
        ("square", opjit.square, [a]),
        ("astype", lambda x: (x.astype("float32") * 2).astype("float64"), [a]),
    ]


@pytest.mark.parametrize("name,fn,inputs", _cases(), ids=[c[0] for c in _cases()])
def test_backward_matches_finite_differences(name, fn, inputs):
    # Through float32 the step must be large enough to survive rounding.
    eps = 1e-3 if name == "astype" else 0.0
    r = opjit.gradcheck(fn, inputs, eps=eps, atol=1e-4 if eps else 0.0)
    assert r, r


def test_broadcast_grads_are_summed_back():
    x = opjit.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    b = opjit.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    c = opjit.tensor(np.array([[10.0], [20.0]]), requires_grad=True)
    s = opjit.tensor(np.array(2.0), requires_grad=True)
    ((x + b) * c * s).sum().backward()
    assert b.grad.shape == (3,) and c.grad.shape == (2, 1) and s.grad.shape == ()
    np.testing.assert_allclose(x.grad, np.broadcast_to(c.data * 2, (2, 3)))
    np.testing.assert_allclose(b.grad, (c.data * 2).sum() * np.ones(3))
    np.testing.assert_allclose(c.grad, ((x.data + b.data) * 2).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(s.grad, ((x.data + b.data) * c.data).sum())


def test_grads_accumulate_and_keep_dtypes():
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    (x * x).sum().backward()
    (x * 3).sum().backward()
    assert isinstance(x.grad, np.ndarray) and x.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad, 2 * x.data + 3)


def test_grad_of_intermediate_and_unused():
    x = opjit.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    w = opjit.tensor(np.array([1.0]), requires_grad=True)
    h = x * 2
    y = (h * h).sum()
    gh, gx, gw = opjit.grad(y, [h, x, w])
    np.testing.assert_allclose(gh, 2 * h.data)
    np.testing.assert_allclose(gx, 8 * x.data)
    assert gw is None and x.grad is None  # grad() leaves .grad alone
    with pytest.raises(opjit.InvalidArgument, match="not used"):
        opjit.grad((x * 2).sum(), [w], allow_unused=False)


def test_retain_graph_false_frees_the_graph():
    x = opjit.tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x).mean()
    y.backward()
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.backward()
    assert "a second time" in str(e.value) and "retain_graph=True" in str(e.value)
    z = (x ** 3).sum()
    x.grad = None
    z.backward(retain_graph=True)
    z.backward()
    np.testing.assert_allclose(x.grad, 2 * 3 * x.data ** 2)


# ---- daemon ops and the math together ------------------------------------------------

def test_daemon_op_then_mean_backward(client, grad_ops, backward_supported):
    square, mul = client.op("square"), client.op("mul")
    data = np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]], np.float32)
    x = opjit.tensor(data, requires_grad=True)
    y = square(x)
    assert isinstance(y, opjit.Tensor) and y.grad_fn is not None
    y.mean().backward()
    np.testing.assert_allclose(x.grad, 2 * data / data.size, rtol=1e-6)

    # Math before and after daemon ops, and a broadcast operand.
    x.grad = None
    w = opjit.tensor(np.array([2.0, 3.0, 4.0], np.float32), requires_grad=True)
    z = mul(square(x * 0.5), w + 0 * x) - x
    loss = (z[:, 1:] ** 2).sum() / 4
    loss.backward()
    zd = (data * 0.5) ** 2 * w.data - data
    dz = np.zeros_like(data)
    dz[:, 1:] = 2 * zd[:, 1:] / 4
    np.testing.assert_allclose(x.grad, dz * (2 * (data * 0.5) * 0.5 * w.data - 1), rtol=1e-5)
    np.testing.assert_allclose(w.grad, (dz * (data * 0.5) ** 2).sum(axis=0), rtol=1e-5)


def test_daemon_op_graph_freed_without_retain(client, grad_ops, backward_supported):
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y = client.op("square")(x).sum()
    y.backward()
    with pytest.raises(opjit.FailedPrecondition, match="retain_graph=True"):
        y.backward()

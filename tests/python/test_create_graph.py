"""create_graph and retain_graph in the Python API (issue 29 item 5).

Double backward end to end: through client-side Tensor math (whose backward
is written in recorded Tensor ops), and through a daemon op whose bprop has
its own bprop (square -> square_grad -> square_grad_grad, registered from
kernels/examples/*.json), where the server keeps a context on the bprop call.
Second-order checks: d2/dx2 of x**3, and opjit.gradgradcheck.
"""

import os

import numpy as np
import pytest

import opjit

from conftest import EXAMPLES, free_port

NS = "cg29"  # the JSON ops' own namespace: grad_ops registers another `square`


@pytest.fixture(scope="module")
def dd_client(daemon):
    with opjit.Client(daemon.unix_address, namespace=NS, timeout=120) as c:
        for name in ("square_grad_grad", "square_grad", "square"):
            c.register(os.path.join(EXAMPLES, name + ".json"))
        yield c


# ---- client-side math ---------------------------------------------------------------

def test_second_derivative_of_cube():
    data = np.array([-1.5, 0.5, 2.0])
    x = opjit.tensor(data, requires_grad=True)
    y = (x ** 3).sum()
    g, = opjit.grad(y, x, create_graph=True)
    assert isinstance(g, opjit.Tensor) and g.grad_fn is not None
    np.testing.assert_allclose(g.numpy(), 3 * data ** 2)
    gg, = opjit.grad(g.sum(), x)
    np.testing.assert_allclose(gg, 6 * data)
    # Numerically: central differences of the analytic first derivative.
    eps = 1e-5
    num = ((3 * (data + eps) ** 2) - (3 * (data - eps) ** 2)) / (2 * eps)
    np.testing.assert_allclose(gg, num, rtol=1e-8)


def test_backward_create_graph_then_backward_of_grad():
    data = np.array([0.3, -0.7, 1.1])
    x = opjit.tensor(data, requires_grad=True)
    (opjit.tanh(x) * x).sum().backward(create_graph=True)
    g = x.grad
    assert isinstance(g, opjit.Tensor) and g.grad_fn is not None
    t = np.tanh(data)
    np.testing.assert_allclose(g.numpy(), t + x.data * (1 - t * t))
    x.grad = None
    g.sum().backward()
    # d/dx [tanh + x (1 - tanh^2)] = 2 (1 - tanh^2) - 2 x tanh (1 - tanh^2)
    np.testing.assert_allclose(x.grad, 2 * (1 - t * t) - 2 * data * t * (1 - t * t), rtol=1e-12)


def test_third_order():
    x = opjit.tensor(np.array([1.0, 2.0]), requires_grad=True)
    g1, = opjit.grad((x ** 4).sum(), x, create_graph=True)
    g2, = opjit.grad(g1.sum(), x, create_graph=True)
    g3, = opjit.grad(g2.sum(), x)
    np.testing.assert_allclose(g3, 24 * x.data)


GG_CASES = [
    ("cube", lambda x: x ** 3, [np.array([-1.5, 0.5, 2.0])]),
    ("tanh_mean", lambda x: opjit.tanh(x).mean() * x.sum(), [np.array([[0.1, -0.4], [0.9, 1.3]])]),
    ("div_broadcast", lambda x, y: (x / (y * y + 1)).sum(axis=0),
     [np.array([[0.1, -0.4, 0.2], [0.9, 1.3, -2.0]]), np.array([0.5, -1.0, 2.0])]),
    ("exp_log_sqrt_slice", lambda x: opjit.exp(x[1:]) * opjit.log(x[:2]) + opjit.sqrt(x)[0],
     [np.array([0.5, 1.5, 2.5])]),
    ("reshape_pow", lambda x, y: (x.reshape(3, 2) ** y).mean(), [np.array([0.5, 1., 1.5, 2., 2.5, 3.]),
                                                                 np.array([[1.5, 2.5]])]),
]


@pytest.mark.parametrize("name,fn,arrays", GG_CASES, ids=[c[0] for c in GG_CASES])
def test_gradgradcheck_client_math(name, fn, arrays):
    inputs = [opjit.tensor(a, requires_grad=True) for a in arrays]
    assert opjit.gradcheck(fn, inputs)
    r = opjit.gradgradcheck(fn, inputs)
    assert r and r.order == 2, r


def test_gradgradcheck_catches_a_wrong_second_derivative():
    class Cube(opjit.Function):  # right first derivative, wrong second: the grad is a constant
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return opjit.Tensor(x.numpy() ** 3)

        @staticmethod
        def backward(ctx, dy):
            x, = ctx.saved_tensor()
            return dy * opjit.Tensor(3 * x.numpy() ** 2)  # detached from x

    x = opjit.tensor(np.array([0.5, 1.5]), requires_grad=True)
    assert opjit.gradcheck(Cube.apply, [x])
    r = opjit.gradgradcheck(Cube.apply, [x])
    assert not r and not r.inputs[0].passed


def test_function_backward_is_recorded_under_create_graph():
    class Cube(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return opjit.Tensor(x.numpy() ** 3)

        @staticmethod
        def backward(ctx, dy):
            x, = ctx.saved_tensor()
            return dy * 3 * x ** 2

    x = opjit.tensor(np.array([0.5, 1.5]), requires_grad=True)
    assert opjit.gradgradcheck(Cube.apply, [x])
    g, = opjit.grad(Cube.apply(x).sum(), x, create_graph=True)
    gg, = opjit.grad(g.sum(), x)
    np.testing.assert_allclose(gg, 6 * x.data)


def test_retain_graph_defaults_to_create_graph_and_errors_when_freed():
    x = opjit.tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x ** 3).sum()
    opjit.grad(y, x, create_graph=True)
    opjit.grad(y, x)  # kept by create_graph; this one frees it
    with pytest.raises(opjit.FailedPrecondition) as e:
        opjit.grad(y, x)
    msg = str(e.value)
    assert "SumBackward a second time" in msg and "pass retain_graph=True" in msg


# ---- daemon ops: the bprop's bprop ----------------------------------------------------

def test_daemon_double_backward(dd_client, backward_supported):
    square = dd_client.op("square")
    data = np.array([3.0, -1.0, 0.5], np.float32)
    x = opjit.tensor(data, requires_grad=True)
    y = square(x)
    g, = opjit.grad(y, x, grad_outputs=np.full(3, 2.0, np.float32), create_graph=True)
    np.testing.assert_allclose(g.numpy(), 2 * data * 2)  # dx = 2 x dy
    assert g.grad_fn is not None and g.grad_fn.name() == "square_gradBackward"
    # d/dx sum(2 x dy) = 2 dy = 4 (as autograd_it_test's RetainAndDoubleBackward)
    gg, = opjit.grad(g.sum(), x)
    np.testing.assert_allclose(gg, np.full(3, 4.0))


def test_daemon_double_backward_through_mean(dd_client, backward_supported):
    square = dd_client.op("square")
    data = np.array([[1.0, 2.0], [-3.0, 0.25]], np.float32)
    x = opjit.tensor(data, requires_grad=True)
    square(x).mean().backward(create_graph=True)
    g = x.grad
    np.testing.assert_allclose(g.numpy(), 2 * data / 4, rtol=1e-6)
    x.grad = None
    (g * g).sum().backward()  # d/dx sum((x/2)^2) = x/2
    np.testing.assert_allclose(x.grad, data / 2, rtol=1e-6)


def test_daemon_gradgradcheck(dd_client, backward_supported):
    square = dd_client.op("square")
    x = opjit.tensor(np.array([0.5, -1.25, 2.0], np.float32), requires_grad=True)
    fn = lambda t: square(t * 1.5) * t  # noqa: E731  (daemon op and client math)
    assert opjit.gradcheck(fn, [x])
    r = opjit.gradgradcheck(fn, [x])
    assert r, r


def test_daemon_retain_graph_false_frees_the_context(dd_client, backward_supported):
    square = dd_client.op("square")
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y = square(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad, 2 * (2 * x.data))
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.backward()
    assert "a second time" in str(e.value) and "retain_graph=True" in str(e.value)


def test_daemon_bprop_without_its_own_bprop(client, grad_ops, backward_supported):
    # grad_ops' square_grad has no bprop: the first backward works, the second says why not.
    x = opjit.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    g, = opjit.grad(client.op("square")(x).sum(), x, create_graph=True)
    np.testing.assert_allclose(g.numpy(), 2 * x.data)
    with pytest.raises(opjit.FailedPrecondition) as e:
        opjit.grad(g.sum(), x)
    assert e.value.reason == "NOT_DIFFERENTIABLE" and "square_grad" in str(e.value)


def test_daemon_double_backward_through_a_routed_client(daemon, dd_client, backward_supported):
    # Several addresses (the first dead): the bprop's context is used where it was kept.
    dead = "127.0.0.1:%d" % free_port()
    with opjit.Client([dead, daemon.tcp_address], namespace=NS, timeout=60,
                      health_timeout=0.5) as c:
        x = opjit.tensor(np.array([2.0, -0.5], np.float32), requires_grad=True)
        g, = opjit.grad((c.op("square")(x) * 3).sum(), x, create_graph=True)
        np.testing.assert_allclose(g.numpy(), 6 * x.data)
        gg, = opjit.grad(g.sum(), x)
        np.testing.assert_allclose(gg, np.full(2, 6.0))

"""Backward on the fast path (issue 30 goal 1).

With a fast channel open, a forward that records a gradient is a plain
channel call and the client keeps the tensors the bprop reads
(opjit.op.ClientOpNode); the backward is the bprop's own op call, with no
Backward RPC and no context on the daemon. These tests check that this path
is the one taken (call_counts: "client_backward" against "backward", the
Backward RPCs), that its gradients equal the daemon-context path's and an
analytic reference, and that everything the context path does still holds:
save_for_backward's null slots, stop_gradient grads, retain_graph, create_graph
(double backward, also across a bprop the client cannot run), the fallback
without a channel, and a clear error when the daemon is gone.
"""

import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest

import opjit

from conftest import EXAMPLES, Daemon, example_source, opjitd_binary

NS = "fbw"
F32 = opjit.DataType.F32_Default
X = np.array([0.5, -1.25, 2.0, 3.5], np.float32)
G = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def renamed(example, name, bprop=None):
    """kernels/examples/<example>.json as op `name`, its backward op `bprop`
    saving everything (none without bprop)."""
    with open(os.path.join(EXAMPLES, example + ".json")) as f:
        spec = json.load(f)
    impl = spec["implementations"][0]
    impl["source"] = example_source(impl.pop("source_file"))
    spec["name"] = name
    spec.pop("backward", None)
    if bprop:
        spec["backward"] = {"op": bprop}
    return spec


def register_ops(c):
    # tanh saves only y: tanh_grad's optional x is a null slot.
    c.register(os.path.join(EXAMPLES, "tanh_grad.json"))
    c.register(os.path.join(EXAMPLES, "tanh.json"))
    # The square chain saving everything: every backward runs from the client.
    c.register(renamed("square_grad_grad", "fb_sqgg"))
    c.register(renamed("square_grad", "fb_sqg", "fb_sqgg"))
    c.register(renamed("square", "fb_sq", "fb_sqg"))
    # The examples' own square chain: square saves x only, and square_grad's
    # y is required, so a null there is no op call's: the daemon keeps the context.
    for name in ("square_grad_grad", "square_grad", "square"):
        c.register(os.path.join(EXAMPLES, name + ".json"))
    # Saves everything, but its bprop is that square_grad (saving x and dy).
    c.register(renamed("square", "fb_sq_mixed", "square_grad"))
    mul = example_source("mul.cc")
    for suffix, policy in (("", None), ("_strict", "error")):
        c.register(opjit.CustomRegOp("fb_mul_grad").input(0, "x").input(1, "w").input(2, "y")
                   .input(3, "dy").output(0, "dx").output(1, "dw").dtype_format(*[F32] * 6)
                   .target("CPU").impl(source=mul, entry="MulGrad")
                   .output_rule("same_as", input=0).output_rule("same_as", input=1))
        c.register(opjit.CustomRegOp("fb_mul" + suffix).input(0, "x").input(1, "w")
                   .output(0, "y").dtype_format(F32, F32, F32).target("CPU")
                   .impl(source=mul, entry="Mul").output_rule("same_as", input=0)
                   .bprop("fb_mul_grad", stop_gradient_grads=policy))


@pytest.fixture(scope="module")
def ops(daemon):
    with opjit.Client(daemon.unix_address, namespace=NS, timeout=120) as c:
        register_ops(c)
    return True


@pytest.fixture
def fast(daemon, ops):
    with opjit.Client(daemon.unix_address, namespace=NS, timeout=120, fast="on") as c:
        yield c


@pytest.fixture
def slow(daemon, ops):
    with opjit.Client(daemon.unix_address, namespace=NS, timeout=120, fast="off") as c:
        yield c


def delta(c, before):
    after = c.call_counts()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def tanh_grad_of(c, x=X, g=G):
    t = opjit.tensor(x, requires_grad=True)
    c.op("tanh")(t).backward(g)
    return t.grad


def test_tanh_backward_runs_from_the_client(fast, slow):
    before = fast.call_counts()
    got = tanh_grad_of(fast)
    d = delta(fast, before)
    assert d["client_backward"] == 1 and d["backward"] == 0, d  # no Backward RPC
    assert d["fast"] == 2 and d["handle"] == 0 and d["grpc"] == 0, d
    y = np.tanh(X)
    np.testing.assert_allclose(got, G * (1 - y * y), rtol=1e-5)
    before = slow.call_counts()
    want = tanh_grad_of(slow)  # the daemon's context and its Backward RPC
    assert delta(slow, before)["backward"] == 1
    np.testing.assert_array_equal(got, want)


def test_big_tensors_take_the_same_path(fast, slow):
    x = np.linspace(-3, 3, 200_000, dtype=np.float32)
    g = np.cos(x).astype(np.float32)
    before = fast.call_counts()
    got = tanh_grad_of(fast, x, g)
    d = delta(fast, before)
    assert d["client_backward"] == 1 and d["backward"] == 0 and d["fast"] == 2, d
    np.testing.assert_array_equal(got, tanh_grad_of(slow, x, g))


def test_saved_tensors_are_a_snapshot(fast):
    # Like the daemon's context: changing the arrays after the forward does
    # not change the gradient.
    data = X.copy()
    x = opjit.tensor(data, requires_grad=True)
    y = fast.op("fb_sq")(x)
    data[:] = 100
    y.data[:] = -7
    y.backward(G)
    np.testing.assert_allclose(x.grad, 2 * X * G)


def test_two_inputs_and_stop_gradient_warning(fast, slow):
    for c in (fast, slow):
        x = opjit.tensor(X, requires_grad=True)
        w = opjit.tensor(G)  # stop_gradient
        before = c.call_counts()
        y = c.op("fb_mul")(x, w)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            y.backward(np.ones(4, np.float32))
        np.testing.assert_array_equal(x.grad, G)
        assert w.grad is None
        msgs = [str(s.message) for s in seen if issubclass(s.category, opjit.OpjitWarning)]
        assert len(msgs) == 1 and "input w" in msgs[0] and "dropped" in msgs[0], msgs
        d = delta(c, before)
        assert (d["client_backward"], d["backward"]) == ((1, 0) if c is fast else (0, 1)), d
    assert issubclass(seen[0].category, opjit.OpjitWarning)


def test_stop_gradient_grads_error(fast):
    x = opjit.tensor(X, requires_grad=True)
    w = opjit.tensor(G)
    y = fast.op("fb_mul_strict")(x, w)
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.backward(np.ones(4, np.float32))
    assert e.value.reason == "STOP_GRADIENT_GRAD" and e.value.metadata.get("input") == "w"
    # A zero grad carries nothing: no error.
    y = fast.op("fb_mul_strict")(x, w)
    g, = opjit.grad(y, x, grad_outputs=[np.zeros(4, np.float32)])
    np.testing.assert_array_equal(g, np.zeros(4, np.float32))


def test_both_inputs_and_a_grad_of_the_wrong_dtype(fast):
    x = opjit.tensor(X, requires_grad=True)
    w = opjit.tensor(G, requires_grad=True)
    y = fast.op("fb_mul")(x, w)
    (y * 3).sum().backward()
    np.testing.assert_allclose(x.grad, 3 * G)
    np.testing.assert_allclose(w.grad, 3 * X)
    # A float64 grad for the float32 output is cast to float32, as torch does with
    # y.backward(gradient) (issue 40); one of another shape is refused.
    y = fast.op("fb_mul")(x, w)
    x.grad = w.grad = None
    y.backward(np.ones(4, np.float64))
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad, G)
    y = fast.op("fb_mul")(x, w)
    with pytest.raises(opjit.InvalidArgument) as e:
        y.backward(np.ones(2, np.float32))
    assert "[2]" in str(e.value) and "[4]" in str(e.value)


def test_retain_graph(fast):
    x = opjit.tensor(X, requires_grad=True)
    y = fast.op("fb_sq")(x)
    y.backward(G, retain_graph=True)
    y.backward(G)
    np.testing.assert_allclose(x.grad, 4 * X * G)
    with pytest.raises(opjit.FailedPrecondition) as e:
        y.backward(G)
    assert "second time" in str(e.value)


def test_double_backward_from_the_client(fast, slow):
    results = []
    for c in (fast, slow):
        before = c.call_counts()
        x = opjit.tensor(X, requires_grad=True)
        y = c.op("fb_sq")(x)
        g, = opjit.grad(y, x, grad_outputs=[G], create_graph=True)
        assert isinstance(g, opjit.Tensor) and g.grad_fn is not None
        np.testing.assert_allclose(g.numpy(), 2 * X * G)
        gg, = opjit.grad((g * g).sum(), x)  # d/dx sum((2 x G)^2) = 8 x G^2
        np.testing.assert_allclose(gg, 8 * X * G * G, rtol=1e-6)
        # Backwards: fb_sq's, then fb_sqg's and fb_sq's again (the bprop's
        # y input is fb_sq's output: its zero grad_y goes back through fb_sq).
        results.append((g.numpy().copy(), gg, delta(c, before)))
    (g1, gg1, d1), (g2, gg2, d2) = results
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_array_equal(gg1, gg2)
    assert d1["backward"] == 0 and d1["client_backward"] == 3, d1
    assert d2["backward"] == 3 and d2["client_backward"] == 0, d2


def test_a_bprop_the_client_cannot_run_keeps_the_daemon_context(fast):
    # square saves x only: square_grad's required y would be a null slot.
    x = opjit.tensor(X, requires_grad=True)
    before = fast.call_counts()
    y = fast.op("square")(x)
    assert y.grad_fn.context_id  # the daemon's context
    g, = opjit.grad(y, x, grad_outputs=[G], create_graph=True)
    np.testing.assert_allclose(g.numpy(), 2 * X * G)
    gg, = opjit.grad(g.sum(), x)
    np.testing.assert_allclose(gg, 2 * G)
    d = delta(fast, before)
    assert d["backward"] == 2 and d["client_backward"] == 0, d


def test_the_client_path_records_a_bprop_that_keeps_a_daemon_context(fast):
    # The first backward runs from the client and records square_grad's
    # call, whose own backward needs a null y: that call keeps a daemon context.
    x = opjit.tensor(X, requires_grad=True)
    before = fast.call_counts()
    y = fast.op("fb_sq_mixed")(x)
    assert not getattr(y.grad_fn, "context_id", "")
    g, = opjit.grad(y, x, grad_outputs=[G], create_graph=True)
    gg, = opjit.grad(g.sum(), x)
    np.testing.assert_allclose(gg, 2 * G)
    d = delta(fast, before)
    # fb_sq_mixed's backward twice (the second for grad_y), square_grad's once.
    assert d["client_backward"] == 2 and d["backward"] == 1, d


def test_no_channel_keeps_the_daemon_context(slow):
    x = opjit.tensor(X, requires_grad=True)
    before = slow.call_counts()
    y = slow.op("tanh")(x)
    assert y.grad_fn.context_id
    y.backward(G)
    d = delta(slow, before)
    assert d["backward"] == 1 and d["client_backward"] == 0 and d["fast"] == 0, d


def test_a_daemon_gone_before_backward_is_a_clear_error(ops):
    state = tempfile.mkdtemp(prefix="opjit-fbw-")
    d = Daemon(opjitd_binary(), state)
    d.start()
    try:
        with opjit.Client(d.unix_address, namespace=NS, timeout=20, fast="on") as c:
            register_ops(c)
            x = opjit.tensor(X, requires_grad=True)
            y = c.op("tanh")(x)
            d.stop()
            with pytest.raises(opjit.OpjitError) as e:
                y.backward(G)
            assert isinstance(e.value, opjit.Unavailable), repr(e.value)
            assert x.grad is None
    finally:
        d.stop()
        shutil.rmtree(state, ignore_errors=True)

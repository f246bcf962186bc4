"""The frameworks' autograd rules on the Python tape, opjit.Function and opjit.PyLayer (issue 40, item 1).

opjit.Function follows torch.autograd.Function, opjit.PyLayer Paddle's
PyLayer (the table of differences is in opjit.autograd's docstring). Every
torch expectation here is computed live with torch, side by side, in
float64. Paddle is not installed: its expectations are written from its
documentation and its own tests (paddle/fluid/pybind/eager_py_layer.cc,
paddle/fluid/eager/pylayer/py_layer_node.cc, test/legacy_test/
test_pylayer_op.py); each such test says which documented behaviour it
encodes. No test here needs a daemon.
"""

import warnings

import numpy as np
import pytest

import opjit
from opjit import autograd as ag
from opjit._grad_rules import GradShapeError

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the torch comparisons)")

RNG = np.random.default_rng(40)


def raises_like_torch(torch_fn, opjit_fn, match=None):
    """Both raise, opjit's error is an instance of torch's type (and an opjit error)."""
    with pytest.raises(Exception) as want:
        torch_fn()
    with pytest.raises(type(want.value), match=match) as got:
        opjit_fn()
    assert isinstance(got.value, opjit.OpjitError), got.value
    return want.value, got.value


# ---- 1. double backward through saved outputs, vs torch -----------------------------
#
# Each case: forward(m, x, b) and backward(m, ctx, g) written once, run as a
# torch.autograd.Function, an opjit.Function, an opjit.PyLayer; and the
# plain math on the tape. m is the math module (torch or opjit).

def _saved(ctx):
    return ctx.saved_tensors


CASES = {
    # tanh saving its output: d2 = -2 tanh (1 - tanh^2)
    "tanh_saves_output": (
        lambda m, ctx, x, b: _save(ctx, m.tanh(x)),
        lambda m, ctx, g: (g * (1 - _saved(ctx)[0] * _saved(ctx)[0]), None),
        lambda m, x, b: m.tanh(x)),
    # x^3 saving its input
    "cube_saves_input": (
        lambda m, ctx, x, b: _save(ctx, x * x * x, x),
        lambda m, ctx, g: (g * 3 * _saved(ctx)[1] * _saved(ctx)[1], None),
        lambda m, x, b: x ** 3),
    # x^3 saving its output and input: dy/dx = 3 y / x
    "cube_saves_output": (
        lambda m, ctx, x, b: _save(ctx, x * x * x, x),
        lambda m, ctx, g: (g * 3 * _saved(ctx)[0] / _saved(ctx)[1], None),
        lambda m, x, b: x * x * x),
    # exp saving its output
    "exp_saves_output": (
        lambda m, ctx, x, b: _save(ctx, m.exp(x)),
        lambda m, ctx, g: (g * _saved(ctx)[0], None),
        lambda m, x, b: m.exp(x)),
    # x (4, 8) * b (8,): b's grad is (4, 8) and is summed to (8,) (torch's engine sum_to)
    "mul_broadcast": (
        lambda m, ctx, x, b: _save(ctx, x * b, x, b, out=False),
        lambda m, ctx, g: (g * _saved(ctx)[1], g * _saved(ctx)[0]),
        lambda m, x, b: x * b),
}


def _save(ctx, y, *more, out=True):
    ctx.save_for_backward(*(((y,) if out else ()) + more))
    return y


def _function(base, m, case):
    fwd, bwd, _ = CASES[case]

    class F(base):
        @staticmethod
        def forward(ctx, x, b):
            return fwd(m, ctx, x, b)

        @staticmethod
        def backward(ctx, g):
            return bwd(m, ctx, g)
    F.__name__ = case
    return F


def _second_order(m, f, x, b, v):
    """(first-order grads, grads of sum(v * dL/dx) + sum(dL/db)) with L = sum(f(x, b))."""
    gx, gb = m.grad(f(x, b).sum(), [x, b], create_graph=True, allow_unused=True)
    first = [gx, gb]
    s = (gx * v).sum()
    if gb is not None:
        s = s + (gb * gb).sum()
    hx, hb = m.grad(s, [x, b], allow_unused=True)
    return first, [hx, hb]


class _TorchGrad:
    tanh, exp = staticmethod(torch.tanh), staticmethod(torch.exp)

    @staticmethod
    def grad(out, ins, create_graph=False, allow_unused=True):
        return torch.autograd.grad(out, ins, create_graph=create_graph, allow_unused=allow_unused)


class _OpjitGrad:
    tanh, exp = staticmethod(opjit.tanh), staticmethod(opjit.exp)

    @staticmethod
    def grad(out, ins, create_graph=False, allow_unused=True):
        return opjit.grad(out, ins, create_graph=create_graph, allow_unused=allow_unused)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("how", ["tape", "Function", "PyLayer"])
def test_double_backward_matches_torch(case, how):
    xa = RNG.uniform(0.5, 1.5, (4, 8)) * RNG.choice([-1, 1], (4, 8))
    ba = RNG.standard_normal(8)
    va = RNG.standard_normal((4, 8))
    tx = torch.tensor(xa, requires_grad=True)
    tb = torch.tensor(ba, requires_grad=True)
    tf = _function(torch.autograd.Function, _TorchGrad, case)
    want_first, want_second = _second_order(_TorchGrad, tf.apply, tx, tb, torch.tensor(va))

    x = opjit.tensor(xa, requires_grad=True)
    b = opjit.tensor(ba, requires_grad=True)
    if how == "tape":
        f = lambda x, b: CASES[case][2](_OpjitGrad, x, b)  # noqa: E731
        if case != "mul_broadcast":
            want_first, want_second = _second_order(
                _TorchGrad, lambda x, b: CASES[case][2](_TorchGrad, x, b), tx, tb,
                torch.tensor(va))
    else:
        f = _function(getattr(opjit, how), _OpjitGrad, case).apply
    got_first, got_second = _second_order(_OpjitGrad, f, x, b, opjit.Tensor(va))
    for got, want in zip(got_first + got_second, want_first + want_second):
        if want is None:
            assert got is None or not np.any(np.asarray(got.data if isinstance(
                got, opjit.Tensor) else got))
            continue
        assert got is not None
        got = got.numpy() if isinstance(got, opjit.Tensor) else got
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-6, atol=1e-9)


def test_saved_output_is_the_output_with_its_graph():
    seen = []

    class Tanh(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            y = opjit.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            y, = ctx.saved_tensors
            seen.append(y)
            return g * (1 - y * y)

    x = opjit.tensor(RNG.standard_normal(3), requires_grad=True)
    y = Tanh.apply(x)
    y.backward(create_graph=True)
    assert seen[0] is y and seen[0].grad_fn is y.grad_fn  # torch: the saved output, unpacked
    assert x.grad.grad_fn is not None


# ---- 2. one grad per argument, needs_input_grad, a grad per output --------------------

def _per_argument(base):
    got = {}

    class F(base):
        @staticmethod
        def forward(ctx, x, n, lst, y):
            got["needs"] = ctx.needs_input_grad
            return x * y * n

        @staticmethod
        def backward(ctx, g):
            return g * 2, None, None, None
    return F, got


def test_function_one_grad_per_argument_and_needs_input_grad_like_torch():
    xa = RNG.standard_normal(3)
    tf, tgot = _per_argument(torch.autograd.Function)
    tx = torch.tensor(xa, requires_grad=True)
    tf.apply(tx, 3, [tx], torch.ones(3, dtype=torch.float64)).sum().backward()
    f, got = _per_argument(opjit.Function)
    x = opjit.tensor(xa, requires_grad=True)
    f.apply(x, 3, [x], opjit.tensor(np.ones(3))).sum().backward()
    assert got["needs"] == tgot["needs"] == (True, False, False, False)
    np.testing.assert_allclose(x.grad, tx.grad.numpy())


def test_function_keyword_arguments_come_last_and_their_grads_are_optional():
    # torch's apply takes no keywords; opjit's does: they follow the positional arguments.
    class Mul(opjit.Function):
        @staticmethod
        def forward(ctx, x, y=None, scale=1.0):
            Mul.needs = ctx.needs_input_grad
            ctx.save_for_backward(x, y)
            return x * y * scale

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return (g * y,) if Mul.short else (g * y, g * x, None)
    for short in (True, False):
        Mul.short = short
        x = opjit.tensor(np.array([2.0]), requires_grad=True)
        y = opjit.tensor(np.array([3.0]), requires_grad=True)
        Mul.apply(x, y=y, scale=1.0).sum().backward()
        assert Mul.needs == (True, True, False)
        assert x.grad == 3.0 and (y.grad is None if short else y.grad == 2.0)


def _outputs_fn(base, materialize, m):
    seen = []

    class F(base):
        @staticmethod
        def forward(ctx, x):
            if not materialize:
                ctx.set_materialize_grads(False)
            c = x * 3
            ctx.mark_non_differentiable(c)
            if m is torch:
                return x * 2, x.argmax(), 3, x > 0, c
            return x * 2, opjit.Tensor(np.argmax(x.numpy())), 3, opjit.Tensor(x.numpy() > 0), c

        @staticmethod
        def backward(ctx, ga, gi, gn, gb, gc):
            seen.append((ga, gi, gn, gb, gc))
            return ga * 2
    return F, seen


@pytest.mark.parametrize("materialize", [True, False])
def test_function_backward_gets_a_grad_per_output_like_torch(materialize):
    xa = RNG.standard_normal(3)
    tf, tseen = _outputs_fn(torch.autograd.Function, materialize, torch)
    tx = torch.tensor(xa, requires_grad=True)
    touts = tf.apply(tx)
    touts[0].sum().backward()
    f, seen = _outputs_fn(opjit.Function, materialize, opjit)
    x = opjit.tensor(xa, requires_grad=True)
    outs = f.apply(x)
    outs[0].sum().backward()
    assert [o.requires_grad if hasattr(o, "requires_grad") else None for o in outs] == \
        [o.requires_grad if hasattr(o, "requires_grad") else None for o in touts]
    assert outs[1].grad_fn is None and outs[3].grad_fn is None  # integer, bool: no gradient
    for got, want in zip(seen[0], tseen[0]):
        if want is None:
            assert got is None
            continue
        assert isinstance(got, opjit.Tensor)
        assert got.shape == tuple(want.shape)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        assert got.dtype.kind == {torch.int64: "i", torch.bool: "b"}.get(want.dtype, "f")
    np.testing.assert_allclose(x.grad, tx.grad.numpy())


def test_function_grad_count_rules_like_torch():
    def make(base, nback, extra=None):
        class F(base):
            @staticmethod
            def forward(ctx, x, y, n):
                return x * y

            @staticmethod
            def backward(ctx, g):
                out = (g, g, extra)[:nback]
                return out + (None,) * 2 if nback == 3 and extra is None else out
        return F

    def run(m, cls):
        if m is torch:
            x = torch.ones(2, dtype=torch.float64, requires_grad=True)
            cls.apply(x, torch.ones(2, dtype=torch.float64, requires_grad=True), 3).sum().backward()
        else:
            x = opjit.tensor(np.ones(2), requires_grad=True)
            cls.apply(x, opjit.tensor(np.ones(2), requires_grad=True), 3).sum().backward()

    # Too few: "incorrect number of gradients (expected 3, got 2)".
    _, err = raises_like_torch(lambda: run(torch, make(torch.autograd.Function, 2)),
                               lambda: run(opjit, make(opjit.Function, 2)),
                               match=r"incorrect number of gradients \(expected 3, got 2\)")
    assert isinstance(err, opjit.GradRuleError)
    # Trailing Nones beyond the arguments are allowed.
    run(torch, make(torch.autograd.Function, 3))
    run(opjit, make(opjit.Function, 3))
    # A gradient for the non-Tensor argument n.
    raises_like_torch(lambda: run(torch, make(torch.autograd.Function, 3, extra=torch.ones(2))),
                      lambda: run(opjit, make(opjit.Function, 3, extra=np.ones(2))),
                      match="different than None at position 3")

    class NotAGrad(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return 3

    class TNotAGrad(torch.autograd.Function):
        forward, backward = NotAGrad.forward, NotAGrad.backward
    raises_like_torch(
        lambda: TNotAGrad.apply(torch.ones(2, requires_grad=True)).sum().backward(),
        lambda: NotAGrad.apply(opjit.tensor(np.ones(2), requires_grad=True)).sum().backward())


def test_an_output_returned_twice_is_one_tensor_like_torch():
    def make(base):
        class Twice(base):
            @staticmethod
            def forward(ctx, x, y):
                o = x * 2
                return o, o, y

            @staticmethod
            def backward(ctx, g1, g2, gy):
                return g1 * 2 + g2 * 2, gy if ctx.needs_input_grad[1] else None
        return Twice
    tx = torch.ones(2, dtype=torch.float64, requires_grad=True)
    ta, tb, tc = make(torch.autograd.Function).apply(tx, torch.ones(2, dtype=torch.float64))
    (ta + tb + tc).sum().backward()
    for base in (opjit.Function, opjit.PyLayer):
        x = opjit.tensor(np.ones(2), requires_grad=True)
        y = opjit.tensor(np.ones(2))
        a, b, c = make(base).apply(x, y)
        assert (a is b) == (ta is tb) is True
        # An input returned unchanged: in torch a new tensor (a view), in Paddle (in place)
        # y itself; either way it carries the node.
        assert (c is y) == (base is opjit.PyLayer) and c.grad_fn is a.grad_fn
        assert c.requires_grad == tc.requires_grad is True
        (a + b + c).sum().backward()
        np.testing.assert_array_equal(x.grad, tx.grad.numpy())


def test_function_forward_without_a_tensor_output_like_torch():
    class NoTensor(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            return x.shape

    class TNoTensor(torch.autograd.Function):
        forward = NoTensor.forward
    assert NoTensor.apply(opjit.tensor(np.ones(3), requires_grad=True)) == (3,) == tuple(
        TNoTensor.apply(torch.ones(3, requires_grad=True)))


# ---- 3. a grad is summed to its input, cast to its dtype, refused with both shapes ----

def _returns(base, make_grad):
    class F(base):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return make_grad(g)
    return F


def test_broadcast_grad_is_summed_like_torch():
    tx = torch.ones(3, dtype=torch.float64, requires_grad=True)
    _returns(torch.autograd.Function,
             lambda g: torch.ones(4, 3, dtype=torch.float64)).apply(tx).sum().backward()
    for base in (opjit.Function, opjit.PyLayer):
        x = opjit.tensor(np.ones(3), requires_grad=True)
        _returns(base, lambda g: np.ones((4, 3))).apply(x).sum().backward()
        np.testing.assert_array_equal(x.grad, tx.grad.numpy())
        assert x.grad.shape == (3,)


def test_float16_grad_lands_in_a_float32_leaf_as_float32():
    tx = torch.ones(3, dtype=torch.float32, requires_grad=True)
    _returns(torch.autograd.Function, lambda g: g.half()).apply(tx).sum().backward()
    for base in (opjit.Function, opjit.PyLayer):
        x = opjit.tensor(np.ones(3, np.float32), requires_grad=True)
        _returns(base, lambda g: g.astype("float16")).apply(x).sum().backward()
        assert x.grad.dtype == np.float32 and tx.grad.dtype == torch.float32
        np.testing.assert_array_equal(x.grad, tx.grad.numpy())


def test_a_grad_that_cannot_be_summed_is_refused_naming_the_input():
    for base in (opjit.Function, opjit.PyLayer):
        x = opjit.tensor(np.ones(3), requires_grad=True)
        y = _returns(base, lambda g: np.ones(4)).apply(x)
        with pytest.raises(GradShapeError) as e:
            y.sum().backward()
        # torch: "returned an invalid gradient at index 0 - got [4] but expected shape
        # compatible with [3]", a RuntimeError.
        assert isinstance(e.value, RuntimeError)
        assert "input 0" in str(e.value) and "[4]" in str(e.value) and "[3]" in str(e.value)
        assert e.value.metadata["grad_shape"] == "[4]"


class _BiasNode(ag.Node):
    """A tape node whose backward gives a (4, 8) grad for its (8,) bias, as a
    registered bprop may (opjit.torch sums it; so must the tape)."""

    def apply(self, grads, retain_graph, create_graph=False):
        return [grads[0], grads[0] * 1]


def test_tape_node_grad_for_a_broadcast_input_is_summed():
    x = opjit.tensor(RNG.standard_normal((4, 8)), requires_grad=True)
    b = opjit.tensor(RNG.standard_normal(8), requires_grad=True)
    y = opjit.Tensor(x.numpy() + b.numpy())
    y.grad_fn, y.requires_grad = _BiasNode([x, b], [((4, 8), np.dtype(np.float64))]), True
    (y * y).sum().backward()
    np.testing.assert_allclose(b.grad, (2 * y.numpy()).sum(0))
    assert b.grad.shape == (8,)
    np.testing.assert_allclose(x.grad, 2 * y.numpy())


def test_bprop_check_grad_sums_and_casts():
    from opjit._bprop import check_grad

    class Plan:
        out_names = ["y"]
    g = check_grad(Plan, 0, np.ones((4, 8), np.float64), ((8,), np.dtype(np.float32)), "ns/op")
    assert g.shape == (8,) and g.dtype == np.float32 and np.all(g == 4)
    with pytest.raises(GradShapeError, match="y"):
        check_grad(Plan, 0, np.ones((4, 7)), ((8,), np.dtype(np.float64)), "ns/op")


def test_root_grad_of_another_shape_is_refused_like_torch():
    raises_like_torch(
        lambda: (torch.ones(3, requires_grad=True) * 2).backward(torch.ones(2)),
        lambda: (opjit.tensor(np.ones(3), requires_grad=True) * 2).backward(np.ones(2)),
        match="Mismatch in shape")


# ---- 4. integer and bool outputs -----------------------------------------------------

def test_integer_outputs_of_a_function_are_not_differentiable_like_torch():
    class ArgMax(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            return opjit.Tensor(np.argmax(x.numpy())), opjit.Tensor(x.numpy() > 0), x * 2

        @staticmethod
        def backward(ctx, gi, gb, g):
            return g * 2

    class TArgMax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.argmax(), x > 0, x * 2
    x = opjit.tensor(np.array([1.0, 3.0]), requires_grad=True)
    tx = torch.tensor([1.0, 3.0], requires_grad=True)
    got, want = ArgMax.apply(x), TArgMax.apply(tx)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [False, False, True]
    assert got[0].grad_fn is None and got[1].grad_fn is None


@pytest.mark.parametrize("dtype", ["bool", "float16", "float32", "float64", "uint8", "int32",
                                   "int64"])
def test_pylayer_integer_outputs_carry_the_grad_through_a_cast(dtype):
    # Paddle's test_pylayer_dtype: forward casts x to `dtype`, backward returns dy; after
    # paddle.cast(z, "float32") and z.sum().backward(), x.grad is not None (Paddle sets
    # stop_gradient False on every PyLayer output, whatever its dtype).
    class Cast(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x, dtype):
            return x.astype(dtype)

        @staticmethod
        def backward(ctx, dy):
            return dy

    x = opjit.tensor(RNG.standard_normal((2, 3)).astype(np.float32))
    x.stop_gradient = False
    z = Cast.apply(x, dtype)
    assert not z.stop_gradient
    z = z.astype("float32")
    z.sum().backward()
    assert x.grad is not None and x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad, np.ones((2, 3)))


# ---- 5. in place: versions, mark_dirty, saved tensors, leaves --------------------------

def test_every_inplace_op_bumps_the_version():
    t = opjit.tensor(np.ones(3))
    assert t._version == 0
    steps = [lambda t: t.__iadd__(1), lambda t: t.__isub__(1), lambda t: t.__imul__(2),
             lambda t: t.__itruediv__(2), lambda t: t.__setitem__(0, 5.0), lambda t: t.add_(1),
             lambda t: t.sub_(1), lambda t: t.mul_(1), lambda t: t.div_(1), lambda t: t.zero_(),
             lambda t: t.fill_(2.0), lambda t: t.copy_(np.arange(3.0)), lambda t: t._bump_version()]
    for k, step in enumerate(steps, 1):
        before = t
        step(t)
        assert t is before and t._version == k
    np.testing.assert_array_equal(t.numpy(), [0, 1, 2])
    d = t.detach()
    d += 1  # detach shares data and version counter, as in torch
    assert t._version == d._version == len(steps) + 1
    np.testing.assert_array_equal(t.numpy(), [1, 2, 3])


def test_inplace_ops_are_recorded_like_torch():
    xa, ba = RNG.standard_normal((2, 3)), RNG.standard_normal(3)

    def f(x, b):
        y = x * 2
        y += b
        y *= x
        y[0, 1:] = b[:2] * 3
        y -= 1
        y /= b * b + 1
        y.mul_(b)
        return y.sum()
    x, b = opjit.tensor(xa, requires_grad=True), opjit.tensor(ba, requires_grad=True)
    f(x, b).backward()
    tx, tb = torch.tensor(xa, requires_grad=True), torch.tensor(ba, requires_grad=True)
    f(tx, tb).backward()
    np.testing.assert_allclose(x.grad, tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(b.grad, tb.grad.numpy(), rtol=1e-12)

    def square_in_place(m):  # y *= y reads the y it modifies: torch refuses at backward
        x = (torch.ones(3, dtype=torch.float64, requires_grad=True) if m is torch
             else opjit.tensor(np.ones(3), requires_grad=True))
        y = x * 2
        y *= y
        y.sum().backward()
    raises_like_torch(lambda: square_in_place(torch), lambda: square_in_place(opjit),
                      match="modified by an inplace operation")


def test_a_leaf_that_requires_grad_cannot_be_modified_in_place_like_torch():
    for op in (lambda t: t.__iadd__(1), lambda t: t.__setitem__(0, 1.0), lambda t: t.mul_(2)):
        _, err = raises_like_torch(lambda: op(torch.ones(2, requires_grad=True)),
                                   lambda: op(opjit.tensor(np.ones(2), requires_grad=True)),
                                   match="leaf")
        assert isinstance(err, ValueError)  # Paddle: ValueError ("Leaf Var ... inplace")
    w = opjit.tensor(np.ones(2), requires_grad=True)
    with opjit.no_grad():  # an optimizer step
        w -= 0.5
    assert w._version == 1 and w.is_leaf and w.requires_grad


def test_views_share_the_version_and_are_not_modified_in_place_in_a_graph():
    # torch: a slice shares its base's version counter; an in-place op on a view of a
    # leaf that requires grad raises. On a view of a non-leaf torch rewrites the base's
    # history; the tape refuses instead of giving the base a wrong gradient.
    raises_like_torch(lambda: torch.ones(4, requires_grad=True)[1:].add_(1),
                      lambda: opjit.tensor(np.ones(4), requires_grad=True)[1:].add_(1),
                      match="view of a leaf Variable")
    a = opjit.tensor(np.ones(4))
    v = a[1:]
    v += 1
    assert a._version == v._version == 1
    np.testing.assert_array_equal(a.numpy(), [1, 2, 2, 2])
    x = opjit.tensor(np.ones(4), requires_grad=True)
    t = x * 1
    with pytest.raises(opjit.GradRuleError, match="view"):
        t.reshape(2, 2)[0] = opjit.tensor(np.ones(2), requires_grad=True)
    tx = torch.ones(4, requires_grad=True)
    with opjit.no_grad(), torch.no_grad():
        x[1:] -= 0.5  # an optimizer step through a view: -= on the slice, then setitem
        tx[1:] -= 0.5
    np.testing.assert_array_equal(x.numpy(), tx.detach().numpy())
    assert x._version == tx._version == 2


def test_a_saved_tensor_modified_in_place_raises_naming_it_like_torch():
    def make(base):
        class Square(base):
            @staticmethod
            def forward(ctx, a):
                ctx.save_for_backward(a)
                return a * a

            @staticmethod
            def backward(ctx, g):
                a, = ctx.saved_tensors
                return 2 * a * g
        return Square

    def run(m, base):
        x = (torch.ones(3, dtype=torch.float64, requires_grad=True) if m is torch
             else opjit.tensor(np.ones(3), requires_grad=True))
        a = x * 1
        y = make(base).apply(a)
        a.add_(1)
        y.sum().backward()
    _, err = raises_like_torch(lambda: run(torch, torch.autograd.Function),
                               lambda: run(opjit, opjit.Function),
                               match="modified by an inplace operation")
    assert isinstance(err, opjit.SavedTensorModifiedError)
    assert "saved tensor 0" in str(err) and "float64[3]" in str(err) and "version 1" in str(err)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(opjit, opjit.PyLayer)
    # The tape's own ops: * reads both operands, tanh its output (torch's saved tensors).
    for reads_output in (False, True):
        a = opjit.tensor(np.ones(3), requires_grad=True) * 1
        y = opjit.tanh(a) if reads_output else a * opjit.tensor(np.ones(3), requires_grad=True)
        with opjit.no_grad():
            (y if reads_output else a).add_(1)
        with pytest.raises(opjit.SavedTensorModifiedError, match="needed by (Tanh|Mul)Backward"):
            (y * 1).sum().backward()


def _dirty_fn(base, ret_self=True):
    class Dirty(base):
        @staticmethod
        def forward(ctx, a):
            a.mul_(2)
            ctx.mark_dirty(a)
            return a if ret_self else a * 1

        @staticmethod
        def backward(ctx, g):
            return g * 2
    return Dirty


def test_mark_dirty_like_torch():
    xa = RNG.standard_normal(3)
    tx = torch.tensor(xa, requires_grad=True)
    ta = tx * 1
    tv = ta._version
    tb = _dirty_fn(torch.autograd.Function).apply(ta)
    tb.sum().backward()
    x = opjit.tensor(xa, requires_grad=True)
    a = x * 1
    b = _dirty_fn(opjit.Function).apply(a)
    assert (b is a) == (tb is ta) is True
    assert a._version - 0 == ta._version - tv  # the mul_ inside forward
    assert a.grad_fn.name() == "DirtyBackward"
    b.sum().backward()
    np.testing.assert_allclose(x.grad, tx.grad.numpy())
    np.testing.assert_allclose(a.numpy(), ta.detach().numpy())
    # A leaf that requires grad cannot be returned as modified.
    _, err = raises_like_torch(
        lambda: _dirty_fn(torch.autograd.Function).apply(torch.ones(2, requires_grad=True)),
        lambda: _dirty_fn(opjit.Function).apply(opjit.tensor(np.ones(2), requires_grad=True)),
        match="leaf Variable that requires grad")
    assert isinstance(err, opjit.LeafInplaceError)
    # Marked dirty but not returned.
    raises_like_torch(
        lambda: _dirty_fn(torch.autograd.Function, False).apply(
            torch.ones(2, requires_grad=True) * 1),
        lambda: _dirty_fn(opjit.Function, False).apply(
            opjit.tensor(np.ones(2), requires_grad=True) * 1),
        match="dirty")


def test_mark_dirty_without_an_inplace_op_still_moves_the_version():
    class Dirty(opjit.Function):
        @staticmethod
        def forward(ctx, a):
            a.data *= 2  # invisible to the version counter
            ctx.mark_dirty(a)
            return a

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class Keep(opjit.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, g):
            a, = ctx.saved_tensors
            return 2 * a * g
    a = opjit.tensor(np.ones(2), requires_grad=True) * 1
    y = Keep.apply(a)
    Dirty.apply(a)
    assert a._version == 1
    with pytest.raises(opjit.SavedTensorModifiedError):
        y.sum().backward()


def _identity(base, not_inplace=False):
    class Ident(base):
        @staticmethod
        def forward(ctx, x):
            if not_inplace:
                ctx.mark_not_inplace(x)
            return x

        @staticmethod
        def backward(ctx, dy):
            return dy
    return Ident


def test_returned_input_is_a_view_in_function_and_in_place_in_pylayer():
    # torch: a new tensor (a view), the input keeps its grad_fn.
    ta = torch.ones(2, requires_grad=True) * 1
    tb = _identity(torch.autograd.Function).apply(ta)
    a = opjit.tensor(np.ones(2), requires_grad=True) * 1
    a_fn = a.grad_fn
    b = _identity(opjit.Function).apply(a)
    assert (b is a) == (tb is ta) is False
    assert a.grad_fn is a_fn and b.grad_fn.name() == "IdentBackward"
    leaf = opjit.tensor(np.ones(2), requires_grad=True)
    assert _identity(opjit.Function).apply(leaf) is not leaf
    # Paddle (eager_py_layer.cc): an input returned as is, not marked not-inplace, is the
    # output itself ("inplace strategy", version bumped); a leaf that does not stop
    # gradient raises ValueError (test_pylayer_inplace_and_leaf_exception).
    a = opjit.tensor(np.ones(2), requires_grad=True) * 1
    b = _identity(opjit.PyLayer).apply(a)
    assert b is a and a._version == 1 and a.grad_fn.name() == "IdentBackward"
    with pytest.raises(ValueError, match="inplace"):
        _identity(opjit.PyLayer).apply(opjit.tensor(np.ones(2), requires_grad=True))
    # mark_not_inplace: a new Tensor over the same data (PyLayerContext.mark_not_inplace).
    leaf = opjit.tensor(np.ones(2), requires_grad=True)
    out = _identity(opjit.PyLayer, not_inplace=True).apply(leaf)
    assert out is not leaf and leaf.is_leaf and out.grad_fn is not None
    assert np.shares_memory(out.numpy(), leaf.numpy())
    out.sum().backward()
    np.testing.assert_array_equal(leaf.grad, [1, 1])


def test_pylayer_inplace_bumps_a_version_an_earlier_op_saved():
    # Paddle's test_pylayer_inplace_backward_error: var_c = var_b ** 2 saved var_b, then the
    # PyLayer returns var_b in place: backward raises RuntimeError (tensor_version 1 !=
    # wrapper_version_snapshot 0). And test_pylayer_inplace_backward_success_1/_2: the ops
    # after it see the new version and run.
    data = opjit.tensor(np.ones((2, 3)), requires_grad=True)
    var_b = data ** 2
    var_c = var_b ** 2
    _identity(opjit.PyLayer).apply(var_b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        var_c.sum().backward()
    for i, after in enumerate((lambda c: (c ** 2).sum(), lambda c: (c + c).sum())):
        data = opjit.tensor(np.ones((2, 3)) / (i + 1), requires_grad=True)
        var_b = data ** 2
        after(_identity(opjit.PyLayer).apply(var_b)).backward()
        assert data.grad is not None and np.all(data.grad != 0)


# ---- 6. once_differentiable ------------------------------------------------------------

def _once(base, od):
    class Square(base):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        @od
        def backward(ctx, g):
            a, = ctx.saved_tensors
            Square.grad_mode = (torch.is_grad_enabled() if base is torch.autograd.Function
                                else opjit.is_grad_enabled())
            return 2 * a * g
    return Square


def test_once_differentiable_like_torch():
    from torch.autograd.function import once_differentiable as tod
    assert opjit.once_differentiable is ag.once_differentiable
    xa = RNG.standard_normal(3)
    TS, S = _once(torch.autograd.Function, tod), _once(opjit.Function, opjit.once_differentiable)
    tx, x = torch.tensor(xa, requires_grad=True), opjit.tensor(xa, requires_grad=True)
    ty, y = TS.apply(tx), S.apply(x)
    tg, = torch.autograd.grad((ty * ty).sum(), tx, create_graph=True)
    g, = opjit.grad((y * y).sum(), x, create_graph=True)
    assert S.grad_mode is TS.grad_mode is False
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy())
    _, err = raises_like_torch(lambda: tg.sum().backward(), lambda: g.sum().backward(),
                               match="differentiate twice a function that was marked with "
                                     "@once_differentiable")
    assert isinstance(err, opjit.GradRuleError)
    # First order (no create_graph) is untouched.
    S.apply(x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * xa)


# ---- 7. tensors inside list and tuple arguments ------------------------------------------

def test_pylayer_tracks_tensors_in_a_list_argument():
    # Paddle's test_simple_pylayer_multi_output: tanh.apply(x1=[input1, input2, input3],
    # func1=paddle.concat), backward returns paddle.split(dy1, 3): a list of grads, one per
    # Tensor of the list argument (eager_py_layer.cc: a list/tuple of Tensors is one input).
    class Concat(opjit.PyLayer):
        @staticmethod
        def forward(ctx, xs, scale):
            ctx.n = len(xs)
            return opjit.Tensor(np.concatenate([x.numpy() for x in xs]) * scale)

        @staticmethod
        def backward(ctx, dy):
            return [dy[k * 2:(k + 1) * 2] * 2 for k in range(ctx.n)]

    xs = [opjit.tensor(RNG.standard_normal(2), requires_grad=True) for _ in range(3)]
    seen = {}

    class Spy(Concat):
        @staticmethod
        def forward(ctx, xs, scale):
            seen["needs"] = ctx.needs_input_grad
            return Concat.forward(ctx, xs, scale)
    y = Spy.apply(tuple(xs), 2.0)
    assert y.grad_fn is not None and seen["needs"] == (True, False)
    (y * opjit.Tensor(np.arange(6.0))).sum().backward()
    for k, x in enumerate(xs):
        np.testing.assert_allclose(x.grad, 2 * np.arange(2.0 * k, 2.0 * k + 2))


def test_function_does_not_track_tensors_in_a_list_like_torch():
    class L(opjit.Function):
        @staticmethod
        def forward(ctx, xs):
            L.needs = ctx.needs_input_grad
            return xs[0] * 2

        @staticmethod
        def backward(ctx, g):
            return None

    class TL(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xs):
            TL.needs = ctx.needs_input_grad
            return xs[0] * 2
    got = L.apply([opjit.tensor(np.ones(2), requires_grad=True)])
    want = TL.apply([torch.ones(2, requires_grad=True)])
    assert got.requires_grad == want.requires_grad is False
    assert L.needs == TL.needs == (False,)


def test_list_outputs_function_like_torch_and_pylayer_as_paddle():
    # torch: a list returned by forward is one non-Tensor output (no graph); Paddle
    # (eager_py_layer.cc): Tensors inside a list/tuple output are outputs, and backward
    # gets their grads as a list.
    class TL(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return [x * 2, x * 3]

    class L(opjit.Function):
        forward = TL.forward

    class P(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x):
            return x * 2, [x * 3, "tag", x * 4]

        @staticmethod
        def backward(ctx, g, gs):
            P.seen = gs
            return g * 2 + gs[0] * 3 + gs[1] * 4
    want = TL.apply(torch.ones(2, requires_grad=True))
    got = L.apply(opjit.tensor(np.ones(2), requires_grad=True))
    assert isinstance(got, list) and isinstance(want, list)
    assert [t.grad_fn is None for t in got] == [t.grad_fn is None for t in want] == [True, True]
    x = opjit.tensor(np.ones(2), requires_grad=True)
    a, (b, tag, c) = P.apply(x)
    assert tag == "tag" and b.grad_fn is a.grad_fn is c.grad_fn is not None
    b.sum().backward()
    assert isinstance(P.seen, list) and len(P.seen) == 2
    np.testing.assert_array_equal(P.seen[1].numpy(), [0, 0])  # materialized
    np.testing.assert_array_equal(x.grad, [3, 3])


# ---- 8. nested PyLayers: a saved tensor keeps its graph -----------------------------------

def test_nested_pylayer_backward_runs_on_a_saved_output():
    calls = []

    class Inner(opjit.PyLayer):
        @staticmethod
        def forward(ctx, y):
            ctx.save_for_backward(y)
            return y * y

        @staticmethod
        def backward(ctx, g):
            calls.append("inner")
            y, = ctx.saved_tensor()
            return 2 * y * g

    class Outer(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x):
            y = opjit.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            calls.append("outer")
            y, = ctx.saved_tensor()
            with opjit.enable_grad():
                # d(y^2)/dy = 2y, by a PyLayer differentiated inside this backward
                two_y, = opjit.grad(Inner.apply(y).sum(), [y])
            return dy * (1 - two_y * y / 2)

    xa = RNG.standard_normal(4)
    x = opjit.tensor(xa, requires_grad=True)
    Outer.apply(x).sum().backward()
    assert calls == ["outer", "inner"]
    np.testing.assert_allclose(x.grad, 1 - np.tanh(xa) ** 2)


# ---- 9. Paddle's PyLayer rules (its documentation and test_pylayer_op.py) ----------------

def test_pylayer_forward_must_return_a_tensor_as_paddle():
    # test_pylayer_Exception_forward: forward returning None or 1 raises ValueError;
    # [None, x] and [1, 2, x] are fine.
    def layer(ret):
        class L(opjit.PyLayer):
            @staticmethod
            def forward(ctx, *args):
                return ret(args)

            @staticmethod
            def backward(ctx, *args):
                return args
        return L
    x = opjit.tensor(np.ones((2, 3)))
    for ret in (lambda a: None, lambda a: 1, lambda a: (a[0].shape,)):
        with pytest.raises(ValueError, match="At least one output"):
            layer(ret).apply(x)
    with pytest.raises(opjit.PyLayerError):
        layer(lambda a: None).apply(x)
    assert isinstance(layer(lambda a: [None, a[0]]).apply(x)[1], opjit.Tensor)
    assert isinstance(layer(lambda a: [1, 2, a[0]]).apply(x)[2], opjit.Tensor)


def test_pylayer_backward_gets_grads_of_tensor_outputs_only():
    # test_return_to_tensor: forward returns (y1, 5, None, "helloworld", tensor_1),
    # backward(ctx, dy1, dy2) receives the two Tensors' grads.
    seen = []

    class Tanh(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x1):
            y1 = opjit.tanh(x1)
            ctx.save_for_backward(y1)
            return y1, 5, None, "helloworld", opjit.tensor(np.array([1, 2], np.float32))

        @staticmethod
        def backward(ctx, dy1, dy2):
            seen.append(dy2)
            return dy1

    x = opjit.tensor(RNG.standard_normal((2, 3)).astype(np.float32), requires_grad=True)
    z, number, none_item, string_item, tensor1 = Tanh.apply(x1=x)
    assert (number, none_item, string_item) == (5, None, "helloworld")
    assert not tensor1.stop_gradient
    z.mean().backward()
    np.testing.assert_array_equal(seen[0].numpy(), [0, 0])
    np.testing.assert_allclose(x.grad, np.full((2, 3), 1 / 6, np.float32))


def test_pylayer_backward_count_and_stop_gradient_rules():
    def layer(fwd, bwd):
        class L(opjit.PyLayer):
            forward = staticmethod(fwd)
            backward = staticmethod(bwd)
        return L

    def xs(*stop):
        out = []
        for s in stop:
            t = opjit.tensor(RNG.standard_normal((2, 3)))
            t.stop_gradient = s
            out.append(t)
        return out
    add = lambda ctx, a, b: a + b  # noqa: E731
    two = lambda ctx, a, b: (a * 2, b * 5)  # noqa: E731
    # test_pylayer_num_output_match: two inputs needing grads, backward returns one.
    with pytest.raises(ValueError):
        layer(add, lambda ctx, dy: dy + 1).apply(*xs(False, False)).mean().backward()
    # test_pylayer_Exception_bk: Layer_bk_match: one input, backward returns two.
    a, = xs(False)
    z = layer(lambda ctx, x: (x * 2, x * 5), lambda ctx, d1, d2: (d2 * 2, d1 * 2)).apply(a)
    with pytest.raises(ValueError, match="should be 1, but received 2"):
        (z[0] + z[1]).mean().backward()
    # Layer_bk_one1 / test_pylayer_bk_return_none: a non-Tensor grad.
    with pytest.raises(ValueError, match="Tensor or None"):
        layer(lambda ctx, x: x + x, lambda ctx, dy: 1).apply(*xs(False)).mean().backward()
    with pytest.raises(ValueError):
        layer(add, lambda ctx, dy: 1).apply(*xs(True, False)).mean().backward()
    with pytest.raises(ValueError):
        z = layer(two, lambda ctx, *a: (1, 1)).apply(*xs(True, False))
        (z[0] + z[1]).mean().backward()
    # A grad for an input with stop_gradient (py_layer_node.cc: "should return None").
    with pytest.raises(ValueError, match="stop_gradient"):
        layer(add, lambda ctx, dy: (dy, dy)).apply(*xs(False, True)).mean().backward()
    # Fewer grads are fine where the missing inputs stop gradient; None for a needed one too.
    a, b = xs(False, True)
    layer(add, lambda ctx, dy: dy).apply(a, b).mean().backward()
    np.testing.assert_allclose(a.grad, np.full((2, 3), 1 / 6))
    a, = xs(False)
    layer(lambda ctx, x: x * 2, lambda ctx, dy: None).apply(a).sum().backward()
    assert a.grad is None


def test_pylayer_materialize_and_non_differentiable_as_paddle():
    # test_materialize_grads / test_dont_materialize_grads / test_mark_non_differentiable2.
    seen = []

    def layer(materialize):
        class L(opjit.PyLayer):
            @staticmethod
            def forward(ctx, x):
                ctx.mark_not_inplace(x)
                if not materialize:
                    ctx.set_materialize_grads(False)
                return x, x + x

            @staticmethod
            def backward(ctx, grad, grad2):
                seen.append(grad2)
                return grad
        return L
    for materialize in (True, False):
        x = opjit.tensor(np.ones(1), requires_grad=True)
        layer(materialize).apply(x)[0].backward()
        np.testing.assert_array_equal(x.grad, [1])
    np.testing.assert_array_equal(seen[0].numpy(), [0])
    assert seen[1] is None

    class ND(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x):
            a, b = x + x, x + x + x
            ctx.mark_non_differentiable(a)
            return a, b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            seen.append(grad_a)
            return grad_b
    x = opjit.tensor(np.ones(1), requires_grad=True)
    a, b = ND.apply(x)
    assert a.stop_gradient and not b.stop_gradient
    b.sum().backward()
    np.testing.assert_array_equal(seen[-1].numpy(), [0])
    np.testing.assert_array_equal(x.grad, [1])


def test_pylayer_saved_tensor_is_none_when_nothing_was_saved():
    # PyLayerContext.saved_tensor(): "None" when save_for_backward was not called;
    # torch's saved_tensors is an empty tuple.
    got = {}

    class P(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            got["p"] = ctx.saved_tensor()
            return g * 2

    class F(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            got["f"] = ctx.saved_tensors
            return g * 2
    for cls in (P, F):
        cls.apply(opjit.tensor(np.ones(2), requires_grad=True)).sum().backward()
    assert got == {"p": None, "f": ()}


def test_pylayer_grad_in_dtype_consistent():
    # test_set_grad_in_dtype_consistent: with set_grad_in_dtype_consistent(False) the float16
    # grad a later PyLayer returns reaches backward as float16; by default it is cast.
    seen = []

    def first(consistent):
        class CusTanh(opjit.PyLayer):
            @staticmethod
            def forward(ctx, x):
                y = opjit.tanh(x)
                ctx.save_for_backward(y)
                if not consistent:
                    ctx.set_grad_in_dtype_consistent(False)
                return y

            @staticmethod
            def backward(ctx, dy):
                seen.append(dy.dtype)
                y, = ctx.saved_tensor()
                return dy * (1 - opjit.square(y))
        return CusTanh

    class CastGrad(opjit.PyLayer):
        @staticmethod
        def forward(ctx, x):
            y = opjit.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            y, = ctx.saved_tensor()
            return (dy * (1 - opjit.square(y))).astype("float16")
    for consistent in (False, True):
        x = opjit.tensor(RNG.standard_normal((3, 3)).astype(np.float32), requires_grad=True)
        CastGrad.apply(first(consistent).apply(x)).backward()
        assert x.grad.dtype == np.float32
    assert seen == [np.float16, np.float32]


def test_pylayer_is_its_own_class_and_errors_are_opjit_errors():
    assert issubclass(opjit.PyLayer, opjit.Function) and opjit.PyLayer is not opjit.Function
    assert issubclass(opjit.PyLayerContext, opjit.FunctionCtx)
    assert opjit.autograd.PyLayer is opjit.PyLayer
    for cls, base in ((opjit.GradRuleError, RuntimeError), (opjit.PyLayerError, ValueError),
                      (opjit.SavedTensorModifiedError, RuntimeError),
                      (opjit.LeafInplaceError, RuntimeError), (opjit.LeafInplaceError, ValueError),
                      (GradShapeError, RuntimeError)):
        assert issubclass(cls, opjit.OpjitError) and issubclass(cls, base)


def test_grad_runs_only_the_nodes_it_needs():
    calls = []

    class Count(opjit.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            return g

    x = opjit.tensor(np.ones(2), requires_grad=True)
    y = Count.apply(x)
    z = (y * 3).sum()
    g, = opjit.grad(z, [y])
    np.testing.assert_array_equal(g, [3, 3])
    assert calls == []  # torch's grad() stops at y too


def test_stop_gradient_grads_policy_still_applies_to_function():
    class Add(opjit.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, g):
            return g, g
    a = opjit.tensor(np.ones(2), requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        Add.apply(a, opjit.tensor(np.ones(2))).sum().backward()
    assert any(issubclass(x.category, opjit.StopGradientGradWarning) for x in w)
    np.testing.assert_array_equal(a.grad, [1, 1])

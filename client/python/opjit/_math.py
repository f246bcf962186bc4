"""Tensor arithmetic, computed on the client with numpy and recorded on the tape.

Why here and not as daemon ops: this is glue math on small tensors (a loss's
``mean``, a ``1 - y*y`` in a PyLayer backward). A daemon round trip costs
more than numpy does on such tensors, and the daemon's ops are the user's own
kernels; opjit registers none of its own. Heavy math belongs in a kernel.

Every op records a MathNode when grad mode is on and an operand requires
grad. A node's backward is written with these same Tensor ops, so under
``create_graph=True`` (where the engine runs with grad mode on) the
gradients are themselves recorded and can be differentiated again. Gradients
of broadcast operands are summed back to the operand's shape and cast to its
dtype.

A node remembers the versions of the tensors its backward reads (torch's
saved tensors: both operands of ``*`` and ``/``, the output of ``tanh``,
``exp`` and ``sqrt``...); one modified in place since raises
SavedTensorModifiedError at backward. The in-place ops (``+=``,
``t[i] = v``, ``add_``...) are recorded as their out-of-place forms whose
result is written back into the tensor, which takes the new node (torch's
rebase of history).
"""

import weakref

import numpy as np

from opjit import _tensors as T
from opjit.autograd import Node, Tensor, _check_saved, is_grad_enabled
from opjit.errors import GradRuleError, LeafInplaceError

__all__ = ["tanh", "exp", "log", "sqrt", "square", "randn", "seed"]


class MathNode(Node):
    """A numpy op recorded on the tape: `backward(node, g)` returns one grad per input."""

    def __init__(self, name, inputs, out_meta, backward, saved, checks=None):
        super().__init__(inputs, out_meta)
        self._name = name
        self._backward = backward
        self.saved = saved
        self.checks = [] if checks is None else checks  # _saved_entry records
        self._output = None         # a weak reference to the output (saved outputs)

    def name(self):
        return self._name + "Backward"

    def output(self):
        """The output Tensor when it is still alive (else None)."""
        return self._output() if self._output is not None else None

    def apply(self, grads, retain_graph, create_graph=False):
        _check_saved(self.checks, self.name())
        g = grads[0]
        if g is None:
            shape, dtype = self.out_meta[0]
            g = Tensor(np.zeros(shape, dtype))
        out = self._backward(self, g)
        if not retain_graph:
            self.saved = None
        return [o if (o is not None and t is not None and t.requires_grad) else None
                for o, t in zip(out, self.inputs)]


def _is_diff(dtype):
    return dtype.kind in "fc"


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def _arr(v):
    """A numpy result as an ndarray (reductions of 0-d give numpy scalars)."""
    return v if isinstance(v, np.ndarray) else np.asarray(v)


_INPUT_LABELS = ("input 0", "input 1")


def _record(name, value, inputs, backward, reads_inputs=False, reads_output=False, **saved):
    """A Tensor of `value`, with a MathNode when an input Tensor requires grad.

    reads_inputs: the backward reads the input Tensors (their versions are
    checked at backward); reads_output: it reads the output."""
    out = Tensor(_arr(value))
    if is_grad_enabled() and _is_diff(out.dtype) and any(
            isinstance(t, Tensor) and t.requires_grad for t in inputs):
        slots = [t if isinstance(t, Tensor) else None for t in inputs]
        checks = [(_INPUT_LABELS[i], t, t._vc, t._vc[0]) for i, t in enumerate(slots)
                  if t is not None] if reads_inputs else []
        node = MathNode(name, slots, [(out.shape, out.dtype)], backward, saved, checks)
        if reads_output:  # the output itself is not held: no cycle through the node
            checks.append(("its output 0", None, out._vc, 0))
            node._output = weakref.ref(out)
        out.grad_fn = node
        out._output_index = 0
        out.requires_grad = True
    return out


def _operand(x):
    """A binary op's operand: a Tensor, or a constant (Python scalar or ndarray)."""
    if isinstance(x, Tensor) or isinstance(x, (bool, int, float, complex)):
        return x
    if isinstance(x, np.generic):
        return x
    return T.as_ndarray(x)


def _needs(x):
    return isinstance(x, Tensor) and x.requires_grad


def _fit(g, like):
    """g summed over the axes `like` was broadcast along, in like's shape and dtype."""
    shape = like.shape
    if g.shape != shape:
        lead = g.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
        if axes:
            g = sum_(g, axis=axes, keepdims=True)
        if g.shape != shape:
            g = reshape(g, shape)
    if g.dtype != like.dtype and _is_diff(like.dtype):
        g = astype(g, like.dtype)
    return g


# ---- binary ------------------------------------------------------------------------

def add(a, b):
    a, b = _operand(a), _operand(b)

    def bw(node, g):
        return [_fit(g, a) if _needs(a) else None, _fit(g, b) if _needs(b) else None]
    return _record("Add", np.add(_data(a), _data(b)), [a, b], bw)


def sub(a, b):
    a, b = _operand(a), _operand(b)

    def bw(node, g):
        return [_fit(g, a) if _needs(a) else None, _fit(-g, b) if _needs(b) else None]
    return _record("Sub", np.subtract(_data(a), _data(b)), [a, b], bw)


def mul(a, b):
    a, b = _operand(a), _operand(b)

    def bw(node, g):
        return [_fit(g * b, a) if _needs(a) else None, _fit(g * a, b) if _needs(b) else None]
    return _record("Mul", np.multiply(_data(a), _data(b)), [a, b], bw, reads_inputs=True)


def div(a, b):
    a, b = _operand(a), _operand(b)

    def bw(node, g):
        ga = _fit(g / b, a) if _needs(a) else None
        gb = _fit(-g * a / (b * b), b) if _needs(b) else None
        return [ga, gb]
    return _record("Div", np.true_divide(_data(a), _data(b)), [a, b], bw, reads_inputs=True)


def pow_(a, b):
    """a ** b: b a scalar (the usual case) or a tensor; a scalar base works too."""
    a, b = _operand(a), _operand(b)

    def bw(node, g):
        ga = gb = None
        if _needs(a):
            if not isinstance(b, Tensor) and np.all(np.asarray(b) == 0):
                ga = _fit(g * 0, a)
            elif not isinstance(b, Tensor) and np.all(np.asarray(b) == 1):
                ga = _fit(g, a)
            else:
                ga = _fit(g * b * pow_(a, b - 1), a)
        if _needs(b):
            gb = _fit(g * pow_(a, b) * log(a), b)
        return [ga, gb]
    return _record("Pow", np.power(_data(a), _data(b)), [a, b], bw, reads_inputs=True)


def neg(a):
    return _record("Neg", np.negative(a.data), [a], lambda node, g: [-g])


# ---- unary -------------------------------------------------------------------------

def _unary_input(x):
    return x if isinstance(x, Tensor) else Tensor(T.as_ndarray(x))


def tanh(x):
    """Elementwise tanh (client-side numpy, recorded on the tape)."""
    x = _unary_input(x)
    y = np.tanh(x.data)

    def bw(node, g):
        if is_grad_enabled():  # create_graph: through the output, so it is recorded
            t = _saved_output(node, tanh, x)
            return [g * (1 - t * t)]
        return [g * (1 - node.saved["y"] * node.saved["y"])]
    return _record("Tanh", y, [x], bw, reads_output=True, y=y)


def _saved_output(node, fn, x):
    """A node's output as its backward reads it under create_graph: the output
    Tensor itself, with its graph (torch's saved result), or fn(x) again
    when that Tensor is gone."""
    y = node.output()
    return y if y is not None else fn(x)


def exp(x):
    """Elementwise exp (client-side numpy, recorded on the tape)."""
    x = _unary_input(x)
    y = np.exp(x.data)

    def bw(node, g):
        return [g * (_saved_output(node, exp, x) if is_grad_enabled() else node.saved["y"])]
    return _record("Exp", y, [x], bw, reads_output=True, y=y)


def log(x):
    """Elementwise natural log (client-side numpy, recorded on the tape)."""
    x = _unary_input(x)
    return _record("Log", np.log(x.data), [x], lambda node, g: [g / x], reads_inputs=True)


def sqrt(x):
    """Elementwise square root (client-side numpy, recorded on the tape)."""
    x = _unary_input(x)
    y = np.sqrt(x.data)

    def bw(node, g):
        return [g * 0.5 / (_saved_output(node, sqrt, x) if is_grad_enabled()
                           else node.saved["y"])]
    return _record("Sqrt", y, [x], bw, reads_output=True, y=y)


def square(x):
    """x * x (client-side numpy, recorded on the tape)."""
    x = _unary_input(x)
    return _record("Square", np.multiply(x.data, x.data), [x], lambda node, g: [g * 2 * x],
                   reads_inputs=True)


def astype(x, dtype):
    """x converted to dtype; the gradient is converted back."""
    dt = np.dtype(dtype)
    if x.dtype == dt:
        return clone(x)  # a new Tensor, as Paddle's cast and numpy's astype give

    def bw(node, g):
        # Back to x's dtype, whatever it is: an integer x requires grad only
        # as a PyLayer's output (Paddle's rule), and Paddle's cast does so.
        return [astype(g, x.dtype)]
    return _record("Cast", x.data.astype(dt), [x], bw)


def clone(x):
    """A copy of x; the gradient passes through."""
    return _record("Clone", np.array(x.data, copy=True), [x], lambda node, g: [g])


# ---- shape ---------------------------------------------------------------------------

def _shape_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = shape[0]
    return tuple(int(n) for n in shape)


def reshape(x, *shape):
    """x in a new shape (-1 allowed); the gradient is reshaped back."""
    shape = _shape_arg(shape)
    return _view(_record("Reshape", x.data.reshape(shape), [x],
                         lambda node, g: [reshape(g, x.shape)]), x)


def broadcast_to(x, shape):
    """x broadcast to shape; its gradient is summed back."""
    shape = _shape_arg((shape,))
    return _record("Expand", np.array(np.broadcast_to(x.data, shape)), [x],
                   lambda node, g: [_fit(g, x)])


def _axes(ndim, axis):
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (list, tuple)):
        return tuple(sorted(int(a) % ndim if ndim else 0 for a in axis))
    return (int(axis) % ndim if ndim else 0,)


def _reduce_args(axis, dim, keepdims, keepdim):
    if dim is not None:
        axis = dim
    if keepdim is not None:
        keepdims = keepdim
    if isinstance(axis, list):
        axis = tuple(axis)
    return axis, bool(keepdims)


def _expand_back(g, x, axis, keepdims):
    """The grad of a reduction over `axis`, broadcast back to x's shape."""
    if not keepdims:
        kept = list(x.shape)
        for a in _axes(x.ndim, axis):
            kept[a] = 1
        g = reshape(g, kept)
    return broadcast_to(g, x.shape)


def sum_(x, axis=None, keepdims=False, dim=None, keepdim=None, dtype=None):
    """Sum over axis (int, tuple or None: all); keepdims keeps reduced axes as 1."""
    axis, keepdims = _reduce_args(axis, dim, keepdims, keepdim)
    x = _unary_input(x)
    value = np.sum(x.data, axis=axis, keepdims=keepdims, dtype=dtype)
    return _record("Sum", value, [x], lambda node, g: [_fit(_expand_back(g, x, axis, keepdims), x)])


def mean(x, axis=None, keepdims=False, dim=None, keepdim=None):
    """Mean over axis (int, tuple or None: all); keepdims keeps reduced axes as 1."""
    axis, keepdims = _reduce_args(axis, dim, keepdims, keepdim)
    x = _unary_input(x)
    value = _arr(np.mean(x.data, axis=axis, keepdims=keepdims))
    n = 1
    for a in _axes(x.ndim, axis):
        n *= x.shape[a] if x.ndim else 1

    def bw(node, g):
        return [_fit(_expand_back(g, x, axis, keepdims) / n, x)]
    return _record("Mean", value, [x], bw)


def _index(idx):
    if isinstance(idx, Tensor):
        return idx.data
    if isinstance(idx, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in idx)
    return idx


def getitem(x, idx):
    """x[idx] (numpy indexing); the gradient is scattered (added) back."""
    idx = _index(idx)
    return _view(_record("Slice", _arr(x.data[idx]), [x],
                         lambda node, g: [_index_add(g, idx, x.shape, x.dtype)]), x)


def _view(out, x):
    """out, marked a view of x where numpy made it one: they share x's version
    counter (as torch's views do), so an in-place change through either is seen
    by the tensors saved for backward."""
    if out.data is not x.data and np.may_share_memory(out.data, x.data):
        out._vc = x._vc
        out._view_of = x
    return out


def _index_add(g, idx, shape, dtype):
    """zeros(shape) with g added at idx; its own gradient is gg[idx]."""
    out = np.zeros(shape, np.result_type(g.dtype, dtype))
    np.add.at(out, idx, g.data)
    return _record("IndexAdd", out, [g], lambda node, gg: [getitem(gg, idx)])


# ---- in place ------------------------------------------------------------------------

def _check_inplace(t, other=None):
    """torch and Paddle: a leaf that requires grad is not modified in place while
    grad is recorded (under no_grad it may be: an optimizer step). Nor, here,
    a view (a slice, a reshape) of a tensor in a graph: torch rewrites the
    base's history then, which the tape does not, so it refuses rather than
    give the base a wrong gradient."""
    if not is_grad_enabled():
        return
    if t.requires_grad and t.grad_fn is None:
        raise LeafInplaceError(
            "a leaf Variable that requires grad is being used in an in-place operation "
            "(Paddle: a leaf Tensor that doesn't stop gradient can't use inplace strategy); "
            "modify it under opjit.no_grad(), or modify a copy (clone())",
            reason="LEAF_INPLACE")
    base = t._view_of
    if base is not None and (base.requires_grad or t.requires_grad or _needs(other)):
        if base.requires_grad and base.grad_fn is None:
            raise LeafInplaceError(
                "a view of a leaf Variable that requires grad is being used in an in-place "
                "operation", reason="LEAF_INPLACE")
        raise GradRuleError(
            "an in-place operation on a view (a slice or reshape) of a tensor that is part of "
            "a graph: opjit's tape does not rewrite the base tensor's history, so it refuses "
            "rather than give it a wrong gradient; modify the base with t[index] = value, or "
            "a clone()", reason="INPLACE_ON_VIEW")


def _stand_in(t, copy):
    """The value t had before an in-place op, for the op's record: t's graph
    position, a copy of its data where the backward reads it."""
    old = Tensor(np.array(t.data, copy=True) if copy else t.data)
    old.grad_fn, old._output_index, old.requires_grad = t.grad_fn, t._output_index, t.requires_grad
    return old


def _write_back(t, res):
    """t takes res's value and graph position (torch's rebase of history)."""
    if res.dtype != t.dtype:
        if not np.can_cast(res.dtype, t.dtype, "same_kind"):
            raise TypeError("in-place op: the result type %s can't be cast to the tensor's "
                            "dtype %s" % (res.dtype, t.dtype))
        res = astype(res, t.dtype)
    if tuple(res.shape) != tuple(t.shape):
        raise ValueError("in-place op: the result's shape %s doesn't match the tensor's shape %s"
                         % (list(res.shape), list(t.shape)))
    np.copyto(t.data, res.data)
    t.grad_fn, t._output_index, t.requires_grad = res.grad_fn, res._output_index, res.requires_grad


_UFUNCS = {"Add": (add, np.add, False), "Sub": (sub, np.subtract, False),
           "Mul": (mul, np.multiply, True), "Div": (div, np.true_divide, True)}


def _inplace(name):
    fn, ufunc, reads = _UFUNCS[name]

    def op(self, other):
        other = _operand(other)
        _check_inplace(self, other)
        if is_grad_enabled() and (self.requires_grad or _needs(other)):
            # y *= y reads y, whose version this op moves on: its backward raises (torch)
            _write_back(self, fn(_stand_in(self, reads), other))
        else:
            ufunc(self.data, _data(other), out=self.data, casting="same_kind")
        self._bump_version()
        return self
    op.__name__ = name.lower() + "_"
    op.__doc__ = "In place: self %s= other (recorded; the version moves on)." % (
        {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}[name])
    return op


def setitem(x, idx, value):
    """x[idx] = value, in place: recorded when x or value requires grad (x's
    gradient is zero at idx, value's is the gradient there, summed to its shape)."""
    idx = _index(idx)
    value = _operand(value)
    _check_inplace(x, value)
    if is_grad_enabled() and (x.requires_grad or _needs(value)):
        old = _stand_in(x, False)
        new = np.array(x.data, copy=True)
        new[idx] = _data(value)
        keep = np.ones(x.shape, np.bool_)
        keep[idx] = False

        def bw(node, g):
            return [g * keep if _needs(old) else None,
                    _fit(getitem(g, idx), value) if _needs(value) else None]
        _write_back(x, _record("IndexPut", new, [old, value], bw))
    else:
        x.data[idx] = _data(value)
    x._bump_version()


def fill_(x, value):
    """Every element of x set to value, in place."""
    setitem(x, Ellipsis, value)
    return x


def zero_(x):
    """x set to zeros, in place."""
    return fill_(x, 0)


def copy_(x, src):
    """src (broadcast) written into x, in place; src's gradient is x's, summed."""
    setitem(x, Ellipsis, src)
    return x


# ---- random --------------------------------------------------------------------------

_rng = np.random.default_rng()


def seed(n):
    """Seeds opjit.randn (Paddle's paddle.seed, torch's manual_seed)."""
    global _rng
    _rng = np.random.default_rng(n)


def randn(*shape, dtype="float32", requires_grad=False):
    """A Tensor of standard normal samples: randn(2, 3) or randn([2, 3], dtype="float64")."""
    shape = _shape_arg(shape)
    return Tensor(_rng.standard_normal(shape).astype(np.dtype(dtype)),
                  requires_grad=requires_grad)


# ---- Tensor methods ------------------------------------------------------------------

def _install():
    def r(fn):
        return lambda self, other: fn(other, self)

    Tensor.__add__ = add
    Tensor.__radd__ = r(add)
    Tensor.__sub__ = sub
    Tensor.__rsub__ = r(sub)
    Tensor.__mul__ = mul
    Tensor.__rmul__ = r(mul)
    Tensor.__truediv__ = div
    Tensor.__rtruediv__ = r(div)
    Tensor.__pow__ = pow_
    Tensor.__rpow__ = r(pow_)
    Tensor.__neg__ = neg
    Tensor.__pos__ = lambda self: self
    Tensor.__getitem__ = getitem
    Tensor.__float__ = lambda self: float(self.data)
    Tensor.__int__ = lambda self: int(self.data)
    Tensor.sum = sum_
    Tensor.mean = mean
    Tensor.reshape = reshape
    Tensor.view = reshape
    Tensor.broadcast_to = broadcast_to
    Tensor.expand = lambda self, *shape: broadcast_to(self, _shape_arg(shape))
    Tensor.astype = astype
    Tensor.clone = clone
    Tensor.tanh = tanh
    Tensor.exp = exp
    Tensor.log = log
    Tensor.sqrt = sqrt
    Tensor.square = square
    Tensor.pow = pow_
    Tensor.__setitem__ = setitem
    for name in ("Add", "Sub", "Mul", "Div"):
        op = _inplace(name)
        setattr(Tensor, op.__name__, op)
        setattr(Tensor, "__i%s__" % {"Add": "add", "Sub": "sub", "Mul": "mul",
                                       "Div": "truediv"}[name], op)
    Tensor.subtract_ = Tensor.sub_   # Paddle's names
    Tensor.multiply_ = Tensor.mul_
    Tensor.divide_ = Tensor.div_
    Tensor.fill_ = fill_
    Tensor.zero_ = zero_
    Tensor.copy_ = copy_


_install()

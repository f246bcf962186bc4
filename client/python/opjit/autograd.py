"""Client-side autograd: Tensor, the backward engine, Function, PyLayer, no_grad.

The graph's nodes:

* ``ClientOpNode`` (opjit.op): a call to a daemon op with a registered bprop,
  made while the namespace's fast channel is open. The forward was a plain
  call; the node keeps copies of the tensors the bprop reads, and its
  backward is the bprop's own op call (see opjit._bprop).
* ``OpNode`` (opjit.op): the same without a fast channel (or for a bprop an
  op call cannot express). The forward left a context on the server
  (``ForwardResponse.context_id``); its backward is the ``Backward`` RPC.
* ``FunctionNode``: a ``Function`` (torch.autograd.Function) or ``PyLayer``
  (Paddle) subclass; its ``backward`` runs here, in Python, and may call
  daemon ops itself.
* ``MathNode``: arithmetic on Tensors (``+ - * /``, ``**``, ``sum``, ``mean``,
  ``reshape``, slicing, ``tanh``..., and the in-place forms ``+=``,
  ``t[i] = v``, ``add_``...), computed here with numpy (see ``opjit._math``);
  its backward is written with the same Tensor ops, so with
  ``create_graph=True`` the gradients are recorded too (double backward).

``Tensor.backward`` walks the graph from the tensor in topological order,
hands each node the gradients of its outputs, and accumulates the gradients
that reach leaf tensors with ``requires_grad`` into their ``.grad`` (a numpy
array). ``grad()`` runs only the nodes that lead to the tensors asked for.
An input with ``stop_gradient`` (``requires_grad=False``) gets no gradient;
a node none of whose inputs needs one is never recorded, so its backward
never runs.

The rules every node's gradients follow (opjit._grad_rules, shared with
opjit.torch and opjit.mindspore): a gradient whose shape broadcasts to its
input's is summed back to it, it is cast to the input's dtype (a float16
grad reaching a float32 leaf lands as float32), anything else is refused
naming the input and both shapes (GradShapeError, a RuntimeError as in
torch). Every Tensor has a version counter, bumped by each in-place op
(``+=``, ``t[i] = v``, ``add_``..., ``ctx.mark_dirty``); a tensor saved for
backward that was modified after it was saved raises
SavedTensorModifiedError at backward, naming it.

torch.autograd.Function and Paddle's PyLayer
---------------------------------------------

``opjit.Function`` follows torch.autograd.Function (torch 1.13),
``opjit.PyLayer`` Paddle's PyLayer (paddle.autograd.PyLayer, eager mode).
Where they agree both do the same: forward runs with grad recording off;
outputs saved with ``save_for_backward`` are the output objects themselves,
with their graph, so a backward under ``create_graph`` is differentiated
through them (double backward); backward runs with grad recording on only
under ``create_graph``; missing output grads reach backward as zeros of the
output's shape and dtype (``set_materialize_grads(False)``: None);
``mark_non_differentiable`` outputs get no grad_fn and a zero (or None)
grad; gradients are summed/cast to each input (the rules above); when no
input needs a gradient, or grad mode is off, nothing is recorded.
Where they differ:

=========================================  ==========================================  ==========================================
Rule                                       Function (torch)                            PyLayer (Paddle)
=========================================  ==========================================  ==========================================
backward's inputs                          one grad per output of forward, None for    one grad per Tensor output (non-Tensor
                                           a non-Tensor output                         outputs are skipped; a list/tuple of
                                                                                       Tensors gets a list of grads)
backward's outputs                         one per positional argument of forward      one per Tensor argument, keywords
                                           (None for a non-Tensor), then optionally    included (a list/tuple of Tensors
                                           one per keyword argument; extra trailing    counts once, its grads as a list);
                                           Nones are allowed                           fewer are allowed where the missing
                                                                                       inputs have stop_gradient
wrong count of grads                       GradRuleError (RuntimeError) "incorrect     PyLayerError (ValueError)
                                           number of gradients (expected N, got M)"
a grad for a non-Tensor argument           GradRuleError (RuntimeError)                (not an input: counts as too many)
a grad that is not a Tensor/ndarray/None   GradRuleError (RuntimeError)                PyLayerError (ValueError)
a grad for an input that needs none        dropped (StopGradientGradWarning when       PyLayerError (ValueError): backward must
                                           nonzero; ``stop_gradient_grads``)           return None there
Tensors inside list/tuple arguments        not tracked (the list is a constant)        tracked (needs_input_grad: any of them)
forward returns a tuple                    several outputs; a list is ONE non-Tensor   a tuple or a list: several outputs
                                           output (torch's rule)
forward returns no Tensor                  allowed: returned as is, nothing recorded   PyLayerError (ValueError) "At least one
                                                                                       output of forward is a Tensor"
integer/bool outputs                       non-differentiable (requires_grad False,    differentiable like any output
                                           backward gets zeros of their dtype)         (Paddle sets stop_gradient False on every
                                                                                       output; a cast back to float carries
                                                                                       the grad, as in Paddle's test_pylayer_dtype)
forward returns an input unchanged         a new Tensor over the same data (torch's    in place: the input object itself gets
                                           view), unless ``ctx.mark_dirty``            the node and a version bump, unless
                                                                                       ``ctx.mark_not_inplace`` (then a new
                                                                                       Tensor over the same data)
... and that input is a leaf needing grad  fine (a view); with mark_dirty:             LeafInplaceError (a ValueError) unless
                                           LeafInplaceError (a RuntimeError)           mark_not_inplace
``ctx.mark_dirty(*t)``                     yes (t must be returned: GradRuleError)     n/a (returning an input is in place)
``ctx.mark_not_inplace(*t)``               n/a                                         yes
``ctx.saved_tensor()`` with nothing saved  ``()`` (``saved_tensors``)                  None
``set_grad_in_dtype_consistent(False)``    n/a (grads always cast)                     grads reach backward in the dtype they
                                                                                       were computed in
=========================================  ==========================================  ==========================================

``once_differentiable`` (torch.autograd.function.once_differentiable) marks
a backward that is not itself differentiable: it runs with grad recording
off, and differentiating its result again raises GradRuleError
("trying to differentiate twice a function that was marked with
@once_differentiable"), as torch does.
"""

import functools
import threading
import warnings

import numpy as np

from opjit import _tensors as T
from opjit._grad_rules import GradShapeError, differentiable, fit_grad
from opjit.errors import (FailedPrecondition, GradRuleError, InvalidArgument, LeafInplaceError,
                          PyLayerError, SavedTensorModifiedError, StopGradientGradWarning)

__all__ = ["Tensor", "tensor", "to_tensor", "no_grad", "enable_grad", "is_grad_enabled", "Function",
           "FunctionCtx", "PyLayer", "PyLayerContext", "grad", "once_differentiable"]

_state = threading.local()


def is_grad_enabled():
    return getattr(_state, "enabled", True)


class _GradMode:
    def __init__(self, enabled):
        self._enabled = enabled

    def __enter__(self):
        self._prev = is_grad_enabled()
        _state.enabled = self._enabled

    def __exit__(self, *exc):
        _state.enabled = self._prev

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            with _GradMode(self._enabled):
                return fn(*a, **k)
        return wrapper


def no_grad():
    """Context manager (or decorator): calls inside record no graph."""
    return _GradMode(False)


def enable_grad():
    return _GradMode(True)


class Tensor:
    """A numpy array with autograd state.

    Attributes:
      data: the ndarray (may be a view over shared memory; see Client).
      requires_grad: whether gradients flow to (or through) it.
      grad: the accumulated gradient, an ndarray, or None (an opjit.Tensor
        with its own grad_fn after ``backward(create_graph=True)``).
      grad_fn: the node that produced it (None for leaves).
    ``stop_gradient`` is Paddle's spelling of ``not requires_grad``.

    Arithmetic runs on the client, with numpy, and is recorded on the tape
    when an operand requires grad (and grad mode is on): ``+ - * /`` between
    tensors (numpy broadcasting), arrays and scalars, reflected forms too;
    ``-t``, ``t ** p``, ``sum``/``mean`` (``axis``/``dim``, ``keepdims``/
    ``keepdim``), ``reshape``/``view``, ``t[index]``, ``astype``, ``clone``,
    ``tanh``/``exp``/``log``/``sqrt``/``square``. Each has an analytic
    backward; a broadcast operand's gradient is summed back to its shape.
    Results are new Tensors: numpy's dtype rules decide their dtype (a Python
    scalar does not widen float32).

    In-place ops (``+= -= *= /=``, ``t[index] = value``, ``add_``, ``sub_``,
    ``mul_``, ``div_``, ``zero_``, ``fill_``, ``copy_``) write ``data`` and
    bump the tensor's version (``_version``); with grad recording on they
    are recorded too (the tensor gets the new grad_fn, as in torch). A leaf
    that requires grad cannot be modified in place while grad is recorded
    (LeafInplaceError); under ``no_grad`` it can (an optimizer step). A
    slice or reshape that numpy makes a view shares its base's version
    counter; modifying such a view in place while its base is in a graph is
    refused (GradRuleError: torch rewrites the base's history, the tape does
    not). Writing ``t.data`` directly is invisible to the version counter.
    """

    __array_priority__ = 100
    _view_of = None  # the tensor this one is a view of (a slice, a reshape), if any

    def __init__(self, data, requires_grad=False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        arr = T.as_ndarray(data if dtype is None else np.asarray(data, dtype=dtype))
        self.data = arr
        self.requires_grad = bool(requires_grad)
        self.grad = None
        self.grad_fn = None
        self._output_index = 0
        self._vc = [0]  # the version counter, shared by tensors over the same data

    # -- Paddle spelling
    @property
    def stop_gradient(self):
        return not self.requires_grad

    @stop_gradient.setter
    def stop_gradient(self, value):
        self.requires_grad = not value

    @property
    def is_leaf(self):
        return self.grad_fn is None

    @property
    def _version(self):
        """How many in-place modifications this tensor's data has seen."""
        return self._vc[0]

    def _bump_version(self):
        self._vc[0] += 1

    def _alias(self):
        """A new Tensor over the same data and version counter, outside any graph
        (torch's view of an input returned unchanged; Paddle's not-inplace copy)."""
        t = Tensor.__new__(Tensor)
        t.data, t.requires_grad, t.grad, t.grad_fn, t._output_index = (
            self.data, False, None, None, 0)
        t._vc = self._vc
        return t

    def requires_grad_(self, value=True):
        self.requires_grad = bool(value)
        return self

    def detach(self):
        """A new leaf Tensor over the same data (and version counter), outside any graph."""
        return self._alias()

    def numpy(self):
        return self.data

    def item(self):
        return self.data.item()

    def tolist(self):
        return self.data.tolist()

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    @property
    def nbytes(self):
        return self.data.nbytes

    def __len__(self):
        return len(self.data)

    def __array__(self, dtype=None):
        return self.data if dtype is None else self.data.astype(dtype)

    def __opjit_array__(self):
        return self.data

    def __dlpack__(self, stream=None):
        return self.data.__dlpack__()

    def __dlpack_device__(self):
        return self.data.__dlpack_device__()

    def __getattr__(self, name):
        if name == "_vc":  # a Tensor made without __init__ (a subclass, Tensor.__new__)
            self._vc = [0]
            return self._vc
        raise AttributeError("%r object has no attribute %r" % (type(self).__name__, name))

    def __repr__(self):
        extra = ""
        if self.grad_fn is not None:
            extra = ", grad_fn=<%s>" % self.grad_fn.name()
        elif self.requires_grad:
            extra = ", requires_grad=True"
        return "opjit.Tensor(%s%s)" % (np.array2string(self.data, separator=", "), extra)

    def zero_grad(self):
        self.grad = None

    clear_grad = zero_grad

    def backward(self, grad_tensor=None, retain_graph=None, create_graph=False, gradient=None):
        """Backpropagates from this tensor.

        grad_tensor (or ``gradient``, torch's name): d(loss)/d(self); default
        ones (so ``y.backward()`` on any shape is the gradient of
        ``y.sum()``). Its shape must be this tensor's (GradShapeError);
        it is cast to this tensor's dtype. Gradients accumulate into
        ``.grad`` of leaf tensors that require them. A tensor that needs no
        gradient makes this a no-op (Paddle's rule: backward is not run).
        retain_graph: keep the graph (and server contexts) for another
          backward; default: ``create_graph``. Without it the graph is freed
          and a second backward through it raises FailedPrecondition.
        create_graph: record the backward itself, so that ``.grad`` is an
          opjit.Tensor with a grad_fn and can be differentiated again (daemon
          ops differentiate their grads through their bprop's own bprop).
        """
        if gradient is not None:
            grad_tensor = gradient
        if self.grad_fn is None and not self.requires_grad:
            return
        if retain_graph is None:
            retain_graph = create_graph
        g = np.ones_like(self.data) if grad_tensor is None else grad_tensor
        _run_backward([(self, g)], retain_graph=retain_graph, create_graph=create_graph)


def tensor(data, requires_grad=False, dtype=None):
    """opjit.Tensor(data) with ``requires_grad``; ``data`` may be any array-like or DLPack object."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def to_tensor(data, dtype=None, place=None, stop_gradient=True):
    """Paddle's ``paddle.to_tensor``: an opjit.Tensor of data; ``stop_gradient=False``
    makes it require grad. ``place`` must be None or the CPU ("cpu"): opjit's
    tensors live in host memory."""
    if place is not None and str(place).lower() not in ("cpu", "place(cpu)", "cpuplace"):
        raise InvalidArgument("to_tensor: place %r is not supported; opjit.Tensor lives in host "
                              "memory (pass place=None or 'cpu')" % (place,))
    return Tensor(data, requires_grad=not stop_gradient, dtype=dtype)


def _as_grad(g, like):
    """A root gradient for `like`: its exact shape (torch: "Mismatch in shape"), its dtype."""
    if g is None:
        return None
    if not isinstance(g, Tensor):
        g = T.as_ndarray(g)
    if like is not None:
        if tuple(g.shape) != tuple(like.shape):
            raise GradShapeError("Mismatch in shape: the gradient given for the output has shape "
                                 "%s, the output has shape %s" % (list(g.shape), list(like.shape)),
                                 reason="GRAD_SHAPE",
                                 metadata={"grad_shape": str(list(g.shape)),
                                           "input_shape": str(list(like.shape))})
        if g.dtype != like.dtype and differentiable(like.dtype):
            g = g.astype(like.dtype)
    return g


# ---- graph nodes ---------------------------------------------------------------

class Node:
    """A recorded call. `inputs` holds, per input slot, a Tensor, None or a list of those.

    The edges (which node produced each input, and which of its outputs it
    is) are taken when the node is made: an input modified in place later,
    which takes a new grad_fn, still leads this node's gradient to the node
    that made the value it read."""

    def __init__(self, inputs, out_meta):
        self.inputs = inputs
        self.out_meta = out_meta  # (shape, dtype) per output
        self.released = False
        edges = []
        for i, v in enumerate(inputs):
            if v.__class__ is Tensor or isinstance(v, Tensor):
                edges.append((i, None, v, v.grad_fn, v._output_index))
            elif isinstance(v, (list, tuple)):
                for k, t in enumerate(v):
                    if isinstance(t, Tensor):
                        edges.append((i, k, t, t.grad_fn, t._output_index))
        self._edge_list = edges

    def name(self):
        return type(self).__name__

    def input_name(self, i):
        """What errors call input slot i."""
        return "input %d" % i

    def apply(self, grads, retain_graph, create_graph=False):  # pragma: no cover - abstract
        """grads: one Tensor (or None) per output. Returns one gradient per input
        slot (Tensor, ndarray, None, or a list of those for a dynamic input)."""
        raise NotImplementedError


def _input_tensors(inputs):
    for i, v in enumerate(inputs):
        if isinstance(v, (list, tuple)):
            for k, t in enumerate(v):
                if isinstance(t, Tensor):
                    yield i, k, t
        elif isinstance(v, Tensor):
            yield i, None, v


def _edges(node):
    """(slot, k, tensor, its grad_fn, its output index) for every input tensor of
    node, as they were when the node was made."""
    got = getattr(node, "_edge_list", None)
    if got is None:
        got = [(i, k, t, t.grad_fn, t._output_index) for i, k, t in _input_tensors(node.inputs)]
    return got


def _fit(g, t, where="", name="the input", cast=True):
    """g (Tensor, ndarray or None) as a Tensor in t's shape and dtype, or None:
    summed where it broadcasts, cast, refused (GradShapeError) otherwise."""
    if g is None:
        return None
    if isinstance(g, Tensor):
        if g.data.shape == t.data.shape and g.data.dtype == t.data.dtype:
            return g  # the usual case
    else:
        g = T.as_ndarray(g)
    if not getattr(t.grad_fn, "grad_in_dtype_consistent", True):
        cast = False  # Paddle's set_grad_in_dtype_consistent(False) on t's PyLayer
    g = fit_grad(g, t.shape, t.dtype, name, where, cast=cast)
    return g if isinstance(g, Tensor) else Tensor(g)


def _as_grad_tensor(g, like):
    """g (Tensor, ndarray or None) as a Tensor of like's shape and dtype, or None
    (summed where it broadcasts; GradShapeError where it cannot be)."""
    return _fit(g, like) if like is not None else (
        None if g is None else g if isinstance(g, Tensor) else Tensor(T.as_ndarray(g)))


def _saved_entry(label, t):
    """A saved tensor's version record: (label, the tensor, its version
    counter, its version now); described only when the check fails."""
    return (label, t, t._vc, t._vc[0])


def _check_saved(entries, node_name):
    """entries: _saved_entry records: raises SavedTensorModifiedError for the
    first one whose version moved on, naming it (dtype, shape, and which node
    made it, as torch does)."""
    for label, t, vc, version in entries:
        if vc[0] != version:
            what = label
            if t is not None:
                what += " (%s%s" % (t.dtype, list(t.shape))
                if t.grad_fn is not None:
                    what += ", output %d of %s" % (t._output_index, t.grad_fn.name())
                what += ")"
            raise SavedTensorModifiedError(
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: %s, needed by %s, is at version %d; expected version %d "
                "instead" % (what, node_name, vc[0], version),
                reason="SAVED_TENSOR_MODIFIED",
                metadata={"tensor": what, "node": node_name, "version": str(vc[0]),
                          "expected_version": str(version)})


def _run_backward(roots, retain_graph=False, capture=None, create_graph=False):
    """roots: (tensor, grad). capture: {id(tensor): None} to collect, not accumulate.

    Gradients travel as Tensors. With create_graph the engine runs with grad
    mode on, so every node's backward is recorded; otherwise with it off."""
    with _GradMode(bool(create_graph)):
        _backward_pass(roots, retain_graph, capture, create_graph)


def _backward_pass(roots, retain_graph, capture, create_graph):
    # Discover the graph and count each node's consumers.
    deps = {}
    order = []
    stack = [t.grad_fn for t, _ in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        order.append(n)
        deps.setdefault(id(n), 0)
        for _, _, _, fn, _ in _edges(n):
            if fn is not None:
                deps[id(fn)] = deps.get(id(fn), 0) + 1
                stack.append(fn)
    buffers = {id(n): [None] * len(n.out_meta) for n in order}
    nodes = {id(n): n for n in order}

    needed = None
    if capture is not None:
        # grad(): run only the nodes from which a tensor asked for is reached
        # (torch's exec_info), not the whole graph down to the leaves.
        left = dict(deps)
        topo, ready = [], [n for n in order if left[id(n)] == 0]
        while ready:
            n = ready.pop()
            topo.append(n)
            for _, _, _, fn, _ in _edges(n):
                if fn is not None:
                    left[id(fn)] -= 1
                    if left[id(fn)] == 0:
                        ready.append(nodes[id(fn)])
        needed = set()
        for n in reversed(topo):
            for _, _, t, fn, _ in _edges(n):
                if id(t) in capture or (fn is not None and id(fn) in needed):
                    needed.add(id(n))
                    break

    def deliver(t, fn, i, g):
        if g is None:
            return
        if capture is not None and id(t) in capture:
            prev = capture[id(t)]
            capture[id(t)] = g if prev is None else prev + g
        if fn is not None:
            buf = buffers[id(fn)]
            buf[i] = g if buf[i] is None else buf[i] + g
        elif t.grad_fn is None and t.requires_grad and capture is None:
            if create_graph:
                prev = t.grad
                t.grad = g if prev is None else (
                    prev if isinstance(prev, Tensor) else Tensor(prev)) + g
            else:
                prev = t.grad.data if isinstance(t.grad, Tensor) else t.grad
                t.grad = g.data.copy() if prev is None else prev + g.data

    for t, g in roots:
        g = _as_grad(g, t)
        deliver(t, t.grad_fn, t._output_index, g if isinstance(g, Tensor) or g is None else Tensor(g))

    ready = [n for n in order if deps[id(n)] == 0]
    while ready:
        n = ready.pop()
        grads = buffers.pop(id(n))
        if any(g is not None for g in grads) and (needed is None or id(n) in needed):
            if n.released:
                raise FailedPrecondition(
                    "trying to backward through %s a second time: its saved tensors were freed "
                    "(pass retain_graph=True to the first backward)" % n.name())
            in_grads = n.apply(grads, retain_graph, create_graph)
            if not retain_graph:
                n.released = True
        else:
            in_grads = None
        for i, k, t, fn, idx in _edges(n):
            g = None
            if in_grads is not None and i < len(in_grads):
                gi = in_grads[i]
                g = gi[k] if k is not None and isinstance(gi, (list, tuple)) else gi
                if k is not None and not isinstance(gi, (list, tuple)):
                    g = None
            if g is not None and (fn is not None or t.requires_grad):
                name = n.input_name(i) if k is None else "%s[%d]" % (n.input_name(i), k)
                deliver(t, fn, idx, _fit(g, t, n.name(), name))
            if fn is not None:
                deps[id(fn)] -= 1
                if deps[id(fn)] == 0:
                    ready.append(nodes[id(fn)])


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=True):
    """The gradients of `outputs` w.r.t. `inputs` (torch.autograd.grad), without touching .grad.

    Returns one ndarray (or None) per input; with ``create_graph=True`` one
    opjit.Tensor (or None) per input, recorded on the tape, so it can be
    differentiated again (double backward). ``inputs`` may be leaves or
    intermediate tensors; only the nodes between the outputs and them run.
    retain_graph defaults to create_graph; without it the graph is freed.
    allow_unused=False: an input the outputs do not depend on raises
    InvalidArgument instead of giving None.
    """
    if isinstance(outputs, Tensor):
        outputs = [outputs]
    if isinstance(inputs, Tensor):
        inputs = [inputs]
    if retain_graph is None:
        retain_graph = create_graph
    if grad_outputs is None or isinstance(grad_outputs, (Tensor, np.ndarray)):
        grad_outputs = [grad_outputs] * len(outputs) if grad_outputs is None else [grad_outputs]
    roots = []
    for o, g in zip(outputs, grad_outputs):
        if o.grad_fn is None and not o.requires_grad:
            continue
        roots.append((o, np.ones_like(o.data) if g is None else g))
    capture = {id(t): None for t in inputs}
    _run_backward(roots, retain_graph=retain_graph, capture=capture, create_graph=create_graph)
    out = []
    for k, t in enumerate(inputs):
        g = capture[id(t)]
        if g is None and not allow_unused:
            raise InvalidArgument("input %d of grad() is not used by the outputs "
                                  "(pass allow_unused=True to get None)" % k)
        out.append(None if g is None else g if create_graph else g.data)
    return out


# ---- Function and PyLayer --------------------------------------------------------

def _is_grad_value(g):
    return isinstance(g, (Tensor, np.ndarray, np.generic))


class FunctionCtx:
    """What forward hands to backward (torch's FunctionCtx; PyLayerContext for PyLayer).

    Non-tensor values can be set as attributes (``ctx.scale = 2``).
    """

    def __init__(self):
        self._to_save = None    # what save_for_backward was given (None: never called)
        self._saved = None      # after apply: the saved objects, their versions checked
        self._versions = ()     # (what, version counter, version) per saved Tensor
        self._freed = False
        self._non_diff = []
        self._dirty = []
        self._node_name = ""
        self.materialize_grads = True
        self.needs_input_grad = ()

    def save_for_backward(self, *tensors):
        """Keeps tensors for backward (call it in forward, at most once).

        Inputs and outputs are kept as they are: an output keeps its graph,
        so a backward run under ``create_graph`` is differentiated through
        it. Modifying one in place afterwards makes backward raise."""
        self._to_save = tuple(tensors)

    def _seal(self, node_name):
        """At the end of apply: remember the saved tensors' versions."""
        self._node_name = node_name
        saved = () if self._to_save is None else self._to_save
        versions = []
        for k, v in enumerate(saved):
            for j, t in enumerate(v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, Tensor):
                    versions.append(_saved_entry("saved tensor %d%s" % (
                        k, "[%d]" % j if isinstance(v, (list, tuple)) else ""), t))
        self._saved = saved
        self._versions = tuple(versions)

    def _unpack(self):
        if self._freed:
            raise FailedPrecondition("the saved tensors were freed by an earlier backward "
                                     "(use retain_graph=True)")
        if self._saved is None:  # inside forward: what was given so far
            return () if self._to_save is None else self._to_save
        _check_saved(self._versions, self._node_name or "backward")
        return self._saved

    def _free(self):
        self._freed = True
        self._saved = None
        self._to_save = None

    @property
    def saved_tensors(self):
        """The tensors given to save_for_backward, as a tuple (torch's name)."""
        return self._unpack()

    def saved_tensor(self):
        """The tensors given to save_for_backward, as a tuple (Paddle's name)."""
        return self._unpack()

    def mark_non_differentiable(self, *outputs):
        """Marks outputs (the objects forward returns) as having no gradient:
        no grad_fn, and a zero (or None) grad in backward."""
        self._non_diff.extend(outputs)

    def mark_dirty(self, *tensors):
        """torch: forward modified these inputs in place and returns them. The
        returned tensor is the input object, its version moves on and it gets
        this function's node (a leaf that requires grad is refused)."""
        self._dirty.extend(tensors)

    def set_materialize_grads(self, value):
        """False: missing output gradients reach backward as None instead of zeros."""
        self.materialize_grads = bool(value)


def _contains(objs, t):
    return any(o is t for o in objs)


class FunctionNode(Node):
    """A Function/PyLayer application. inputs: one slot per backward output
    (Tensor, None, or a list of Tensors: Paddle's list argument); out_meta:
    one (shape, dtype) per Tensor output; layout: per backward argument,
    None (a non-Tensor output: torch), an output index, or a list of them
    (Paddle's list output)."""

    def __init__(self, cls, ctx, inputs, out_meta, layout):
        super().__init__(inputs, out_meta)
        self.cls = cls
        self.ctx = ctx
        self.layout = layout

    @property
    def grad_in_dtype_consistent(self):
        return getattr(self.ctx, "_grad_in_dtype_consistent", True)

    def name(self):
        return self.cls.__name__ + "Backward"

    def input_name(self, i):
        return "input %d of %s" % (i, self.cls.__name__)

    def apply(self, grads, retain_graph, create_graph=False):
        def one(k):
            g = grads[k]
            if g is None and self.ctx.materialize_grads:
                shape, dtype = self.out_meta[k]
                g = Tensor(np.zeros(shape, dtype))
            return g
        args = [None if e is None else [one(k) for k in e] if isinstance(e, list) else one(e)
                for e in self.layout]
        # With create_graph the ops backward runs are recorded (both frameworks' rule).
        with _GradMode(bool(create_graph)):
            result = self.cls.backward(self.ctx, *args)
        out = self.cls._input_grads(self, result)
        if not retain_graph:
            self.ctx._free()
        return out


def _stop_gradient_grad(cls, k, g):
    """A gradient backward returned for input k, which needs none: dropped,
    and said so unless it is all zeros (cls.stop_gradient_grads: "warn",
    "error" or "ignore")."""
    policy = getattr(cls, "stop_gradient_grads", "warn")
    if policy == "ignore":
        return
    data = g.data if isinstance(g, Tensor) else np.asarray(g)
    if not np.any(data):
        return
    what = ("%s.backward returned a nonzero gradient for input %d, which needs none "
            "(requires_grad=False, Paddle's stop_gradient=True)" % (cls.__name__, k))
    if policy == "error":
        raise InvalidArgument(what + "; return None for it (stop_gradient_grads = 'error')",
                              reason="STOP_GRADIENT_GRAD", metadata={"input": str(k)})
    warnings.warn(what + "; it was dropped (set stop_gradient_grads = 'ignore' or 'error' on "
                  "the class to change that)", StopGradientGradWarning, stacklevel=5)


class Function:
    """Custom forward/backward with torch.autograd.Function's rules (see the
    module's docstring for where Paddle's PyLayer differs).

    Subclass it with static ``forward(ctx, *args, **kwargs)`` and
    ``backward(ctx, *grads)``; run it with ``apply``. forward runs with grad
    recording off, and may call daemon ops. backward receives one gradient
    per output of forward (None for a non-Tensor output; zeros, or None
    after ``ctx.set_materialize_grads(False)``, for an output that got none)
    and returns one per positional argument of forward (None for
    non-Tensors; extra trailing Nones are allowed), then optionally one per
    keyword argument (opjit's extension: torch's apply takes none).
    ``ctx.needs_input_grad`` has one bool per argument, keywords last. Returned gradients are summed to their input's shape where
    they broadcast and cast to its dtype. Integer and bool outputs are not
    differentiable. Inputs that need no gradient get None whatever backward
    returns, and when no input needs one, no node is recorded and backward
    never runs. A nonzero gradient returned for an input that needs none is
    dropped with a StopGradientGradWarning; set the class attribute
    ``stop_gradient_grads`` to "error" to raise instead, or "ignore".
    """

    stop_gradient_grads = "warn"
    _ctx_class = FunctionCtx
    _track_lists = False      # Paddle: Tensors inside list/tuple arguments are inputs
    _int_outputs_differentiable = False

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("Function subclasses must define forward(ctx, ...)")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("Function subclasses must define backward(ctx, *grads)")

    # -- the framework's rules, overridden by PyLayer
    @classmethod
    def _slots(cls, values):
        """One input slot per argument: the Tensor, or None."""
        return [v if isinstance(v, Tensor) else None for v in values]

    @classmethod
    def _outputs(cls, result):
        """(items, rebuild): forward's outputs as a list, and how to return them."""
        if isinstance(result, tuple):
            return list(result), lambda items: type(result)(items) if type(result) is tuple \
                else type(result)(*items)
        return [result], lambda items: items[0]

    @classmethod
    def _returned_input(cls, ctx, o, record):
        """An input returned by forward: "dirty" (the object itself becomes the
        output), "alias" (a new Tensor over its data) or "same" (as is)."""
        return "dirty" if _contains(ctx._dirty, o) else "alias"

    @classmethod
    def _leaf_dirty_error(cls, k):
        return LeafInplaceError(
            "%s: a leaf Variable that requires grad has been used in an in-place operation "
            "(argument %d of forward, given to ctx.mark_dirty and returned)" % (cls.__name__, k),
            reason="LEAF_INPLACE")

    @classmethod
    def _no_tensor_output(cls, result):
        return result  # torch: returned as is, nothing recorded

    @classmethod
    def _check_dirty(cls, ctx, inputs, returned):
        for d in ctx._dirty:
            if not _contains(returned, d):
                raise GradRuleError(
                    "%s: some tensors marked as dirty (modified in place) in forward were not "
                    "returned as outputs: the inputs forward modifies in place must all be "
                    "outputs of the Function" % cls.__name__, reason="DIRTY_NOT_RETURNED")
            if not _contains(inputs, d):
                warnings.warn("%s: only input Tensors should be given to ctx.mark_dirty(); one "
                              "that is not an input needs no marking" % cls.__name__,
                              UserWarning, stacklevel=4)

    @classmethod
    def apply(cls, *args, **kwargs):
        ctx = cls._ctx_class()
        values = list(args) + list(kwargs.values())
        slots = cls._slots(values)
        inputs = [t for s in slots for t in (s if isinstance(s, list) else [s])
                  if isinstance(t, Tensor)]
        record = is_grad_enabled() and any(t.requires_grad for t in inputs)
        ctx.needs_input_grad = tuple(
            any(isinstance(t, Tensor) and t.requires_grad for t in v)
            if cls._track_lists and isinstance(v, (list, tuple))
            else (isinstance(v, Tensor) and v.requires_grad) for v in values)
        with no_grad():
            result = cls.forward(ctx, *args, **kwargs)
        return cls._wrap(ctx, slots, inputs, record, result, len(args))

    @classmethod
    def _wrap(cls, ctx, slots, inputs, record, result, n_positional):
        items, rebuild = cls._outputs(result)
        # Pass 1: which objects are the outputs, and the checks that come first.
        plan = []      # per item: None (not a Tensor output), an output index or a list
        outs = []      # per output index: [returned object, the Tensor to return, dirty]
        returned = []

        def tensor_out(o):
            returned.append(o)
            t = Tensor(o) if isinstance(o, np.ndarray) else o
            dirty = fresh = False
            prev = next((x for x in outs if x[0] is o), None)
            if prev is not None and not _contains(inputs, o):
                # The same output twice: one object, the last index wins (as in both).
                outs.append(prev)
                return len(outs) - 1
            if _contains(inputs, o) and prev is None:
                how = cls._returned_input(ctx, o, record)
                if how == "dirty" and record and o.is_leaf and o.requires_grad:
                    raise cls._leaf_dirty_error(
                        next(k for k, x in enumerate(inputs) if x is o))
                dirty = how == "dirty"
                if how == "alias":
                    t, fresh = o._alias(), True
            elif prev is not None or (t is o and o.is_leaf and o.requires_grad):
                t, fresh = t._alias(), True  # an alias: the object itself is left alone
            else:
                fresh = True
            outs.append((o, t, dirty, fresh))
            return len(outs) - 1

        for o in items:
            if isinstance(o, (Tensor, np.ndarray)):
                plan.append(tensor_out(o))
            elif cls._track_lists and isinstance(o, (list, tuple)) and any(
                    isinstance(x, (Tensor, np.ndarray)) for x in o):
                plan.append([tensor_out(x) if isinstance(x, (Tensor, np.ndarray)) else None
                             for x in o])
            else:
                plan.append(None)
        if not outs:
            return cls._no_tensor_output(result)
        cls._check_dirty(ctx, inputs, returned)

        # Pass 2: versions, the node, grad_fn.
        for o, t, dirty, _ in outs:
            if dirty:
                o._bump_version()  # both frameworks bump a tensor returned as modified
        metas = [(t.shape, t.dtype) for _, t, _, _ in outs]
        layout = []
        for p in plan:
            if isinstance(p, list):
                layout.append([k for k in p if k is not None])
            elif p is not None or not cls._track_lists:
                layout.append(p)  # torch: a non-Tensor output gets None
        node = FunctionNode(cls, ctx, slots, metas, layout) if record else None
        if node is not None:
            node.n_positional = n_positional
        for k, (o, t, dirty, fresh) in enumerate(outs):
            diff = (node is not None and not _contains(ctx._non_diff, o)
                    and (cls._int_outputs_differentiable or differentiable(t.dtype)))
            if diff:
                t.grad_fn, t._output_index, t.requires_grad = node, k, True
            elif fresh and t.grad_fn is None:
                t.requires_grad = False
        ctx._seal(node.name() if node is not None else cls.__name__ + "Backward")

        def item(p, o):
            if p is None:
                return o
            if isinstance(p, list):
                vals = [outs[k][1] if k is not None else x for k, x in zip(p, o)]
                return type(o)(vals) if not isinstance(o, list) else _refill(o, vals)
            return outs[p][1]
        return rebuild([item(p, o) for p, o in zip(plan, items)])

    @classmethod
    def _input_grads(cls, node, result):
        """torch's rules: one grad per argument of forward (trailing Nones
        beyond allowed), None for non-Tensors, each fitted to its input."""
        name = node.name()
        if not isinstance(result, (tuple, list)):
            result = (result,)
        n = len(node.inputs)
        # Keyword arguments (opjit's extension: torch's apply takes none) come after the
        # positional ones; their gradients may be left out.
        req = getattr(node, "n_positional", n)
        if len(result) > n and all(g is None for g in result[n:]):
            result = result[:n]
        if not req <= len(result) <= n:
            expected = "%d" % req if req == n else "%d to %d" % (req, n)
            raise GradRuleError("function %s returned an incorrect number of gradients "
                                "(expected %s, got %d)" % (name, expected, len(result)),
                                reason="GRAD_COUNT",
                                metadata={"expected": expected, "got": str(len(result))})
        result = tuple(result) + (None,) * (n - len(result))
        out = []
        for i, (t, g) in enumerate(zip(node.inputs, result)):
            if g is None:
                out.append(None)
                continue
            if not _is_grad_value(g):
                raise GradRuleError("function %s returned %s as the gradient at position %d: "
                                    "expected a Tensor or None" % (name, type(g).__name__, i + 1),
                                    reason="GRAD_TYPE")
            if t is None:
                raise GradRuleError("function %s returned a gradient different than None at "
                                    "position %d, but the corresponding forward input was not a "
                                    "Tensor" % (name, i + 1), reason="GRAD_FOR_NON_TENSOR")
            if not t.requires_grad:
                _stop_gradient_grad(cls, i, g)
                out.append(None)
                continue
            out.append(_fit(g, t, name, node.input_name(i)))
        return out


def _refill(lst, vals):
    lst[:] = vals  # Paddle writes the new output tensors into the returned list itself
    return lst


class PyLayerContext(FunctionCtx):
    """Paddle's PyLayerContext: save_for_backward/saved_tensor,
    mark_not_inplace, mark_non_differentiable, set_materialize_grads,
    set_grad_in_dtype_consistent."""

    def __init__(self):
        super().__init__()
        self._not_inplace = []
        self._grad_in_dtype_consistent = True

    def saved_tensor(self):
        """The tensors given to save_for_backward, or None when it was not called (Paddle)."""
        if self._to_save is None and self._saved in (None, ()) and not self._freed:
            return None
        return self._unpack()

    def mark_not_inplace(self, *tensors):
        """Inputs that forward returns unchanged but that must not be treated as
        modified in place: the output is a new Tensor over the same data, and
        the input keeps its own graph (call it in forward, at most once)."""
        self._not_inplace.extend(tensors)

    def set_grad_in_dtype_consistent(self, value):
        """False: the grads reach backward in the dtype they were computed in,
        not cast to the outputs' dtype (default True)."""
        self._grad_in_dtype_consistent = bool(value)


class PyLayer(Function):
    """Custom forward/backward with Paddle's PyLayer rules (paddle.autograd.PyLayer).

    As Function, except (see the module's docstring for the whole table):
    backward receives one gradient per Tensor output (a list for a list of
    Tensors; non-Tensor outputs get none) and returns one per Tensor
    argument, Tensors inside a list or tuple argument counting as one
    argument whose gradients are a list; a gradient returned for an input
    with stop_gradient raises (PyLayerError, a ValueError); forward must
    return at least one Tensor (PyLayerError); returning an input unchanged
    is in place (the input object gets the node) unless
    ``ctx.mark_not_inplace`` names it, and a leaf that needs a gradient
    cannot be so returned (LeafInplaceError, a ValueError); integer outputs
    are differentiable.
    """

    stop_gradient_grads = "error"
    _ctx_class = PyLayerContext
    _track_lists = True
    _int_outputs_differentiable = True

    @classmethod
    def _slots(cls, values):
        slots = []
        for v in values:
            if isinstance(v, Tensor):
                slots.append(v)
            elif isinstance(v, (list, tuple)):
                ts = [t for t in v if isinstance(t, Tensor)]
                if ts:
                    slots.append(ts)
        return slots

    @classmethod
    def _outputs(cls, result):
        if isinstance(result, (tuple, list)):
            return list(result), lambda items: _refill(result, items) \
                if isinstance(result, list) else type(result)(items)
        return [result], lambda items: items[0]

    @classmethod
    def _returned_input(cls, ctx, o, record):
        if not record:
            return "same"
        return "alias" if _contains(ctx._not_inplace, o) else "dirty"

    @classmethod
    def _leaf_dirty_error(cls, k):
        return LeafInplaceError(
            "%s: Leaf Var (input %d) that doesn't stop gradient can't use inplace strategy: "
            "forward returned it unchanged; call ctx.mark_not_inplace on it" % (cls.__name__, k),
            reason="LEAF_INPLACE")

    @classmethod
    def _no_tensor_output(cls, result):
        raise PyLayerError("%s: At least one output of `PyLayer.forward` is a `Tensor` (got %s)"
                           % (cls.__name__, type(result).__name__), reason="NO_TENSOR_OUTPUT")

    @classmethod
    def _check_dirty(cls, ctx, inputs, returned):
        pass

    @classmethod
    def _input_grads(cls, node, result):
        """Paddle's rules: one grad per Tensor (or list of Tensors) argument;
        fewer only where the missing inputs have stop_gradient; None where
        they have it."""
        name = node.name()
        n = len(node.inputs)
        if isinstance(result, list) and not (n == 1 and isinstance(node.inputs[0], list)):
            result = tuple(result)  # Paddle wants a tuple; a list is taken as one too
        if not isinstance(result, tuple):
            result = (result,)
        if len(result) > n:
            raise PyLayerError("%s: The number of outputs of `PyLayer.backward` should be %d, "
                               "but received %d" % (name, n, len(result)), reason="GRAD_COUNT",
                               metadata={"expected": str(n), "got": str(len(result))})
        policy = getattr(cls, "stop_gradient_grads", "error")
        out = []
        for i, slot in enumerate(node.inputs):
            ts = slot if isinstance(slot, list) else [slot]
            stop = not any(t.requires_grad for t in ts)
            if i >= len(result):
                if not stop:
                    raise PyLayerError("%s's backward returned no gradient at position %d, for "
                                       "an input that needs one" % (name, i), reason="GRAD_COUNT")
                out.append(None)
                continue
            g = result[i]
            if stop:
                if g is not None:
                    if policy == "error":
                        raise PyLayerError(
                            "%s's backward should return None at position %d, because its "
                            "forward Tensor's stop_gradient is True" % (name, i),
                            reason="STOP_GRADIENT_GRAD", metadata={"input": str(i)})
                    for x in (g if isinstance(g, (list, tuple)) else [g]):
                        if x is not None:
                            _stop_gradient_grad(cls, i, x)
                out.append(None)
                continue
            if isinstance(slot, list):
                if not isinstance(g, (list, tuple)) or len(g) != len(ts):
                    raise PyLayerError(
                        "%s: the gradient at position %d is for a list of %d Tensors: return a "
                        "list of %d gradients (got %s)" % (name, i, len(ts), len(ts),
                                                           type(g).__name__),
                        reason="GRAD_TYPE")
                row = []
                for k, (t, x) in enumerate(zip(ts, g)):
                    if x is not None and not _is_grad_value(x):
                        raise PyLayerError("%s: We can only support Tensor or None for backward "
                                           "output, but got %s" % (name, type(x).__name__),
                                           reason="GRAD_TYPE")
                    row.append(_fit(x, t, name, "%s[%d]" % (node.input_name(i), k))
                               if x is not None and t.requires_grad else None)
                out.append(row)
                continue
            if g is not None and not _is_grad_value(g):
                raise PyLayerError("%s: We can only support Tensor or None for backward output, "
                                   "but got %s" % (name, type(g).__name__), reason="GRAD_TYPE")
            out.append(_fit(g, slot, name, node.input_name(i)))
        return out


# ---- once_differentiable --------------------------------------------------------

_TWICE = ("trying to differentiate twice a function that was marked with "
          "@once_differentiable")


class _DelayedErrorNode(Node):
    """The grad_fn of what a @once_differentiable backward returns under
    create_graph: differentiating through it raises."""

    def __init__(self, inputs, out_meta, where):
        super().__init__(inputs, out_meta)
        self.where = where

    def name(self):
        return "OnceDifferentiableError"

    def apply(self, grads, retain_graph, create_graph=False):
        raise GradRuleError("%s (%s)" % (_TWICE, self.where), reason="ONCE_DIFFERENTIABLE")


def once_differentiable(fn):
    """Decorator for a Function's backward (torch.autograd.function.once_differentiable):
    it runs with grad recording off, so it may use anything (numpy included);
    under create_graph, the gradients it returns carry a node that raises
    GradRuleError when differentiated again, instead of a silently missing
    second derivative."""

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        with no_grad():
            outputs = fn(ctx, *args)
        if not is_grad_enabled():
            return outputs
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        if not any(isinstance(a, Tensor) and a.requires_grad for a in flat):
            return outputs
        single = not isinstance(outputs, tuple)
        items = [outputs] if single else list(outputs)
        tensors = [x for x in items if _is_grad_value(x) and not isinstance(x, np.generic)]
        if not tensors:
            return outputs
        node = _DelayedErrorNode(
            [x if isinstance(x, Tensor) else None for x in tensors],
            [(x.shape, x.dtype) for x in tensors], getattr(fn, "__qualname__", "backward"))
        wrapped = []
        k = 0
        for x in items:
            if _is_grad_value(x) and not isinstance(x, np.generic):
                t = x._alias() if isinstance(x, Tensor) else Tensor(x)
                t.grad_fn, t._output_index, t.requires_grad = node, k, True
                k += 1
                wrapped.append(t)
            else:
                wrapped.append(x)
        return wrapped[0] if single else tuple(wrapped)
    return wrapper


from opjit import _math  # noqa: E402,F401  (Tensor arithmetic; imports this module)

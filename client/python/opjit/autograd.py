"""Client-side autograd: Tensor, the backward engine, Function (PyLayer), no_grad.

The graph's nodes:

* ``ClientOpNode`` (opjit.op): a call to a daemon op with a registered bprop,
  made while the namespace's fast channel is open. The forward was a plain
  call; the node keeps copies of the tensors the bprop reads, and its
  backward is the bprop's own op call (see opjit._bprop).
* ``OpNode`` (opjit.op): the same without a fast channel (or for a bprop an
  op call cannot express). The forward left a context on the server
  (``ForwardResponse.context_id``); its backward is the ``Backward`` RPC.
* ``FunctionNode``: a ``Function`` subclass; its ``backward`` runs here, in
  Python, and calls daemon ops itself (Paddle PyLayer / torch.autograd.Function).

* ``MathNode``: arithmetic on Tensors (``+ - * /``, ``**``, ``sum``, ``mean``,
  ``reshape``, slicing, ``tanh``...), computed here with numpy (see
  ``opjit._math``); its backward is written with the same Tensor ops, so with
  ``create_graph=True`` the gradients are recorded too (double backward).

``Tensor.backward`` walks the graph from the tensor in topological order,
hands each node the gradients of its outputs, and accumulates the gradients
that reach leaf tensors with ``requires_grad`` into their ``.grad`` (a numpy
array). An input with ``stop_gradient`` (``requires_grad=False``) gets no
gradient; a node none of whose inputs needs one is never recorded, so its
backward never runs.
"""

import threading

import numpy as np

from opjit import _tensors as T
from opjit.errors import FailedPrecondition, InvalidArgument, StopGradientGradWarning

__all__ = ["Tensor", "tensor", "no_grad", "enable_grad", "is_grad_enabled", "Function",
           "FunctionCtx", "PyLayer", "PyLayerContext", "grad"]

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
        import functools

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
    """

    __array_priority__ = 100

    def __init__(self, data, requires_grad=False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        arr = T.as_ndarray(data if dtype is None else np.asarray(data, dtype=dtype))
        self.data = arr
        self.requires_grad = bool(requires_grad)
        self.grad = None
        self.grad_fn = None
        self._output_index = 0

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

    def requires_grad_(self, value=True):
        self.requires_grad = bool(value)
        return self

    def detach(self):
        """A new leaf Tensor over the same data, outside any graph."""
        return Tensor(self.data)

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
        ``y.sum()``). Gradients accumulate into ``.grad`` of leaf tensors that
        require them. A tensor that needs no gradient makes this a no-op
        (Paddle's rule: backward is not run).
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
        if grad_tensor is None:
            g = np.ones_like(self.data)
        elif isinstance(grad_tensor, Tensor):
            g = grad_tensor  # kept as is: under create_graph it may carry a graph of its own
        else:
            g = _as_grad(grad_tensor, self)
        _run_backward([(self, g)], retain_graph=retain_graph, create_graph=create_graph)


def tensor(data, requires_grad=False, dtype=None):
    """opjit.Tensor(data) with ``requires_grad``; ``data`` may be any array-like or DLPack object."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def _as_grad(g, like):
    if g is None:
        return None
    if isinstance(g, Tensor):
        g = g.data
    g = T.as_ndarray(g)
    if like is not None and g.shape != like.shape:
        raise InvalidArgument("gradient of shape %s for a tensor of shape %s"
                              % (g.shape, like.shape))
    return g


# ---- graph nodes ---------------------------------------------------------------

class Node:
    """A recorded call. `inputs` holds, per input slot, a Tensor, None or a list of those."""

    def __init__(self, inputs, out_meta):
        self.inputs = inputs
        self.out_meta = out_meta  # (shape, dtype) per output
        self.released = False

    def name(self):
        return type(self).__name__

    def apply(self, grads, retain_graph, create_graph=False):  # pragma: no cover - abstract
        """grads: one Tensor (or None) per output. Returns one gradient per input
        slot (Tensor, ndarray, None, or a list of those for a dynamic input)."""
        raise NotImplementedError


def _edges(node):
    """(slot, k, tensor) for every input tensor of node."""
    for i, v in enumerate(node.inputs):
        if isinstance(v, (list, tuple)):
            for k, t in enumerate(v):
                if isinstance(t, Tensor):
                    yield i, k, t
        elif isinstance(v, Tensor):
            yield i, None, v


def _as_grad_tensor(g, like):
    """g (Tensor, ndarray or None) as a Tensor of like's shape, or None."""
    if g is None:
        return None
    if not isinstance(g, Tensor):
        g = Tensor(T.as_ndarray(g))
    if like is not None and g.shape != like.shape:
        raise InvalidArgument("gradient of shape %s for a tensor of shape %s"
                              % (g.shape, like.shape))
    return g


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
        for _, _, t in _edges(n):
            if t.grad_fn is not None:
                deps[id(t.grad_fn)] = deps.get(id(t.grad_fn), 0) + 1
                stack.append(t.grad_fn)
    buffers = {id(n): [None] * len(n.out_meta) for n in order}
    nodes = {id(n): n for n in order}

    def deliver(t, g):
        if g is None:
            return
        if capture is not None and id(t) in capture:
            prev = capture[id(t)]
            capture[id(t)] = g if prev is None else prev + g
        if t.grad_fn is not None:
            buf = buffers[id(t.grad_fn)]
            i = t._output_index
            buf[i] = g if buf[i] is None else buf[i] + g
        elif t.requires_grad and capture is None:
            if create_graph:
                prev = t.grad
                t.grad = g if prev is None else (
                    prev if isinstance(prev, Tensor) else Tensor(prev)) + g
            else:
                prev = t.grad.data if isinstance(t.grad, Tensor) else t.grad
                t.grad = g.data.copy() if prev is None else prev + g.data

    for t, g in roots:
        deliver(t, _as_grad_tensor(g, t))

    ready = [n for n in order if deps[id(n)] == 0]
    while ready:
        n = ready.pop()
        grads = buffers.pop(id(n))
        if any(g is not None for g in grads):
            if n.released:
                raise FailedPrecondition(
                    "trying to backward through %s a second time: its saved tensors were freed "
                    "(pass retain_graph=True to the first backward)" % n.name())
            in_grads = n.apply(grads, retain_graph, create_graph)
            if not retain_graph:
                n.released = True
        else:
            in_grads = None
        for i, k, t in _edges(n):
            g = None
            if in_grads is not None:
                gi = in_grads[i]
                g = gi[k] if k is not None and isinstance(gi, (list, tuple)) else gi
                if k is not None and not isinstance(gi, (list, tuple)):
                    g = None
            if g is not None and t.requires_grad:
                deliver(t, _as_grad_tensor(g, t))
            if t.grad_fn is not None:
                deps[id(t.grad_fn)] -= 1
                if deps[id(t.grad_fn)] == 0:
                    ready.append(nodes[id(t.grad_fn)])


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=True):
    """The gradients of `outputs` w.r.t. `inputs` (torch.autograd.grad), without touching .grad.

    Returns one ndarray (or None) per input; with ``create_graph=True`` one
    opjit.Tensor (or None) per input, recorded on the tape, so it can be
    differentiated again (double backward). ``inputs`` may be leaves or
    intermediate tensors. retain_graph defaults to create_graph; without it
    the graph is freed. allow_unused=False: an input the outputs do not
    depend on raises InvalidArgument instead of giving None.
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


# ---- Function (PyLayer) ----------------------------------------------------------

class FunctionCtx:
    """What forward hands to backward (Paddle's PyLayerContext).

    Non-tensor values can be set as attributes (``ctx.scale = 2``).
    """

    def __init__(self):
        self._saved = ()
        self._non_diff = set()
        self.materialize_grads = True
        self.needs_input_grad = ()

    def save_for_backward(self, *tensors):
        """Keeps tensors for backward (call it in forward)."""
        self._saved = tuple(tensors)

    def saved_tensor(self):
        """The tensors given to save_for_backward, as a tuple."""
        if self._saved is None:
            raise FailedPrecondition("the saved tensors were freed by an earlier backward "
                                     "(use retain_graph=True)")
        return self._saved

    @property
    def saved_tensors(self):
        return self.saved_tensor()

    def mark_non_differentiable(self, *outputs):
        """Marks outputs (the objects forward returns) as having no gradient."""
        self._non_diff.update(id(o) for o in outputs)

    def set_materialize_grads(self, value):
        """False: missing output gradients reach backward as None instead of zeros."""
        self.materialize_grads = bool(value)


class FunctionNode(Node):
    def __init__(self, cls, ctx, inputs, out_meta):
        super().__init__(inputs, out_meta)
        self.cls = cls
        self.ctx = ctx

    def name(self):
        return self.cls.__name__ + "Backward"

    def apply(self, grads, retain_graph, create_graph=False):
        args = []
        for g, (shape, dtype) in zip(grads, self.out_meta):
            if g is None and self.ctx.materialize_grads:
                g = Tensor(np.zeros(shape, dtype))
            args.append(g)
        # With create_graph the ops backward runs are recorded (torch's rule).
        with _GradMode(bool(create_graph)):
            result = self.cls.backward(self.ctx, *args)
        if not isinstance(result, (tuple, list)):
            result = (result,)
        n_in = len(self.inputs)
        if len(result) != n_in:
            raise InvalidArgument("%s.backward returned %d gradient(s); forward had %d tensor "
                                  "input(s)" % (self.cls.__name__, len(result), n_in))
        out = []
        for k, (t, g) in enumerate(zip(self.inputs, result)):
            if g is not None and not t.requires_grad:
                _stop_gradient_grad(self.cls, k, g)
            if g is None or not t.requires_grad:
                out.append(None)
            else:
                out.append(g if isinstance(g, Tensor) else T.as_ndarray(g))
        if not retain_graph:
            self.ctx._saved = None
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
    import warnings
    warnings.warn(what + "; it was dropped (set stop_gradient_grads = 'ignore' or 'error' on "
                  "the class to change that)", StopGradientGradWarning, stacklevel=4)


class Function:
    """Custom forward/backward with PyLayer / torch.autograd.Function semantics.

    Subclass it with static ``forward(ctx, *args, **kwargs)`` and
    ``backward(ctx, *grads)``; run it with ``apply``. forward runs with grad
    recording off, and may call daemon ops; backward receives one gradient per
    tensor output of forward and returns one per tensor input of forward
    (None allowed). Inputs that need no gradient get None whatever backward
    returns, and when no input needs one, no node is recorded and backward
    never runs. A nonzero gradient returned for an input that needs none is
    dropped with a StopGradientGradWarning; set the class attribute
    ``stop_gradient_grads`` to "error" to raise instead, or "ignore".
    """

    stop_gradient_grads = "warn"

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("Function subclasses must define forward(ctx, ...)")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("Function subclasses must define backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args, **kwargs):
        tensor_inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, Tensor)]
        needs = is_grad_enabled() and any(t.requires_grad for t in tensor_inputs)
        ctx = FunctionCtx()
        ctx.needs_input_grad = tuple(t.requires_grad for t in tensor_inputs)
        with no_grad():
            result = cls.forward(ctx, *args, **kwargs)
        single = not isinstance(result, (tuple, list))
        items = [result] if single else list(result)
        outs, metas, tensor_slots = [], [], []
        for o in items:
            if isinstance(o, (Tensor, np.ndarray)):
                t = Tensor(o.data if isinstance(o, Tensor) else o)
                t._non_diff = id(o) in ctx._non_diff
                tensor_slots.append(t)
                metas.append((t.shape, t.dtype))
                outs.append(t)
            else:
                outs.append(o)
        if not tensor_slots:
            raise TypeError("%s.forward must return at least one Tensor" % cls.__name__)
        if needs:
            node = FunctionNode(cls, ctx, tensor_inputs, metas)
            for k, t in enumerate(tensor_slots):
                if not t._non_diff:
                    t.grad_fn = node
                    t._output_index = k
                    t.requires_grad = True
        for t in tensor_slots:
            del t._non_diff
        return outs[0] if single else type(result)(outs) if isinstance(result, tuple) else outs


PyLayer = Function  # Paddle's names: from paddle.autograd import PyLayer
PyLayerContext = FunctionCtx

from opjit import _math  # noqa: E402,F401  (Tensor arithmetic; imports this module)

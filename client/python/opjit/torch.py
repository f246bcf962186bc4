"""opjit ops inside PyTorch programs (needs PyTorch; ``import opjit`` does not).

    import torch, opjit.torch as ot
    leaky = ot.op("leaky_relu")                  # a registered opjit op
    y = leaky(torch.randn(4, 8), alpha=0.5)      # a torch.Tensor
    y = torch.ops.opjit.leaky_relu(x, 0.5)       # the same, as a torch op (torch.library)

* **Calls.** ``ot.op(name, client=None)`` wraps ``client.op(name)``: inputs
  are torch tensors (or anything opjit takes), attrs are keywords (or
  positional after the inputs), outputs are torch tensors whose shapes and
  dtypes come from the daemon's ``Prepare`` (the opjit call path, fast channel
  included). The op is also defined as ``torch.ops.opjit.<name>``
  (``<ns>__<name>`` for an op of namespace ``ns``) where its signature has a
  torch schema: inputs, then attrs by position or keyword with their
  defaults (keyword-only from a required attr that follows a defaulted one,
  which torch's schemas cannot have by position); ``TorchOp.torch_op`` is
  None and ``TorchOp.torch_error`` says why otherwise. Its kernels are
  Autograd (the autograd.Function below), CPU and Meta, as a torch custom
  op's: a torch dispatch mode (FakeTensorMode, SchemaCheckMode, make_fx)
  sees the op itself.
* **Meta and fake tensors.** A call on ``device="meta"`` tensors, or on
  FakeTensors (``torch._subclasses.FakeTensorMode``), runs no kernel: the
  outputs are empty tensors of the same kind whose shapes and dtypes come
  from the daemon's ``Prepare`` (the op's output rules or its InferShape;
  the output rules evaluated here for a server without Prepare). The torch
  op's Meta kernel does the same, so shape-only tracing and torch's
  CrossRefFakeMode work; autograd on meta tensors runs the bprops shape-only.
* **In place.** ``ot.op(name, aliases={0: 1})``: output 0 is written into
  input 1's memory (an in-place or ``out=`` variant; indices or names). The
  call places that output over the input's bytes (a prepared handle, on the
  fast channel or over gRPC, with ``keep_output_bytes`` so the daemon does
  not zero it first: the daemon accepts an output that is exactly an input
  only then), and returns the input tensor itself: no copy when the input
  lives in this client's shared memory (``copy_stats()["written_in_place"]``),
  else one copy in and one back (``copied_back``). The input's version moves
  on, as for torch's in-place ops; under autograd the input is marked dirty
  (``mark_dirty``), a bprop that reads it gets its value from before the
  write (a clone, torch's ``original_self``), and a leaf that requires grad
  is refused (``InPlaceError``, a RuntimeError). The torch op is
  ``<name>_`` with ``Tensor(a!)`` on the input and the output.
* **dtypes.** float16/32/64, int8/16/32/64, uint8 and bool map both ways
  (``torch_dtype``, ``dtype_name``); bfloat16, complex and quantized tensors
  (no opjit dtype), or an output of uint16/32/64 (no torch dtype in torch
  1.13) raise ``opjit.InvalidArgument`` naming the dtype.
* **Autograd.** When grad mode is on and an input requires grad, the call is
  a ``torch.autograd.Function``: its backward runs the op's registered bprop
  (``backward.op``) as another op call on the tensors ``backward.inputs``
  names (forward inputs, outputs, output grads), which torch saved. So torch
  owns what the backward needs (``retain_graph``, freeing, in-place checks);
  the daemon keeps no backward context, and both passes take the fast path.
  A bprop is itself called through ``opjit.torch``, so when it has a bprop
  of its own, double backward works (``create_graph=True``); otherwise the
  second backward raises ``FailedPrecondition`` (``NOT_DIFFERENTIABLE``), as
  does a first backward through an op without a bprop. Outputs named in
  ``backward.non_differentiable`` and integer or bool outputs are marked
  non-differentiable; inputs that need no grad get none. A grad the bprop
  returns at a broadcast shape is summed to its input's (torch's
  ``sum_to``, through opjit._grad_rules: ``GradShapeError`` where it cannot
  be) and cast to the input's dtype. ``ot.function(MyFunction)`` makes an
  ``opjit.Function`` (PyLayer) differentiable in torch at every order: torch
  asks opjit's tape for the grads, under ``create_graph`` as another node.
  Forward-mode AD (dual tensors) and functorch's grad/vjp/jvp raise
  ``UnsupportedTransform`` (a NotImplementedError and RuntimeError, as
  torch raises for an autograd.Function without jvp); under vmap a call
  goes through the torch op, whose per-slice fallback runs it.
  ``ot.module(name, **attrs)`` is an op as an ``nn.Module`` (for
  ``nn.Sequential``).
* **Memory.** CPU tensors are passed to opjit as numpy views (no copy). A
  tensor that lives in this client's shared memory (an earlier output,
  ``ot.empty``, ``ot.from_tensor``) travels by reference: zero copies. Any
  other tensor is copied once into shared memory by the call (counted by
  ``copy_stats()``), and a non-contiguous one is first made contiguous
  (another copy; ``contiguous="error"`` refuses it instead). Outputs are
  torch tensors over the shared memory (no copy). CUDA tensors raise
  ``InvalidArgument`` for now.
* **DLPack.** ``opjit.from_dlpack(torch_tensor)`` is an ndarray over the
  tensor's memory; ``torch.from_dlpack(ndarray)`` (or ``ot.from_dlpack``)
  is a tensor over an opjit output's.
* **The fast path.** A TorchOp caches each call shape's binding (attrs as
  given, each input's dtype and shape) with, when the namespace has a fast
  channel, the op's prepared handle and output specs: a repeated call writes
  its tensor refs (each input where it lives, or a copy; a fresh output
  block) and runs as one ``opjit._fastcall`` channel call, with no protobuf
  and no numpy views, and returns tensors over the output blocks
  (``torch.frombuffer``; a block goes back to the pool when its last tensor
  does). A closed channel or a stale handle sends that call down the
  ordinary path, which recovers, and the next call binds anew. Backward runs
  the bprop the same way. ``TorchOp.prepare(*tensors, **attrs)`` is
  ``Op.prepare`` on torch tensors: the same output tensors every call.
"""

import ctypes
import threading
import time

import numpy as np

try:
    import torch  # absolute: the top-level PyTorch package, not this module
except ImportError as e:
    raise ImportError("opjit.torch needs PyTorch (%s): apt install python3-torch, or "
                      "pip install 'opjit[torch]'; the rest of opjit works without it" % e) \
        from e

import torch.autograd.forward_ad as _fwd_ad

import opjit
from opjit import _fast
from opjit import _tensors as T
from opjit._grad_rules import differentiable, fit_grad
from opjit._shm import ShmUnavailable
from opjit.errors import (FailedPrecondition, InvalidArgument, OpjitError, Unimplemented,
                          error_from_status)
from opjit.op import Op, bprop_args

try:  # torch 1.13's fake tensors (shape-only tracing)
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # pragma: no cover - an older torch
    _FakeTensor = None
_functorch = getattr(torch._C, "_functorch", None)  # functorch's C helpers (torch 1.13)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)

__all__ = ["op", "TorchOp", "PreparedTorchCall", "module", "OpModule", "function", "empty", "empty_like", "zeros", "from_tensor",
           "is_shared", "from_dlpack", "to_dlpack", "torch_dtype", "dtype_name",
           "default_client", "set_default_client", "copy_stats", "reset_copy_stats",
           "UnsupportedTransform", "InPlaceError", "LIBRARY"]

LIBRARY = "opjit"  # torch.ops.opjit.<name>

# opjit dtype name <-> torch dtype. uint16/32/64 have no torch 1.13 dtype.
_TO_TORCH = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


class UnsupportedTransform(Unimplemented):
    """A torch transform an opjit op cannot follow: forward-mode AD (dual
    tensors: an op has no jvp), functorch's grad/vjp/jvp, or vmap of an op
    that is not a torch op. A NotImplementedError, so also a RuntimeError,
    as torch raises for an autograd.Function without jvp (reason
    FORWARD_AD_UNSUPPORTED or FUNCTORCH_UNSUPPORTED)."""


class InPlaceError(FailedPrecondition, RuntimeError):
    """An in-place call torch refuses too (a RuntimeError there): a leaf that
    requires grad written in place under grad mode (reason INPLACE_LEAF)."""


def torch_dtype(name):
    """The torch dtype of an opjit dtype name (or numpy dtype); InvalidArgument if none."""
    if not isinstance(name, str):
        name = T.dtype_name(name)
    dt = _TO_TORCH.get(name)
    if dt is None:
        raise InvalidArgument("opjit dtype %s has no torch counterpart (torch %s has %s)"
                              % (name, torch.__version__, " ".join(_TO_TORCH)))
    return dt


def dtype_name(dtype):
    """The opjit dtype name of a torch dtype; InvalidArgument if opjit has none."""
    name = _FROM_TORCH.get(dtype)
    if name is None:
        raise InvalidArgument("torch dtype %s has no opjit counterpart (opjit.torch takes %s)"
                              % (dtype, ", ".join(str(d) for d in _FROM_TORCH)))
    return name


# ---- the default client and copy accounting ---------------------------------------------

_lock = threading.Lock()
_default = None
_stats = {"calls": 0, "inputs": 0, "shared_inputs": 0, "copied_inputs": 0, "copied_bytes": 0,
          "made_contiguous": 0, "written_in_place": 0, "copied_back": 0, "copied_back_bytes": 0}


def default_client():
    """The client opjit.torch uses when none is given: one opjit.Client()
    ($OPJIT_SERVER, else the default socket), made on first use."""
    global _default
    with _lock:
        if _default is None:
            _default = opjit.Client()
        return _default


def set_default_client(client):
    global _default
    with _lock:
        _default = client


def copy_stats():
    """Counts since the last reset: calls, inputs, shared_inputs (passed by
    reference: already in this client's shared memory), copied_inputs and
    copied_bytes (copied once into shared memory by the call), made_contiguous
    (non-contiguous inputs copied to a contiguous tensor first); for ops
    whose outputs alias inputs (``aliases``): written_in_place (outputs the
    kernel wrote straight into their input's memory) and copied_back /
    copied_back_bytes (outputs written elsewhere, then copied into an input
    that does not live in this client's shared memory)."""
    with _lock:
        return dict(_stats)


def reset_copy_stats():
    with _lock:
        for k in _stats:
            _stats[k] = 0


def _in_pool(pool, addr, nbytes):
    """Whether [addr, addr + nbytes) lies in a live region of `pool` (for
    the copy counts only: the transport decides for itself, under its lock)."""
    for r in pool._regions:
        if r.live and r.addr <= addr and addr + nbytes <= r.addr + r.size:
            return True
    return False


def _pool(client, namespace):
    tr = getattr(client, "_transport", None)
    try:
        return tr.pool(namespace) if tr is not None else None
    except Exception:
        return None


# ---- tensors <-> arrays ----------------------------------------------------------------

def _check_tensor(t, what):
    if not t.is_cpu:
        raise InvalidArgument(
            "%s is a %s tensor (%s): opjit.torch takes CPU tensors for now (CUDA IPC between "
            "torch and opjitd is not implemented); move it with .cpu()"
            % (what, t.device.type.upper(), t.device))
    if t.layout is not torch.strided:
        raise InvalidArgument("%s has layout %s: opjit.torch takes dense (strided) tensors; "
                              "use .to_dense()" % (what, t.layout))
    if t.dtype not in _FROM_TORCH:
        dtype_name(t.dtype)  # raises, naming the dtype


def _text(what):
    return what if isinstance(what, str) else "input %s of op %s" % what


def _array(t, what, contiguous="copy"):
    """A zero-copy ndarray over CPU tensor t (made contiguous first if need
    be). what: a text, or (input name, op name), for errors."""
    if not isinstance(t, torch.Tensor):
        return T.as_ndarray(t, _text(what))
    if not t.is_cpu or t.layout is not torch.strided or t.dtype not in _FROM_TORCH:
        _check_tensor(t, _text(what))
    if not t.is_contiguous():
        if contiguous == "error":
            raise InvalidArgument(
                "%s is not contiguous (shape %s, strides %s): opjit kernels take row-major "
                "tensors; pass .contiguous() (a copy), or use contiguous=\"copy\""
                % (_text(what), tuple(t.shape), t.stride()))
        t = t.contiguous()
        with _lock:
            _stats["made_contiguous"] += 1
    return t.detach().numpy()  # (conj/neg views exist for complex tensors only: refused)


_NP_TORCH = frozenset(T.DTYPES[n] for n in _TO_TORCH)


def _tensor(arr):
    """A torch tensor over ndarray arr (no copy)."""
    if isinstance(arr, torch.Tensor):
        return arr
    if arr.dtype not in _NP_TORCH:
        torch_dtype(T.dtype_name(arr.dtype))  # raises, naming it
    if not arr.flags.writeable:
        arr = arr.copy()  # torch.from_numpy warns on read-only arrays
    return torch.from_numpy(arr)


# ---- shared memory ---------------------------------------------------------------------

def _client(client):
    return client if client is not None else default_client()


def empty(*size, dtype=torch.float32, client=None, requires_grad=False):
    """An uninitialised CPU tensor in `client`'s shared memory: ops take it
    without any copy (a plain torch.empty with the inline transport)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    np_dtype = T.DTYPES[dtype_name(dtype)]
    t = torch.from_numpy(_client(client).empty(tuple(int(s) for s in size), np_dtype))
    return t.requires_grad_(requires_grad) if requires_grad else t


def empty_like(t, client=None):
    return empty(tuple(t.shape), dtype=t.dtype, client=client)


def zeros(*size, dtype=torch.float32, client=None, requires_grad=False):
    t = empty(*size, dtype=dtype, client=client)
    t.zero_()
    return t.requires_grad_(requires_grad) if requires_grad else t


def is_shared(t, client=None, namespace=None):
    """Whether tensor t lives in `client`'s shared memory (ops pass it by reference)."""
    client = _client(client)
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        return False
    pool = _pool(client, client.namespace if namespace is None else namespace)
    return pool is not None and t.numel() > 0 and pool.locate(t.detach().numpy()) is not None


def from_tensor(t, client=None):
    """t in shared memory: t itself when it is there already, else a copy
    there (one copy; requires_grad is kept, the copy is a new leaf)."""
    client = _client(client)
    if is_shared(t, client):
        return t
    _check_tensor(t, "from_tensor's argument")
    out = empty(tuple(t.shape), dtype=t.dtype, client=client)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def from_dlpack(x):
    """A torch tensor over the memory of any DLPack object (an opjit output ndarray...)."""
    return torch.utils.dlpack.from_dlpack(x)


def to_dlpack(t):
    """An ndarray over a CPU tensor's memory (opjit.from_dlpack of it; no copy)."""
    _check_tensor(t, "to_dlpack's argument")
    return opjit.from_dlpack(t.detach())


# ---- ops ------------------------------------------------------------------------------

class _Call:
    """One call's binding: which op, the declared inputs, each group's size,
    attrs; for a cached binding also the keyword attrs it was made from
    (``kw``: None when the call named a version or target) and its fast
    channel plan (``fast``: a _Fast, or None)."""

    __slots__ = ("top", "inputs", "sizes", "attrs", "version", "target", "kw", "fast")

    def __init__(self, top, inputs, sizes, attrs, version, target, kw=None):
        self.top, self.inputs, self.sizes = top, inputs, sizes
        self.attrs, self.version, self.target = attrs, version, target
        self.kw = kw
        self.fast = None


class _Block(np.ndarray):
    """The bytes of one output block; frees the block when the last tensor
    over it goes (torch.frombuffer keeps this array alive as long as the
    storage lives)."""

    __slots__ = ("_blk",)  # (pool, region, offset, spare list); unset on numpy's views

    def __del__(self):
        blk = getattr(self, "_blk", None)
        if blk is not None:
            spare = blk[3]
            if spare is not None and len(spare) < _SPARE_BLOCKS:
                spare.append((blk[1], blk[2]))  # the next call of its shape reuses it
            else:
                blk[0]._defer_free(blk[1], blk[2])  # a deque append: safe anywhere


class _Fast:
    """A call shape bound to the namespace's fast channel: the prepared
    handle, the output specs, and the channel's call function. Each call
    writes its own tensor refs (inputs where they live, fresh output
    blocks) and runs as one slot write and wait in opjit._fastcall."""

    __slots__ = ("prep", "handle", "fch", "native", "pool", "transport", "in_bytes", "outs",
                 "timeout_ns", "flags", "temps", "retired")

    def __init__(self, transport, pool, prep, fch, in_bytes, timeout):
        self.transport, self.pool, self.prep, self.fch = transport, pool, prep, fch
        self.handle = prep.handle
        self.in_bytes = in_bytes
        # Per output: torch dtype, shape, bytes, and the blocks of outputs
        # already freed, kept for the next calls (small outputs only; a
        # list's append and pop are atomic).
        self.outs = [(_TO_TORCH[T.dtype_name(dt)], tuple(shape), nb,
                      [] if nb <= _SPARE_MAX_BYTES else None)
                     for dt, shape, nb in prep.outputs]
        self.timeout_ns = int(timeout * 1e9) if timeout else 0
        self.flags = 0
        # Per input, the block kept for copies of a tensor outside shared
        # memory (small ones; a list, whose pop and append are atomic: empty
        # while a call uses it).
        self.temps = [[] for _ in in_bytes]
        self.retired = False
        ext = getattr(fch, "_ext", None)
        if ext is not None:
            self.native = ext.call  # -> (code, reason, message, kernel_ms)
        else:
            def native(handle, refs, deadline_ns, flags, _call=fch._call):
                r = _call(handle, refs, deadline_ns, flags)
                return r.code, r.reason, r.message, r.kernel_ms
            self.native = native


_grad_enabled = torch.is_grad_enabled
_NOT_ROUTED = object()


def _tensors_in(args, kwargs=None):
    """The torch tensors among args (and in their lists) and kwargs' values."""
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _can_prepare(tr):
    """Whether transport tr may be asked for Prepare: it uses it, or it was
    told to take no fast path (fast="off": the handle then goes over gRPC)."""
    return tr is not None and hasattr(tr, "_prepare") and (
        getattr(tr, "_prepare_ok", False) or getattr(tr, "fast_mode", "") == "off")


def _is_meta_like(t):
    """A tensor with no data to run a kernel on: meta, or a FakeTensor."""
    return isinstance(t, torch.Tensor) and (
        t.is_meta or (_FakeTensor is not None and isinstance(t, _FakeTensor)))


def _own(o):
    """A tensor over o's memory that is not a view (o's storage, offset and strides)."""
    return o.new_empty((0,)).set_(o.storage(), o.storage_offset(), o.size(), o.stride())


def _bump_version(t):
    """Moves t's version counter on, as an in-place torch op does (an
    in-place op on an empty view: no element is touched). Inference tensors
    have no version counter."""
    if not t.is_inference():
        t.detach().as_strided((0,), (1,)).zero_()

_U8 = np.dtype(np.uint8)
_CALL_CACHE = 64  # bindings kept per TorchOp (dropped all at once beyond)
_SPARE_BLOCKS = 4  # freed output blocks kept per output of a call shape...
_SPARE_MAX_BYTES = 1 << 16  # ...when it is at most this big


def _is_float(t):
    return t.is_floating_point() or t.is_complex()


_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64,
                     torch.complex64, torch.complex128))


class _OpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, *flat):
        top = call.top
        saved = flat
        written = ()
        if top._aliases:
            # The kernel writes these inputs (mark_dirty). One the bprop
            # reads is saved as it was before (a clone, as torch's own
            # in-place ops keep original_self).
            written = top._written(call)
            reads = top._bprop_reads(call)
            if reads:
                saved = list(flat)
                for k in reads:
                    saved[k] = flat[k].clone()
        outs = top._run_call(call, flat)
        # Outputs over a shared-memory block are views of it (frombuffer):
        # returned as such, torch would refuse in-place ops on them later
        # ("output of a function that returns views"). The same memory, as
        # tensors of their own.
        if written:
            mine = {id(flat[k]) for k in written}  # aliased outputs: the inputs themselves
            outs = [o if id(o) in mine or not o._is_view() else _own(o) for o in outs]
            ctx.mark_dirty(*[flat[k] for k in written])
        else:
            outs = [_own(o) if o._is_view() else o for o in outs]
        ctx.call = call
        nd = top._non_diff
        # Integer and bool outputs carry no gradient (torch's rule).
        nondiff = [o for j, o in enumerate(outs) if j in nd or o.dtype not in _FLOATS]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        ctx.save_for_backward(*saved, *outs)
        ctx.n_in = len(flat)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        flat, outs = saved[:ctx.n_in], saved[ctx.n_in:]
        dx = ctx.call.top._backward(ctx.call, flat, outs, grads, ctx.needs_input_grad[1:])
        return (None,) + tuple(dx)


class TorchOp:
    """A registered opjit op called on torch tensors; see the module docstring.

    ``TorchOp(op)`` or ``opjit.torch.op(name, client=...)``. ``contiguous``:
    "copy" (default: a non-contiguous input is made contiguous, a copy) or
    "error" (refused with InvalidArgument). ``register``: also define
    ``torch.ops.opjit.<torch_name>`` (default True). ``aliases``: {output
    index: input index}, outputs the kernel writes into that input's memory
    (an in-place or ``out=`` op; see the module docstring).
    """

    def __init__(self, op, contiguous="copy", register=True, torch_name=None, aliases=None):
        if contiguous not in ("copy", "error"):
            raise InvalidArgument('contiguous must be "copy" or "error", not %r' % (contiguous,))
        self.op = op
        self.contiguous = contiguous
        self.torch_op = None
        self.torch_error = None
        self._bprop = None
        self._bprop_args = None
        self._aliases = {}
        self._calls = {}  # (kwargs, (dtype, shape) per input) -> _Call
        self._refresh_def()
        self._aliases = self._check_aliases(aliases)
        base = "%s__%s" % (op.namespace, op.name) if op.namespace else op.name
        # An in-place variant is named as torch names them (mul_), so the
        # op and its in-place form can both be torch ops.
        self.torch_name = torch_name or (base + "_" if self._aliases else base)
        if register:
            self._register()

    def __repr__(self):
        return "opjit.torch.TorchOp(%r)" % (self.op.qualified_name,)

    @property
    def name(self):
        return self.op.name

    @property
    def aliases(self):
        """{output index: input index}: outputs written into their input's memory."""
        return dict(self._aliases)

    def _check_aliases(self, aliases):
        """{output: input} checked against the op's definition: each output
        aliases one required (or optional) input, at most one output per input."""
        if not aliases:
            return {}
        opdef = self.record.op
        outs = sorted(opdef.outputs, key=lambda p: p.index)
        ins = sorted(opdef.inputs, key=lambda p: p.index)
        names_out = {p.name: j for j, p in enumerate(outs)}
        names_in = {p.name: i for i, p in enumerate(ins)}
        checked = {}
        for j, i in dict(aliases).items():
            j = names_out.get(j, j) if isinstance(j, str) else j
            i = names_in.get(i, i) if isinstance(i, str) else i
            if not isinstance(j, int) or not 0 <= j < len(outs):
                raise InvalidArgument("op %s: aliases names output %r; it has %d output(s) (%s)"
                                      % (self.op.name, j, len(outs),
                                         ", ".join(p.name for p in outs)))
            if not isinstance(i, int) or not 0 <= i < len(ins):
                raise InvalidArgument("op %s: aliases names input %r; it has %d input(s) (%s)"
                                      % (self.op.name, i, len(ins),
                                         ", ".join(p.name for p in ins)))
            if (ins[i].param_type or "required") == "dynamic":
                raise InvalidArgument("op %s: output %s cannot alias dynamic input %s (a list "
                                      "of tensors)" % (self.op.name, outs[j].name, ins[i].name))
            if i in checked.values():
                raise InvalidArgument("op %s: two outputs alias input %s" % (self.op.name,
                                                                            ins[i].name))
            checked[j] = i
        return checked

    def _flat_index(self, call, i):
        return sum(call.sizes[:i])

    def _written(self, call):
        """Flat indices of the inputs the kernel writes."""
        return tuple(self._flat_index(call, i) for i in self._aliases.values()
                     if call.sizes[i] == 1)

    def _bprop_reads(self, call):
        """Flat indices of written inputs the bprop reads (saved before the kernel runs)."""
        if not self.record.op.backward.op:
            return ()
        wanted = {i for kind, i in bprop_args(self.record.op) if kind == "in"}
        return tuple(self._flat_index(call, i) for i in self._aliases.values()
                     if i in wanted and call.sizes[i] == 1)

    def _refresh_def(self):
        self.record = self.op.definition()
        opdef = self.record.op
        outs = sorted(opdef.outputs, key=lambda p: p.index)
        nd = set(opdef.backward.non_differentiable)
        self._non_diff = frozenset(j for j, p in enumerate(outs) if p.name in nd)
        self._pool = _pool(self.op.client, self.op.namespace)
        self._dynamic = any(p.param_type == "dynamic" for p in opdef.inputs)
        self._retire_calls()
        self._bprop_args = None

    # -- the call
    def __call__(self, *args, **kwargs):
        if _fwd_ad._current_level >= 0 or _transforms_active():
            routed = self._transformed(args, kwargs)
            if routed is not _NOT_ROUTED:
                return routed
        if self._aliases:
            return self._call_in_place(args, kwargs)
        # The binding of a call shape (attrs, each input's dtype and shape)
        # is cached, with its fast channel plan: a repeated call skips the
        # binding, Prepare and the numpy views.
        try:
            key = (tuple(kwargs.items()),) + tuple([(a.dtype, a.shape) for a in args])
            call = self._calls.get(key)
        except (AttributeError, TypeError):  # not all tensors, or an unhashable attr
            key = call = None
        if call is not None:  # a cached binding: args are its flat tensors
            if _grad_enabled():
                for a in args:
                    if a.requires_grad:
                        if self._dynamic:
                            return self._apply(call, args)
                        return _OpFunction.apply(call, *args)
            f = call.fast
            outs = self._run_fast(call, f, args) if f is not None else None
            if outs is None:
                outs = self._run(call, args)
            return outs[0] if len(outs) == 1 else tuple(outs)
        call, flat = self._bind_call(args, kwargs)
        # (A meta or fake call is not cached: a real call of its shape
        # would find no fast plan there.)
        if key is not None and len(flat) == len(args) and all(
                f is a and isinstance(a, torch.Tensor) and not _is_meta_like(a)
                for f, a in zip(flat, args)):
            call.fast = self._make_fast(call, flat)
            if len(self._calls) >= _CALL_CACHE:
                self._retire_calls()
            self._calls[key] = call
        if _grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return self._apply(call, flat)
        outs = self._run_call(call, flat)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _transformed(self, args, kwargs):
        """A call under forward-mode AD or a functorch transform: refused
        where it cannot work (UnsupportedTransform), routed through the torch
        op under vmap (torch's per-slice fallback), else _NOT_ROUTED."""
        tensors = [t for t in _tensors_in(args, kwargs)]
        if _fwd_ad._current_level >= 0:
            for t in tensors:
                if _fwd_ad.unpack_dual(t).tangent is not None:
                    raise UnsupportedTransform(
                        "op %s: forward-mode AD (torch.autograd.forward_ad) is not supported: "
                        "opjit ops have no jvp (torch raises the same for an autograd.Function "
                        "without one); use reverse mode (backward, torch.autograd.grad)"
                        % self.op.name, reason="FORWARD_AD_UNSUPPORTED",
                        metadata={"op": self.op.qualified_name})
        if _functorch is not None and _transforms_active():
            for t in tensors:
                if _functorch.is_batchedtensor(t):
                    if self.torch_op is not None:
                        # torch's vmap fallback: the op once per slice.
                        return self.torch_op(*args, **kwargs)
                    raise UnsupportedTransform(
                        "op %s: vmap needs the torch op (torch.ops.%s.<name>), which this "
                        "TorchOp does not define (%s)" % (self.op.name, LIBRARY,
                                                          self.torch_error or "register=False"),
                        reason="FUNCTORCH_UNSUPPORTED", metadata={"op": self.op.qualified_name})
                if _functorch.is_functorch_wrapped_tensor(t):
                    raise UnsupportedTransform(
                        "op %s: functorch transforms (grad, vjp, jvp) do not support opjit ops, "
                        "as they do not support autograd.Function in torch %s; use "
                        "torch.autograd.grad" % (self.op.name, torch.__version__),
                        reason="FUNCTORCH_UNSUPPORTED", metadata={"op": self.op.qualified_name})
        return _NOT_ROUTED

    def _call_in_place(self, args, kwargs):
        """A call of an op whose outputs alias inputs: the kernel writes the
        inputs' memory, the outputs are those input tensors, their versions
        move on (torch's in-place rules, mark_dirty under autograd)."""
        call, flat = self._bind_call(args, kwargs)
        for k in self._written(call):
            if not isinstance(flat[k], torch.Tensor):
                raise InvalidArgument("op %s: input %d is written in place, so it must be a "
                                      "torch.Tensor, not %s" % (self.op.name, k,
                                                                type(flat[k]).__name__))
        grad = _grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
        if grad:
            for k in self._written(call):
                t = flat[k]
                if t.requires_grad and t.is_leaf:
                    raise InPlaceError(
                        "op %s writes its input %d in place, which is a leaf tensor that "
                        "requires grad (torch refuses: a leaf Variable that requires grad is "
                        "being used in an in-place operation); clone it, or call under "
                        "torch.no_grad()" % (self.op.name, k), reason="INPLACE_LEAF",
                        metadata={"op": self.op.qualified_name, "input": str(k)})
            return self._apply(call, flat)
        outs = self._run_call(call, flat)
        for k in self._written(call):
            _bump_version(flat[k])
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _apply(self, call, flat):
        """The call as a torch.autograd.Function (an input requires grad)."""
        k = 0
        for p, n in zip(call.inputs, call.sizes):
            if p.param_type == "dynamic" and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in flat[k:k + n]):
                raise InvalidArgument(
                    "op %s: dynamic input %s requires grad; opjit.torch differentiates "
                    "required and optional inputs only" % (self.op.name, p.name))
            k += n
        if not all(isinstance(t, torch.Tensor) for t in flat):
            flat = [t if isinstance(t, torch.Tensor) else _tensor(T.as_ndarray(t))
                    for t in flat]
        return _OpFunction.apply(call, *flat)

    def _bind_call(self, args, kwargs):
        """(_Call, flat inputs) of a call's arguments, as opjit.Op binds them."""
        kwargs = dict(kwargs)
        named = "version" in kwargs or "target" in kwargs
        version = kwargs.pop("version", self.op.version)
        target = kwargs.pop("target", self.op.target)
        record = self.record if version in (0, self.record.version) else \
            self.op.definition(version)
        attrs_in = {k: v for k, v in kwargs.items() if v is not None}
        n_in = len(record.op.inputs)
        positional_attrs = len(args) > n_in
        if positional_attrs and any(v is None for v in args[n_in:]):
            # torch.ops passes every attr, None for an unset optional one.
            for a, v in zip(record.op.attrs, args[n_in:]):
                if v is not None and a.name not in attrs_in:
                    attrs_in[a.name] = v
            args = args[:n_in]
            positional_attrs = False
        inputs, groups, pb_attrs = self.op._bind(record.op, args, dict(attrs_in))
        flat, sizes = [], []
        for g in groups:
            sizes.append(len(g))
            flat.extend(g)
        kw = None if named or positional_attrs else attrs_in
        return _Call(self, inputs, sizes, pb_attrs, version, target, kw), flat

    def _make_fast(self, call, flat):
        """The _Fast plan of this call shape, or None when it cannot take the
        fast channel this way (no channel, no Prepare, an empty tensor, an
        input that is not a dense CPU tensor...)."""
        if call.version != 0 and call.version != self.record.version or self._aliases:
            return None
        try:
            tr = self.op._session._t
            ns = self.op.namespace
            if not isinstance(tr.calls, dict) or tr.copy_outputs or not tr._prepare_ok:
                return None
            pool = tr.pool(ns)
            if pool is None:
                return None
            arrays = []
            for t in flat:
                if not t.is_cpu or t.layout is not torch.strided or t.dtype not in _FROM_TORCH \
                        or t.numel() == 0:
                    return None
                arrays.append(np.empty(tuple(t.shape), T.DTYPES[_FROM_TORCH[t.dtype]]))
            groups, k = [], 0
            for n in call.sizes:
                groups.append(arrays[k:k + n])
                k += n
            prep = tr._prepare(ns, self.op.name, call.version, call.target or "", groups,
                               call.attrs)
            if prep is None or not prep.fast or prep.null_inputs:
                return None
            if any(nb == 0 for _, _, nb in prep.outputs) or \
                    any(dt not in _NP_TORCH for dt, _, _ in prep.outputs):
                return None
            fch = tr.channel(ns)
            if fch is None or prep.n_tensors > fch.max_tensors:
                return None
            probe = pool.alloc(1)  # a server without region ids: the ordinary path
            pool.free(*probe)
            if not probe[0].id:
                return None
            if call.version == 0 and prep.version and prep.version != self.record.version:
                return None  # the op changed: the slow path refreshes the definition
            return _Fast(tr, pool, prep, fch, [a.nbytes for a in arrays], tr.timeout)
        except (ShmUnavailable, opjit.OpjitError):
            return None  # the ordinary path reports it, or copes

    def _run_call(self, call, flat):
        f = call.fast
        if f is not None:
            outs = self._run_fast(call, f, flat)
            if outs is not None:
                return outs
        return self._run(call, flat)

    def _run_fast(self, call, f, flat):
        """The call on the fast channel; None to take the ordinary path
        instead (which then reopens a channel or prepares again)."""
        pool = f.pool
        regions = pool._regions
        refs = []
        temps = blocks = ()
        shared = made = copied_bytes = 0
        try:
            for t, nb in zip(flat, f.in_bytes):
                if not t.is_contiguous():
                    if self.contiguous == "error" or not t.is_cpu:
                        return None  # the ordinary path refuses it
                    t = t.contiguous()
                    made += 1
                addr = t.data_ptr()
                if not addr:  # no data (a FakeTensor): the ordinary path copes
                    return None
                for r in regions:
                    if r.addr <= addr and addr + nb <= r.addr + r.size and r.live:
                        refs += (r.id, addr - r.addr)
                        shared += 1
                        break
                else:
                    if not t.is_cpu:
                        return None
                    j = len(refs) >> 1
                    try:
                        blk = f.temps[j].pop()
                        if not blk[0].live:
                            blk = pool.alloc(nb)
                    except IndexError:
                        blk = pool.alloc(nb)
                    if not temps:
                        temps = []
                    temps.append((j, blk))
                    region, off = blk
                    ctypes.memmove(region.addr + off, addr, nb)
                    refs += (region.id, off)
                    copied_bytes += nb
            blocks = []
            for _, _, nb, spare in f.outs:
                region = None
                if spare:
                    try:
                        blk = spare.pop()
                    except IndexError:  # another thread took it
                        blk = None
                    if blk is not None:
                        region, off = blk
                if region is None or not region.live:  # (a forgotten region: left be)
                    region, off = pool.alloc(nb)
                blocks.append((region, off))
                refs += (region.id, off)
            t_ns = f.timeout_ns
            code, reason, message, _ = f.native(
                f.handle, refs, time.monotonic_ns() + t_ns if t_ns else 0, f.flags)
            if code:
                if reason == "STALE_HANDLE" or reason == "REGION_NOT_REGISTERED":
                    self._drop_fast(call, f)
                    return None
                raise error_from_status(code, message, reason=reason)
            outs = []
            for (region, off), (dtype, shape, nb, spare) in zip(blocks, f.outs):
                b = _Block((nb,), _U8, region.mm, off)
                b._blk = (pool, region, off, spare)
                o = torch.frombuffer(b, dtype=dtype)
                outs.append(o if len(shape) == 1 else o.view(shape))
            blocks = ()
        except _fast.ChannelClosed:
            self._drop_fast(call, f)
            return None
        except ShmUnavailable:
            return None
        finally:
            for region, off in blocks:
                pool.free(region, off)
            for j, blk in temps:
                kept = f.temps[j]
                if not kept and not f.retired and f.in_bytes[j] <= _SPARE_MAX_BYTES:
                    kept.append(blk)  # the next call's copy goes there
                else:
                    pool.free(*blk)
        f.transport.calls["fast"] += 1
        n = len(flat)
        with _lock:
            _stats["calls"] += 1
            _stats["inputs"] += n
            if shared:
                _stats["shared_inputs"] += shared
            if shared != n:
                _stats["copied_inputs"] += n - shared
                _stats["copied_bytes"] += copied_bytes
            if made:
                _stats["made_contiguous"] += made
        return outs

    def _drop_fast(self, call, f):
        """Forgets a plan that stopped working (closed channel, stale handle):
        the ordinary path recovers, and the next call binds anew."""
        call.fast = None
        self._retire_calls()
        f.transport._forget_prepared(f.prep)

    def _retire_calls(self):
        """Drops the cached bindings; their spare output blocks go back to
        the pool, and so do blocks of their outputs freed later."""
        calls, self._calls = getattr(self, "_calls", {}), {}
        for call in calls.values():
            f = call.fast
            if f is None:
                continue
            f.retired = True
            for kept in f.temps:
                while True:
                    try:
                        blk = kept.pop()
                    except IndexError:
                        break
                    f.pool.free(*blk)
            for _, _, _, spare in f.outs:
                if spare is None:
                    continue
                blocks = list(spare)
                spare[:] = [None] * _SPARE_BLOCKS  # full: later frees go to the pool
                for blk in blocks:
                    if blk is not None:
                        f.pool.free(*blk)

    def _run(self, call, flat):
        for t in flat:
            if _is_meta_like(t):
                return self._shape_only(call, flat)
        if self._aliases:
            return self._run_aliased(call, flat)
        return self._run_plain(call, flat)

    # -- shapes only: meta and fake tensors
    def _shape_only(self, call, flat):
        """Outputs of a call on meta (or fake) tensors, from the op's rules,
        without running the kernel: empty tensors of the same kind (meta, or
        fake under the inputs' FakeTensorMode); an aliased output is its input."""
        ref = next(t for t in flat if _is_meta_like(t))
        specs = self._output_specs(call, flat)
        alias_at = self._alias_flat(call)
        self._check_alias_specs(specs, flat, alias_at)
        outs = []
        for j, (dt, shape) in enumerate(specs):
            k = alias_at.get(j)
            outs.append(flat[k] if k is not None else
                        ref.new_empty(shape, dtype=torch_dtype(T.dtype_name(dt))))
        return outs

    def _output_specs(self, call, flat):
        """[(numpy dtype, shape)] of the outputs for inputs of these dtypes
        and shapes: the daemon's Prepare (the op's output rules, or its
        InferShape), else the output rules evaluated here."""
        groups, k = [], 0
        for n in call.sizes:
            row = []
            for t in flat[k:k + n]:
                if isinstance(t, torch.Tensor):
                    dt = T.DTYPES[dtype_name(t.dtype)]
                    row.append(np.broadcast_to(np.empty((), dt), tuple(t.shape)))
                else:
                    row.append(T.as_ndarray(t, "input"))
            groups.append(row)
            k += n
        tr = getattr(self.op._session, "_t", None)
        if _can_prepare(tr):
            try:
                prep = tr._prepare(self.op.namespace, self.op.name, call.version,
                                   call.target or "", groups, call.attrs)
            except Unimplemented:  # a server without Prepare
                prep = None
            if prep is not None:
                return [(np.dtype(dt), tuple(shape)) for dt, shape, _ in prep.outputs]
        return _rule_specs(self.record.op, groups, call.attrs, self.op.name)

    # -- in place: outputs written into their inputs
    def _alias_flat(self, call):
        """{output index: flat index of the input it is written into}."""
        return {j: self._flat_index(call, i) for j, i in self._aliases.items()
                if call.sizes[i] == 1}

    def _check_alias_specs(self, specs, flat, alias_at):
        for j, k in alias_at.items():
            dt, shape = specs[j][0], tuple(specs[j][1])
            t = flat[k]
            if tuple(t.shape) != shape or T.DTYPES[dtype_name(t.dtype)] != np.dtype(dt):
                raise InvalidArgument(
                    "op %s: output %d (%s %s) is written into input %d, which is %s %s: an "
                    "aliased output must have its input's dtype and shape"
                    % (self.op.name, j, np.dtype(dt).name, list(shape), k,
                       dtype_name(t.dtype), list(t.shape)),
                    reason="ALIAS_MISMATCH", metadata={"op": self.op.qualified_name})

    def _run_aliased(self, call, flat):
        """The call with each aliased output placed over its input's bytes
        (a prepared handle, on the fast channel or over gRPC), so the kernel
        writes the input in place: no copy when the input lives in this
        client's shared memory, else one copy in and one back. Without
        shared memory or Prepare: the plain call, then a copy back."""
        tr = getattr(self.op._session, "_t", None)
        pool = None
        if _can_prepare(tr) and not tr.copy_outputs:
            try:
                pool = tr.pool(self.op.namespace)
            except ShmUnavailable:
                pool = None
        if pool is None:
            return self._copy_back(call, flat, self._run_plain(call, flat))
        for attempt in range(3):
            try:
                return self._aliased_once(tr, pool, call, flat)
            except _fast.ChannelClosed:
                from opjit._transport import _NoChannel
                tr._drop_channel(self.op.namespace,
                                 tr._channels.get(self.op.namespace) or _NoChannel)
            except OpjitError as err:
                if attempt == 2:
                    raise
                if err.reason == "STALE_HANDLE":
                    continue  # (_aliased_once forgot the handle)
                if err.reason == "REGION_NOT_REGISTERED":
                    pool.forget_regions()
                    continue
                raise
        raise OpjitError("op %s: the in-place call could not be placed" % self.op.name)

    def _aliased_once(self, tr, pool, call, flat):
        from opjit._proto import exec_pb2
        from opjit._transport import _rpc, _Staging
        ns = self.op.namespace
        groups, arrays, k = [], [], 0
        for p, n in zip(call.inputs, call.sizes):
            row = [_array(flat[k + m], (p.name, self.op.name), self.contiguous) for m in range(n)]
            groups.append(row)
            arrays.extend(row)
            k += n
        try:
            prep = tr._prepare(ns, self.op.name, call.version, call.target or "", groups,
                               call.attrs)
        except Unimplemented:
            prep = None
        if prep is None:
            return self._copy_back(call, flat, self._run_plain(call, flat))
        alias_at = self._alias_flat(call)
        self._check_alias_specs([(dt, shape) for dt, shape, _ in prep.outputs], flat, alias_at)
        st = _Staging(tr, pool)
        try:
            locs, in_place, refs = [], [], []
            for a in arrays:
                here = pool.locate(a) if a.nbytes else None
                locs.append(here if here is not None else st.place(a))
                in_place.append(here is not None)
            kk = 0
            for g in groups:
                if not g:
                    if prep.null_inputs:
                        refs += (0, 0)
                    continue
                for _ in g:
                    refs += (locs[kk][0].id, locs[kk][1])
                    kk += 1
            out_locs = []
            for j, (_, _, nb) in enumerate(prep.outputs):
                k = alias_at.get(j)
                if k is not None:
                    loc = locs[k]
                else:
                    loc = st.reserve(nb)
                    if nb:  # outputs start zeroed, as in any call (keep_output_bytes is on)
                        ctypes.memset(loc[0].addr + loc[1], 0, nb)
                out_locs.append(loc)
                refs += (loc[0].id, loc[1])
            ch = tr.channel(ns) if prep.fast and tr.fast_mode != "off" else None
            if ch is not None and (prep.n_tensors > ch.max_tensors or
                                   not all(r.id for r, _ in locs + out_locs)):
                ch = None  # too many tensors, or a server without region ids: gRPC
            timeout = tr.timeout
            try:
                if ch is not None:
                    reply = ch.call(prep.handle, refs,
                                    time.monotonic_ns() + int(timeout * 1e9) if timeout else 0,
                                    keep_output_bytes=True)
                    if reply.code:
                        raise error_from_status(reply.code, reply.message, reason=reply.reason)
                    tr.calls["fast"] += 1
                else:
                    req = exec_pb2.ForwardRequest(namespace=ns, handle=prep.handle,
                                                  client_id=tr.client_id, keep_output_bytes=True)
                    kk = 0
                    for g in groups:
                        arg = req.inputs.add()
                        for a in g:
                            r, off = locs[kk]
                            kk += 1
                            arg.tensors.add(dtype=T.dtype_name(a.dtype), shape=list(a.shape),
                                            shm=exec_pb2.ShmRef(region=r.name, offset=off))
                    for r, off in out_locs:
                        req.outputs.add().shm.CopyFrom(exec_pb2.ShmRef(region=r.name, offset=off))
                    _rpc(tr.executor.Forward, req, timeout)
                    tr.calls["handle"] += 1
            except OpjitError as err:
                if err.reason == "STALE_HANDLE":
                    tr._forget_prepared(prep)
                raise
            fresh = st.output_views([spec for j, spec in enumerate(prep.outputs)
                                     if j not in alias_at])
            outs, back, back_bytes = [], 0, 0
            fresh = iter(fresh)
            for j, (dt, shape, nb) in enumerate(prep.outputs):
                k = alias_at.get(j)
                if k is None:
                    outs.append(_tensor(next(fresh)))
                    continue
                t = flat[k]
                if not in_place[k] or arrays[k].ctypes.data != t.data_ptr():
                    # Written into a copy: back into the tensor itself.
                    r, off = locs[k]
                    src = pool.view(r, off, dt, shape, track=False)
                    with torch.no_grad():
                        t.detach().copy_(torch.from_numpy(src))
                    back += 1
                    back_bytes += nb
                outs.append(t)
        finally:
            st.done()
        n_shared = sum(in_place)
        with _lock:
            _stats["calls"] += 1
            _stats["inputs"] += len(arrays)
            _stats["shared_inputs"] += n_shared
            _stats["copied_inputs"] += len(arrays) - n_shared
            _stats["copied_bytes"] += sum(a.nbytes for a, s in zip(arrays, in_place) if not s)
            _stats["written_in_place"] += len(alias_at) - back
            _stats["copied_back"] += back
            _stats["copied_back_bytes"] += back_bytes
        return outs

    def _copy_back(self, call, flat, outs):
        """Outputs computed elsewhere, copied into the inputs they alias."""
        alias_at = self._alias_flat(call)
        self._check_alias_specs([(T.DTYPES[dtype_name(o.dtype)], tuple(o.shape)) for o in outs],
                                flat, alias_at)
        outs = list(outs)
        back_bytes = 0
        for j, k in alias_at.items():
            with torch.no_grad():
                flat[k].detach().copy_(outs[j])
            back_bytes += outs[j].numel() * outs[j].element_size()
            outs[j] = flat[k]
        with _lock:
            _stats["copied_back"] += len(alias_at)
            _stats["copied_back_bytes"] += back_bytes
        return outs

    def _run_plain(self, call, flat):
        arrays = []
        pool = self._pool
        shared = copied = copied_bytes = 0
        k = 0
        for p, n in zip(call.inputs, call.sizes):
            row = []
            for _ in range(n):
                a = _array(flat[k], (p.name, self.op.name), self.contiguous)
                k += 1
                if pool is not None and a.nbytes:
                    if _in_pool(pool, a.ctypes.data, a.nbytes):
                        shared += 1
                    else:
                        copied += 1
                        copied_bytes += a.nbytes
                row.append(a)
            arrays.append(row)
        fwd = self.op._session.forward(self.op.name, arrays, call.attrs, version=call.version,
                                       target=call.target)
        with _lock:
            _stats["calls"] += 1
            _stats["inputs"] += k
            _stats["shared_inputs"] += shared
            _stats["copied_inputs"] += copied
            _stats["copied_bytes"] += copied_bytes
        if call.version == 0 and fwd.version and fwd.version != self.record.version:
            self.op.refresh()
            self._refresh_def()
            self._bprop = None
        return [_tensor(o) for o in fwd.outputs]

    # -- a prepared call
    def prepare(self, *args, **kwargs):
        """This call on these tensors, ready to run again and again: a
        PreparedTorchCall over ``opjit.Op.prepare`` (no gradient). Inputs in
        this client's shared memory are used in place; others are copied
        there once (write new values into ``inputs``). Each call returns the
        same output tensors, overwritten by the next (clone what you keep)."""
        if self._aliases:
            raise InvalidArgument("op %s: a prepared call cannot write its inputs in place "
                                  "(aliases); call the TorchOp" % self.op.name)
        if torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise InvalidArgument("op %s: a prepared call records no gradient; call it under "
                                  "torch.no_grad() or on tensors without requires_grad"
                                  % self.op.name)
        arrays = [_array(a, (str(i), self.op.name), self.contiguous)
                  if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        return PreparedTorchCall(self.op.prepare(*arrays, **kwargs))

    # -- backward: the registered bprop op, called through opjit.torch
    def bprop(self):
        """The TorchOp of this op's backward.op (FailedPrecondition if it has none)."""
        if self._bprop is None:
            name = self.record.op.backward.op
            if not name:
                raise FailedPrecondition(
                    "op %s (version %d) is not differentiable: it has no backward op "
                    "(backward.op is empty)" % (self.op.qualified_name, self.record.version),
                    reason="NOT_DIFFERENTIABLE",
                    metadata={"op": self.op.qualified_name, "version": str(self.record.version)})
            qual = "%s/%s" % (self.op.namespace, name) if self.op.namespace else name
            self._bprop = TorchOp(Op(self.op.client, qual, target=self.op.target),
                                  contiguous="copy", register=False)
        return self._bprop

    def _backward(self, call, flat, outs, grads, needs):
        bprop = self.bprop()
        plan = self._bprop_args
        if plan is not None and plan[2] and call.kw is not None and not self._dynamic \
                and len(flat) == len(call.sizes):
            # One tensor per input and keyword attrs: the bprop's own cached call.
            nd = self._non_diff
            args = []
            for kind, i in plan[0]:
                if kind == "in":
                    args.append(flat[i])
                elif kind == "out":
                    args.append(outs[i])
                else:
                    g = grads[i] if i < len(grads) else None
                    args.append(torch.zeros_like(outs[i]) if g is None or i in nd else g)
            battrs = plan[1]
            dx = bprop(*args, **{k: v for k, v in call.kw.items() if k in battrs})
            if isinstance(dx, torch.Tensor):
                dx = (dx,)
            return self._fit_grads(call, flat, [dx[i] if needs[i] and i < len(dx) else None
                                                for i in range(len(flat))])
        groups, k = [], 0
        for n in call.sizes:
            groups.append(list(flat[k:k + n]))
            k += n
        grads = list(grads)
        for j in self._non_diff:
            if j < len(grads):
                grads[j] = torch.zeros_like(outs[j])
        plan = self._bprop_args
        if plan is None:
            # Which forward tensors the bprop takes, and whether the
            # forward's keyword attrs bind to it as they are (the same
            # names with the same types).
            fwd_types = {a.name: a.value_type for a in self.record.op.attrs}
            b_types = {a.name: a.value_type for a in bprop.record.op.attrs}
            plan = self._bprop_args = (
                bprop_args(self.record.op), frozenset(b_types),
                all(fwd_types.get(n, t) == t for n, t in b_types.items()))
        kinds, battrs, kw_ok = plan
        args = []
        for kind, i in kinds:
            if kind == "in":
                g = groups[i] if i < len(groups) else []
                dynamic = call.inputs[i].param_type == "dynamic"
                args.append(g if dynamic else (g[0] if g else None))
            elif kind == "out":
                args.append(outs[i])
            else:
                g = grads[i] if i < len(grads) else None
                args.append(torch.zeros_like(outs[i]) if g is None else g)
        # Attrs of the forward the bprop also declares go along (MindSpore's
        # bprops see the forward's attrs).
        if kw_ok and call.kw is not None and all(isinstance(a, torch.Tensor) for a in args):
            # The bprop's own call path: its cached binding, the fast channel,
            # and autograd when create_graph asks for it.
            dx = bprop(*args, **{k: v for k, v in call.kw.items() if k in battrs})
        else:
            res = bprop.op._bind(bprop.record.op, args, {})
            b_inputs, b_groups, _ = res
            b_attrs = {k: v for k, v in call.attrs.items() if k in battrs}
            bflat, bsizes = [], []
            for g in b_groups:
                bsizes.append(len(g))
                bflat.extend(g)
            bcall = _Call(bprop, b_inputs, bsizes, b_attrs, 0, call.target)
            if torch.is_grad_enabled() and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in bflat):
                dx = _OpFunction.apply(bcall, *bflat)
            else:
                dx = bprop._run(bcall, bflat)
        dx = [dx] if isinstance(dx, torch.Tensor) else list(dx)
        out, k = [], 0
        for i, n in enumerate(call.sizes):
            for _ in range(n):
                g = dx[i] if i < len(dx) and n == 1 else None
                out.append(g if needs[k] else None)
                k += 1
        return self._fit_grads(call, flat, out)

    def _fit_grads(self, call, flat, grads):
        """Each input's grad as torch delivers it: summed to the input's
        shape where the bprop returned a broadcast one (opjit._grad_rules:
        GradShapeError where it cannot be), cast to the input's dtype. The
        sum is a torch op, so it is part of the graph under create_graph."""
        out, k = [], 0
        for p, n in zip(call.inputs, call.sizes):
            for _ in range(n):
                g, t = grads[k], flat[k]
                if g is not None and isinstance(t, torch.Tensor):
                    if tuple(g.shape) != tuple(t.shape):
                        g = fit_grad(g, tuple(t.shape), T.DTYPES[dtype_name(t.dtype)], p.name,
                                     where="op %s's bprop %s" % (self.op.name,
                                                                 self.record.op.backward.op),
                                     cast=False)
                    if g.dtype != t.dtype and _is_float(t):
                        g = g.to(t.dtype)
                out.append(g)
                k += 1
        return out

    # -- torch.library
    def _register(self):
        opdef = self.record.op
        n_in = len(opdef.inputs)
        self._schema_args = (n_in, [a.name for a in opdef.attrs])
        try:
            schema = _schema(self.torch_name, opdef, self._aliases)
        except _NoSchema as e:
            self.torch_error = str(e)
            return
        self.torch_op, self.torch_error = _define(self.torch_name, schema, self)

    def _from_schema(self, args, kwargs):
        """A torch.ops call's arguments as this TorchOp takes them: attrs
        torch passed by position become keywords (so the call's binding is
        cached as a direct call's), unset optional ones (None) are left out."""
        n_in, attr_names = self._schema_args
        kw = {k: v for k, v in kwargs.items() if v is not None}
        if len(args) > n_in:
            for a, v in zip(attr_names, args[n_in:]):
                if v is not None:
                    kw[a] = v
            args = args[:n_in]
        return args, kw


class PreparedTorchCall:
    """``TorchOp.prepare``'s result: calling it (no arguments) runs the op on
    the current contents of ``inputs`` and returns ``outputs`` (one tensor,
    or a tuple), the same tensors every call. ``prepared`` is the underlying
    opjit.PreparedCall (``path``: "fast" or "forward", ``kernel_ms``)."""

    __slots__ = ("prepared", "_np", "_res", "inputs", "outputs")

    def __init__(self, prepared):
        self.prepared = prepared
        self.inputs = [[_tensor(a) for a in g] for g in prepared.inputs]
        self._np = None
        self._wrap(prepared.result)

    def _wrap(self, r):
        if r is None:
            self.outputs, self._res = None, None
        elif isinstance(r, tuple):
            self.outputs = tuple(_tensor(a) for a in r)
            self._res = self.outputs
        else:
            self.outputs = (_tensor(r),)
            self._res = self.outputs[0]
        self._np = r

    def __call__(self):
        r = self.prepared()
        if r is not self._np:  # new output arrays (the op's output shapes changed)
            self._wrap(r)
        return self._res

    def __repr__(self):
        return "opjit.torch.PreparedTorchCall(%r, path=%r)" % (self.prepared._name,
                                                               self.prepared.path)


def _rule_specs(opdef, groups, attrs, name):
    """[(numpy dtype, shape)] per output from the op's output rules, for a
    client whose server has no Prepare: same_as, broadcast and explicit
    (the kernel's InferShape and reductions need the daemon)."""
    outs = sorted(opdef.outputs, key=lambda p: p.index)
    rules = list(opdef.output_rules) or [None] * len(outs)
    first = [g[0] if g else None for g in groups]
    specs = []
    for j, rule in enumerate(rules):
        kind = (rule.kind if rule is not None else "") or "same_as"
        if kind == "same_as":
            src = first[rule.input if rule is not None else 0]
            dt, shape = src.dtype, tuple(src.shape)
        elif kind == "broadcast":
            picked = [first[i] for i in rule.inputs] if rule.inputs else \
                [a for a in first if a is not None]
            shape = tuple(np.broadcast_shapes(*[tuple(a.shape) for a in picked]))
            dt = picked[0].dtype
        elif kind == "explicit":
            dt, shape = (np.dtype(T.DTYPES[rule.dtype]) if rule.dtype else first[0].dtype,
                         tuple(rule.shape))
        else:
            raise Unimplemented("op %s: output %s has a %r rule, which needs the daemon's "
                                "Prepare to give shapes of meta tensors" % (name, outs[j].name,
                                                                           kind))
        if rule is not None and rule.dtype and kind != "explicit":
            dt = T.DTYPES[rule.dtype]
        specs.append((np.dtype(dt), shape))
    return specs


class _NoSchema(Exception):
    pass


_SCHEMA_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str",
                 "listInt": "int[]", "listFloat": "float[]", "listBool": "bool[]",
                 "listStr": "str[]"}


def _schema_default(value_type, text):
    import json
    if value_type == "bool":
        return "True" if text.strip().lower() in ("true", "1") else "False"
    if value_type == "int":
        return str(int(text))
    if value_type == "float":
        return repr(float(text))
    if value_type == "str":
        return json.dumps(text)
    v = json.loads(text)
    if value_type == "listBool":
        return "[%s]" % ",".join("True" if x else "False" for x in v)
    if value_type == "listFloat":
        return "[%s]" % ",".join(repr(float(x)) for x in v)
    if value_type == "listInt":
        return "[%s]" % ",".join(str(int(x)) for x in v)
    return "[%s]" % ",".join(json.dumps(str(x)) for x in v)


def _schema(name, opdef, aliases=None):
    """The torch schema of an opjit op: its inputs as Tensor / Tensor? /
    Tensor[] (in order), then its attrs, positional or keyword (with their
    defaults); its outputs a Tensor tuple. aliases ({output: input}): that
    input is ``Tensor(a!)`` (written in place) and that output ``Tensor(a!)``.

    torch wants no parameter without a default after one with a default
    among the positional ones (torch 1.13 aborts the process on such a
    schema): from the first such attr on, attrs are keyword-only."""
    if not name.isidentifier():
        raise _NoSchema("%r is not a torch op name" % name)
    aliases = aliases or {}
    letters = {}  # input index -> alias set letter
    for j, i in sorted(aliases.items()):
        letters[i] = "abcdefghijklmnopqrstuvwxyz"[len(letters)]
    inputs = sorted(opdef.inputs, key=lambda p: p.index)
    parts = []  # (text, has a default)
    for k, p in enumerate(inputs):
        pt = p.param_type or "required"
        ann = "(%s!)" % letters[k] if k in letters else ""
        if pt == "dynamic":
            parts.append(("Tensor[] %s" % p.name, False))
        elif pt == "optional":
            trailing = all((q.param_type or "required") == "optional" for q in inputs[k:])
            parts.append(("Tensor%s? %s%s" % (ann, p.name, "=None" if trailing else ""), trailing))
        else:
            parts.append(("Tensor%s %s" % (ann, p.name), False))
    for a in opdef.attrs:
        t = _SCHEMA_TYPES.get(a.value_type)
        if t is None:
            raise _NoSchema("attr %s is %s, which torch schemas cannot express"
                            % (a.name, a.value_type))
        if a.default_value:
            try:
                parts.append(("%s %s=%s" % (t, a.name, _schema_default(a.value_type,
                                                                       a.default_value)), True))
            except (ValueError, TypeError):
                raise _NoSchema("attr %s: default %r is not a %s" % (a.name, a.default_value,
                                                                       a.value_type)) from None
        elif (a.param_type or "required") == "optional":
            parts.append(("%s? %s=None" % (t, a.name), True))
        else:
            parts.append(("%s %s" % (t, a.name), False))
    names = [p.name for p in inputs] + [a.name for a in opdef.attrs]
    bad = [n for n in names if not n.isidentifier()]
    if bad or len(set(names)) != len(names):
        raise _NoSchema("argument names %s cannot be a torch schema's" % (bad or names))
    texts, defaulted, star = [], False, False
    for k, (text, has_default) in enumerate(parts):
        if defaulted and not has_default and not star:
            texts.append("*")
            star = True
        defaulted = defaulted or has_default
        texts.append(text)
    outs = sorted(opdef.outputs, key=lambda p: p.index)
    rets = []
    for j in range(len(outs)):
        i = aliases.get(j)
        rets.append("Tensor(%s!)" % letters[i] if i is not None else "Tensor")
    ret = rets[0] if len(rets) == 1 else "(%s)" % ", ".join(rets)
    return "%s(%s) -> %s" % (name, ", ".join(texts), ret)


_library = None
_meta_library = None
_defined = {}  # torch name -> (schema, the TorchOp serving it: the latest ot.op of that name)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _define(name, schema, top):
    """Defines torch.ops.opjit.<name> (once per process; later TorchOps of the
    same schema take it over). Returns (the torch op or None, why not).

    Its kernels, as a torch custom op has them: Autograd (the call as a
    torch.autograd.Function when an input requires grad; otherwise it
    dispatches on below autograd), CPU (runs the op) and Meta (output shapes
    from the op's rules, no kernel run: meta tensors, FakeTensorMode)."""
    global _library, _meta_library
    with _lock:
        prev = _defined.get(name)
        if prev is not None:
            if prev[0] != schema:
                return None, ("torch.ops.%s.%s is already defined in this process as %r (torch "
                              "cannot redefine an op); this op's schema is %r"
                              % (LIBRARY, name, prev[0], schema))
            _defined[name] = (schema, top)
            return getattr(getattr(torch.ops, LIBRARY), name), None
        try:
            if _library is None:
                _library = torch.library.Library(LIBRARY, "DEF")
                _meta_library = torch.library.Library(LIBRARY, "IMPL", "Meta")
            _library.define(schema)
        except Exception as e:  # a schema torch refuses
            return None, "torch.library refused %r: %s" % (schema, e)

        def autograd_kernel(*args, **kwargs):
            t = _defined[name][1]
            a, kw = t._from_schema(args, kwargs)
            tensors = list(_tensors_in(a, kw))
            if (_grad_enabled() and any(x.requires_grad for x in tensors)) or \
                    _fwd_ad._current_level >= 0:
                return t(*a, **kw)  # autograd.Function (or forward AD's refusal)
            if _dispatch_modes() or any(type(x) not in _PLAIN or x.is_meta for x in tensors):
                # A torch dispatch mode (FakeTensorMode, make_fx, schema
                # checks) or a tensor subclass: on to the backend kernels
                # through the dispatcher, as torch's own ops go.
                guard = torch._C._AutoDispatchBelowAutograd()  # noqa: F841 (held)
                try:
                    return getattr(getattr(torch.ops, LIBRARY), name).default(*args, **kwargs)
                finally:
                    del guard
            return t(*a, **kw)

        def cpu_kernel(*args, **kwargs):
            t = _defined[name][1]
            a, kw = t._from_schema(args, kwargs)
            return t(*a, **kw)

        def meta_kernel(*args, **kwargs):
            t = _defined[name][1]
            a, kw = t._from_schema(args, kwargs)
            call, flat = t._bind_call(a, kw)
            outs = t._shape_only(call, flat)
            return outs[0] if len(outs) == 1 else tuple(outs)

        _library.impl(name, autograd_kernel, "Autograd")
        _library.impl(name, cpu_kernel, "CPU")
        _meta_library.impl(name, meta_kernel)
        _defined[name] = (schema, top)
    return getattr(getattr(torch.ops, LIBRARY), name), None


def op(name, client=None, version=0, target=None, contiguous="copy", register=True,
       torch_name=None, aliases=None):
    """A TorchOp for registered op `name` ("op" or "ns/op"), or for an opjit.Op.

    aliases: {output: input} (indices or names): the kernel writes that
    output into that input's memory, in place (``out=`` and ``op_``
    variants); the torch op is then ``<name>_`` with ``Tensor(a!)``."""
    if isinstance(name, Op):
        o = name
    else:
        o = _client(client).op(name, version=version, target=target)
    return TorchOp(o, contiguous=contiguous, register=register, torch_name=torch_name,
                   aliases=aliases)


class OpModule(torch.nn.Module):
    """An opjit op as a torch.nn.Module (for nn.Sequential and friends):
    ``OpModule(top, **attrs)`` calls ``top(*inputs, **attrs)``."""

    def __init__(self, top, **attrs):
        super().__init__()
        self.op = top
        self.attrs = attrs

    def forward(self, *inputs):
        return self.op(*inputs, **self.attrs)

    def extra_repr(self):
        return ", ".join([repr(self.op.op.qualified_name)] +
                         ["%s=%r" % kv for kv in self.attrs.items()])


def module(name, client=None, version=0, target=None, contiguous="copy", **attrs):
    """An OpModule for registered op `name` (or an opjit.Op / TorchOp) with
    fixed `attrs`: ``nn.Sequential(nn.Linear(4, 8), opjit.torch.module("tanh"))``."""
    top = name if isinstance(name, TorchOp) else op(name, client=client, version=version,
                                                   target=target, contiguous=contiguous)
    return OpModule(top, **attrs)


# ---- opjit.Function (PyLayer) in torch ------------------------------------------------

class _TapeNode(torch.autograd.Function):
    """Values on opjit's tape as one torch node. ``state`` holds ``roots``
    (what the node returns: opjit Tensors, or other values) and ``leaves``
    (opjit Tensors standing for ``tensors``, the torch tensors the roots were
    computed from, in order). backward runs opjit.grad of the roots w.r.t.
    the leaves; under create_graph the grads stay on the tape, with leaves
    for the incoming grads too, and come back as another _TapeNode, so every
    order of derivative is torch's and opjit's graph at once."""

    @staticmethod
    def forward(ctx, state, *tensors):
        from opjit.autograd import Tensor
        roots, leaves = state
        ctx.state = state
        ctx.save_for_backward(*tensors)
        res, nondiff = [], []
        for o in roots:
            if isinstance(o, Tensor):
                r = _tensor(np.asarray(o.data))
                if not (o.requires_grad and differentiable(o.dtype)):
                    nondiff.append(r)
            else:
                r = torch.as_tensor(o)
                nondiff.append(r)
            res.append(r)
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(res)

    @staticmethod
    def backward(ctx, *grads):
        from opjit.autograd import Tensor, grad as opjit_grad
        roots, leaves = ctx.state
        tensors = ctx.saved_tensors
        create = torch.is_grad_enabled()  # create_graph=True
        want = [k for k, t in enumerate(leaves) if t.requires_grad and ctx.needs_input_grad[1 + k]]
        rs, gs, g_torch = [], [], []
        for o, g in zip(roots, grads):
            if g is None or not isinstance(o, Tensor) or not o.requires_grad or \
                    not differentiable(o.dtype):
                continue
            rs.append(o)
            gs.append(Tensor(np.ascontiguousarray(_array(g, "a grad")).copy(),
                             requires_grad=create))
            g_torch.append(g)
        out = [None] * len(leaves)
        if rs and want:
            got = opjit_grad(rs, [leaves[k] for k in want], grad_outputs=gs,
                             retain_graph=True, create_graph=create)
            if create:
                pairs = [(k, g) for k, g in zip(want, got) if g is not None]
                if pairs:
                    res = _TapeNode.apply(([g for _, g in pairs], list(leaves) + gs),
                                          *tensors, *g_torch)
                    for (k, _), r in zip(pairs, res):
                        out[k] = r
            else:
                for k, g in zip(want, got):
                    if g is not None:
                        out[k] = _tensor(np.ascontiguousarray(g))
        for k, g in enumerate(out):
            if g is not None:
                t = tensors[k]
                if tuple(g.shape) != tuple(t.shape):
                    g = fit_grad(g, tuple(t.shape), T.DTYPES[dtype_name(t.dtype)],
                                 "argument %d" % k, where="a backward on opjit's tape",
                                 cast=False)
                out[k] = g.to(t.dtype) if g.dtype != t.dtype else g
        return (None,) + tuple(out)


def function(fn, contiguous="copy"):
    """A callable running opjit.Function subclass `fn` on torch tensors,
    differentiable in torch at every order: forward runs on opjit's tape
    (each torch tensor argument a leaf over the same memory), and torch's
    backward asks the tape (create_graph included: double backward). The
    tensor arguments are saved, so torch's in-place checks hold."""
    def call(*args, **kwargs):
        from opjit.autograd import Tensor, enable_grad, no_grad
        tensors = list(_tensors_in(args, kwargs))
        if _fwd_ad._current_level >= 0 and any(
                _fwd_ad.unpack_dual(t).tangent is not None for t in tensors):
            raise UnsupportedTransform(
                "%s: forward-mode AD is not supported through ot.function (an opjit "
                "Function has no jvp)" % call.__name__, reason="FORWARD_AD_UNSUPPORTED")
        if _transforms_active() and _functorch is not None and any(
                _functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            raise UnsupportedTransform(
                "%s: functorch transforms (vmap, grad, vjp) do not support ot.function, as "
                "they do not support autograd.Function in torch %s" % (call.__name__,
                                                                       torch.__version__),
                reason="FUNCTORCH_UNSUPPORTED")
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        leaves, torch_in = [], []

        def leaf(a, i):
            needs = grad and a.requires_grad and _is_float(a)
            t = Tensor(_array(a, "argument %s of %s" % (i, call.__name__), contiguous),
                       requires_grad=needs)
            leaves.append(t)
            torch_in.append(a)
            return t

        opargs = [leaf(a, i) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        opkw = {k: leaf(v, k) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with (enable_grad() if grad else no_grad()):
            outs = fn.apply(*opargs, **opkw)
        single = not isinstance(outs, (tuple, list))
        roots = [outs] if single else list(outs)
        if not grad:
            res = [_tensor(np.asarray(o.data)) if isinstance(o, Tensor) else o for o in roots]
            return res[0] if single else tuple(res)
        res = _TapeNode.apply((roots, leaves), *torch_in)
        res = [r if isinstance(o, Tensor) else o for r, o in zip(res, roots)]
        return res[0] if single else tuple(res)
    call.__name__ = getattr(fn, "__name__", "function")
    call.__doc__ = getattr(fn, "__doc__", None)
    return call

"""opjit ops inside PyTorch programs (needs PyTorch; ``import opjit`` does not).

    import torch, opjit.torch as ot
    leaky = ot.op("leaky_relu")                  # a registered opjit op
    y = leaky(torch.randn(4, 8), alpha=0.5)      # a torch.Tensor
    y = torch.ops.opjit.leaky_relu(x, alpha=0.5)  # the same, as a torch op (torch.library)

* **Calls.** ``ot.op(name, client=None)`` wraps ``client.op(name)``: inputs
  are torch tensors (or anything opjit takes), attrs are keywords (or
  positional after the inputs), outputs are torch tensors whose shapes and
  dtypes come from the daemon's ``Prepare`` (the opjit call path, fast channel
  included). The op is also defined as ``torch.ops.opjit.<name>`` (attrs
  keyword-only; ``<ns>__<name>`` for an op of namespace ``ns``) where its
  signature has a torch schema; ``TorchOp.torch_op`` is None and
  ``TorchOp.torch_error`` says why otherwise.
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
  ``backward.non_differentiable`` are marked so; inputs that need no grad get
  none. ``ot.function(MyFunction)`` makes an ``opjit.Function`` (PyLayer)
  differentiable in torch (first order). ``ot.module(name, **attrs)`` is an
  op as an ``nn.Module`` (for ``nn.Sequential``).
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

import opjit
from opjit import _fast
from opjit import _tensors as T
from opjit._shm import ShmUnavailable
from opjit.errors import FailedPrecondition, InvalidArgument, error_from_status
from opjit.op import Op, bprop_args

__all__ = ["op", "TorchOp", "PreparedTorchCall", "module", "OpModule", "function", "empty", "empty_like", "zeros", "from_tensor",
           "is_shared", "from_dlpack", "to_dlpack", "torch_dtype", "dtype_name",
           "default_client", "set_default_client", "copy_stats", "reset_copy_stats",
           "LIBRARY"]

LIBRARY = "opjit"  # torch.ops.opjit.<name>

# opjit dtype name <-> torch dtype. uint16/32/64 have no torch 1.13 dtype.
_TO_TORCH = {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


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
          "made_contiguous": 0}


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
    (non-contiguous inputs copied to a contiguous tensor first)."""
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
_U8 = np.dtype(np.uint8)
_CALL_CACHE = 64  # bindings kept per TorchOp (dropped all at once beyond)
_SPARE_BLOCKS = 4  # freed output blocks kept per output of a call shape...
_SPARE_MAX_BYTES = 1 << 16  # ...when it is at most this big


class _OpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, *flat):
        top = call.top
        outs = top._run_call(call, flat)
        ctx.call = call
        nd = top._non_diff
        if nd:
            ctx.mark_non_differentiable(*[o for j, o in enumerate(outs) if j in nd])
        ctx.save_for_backward(*flat, *outs)
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
    ``torch.ops.opjit.<torch_name>`` (default True).
    """

    def __init__(self, op, contiguous="copy", register=True, torch_name=None):
        if contiguous not in ("copy", "error"):
            raise InvalidArgument('contiguous must be "copy" or "error", not %r' % (contiguous,))
        self.op = op
        self.contiguous = contiguous
        self.torch_op = None
        self.torch_error = None
        self._bprop = None
        self._bprop_args = None
        self._calls = {}  # (kwargs, (dtype, shape) per input) -> _Call
        self._refresh_def()
        self.torch_name = torch_name or (
            "%s__%s" % (op.namespace, op.name) if op.namespace else op.name)
        if register:
            self._register()

    def __repr__(self):
        return "opjit.torch.TorchOp(%r)" % (self.op.qualified_name,)

    @property
    def name(self):
        return self.op.name

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
        if key is not None and len(flat) == len(args) and all(
                f is a and isinstance(a, torch.Tensor) for f, a in zip(flat, args)):
            call.fast = self._make_fast(call, flat)
            if len(self._calls) >= _CALL_CACHE:
                self._retire_calls()
            self._calls[key] = call
        if _grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return self._apply(call, flat)
        outs = self._run_call(call, flat)
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
        if call.version != 0 and call.version != self.record.version:
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
            return [dx[i] if needs[i] and i < len(dx) else None for i in range(len(flat))]
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
        return out

    # -- torch.library
    def _register(self):
        try:
            schema = _schema(self.torch_name, self.record.op)
        except _NoSchema as e:
            self.torch_error = str(e)
            return
        self.torch_op, self.torch_error = _define(self.torch_name, schema, self)


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


def _schema(name, opdef):
    """The torch schema of an opjit op: its inputs as Tensor / Tensor? /
    Tensor[] (in order), its attrs keyword-only, its outputs a Tensor tuple."""
    if not name.isidentifier():
        raise _NoSchema("%r is not a torch op name" % name)
    inputs = sorted(opdef.inputs, key=lambda p: p.index)
    parts = []
    for k, p in enumerate(inputs):
        pt = p.param_type or "required"
        if pt == "dynamic":
            parts.append("Tensor[] %s" % p.name)
        elif pt == "optional":
            trailing = all((q.param_type or "required") == "optional" for q in inputs[k:])
            parts.append("Tensor? %s%s" % (p.name, "=None" if trailing else ""))
        else:
            parts.append("Tensor %s" % p.name)
    if opdef.attrs:
        parts.append("*")
    for a in opdef.attrs:
        t = _SCHEMA_TYPES.get(a.value_type)
        if t is None:
            raise _NoSchema("attr %s is %s, which torch schemas cannot express"
                            % (a.name, a.value_type))
        if a.default_value:
            try:
                parts.append("%s %s=%s" % (t, a.name, _schema_default(a.value_type,
                                                                     a.default_value)))
            except (ValueError, TypeError):
                raise _NoSchema("attr %s: default %r is not a %s" % (a.name, a.default_value,
                                                                       a.value_type)) from None
        elif (a.param_type or "required") == "optional":
            parts.append("%s? %s=None" % (t, a.name))
        else:
            parts.append("%s %s" % (t, a.name))
    names = [p.name for p in inputs] + [a.name for a in opdef.attrs]
    bad = [n for n in names if not n.isidentifier()]
    if bad or len(set(names)) != len(names):
        raise _NoSchema("argument names %s cannot be a torch schema's" % (bad or names))
    n_out = len(opdef.outputs)
    ret = "Tensor" if n_out == 1 else "(%s)" % ", ".join(["Tensor"] * n_out)
    return "%s(%s) -> %s" % (name, ", ".join(parts), ret)


_library = None
_defined = {}  # torch name -> (schema, the TorchOp serving it: the latest ot.op of that name)


def _define(name, schema, top):
    """Defines torch.ops.opjit.<name> (once per process; later TorchOps of the
    same schema take it over). Returns (the torch op or None, why not)."""
    global _library
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
            _library.define(schema)
        except Exception as e:  # a schema torch refuses
            return None, "torch.library refused %r: %s" % (schema, e)

        def kernel(*args, **kwargs):
            return _defined[name][1](*args, **kwargs)

        _library.impl(name, kernel, "CompositeImplicitAutograd")
        _defined[name] = (schema, top)
    return getattr(getattr(torch.ops, LIBRARY), name), None


def op(name, client=None, version=0, target=None, contiguous="copy", register=True,
       torch_name=None):
    """A TorchOp for registered op `name` ("op" or "ns/op"), or for an opjit.Op."""
    if isinstance(name, Op):
        o = name
    else:
        o = _client(client).op(name, version=version, target=target)
    return TorchOp(o, contiguous=contiguous, register=register, torch_name=torch_name)


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

class _PyLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, kwargs, contiguous, *args):
        from opjit.autograd import Tensor, enable_grad
        leaves, pos = [], []
        opargs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                needs = ctx.needs_input_grad[3 + i] and a.is_floating_point()
                t = Tensor(_array(a, "argument %d of %s" % (i, fn.__name__), contiguous),
                           requires_grad=needs)
                leaves.append(t)
                pos.append(i)
                opargs.append(t)
            else:
                opargs.append(a)
        with enable_grad():
            outs = fn.apply(*opargs, **kwargs)
        single = not isinstance(outs, (tuple, list))
        outs = [outs] if single else list(outs)
        ctx.opjit = (leaves, pos, outs, len(args))
        res = []
        for o in outs:
            res.append(_tensor(np.array(o.data, copy=False)) if isinstance(o, Tensor)
                       else torch.as_tensor(o))
        nondiff = [r for r, o in zip(res, outs)
                   if not (isinstance(o, Tensor) and o.requires_grad)]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return res[0] if single else tuple(res)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        from opjit.autograd import grad as opjit_grad
        leaves, pos, outs, n = ctx.opjit
        roots, gs = [], []
        for o, g in zip(outs, grads):
            if getattr(o, "requires_grad", False) and g is not None:
                roots.append(o)
                gs.append(_array(g, "a grad").copy())
        want = [t for t in leaves if t.requires_grad]
        got = opjit_grad(roots, want, grad_outputs=gs, retain_graph=True) if roots and want \
            else [None] * len(want)
        by_leaf = dict(zip([id(t) for t in want], got))
        out = [None] * n
        for t, i in zip(leaves, pos):
            g = by_leaf.get(id(t))
            out[i] = None if g is None else _tensor(np.ascontiguousarray(g))
        return (None, None, None) + tuple(out)


def function(fn, contiguous="copy"):
    """A callable running opjit.Function subclass `fn` on torch tensors,
    differentiable in torch (first order: its backward runs on opjit's tape)."""
    def call(*args, **kwargs):
        return _PyLayer.apply(fn, kwargs, contiguous, *args)
    call.__name__ = getattr(fn, "__name__", "function")
    call.__doc__ = getattr(fn, "__doc__", None)
    return call

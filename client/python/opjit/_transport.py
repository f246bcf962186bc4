"""How a client's calls travel: staging, placement, prepared handles, the fast channel.

A :class:`Transport` belongs to one ``Client``. It owns

* the shared-memory pools (one per namespace, :mod:`opjit._shm`) and the
  decision to fall back to inline bytes when shared memory cannot be used;
* the lease renewer (regions, handles and channels share the client's lease);
* the prepared handles: one ``Prepare`` per call shape (namespace, op,
  version, target, input dtypes and shapes, attrs), cached; the server's
  answer says where every output goes and how big it is;
* the fast channels (:mod:`opjit._fast`), one per namespace, opened lazily
  on a same-host server;
* backward contexts of dropped graphs, released in batches.

:class:`Session` is the small surface ``opjit.Op``, ``OpNode`` and
``gradcheck`` use, and ``verify``/``bench`` (``Client.session(namespace)``).

Which path a forward takes:

=======================================  ==========================================
situation                                path
=======================================  ==========================================
inline transport (a remote server, or    ``Forward`` with inline tensors
shared memory unusable)
``fast="off"``, or a server without      ``Forward`` with shm inputs; outputs placed
``Prepare``                              by the server (``alloc_in``) in a free tail
shm, the handle can run on a channel     the fast channel (no gRPC at all)
(CPU, process isolation), no gradient
shm otherwise (``requires_grad``, GPU,   ``Forward`` with the handle; outputs at the
no channel)                              exact offsets the client allocated
=======================================  ==========================================

Failures are retried where the call certainly did not run or is safe to
repeat, deciding on the server's reason, never on its text:
``STALE_HANDLE`` (the op changed: prepare again, once), ``REGION_NOT_REGISTERED``
(the server forgot our regions: new ones), outputs that did not fit an
``alloc_in`` tail (inline outputs), a closed channel before the call ran
(reopen once, else gRPC).
"""

import collections
import logging
import os
import threading
import time
import weakref

import grpc
import numpy as np

from opjit import _fast
from opjit import _tensors as T
from opjit._proto import exec_pb2, memory_pb2
from opjit._shm import ShmPool, ShmUnavailable
from opjit.errors import (FailedPrecondition, InvalidArgument, OpjitError, Unimplemented,
                          error_from_rpc, error_from_status)

_log = logging.getLogger("opjit")

FAST_MODES = ("auto", "on", "off")
_HANDLE_CACHE = 1024          # prepared call shapes kept per client
_CHANNEL_RETRY_S = 5.0        # after OpenChannel was refused, try again this much later
_MIN_OUTPUT_TAIL = 64 << 10   # alloc_in: the smallest free tail offered for outputs


class ShmUnavailableError(FailedPrecondition):
    """transport="shm" (or fast="on") was asked for, but it cannot be used."""


def fast_mode_from_env(value=None):
    """The fast-path mode: `value`, else $OPJIT_FAST ("1"/"on", "0"/"off",
    "auto"), else "auto"."""
    if value is None:
        value = os.environ.get("OPJIT_FAST", "auto")
    v = str(value).strip().lower()
    v = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off",
         "": "auto"}.get(v, v)
    if v not in FAST_MODES:
        raise InvalidArgument('fast must be "auto", "on" or "off" (or $OPJIT_FAST 1/0); got %r'
                              % (value,))
    return v


def _rpc(fn, request, timeout):
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as e:
        raise error_from_rpc(e) from None


class Forwarded:
    """What a forward returned: ``outputs`` (ndarrays), ``version`` (the op
    version that ran), ``context_id`` (a backward context, or ""),
    ``kernel_ms`` and ``path`` ("fast", "handle" or "grpc")."""

    __slots__ = ("outputs", "version", "context_id", "kernel_ms", "path")

    def __init__(self, outputs, version, context_id, kernel_ms, path):
        self.outputs = outputs
        self.version = version
        self.context_id = context_id
        self.kernel_ms = kernel_ms
        self.path = path


class Prepared:
    """A cached Prepare answer: the handle and each output's dtype, shape and size."""

    __slots__ = ("key", "namespace", "handle", "version", "fast", "outputs", "null_inputs",
                 "n_tensors")

    def __init__(self, key, namespace, resp, groups):
        self.key = key
        self.namespace = namespace
        self.handle = resp.handle
        self.version = resp.version
        self.outputs = [(T.numpy_dtype(s.dtype), tuple(s.shape), int(s.byte_size))
                        for s in resp.outputs]
        n_given = sum(len(g) for g in groups)
        n_absent = sum(1 for g in groups if not g)
        self.n_tensors = len(resp.inputs) + len(resp.outputs)
        # The flat inputs in call order; an absent optional input is either
        # listed (a null slot, region 0) or left out.
        if len(resp.inputs) == n_given:
            self.null_inputs = False
            self.fast = bool(resp.fast)
        elif n_absent and len(resp.inputs) == n_given + n_absent:
            self.null_inputs = True
            self.fast = bool(resp.fast)
        else:
            self.null_inputs = False
            self.fast = False  # cannot map our inputs onto its list: gRPC with the handle


class _PreparedLogic:
    """PreparedCall's Python side, over either Call (see PreparedCall)."""

    def __init__(self, transport, ns, name, version, target, groups, attrs, keep):
        self._t = transport
        self._ns, self._name, self._version, self._target = ns, name, version, target
        self._attrs, self._keep = attrs, keep
        self._fch = self._prep = None  # the FastChannel and Prepared bound to
        self._blocks = []              # 1-byte blocks standing for empty tensors
        self._recovering = False       # in _slow's one retry
        self._retry_at = 0.0           # unbound: when _setup may try the channel again
        self.kernel_ms = 0.0
        self.path = "forward"
        self.outputs = None
        self.result = None
        pool = transport.pool(ns)
        if pool is not None:
            groups = [[self._in_pool(pool, a) for a in g] for g in groups]
        self.inputs = groups
        self._setup()

    @staticmethod
    def _in_pool(pool, a):
        if not a.nbytes or pool.locate(a) is not None:
            return a
        try:
            b = pool.empty(a.shape, a.dtype)
        except ShmUnavailable:
            return a
        np.copyto(b, a)
        return b

    def _ref(self, pool, a):
        """(region id, offset) of `a` (a 1-byte block for an empty one), or None."""
        if not a.nbytes:
            region, off = pool.alloc(1)
            self._blocks.append(pool.view(region, off, np.uint8, (1,), track=True))
        else:
            loc = pool.locate(a)
            if loc is None:
                return None
            region, off = loc
        return (region.id, off) if region.id else None

    def _setup(self):
        """Binds the call to the namespace's fast channel when it can run
        there (else leaves it unbound: an ordinary forward per call)."""
        self.unbind()
        self.path = "forward"
        self._retry_at = time.monotonic() + _CHANNEL_RETRY_S
        t, ns = self._t, self._ns
        pool = t.pool(ns)
        if pool is None or not t._prepare_ok:
            return
        try:
            prep = t._prepare(ns, self._name, self._version, self._target, self.inputs,
                              self._attrs)
            ch = t.channel(ns) if prep is not None and prep.fast else None
            if ch is None or prep.n_tensors > ch.max_tensors:
                return
            specs = [(dtype, shape) for dtype, shape, _ in prep.outputs]
            if self.outputs is None or [(o.dtype, o.shape) for o in self.outputs] != specs:
                self.outputs = tuple(pool.empty(shape, dtype) for dtype, shape in specs)
                self.result = self.outputs[0] if len(self.outputs) == 1 else self.outputs
            self._blocks = []
            refs = []
            for g in self.inputs:
                if not g and prep.null_inputs:
                    refs += (0, 0)
                for a in g:
                    r = self._ref(pool, a)
                    if r is None:
                        return
                    refs += r
            for o in self.outputs:
                r = self._ref(pool, o)
                if r is None:
                    return
                refs += r
        except ShmUnavailable as e:
            if e.permanent:
                t.shm_failed(str(e))
            return
        timeout = t.timeout
        self.bind(ch.native, prep.handle, refs,
                  _fast.F_KEEP_OUTPUT_BYTES if self._keep else 0,
                  int(timeout * 1e9) if timeout else 0)
        self._fch, self._prep = ch, prep
        self.path = "fast"

    def _slow(self, code, reason, message):
        """Whatever the bound call could not answer (see opjit._fast.Call)."""
        t, ns = self._t, self._ns
        if code is None:  # unbound: try the channel again now and then
            if time.monotonic() >= self._retry_at and not self._recovering:
                self._setup()
                if self.path == "fast":
                    return self()
            return self._forward()
        if not self._recovering and (code == -1 or reason == "STALE_HANDLE"):
            # The channel closed before the call ran (reopen it), or the op
            # changed (prepare again): once, as Op calls do.
            self._recovering = True
            try:
                if code == -1:
                    t._drop_channel(ns, self._fch)
                else:
                    t._forget_prepared(self._prep)
                self._setup()
                return self()
            finally:
                self._recovering = False
        if code == -1:  # closed twice in a row: gRPC for a while
            t._channel_refused[ns] = time.monotonic() + _CHANNEL_RETRY_S
            self.unbind()
            self.path = "forward"
            return self._forward()
        if reason == "REGION_NOT_REGISTERED":
            # The server forgot this client's regions (a lapsed lease): the
            # next Op call places its tensors anew; this call cannot.
            pool = t.pool(ns)
            if pool is not None:
                pool.forget_regions()
            message += " (this prepared call's shared memory is gone: prepare it again)"
        raise error_from_status(code, message, reason=reason)

    def _forward(self):
        fwd = self._t.forward(self._ns, self._name, self._version, self._target, self.inputs,
                              self._attrs, None, self._keep)
        outs = fwd.outputs
        if self.outputs is not None and [(o.dtype, o.shape) for o in self.outputs] == \
                [(o.dtype, o.shape) for o in outs]:
            for dst, src in zip(self.outputs, outs):
                np.copyto(dst, src)
        else:
            self.outputs = tuple(outs)
            self.result = self.outputs[0] if len(outs) == 1 else self.outputs
        self.kernel_ms = fwd.kernel_ms
        return self.result


class PreparedCall(_PreparedLogic, _fast.Call):
    """One op call with its tensors fixed, run again and again (``Op.prepare``).

    Calling it (no arguments) runs the op on the current contents of
    ``inputs`` and returns its outputs: one array, or a tuple for several.
    The outputs are the same arrays every call, overwritten by each (copy
    what you keep). ``inputs`` holds the arrays given to ``Op.prepare``, or
    a copy in this client's shared memory of those that were not there:
    write new values into them in place. ``kernel_ms`` is the last call's
    kernel time and ``path`` how the calls travel: "fast" (the handle and
    tensor refs written once, then one slot write per call on the fast
    channel; with the compiled extension ``opjit._fastcall`` the whole call
    runs in C++ and returns without allocating), else "forward" (an ordinary
    forward per call, outputs copied into the same arrays from the second
    call on).

    The same failures as ``Op`` calls, mapped to the same exceptions: a
    kernel error, a crash, a deadline (the client's timeout). A channel
    closed before the call ran is reopened once; a handle gone stale (the
    op changed) is prepared again once, with new output arrays if their
    shapes changed.
    """


if _fast.Call is _fast.PyCall:
    _PyPreparedCall = PreparedCall
else:
    class _PyPreparedCall(_PreparedLogic, _fast.PyCall):
        """PreparedCall on the pure-Python channel (Transport.pure_python)."""


class _Staging:
    """One call's tensors in shared memory (or inline), and its outputs."""

    def __init__(self, transport, pool, inline_outputs=False):
        self.transport = transport
        self.pool = pool
        self.temps = []      # blocks freed when the call ends
        self.outs = []       # exact output blocks (prepared calls)
        self.reserved = None  # an alloc_in tail (plain calls)
        self.inline_outputs = inline_outputs

    # ---- prepared calls: exact blocks ------------------------------------------

    def place(self, arr):
        """(region, offset) of arr's bytes in the pool: by reference when it
        already lives there, else a copy in a temporary block."""
        loc = self.pool.locate(arr) if arr.nbytes else None
        if loc is not None:
            return loc
        region, off = self.pool.alloc(arr.nbytes)
        self.temps.append((region, off))
        if arr.nbytes:
            self.pool.write(region, off, arr)
        return region, off

    def reserve(self, nbytes):
        """A block of nbytes for an output, tracked by the view made of it."""
        region, off = self.pool.alloc(nbytes)
        self.outs.append((region, off, nbytes))
        return region, off

    def output_views(self, specs):
        """The outputs as arrays over their blocks (see ShmPool.view)."""
        copy = self.transport.copy_outputs
        out = []
        for (region, off, nbytes), (dtype, shape, _) in zip(self.outs, specs):
            if nbytes == 0:
                self.pool.free(region, off)
                out.append(np.empty(shape, dtype))
                continue
            v = self.pool.view(region, off, dtype, shape, track=True)
            out.append(v.copy() if copy else v)
        self.outs = []
        return out

    # ---- plain calls: protobuf tensors --------------------------------------------

    def tensor(self, arr):
        if self.pool is not None and arr.nbytes > 0:
            region, off = self.place(arr)
            return exec_pb2.Tensor(dtype=T.dtype_name(arr.dtype), shape=list(arr.shape),
                                   shm=exec_pb2.ShmRef(region=region.name, offset=off))
        return T.inline_tensor(arr)

    def placements(self, min_bytes):
        """alloc_in: the free tail of a region of at least min_bytes."""
        if self.pool is None or self.inline_outputs:
            return []
        region, off = self.pool.reserve_tail(max(min_bytes, _MIN_OUTPUT_TAIL))
        self.reserved = (region, off)
        return [exec_pb2.OutputPlacement(alloc_in=exec_pb2.ShmRef(region=region.name, offset=off))]

    def results(self, tensors, inline_views=None):
        """Output arrays of `tensors`; `inline_views`: per tensor, its inline
        bytes when the response was read with T.split_inline_response."""
        shm = []
        for t in tensors:
            if t.WhichOneof("data") == "shm":
                if self.reserved is None or t.shm.region != self.reserved[0].name:
                    raise InvalidArgument("the server placed an output in region %r, which this "
                                          "call did not offer" % t.shm.region)
                shm.append((t.shm.offset, T.numpy_dtype(t.dtype), tuple(t.shape)))
        views = []
        if self.reserved is not None:
            region, at = self.reserved
            self.reserved = None
            views = self.pool.place_outputs(region, at, shm)
        out, k = [], 0
        copy = self.transport.copy_outputs
        for j, t in enumerate(tensors):
            if t.WhichOneof("data") == "shm":
                v = views[k]
                k += 1
                out.append(v.copy() if copy else v)
            else:
                out.append(T.array_from_inline(t, inline_views[j] if inline_views else None))
        return out

    def done(self):
        if self.pool is None:
            return
        for region, off in self.temps:
            self.pool.free(region, off)
        self.temps = []
        for region, off, _ in self.outs:
            self.pool.free(region, off)
        self.outs = []
        if self.reserved is not None:
            self.pool.free(*self.reserved)
            self.reserved = None


class Transport:
    """The calls, memory and leases of one Client (see the module docstring)."""

    def __init__(self, executor, memory, client_id, *, transport="auto", local=True, fast=None,
                 spin_us=None, lease_ms=60000, region_bytes=16 << 20, timeout=None,
                 copy_outputs=False, raw_forward=None, evaluator=None):
        self.executor = executor
        self.evaluator = evaluator  # the Evaluator stub (Verify, Benchmark)
        # Executor.Forward with bytes in and out (the wire format written and
        # read by _tensors: one copy of the tensor bytes each way); None:
        # inline calls use the generated stub.
        self.raw_forward = raw_forward
        self.memory = memory
        self.client_id = client_id
        self.timeout = timeout
        self.copy_outputs = copy_outputs
        self.lease_ms = lease_ms
        self.region_bytes = region_bytes
        self.spin_us = spin_us
        self.fast_mode = fast_mode_from_env(fast)
        if transport == "auto" and not local:
            transport = "inline"
        self._shm_mode = transport
        self.shm_failure = None if transport != "inline" else "transport is inline"
        self._fast_failure = None
        if self.fast_mode == "off":
            self._fast_failure = "fast is off"
        elif not local:
            self._fast_failure = "the server is not on this host"
        elif not _fast.supported():
            self._fast_failure = "the fast channel needs x86-64 Linux"
        self._prepare_ok = self.fast_mode != "off"
        # Channels and PreparedCalls in pure Python even where opjit._fastcall
        # is in use (benchmarks set it, before the first call, to compare both
        # in one process).
        self.pure_python = _fast.EXTENSION is None
        self._lock = threading.Lock()
        self._pools = {}
        self._prepared = collections.OrderedDict()
        self._released_handles = []   # (namespace, handle) evicted from the cache
        self._handle_namespaces = set()
        self._channels = {}
        self._channel_refused = {}    # namespace -> monotonic time to try again (inf: never)
        self._channel_lock = threading.Lock()
        self._dead_contexts = []
        # Forwards per path (not PreparedCalls); "backward": Backward RPCs (the
        # daemon's contexts), "client_backward": backwards run from tensors the
        # client kept (opjit.op.ClientOpNode: a bprop op call, no Backward RPC).
        self.calls = {"fast": 0, "handle": 0, "grpc": 0, "backward": 0, "client_backward": 0}
        self._retired_bound = 0       # PreparedCall calls on channels since dropped
        self._closed = False
        self._stop = threading.Event()
        self._renewer = None

    # ---- memory --------------------------------------------------------------------

    def pool(self, namespace):
        """The region pool of `namespace`, or None when tensors go inline."""
        if self.shm_failure:
            return None
        with self._lock:
            pool = self._pools.get(namespace)
            if pool is None:
                pool = ShmPool(self.memory, namespace, self.client_id, lease_ms=self.lease_ms,
                               region_bytes=self.region_bytes,
                               timeout=self.timeout if self.timeout else 30.0)
                self._pools[namespace] = pool
                self._start_renewer()
            return pool

    def shm_failed(self, why):
        """Shared memory cannot be used: raise (transport="shm") or go inline."""
        if self._shm_mode == "shm":
            raise ShmUnavailableError(why)
        if not self.shm_failure:
            _log.info("opjit: using inline tensors: %s", why)
            self.shm_failure = why

    def empty(self, namespace, shape, dtype):
        pool = self.pool(namespace)
        if pool is not None:
            try:
                return pool.empty(shape, dtype)
            except ShmUnavailable as e:
                if e.permanent:
                    self.shm_failed(str(e))
        return np.empty(shape, dtype)

    def shm_stats(self):
        out = {"regions": 0, "bytes": 0, "blocks": 0, "used_bytes": 0}
        for pool in list(self._pools.values()):
            for k, v in pool.stats().items():
                out[k] += v
        return out

    # ---- leases ----------------------------------------------------------------------

    def _start_renewer(self):
        if self._renewer is not None:
            return
        ref = weakref.ref(self)
        period = max(self.lease_ms / 3000.0, 0.05)
        stop = self._stop

        def loop():
            while not stop.wait(period):
                t = ref()
                if t is None:
                    return
                try:
                    t.renew()
                except Exception as e:  # daemon restarting etc.: the next call sees it
                    _log.debug("opjit: lease renewal failed: %s", e)
                del t

        self._renewer = threading.Thread(target=loop, name="opjit-lease", daemon=True)
        self._renewer.start()

    def renew(self):
        """Releases queued contexts and handles, and renews the client's lease."""
        self.flush_contexts()
        self._flush_handles()
        for ns, pool in list(self._pools.items()):
            pool.renew(force=ns in self._channels or ns in self._handle_namespaces)

    # ---- contexts ----------------------------------------------------------------------

    def release_context(self, namespace, context_id):
        _rpc(self.executor.ReleaseContext, exec_pb2.ReleaseContextRequest(
            namespace=namespace, context_id=context_id), self.timeout)

    def forget_context(self, namespace, context_id):
        """Queues a context for release (safe from finalizers: no RPC here)."""
        self._dead_contexts.append((namespace, context_id))

    def flush_contexts(self):
        while self._dead_contexts:
            try:
                ns, cid = self._dead_contexts.pop()
            except IndexError:  # another thread took the last one
                return
            try:
                self.executor.ReleaseContext(exec_pb2.ReleaseContextRequest(
                    namespace=ns, context_id=cid), timeout=5.0)
            except grpc.RpcError:
                pass  # already used, expired, or an older server

    # ---- prepared handles ------------------------------------------------------------

    def _prepare(self, ns, name, version, target, groups, attrs):
        """The cached Prepared for this call shape (Prepare on a miss), or None
        when the server has no Prepare."""
        key = (ns, name, version, target,
               tuple(tuple((a.dtype.str, a.shape) for a in g) for g in groups),
               tuple(sorted((k, v.SerializeToString(deterministic=True))
                            for k, v in attrs.items())) if attrs else ())
        p = self._prepared.get(key)
        if p is not None:
            return p
        req = exec_pb2.PrepareRequest(namespace=ns, op=name, version=version, target=target,
                                      client_id=self.client_id)
        for g in groups:
            req.inputs.add().tensors.extend(
                [exec_pb2.Tensor(dtype=T.dtype_name(a.dtype), shape=list(a.shape)) for a in g])
        for k, v in attrs.items():
            req.attrs[k].CopyFrom(v)
        try:
            resp = self.executor.Prepare(req, timeout=self.timeout)
        except grpc.RpcError as e:
            err = error_from_rpc(e)
            if err.code == grpc.StatusCode.UNIMPLEMENTED and self.fast_mode != "on":
                _log.debug("opjit: the server has no Prepare; calls go over plain gRPC")
                self._prepare_ok = False
                return None
            raise err from None
        if not resp.handle:
            self._prepare_ok = False
            return None
        p = Prepared(key, ns, resp, groups)
        with self._lock:
            self._handle_namespaces.add(ns)
            self._prepared[key] = p
            while len(self._prepared) > _HANDLE_CACHE:
                _, old = self._prepared.popitem(last=False)
                self._released_handles.append((old.namespace, old.handle))
        return p

    def _forget_prepared(self, p):
        with self._lock:
            if self._prepared.get(p.key) is p:
                del self._prepared[p.key]

    def _flush_handles(self):
        with self._lock:
            todo, self._released_handles = self._released_handles, []
        by_ns = collections.defaultdict(list)
        for ns, h in todo:
            by_ns[ns].append(h)
        for ns, hs in by_ns.items():
            try:
                self.executor.ReleaseHandles(exec_pb2.ReleaseHandlesRequest(
                    namespace=ns, client_id=self.client_id, handles=hs), timeout=5.0)
            except grpc.RpcError as e:
                _log.debug("opjit: ReleaseHandles failed: %s", e.details())

    # ---- fast channels -----------------------------------------------------------------

    def channel(self, namespace):
        """The open fast channel of `namespace`, opening it on first use; None
        when there is none (fast="off", a remote server, refused...)."""
        ch = self._channels.get(namespace)
        if ch is not None and not ch.closed:
            return ch
        if self._fast_failure:
            return None
        retry_at = self._channel_refused.get(namespace)
        if retry_at is not None and time.monotonic() < retry_at:
            return None
        with self._channel_lock:
            ch = self._channels.get(namespace)
            if ch is not None and not ch.closed:
                return ch
            return self._open_channel(namespace)

    def _open_channel(self, ns):
        on = self.fast_mode == "on"
        try:
            resp = self.executor.OpenChannel(exec_pb2.OpenChannelRequest(
                namespace=ns, client_id=self.client_id, lease_ms=self.lease_ms),
                timeout=self.timeout)
        except grpc.RpcError as e:
            err = error_from_rpc(e)
            if on:
                raise err from None
            code = err.code
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self._channel_refused[ns] = float("inf")
            elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION):
                self._channel_refused[ns] = time.monotonic() + _CHANNEL_RETRY_S
            _log.debug("opjit: no fast channel for namespace %r (%s); using gRPC", ns, err)
            return None
        try:
            kind = _fast.PyFastChannel if self.pure_python else _fast.FastChannel
            ch = kind(resp, spin_us=self.spin_us)
        except (OSError, _fast.ChannelError) as e:
            try:
                self.memory.UnregisterRegion(memory_pb2.UnregisterRegionRequest(
                    namespace=ns, name=resp.region), timeout=5.0)
            except grpc.RpcError:
                pass
            if isinstance(e, OSError):
                # This /dev/shm is not the server's (another container...):
                # shared memory as a whole is unusable, not just the channel.
                raise ShmUnavailable("cannot map the fast channel %s: %s" % (resp.shm_key, e)) \
                    from None
            if on:
                raise ShmUnavailableError("fast=\"on\": the fast channel is unusable: %s" % e) \
                    from None
            self._channel_refused[ns] = float("inf")
            _log.debug("opjit: the fast channel is unusable (%s); using gRPC", e)
            return None
        self._channels[ns] = ch
        self._handle_namespaces.add(ns)
        _log.debug("opjit: fast channel %d for namespace %r (executor %d, spin %d us)",
                   resp.channel_id, ns, ch.worker_pid, ch.spin_ns // 1000)
        return ch

    def _drop_channel(self, ns, ch):
        with self._channel_lock:
            if self._channels.get(ns) is ch:
                del self._channels[ns]
                self._retired_bound += ch.bound_calls
        ch.close()

    def call_counts(self):
        """Forwards by path, PreparedCall calls on a channel counted as "fast"."""
        out = dict(self.calls)
        with self._channel_lock:
            out["fast"] += self._retired_bound + sum(ch.bound_calls
                                                     for ch in self._channels.values())
        return out

    def prepare_call(self, ns, name, version, target, groups, attrs, keep_output_bytes=False):
        """A PreparedCall of op `name` on `groups` (see PreparedCall)."""
        kind = _PyPreparedCall if self.pure_python else PreparedCall
        return kind(self, ns, name, version, target or "", groups, attrs, bool(keep_output_bytes))

    # ---- forward ------------------------------------------------------------------------

    def forward(self, ns, name, version, target, groups, attrs, flags=None,
                keep_output_bytes=False):
        """Runs a forward; returns Forwarded. See the module docstring for the paths.

        groups: per declared input, a list of ndarrays (empty: absent);
        attrs: {name: opjit.v1.AttrValue}; flags: one requires_grad bool per
        declared input, or None; keep_output_bytes: outputs in this client's
        shared memory are not zero-filled first (ForwardRequest.keep_output_bytes).
        """
        keep = bool(keep_output_bytes)
        if self._dead_contexts:
            self.flush_contexts()
        target = target or ""
        inline = inline_outputs = stale_retried = reopened = False
        for attempt in range(6):
            pool = None if inline else self.pool(ns)
            prep = None
            try:
                if pool is not None and self._prepare_ok:
                    prep = self._prepare(ns, name, version, target, groups, attrs)
                    if prep is not None:
                        return self._forward_prepared(ns, pool, prep, groups, flags, keep)
                return self._forward_plain(ns, pool, name, version, target, groups, attrs, flags,
                                           inline_outputs, keep)
            except ShmUnavailable as e:
                if e.permanent:
                    self.shm_failed(str(e))
                else:
                    inline = True
            except _fast.ChannelClosed:
                self._drop_channel(ns, self._channels.get(ns) or _NoChannel)
                if reopened:  # closed twice in a row: gRPC for a while
                    self._channel_refused[ns] = time.monotonic() + _CHANNEL_RETRY_S
                reopened = True
            except OpjitError as err:
                if prep is not None and err.reason == "STALE_HANDLE" and not stale_retried:
                    self._forget_prepared(prep)
                    stale_retried = True
                    continue
                if pool is None or attempt == 5:
                    raise
                if err.reason == "REGION_NOT_REGISTERED":
                    pool.forget_regions()
                elif err.reason == "REGION_TOO_SMALL" and prep is None and not inline_outputs \
                        and err.metadata.get("tensor", "").startswith("outputs["):
                    inline_outputs = True
                else:
                    raise
        raise OpjitError("the call could not be placed")  # pragma: no cover

    def _forward_plain(self, ns, pool, name, version, target, groups, attrs, flags,
                       inline_outputs, keep=False):
        if pool is None and self.raw_forward is not None:
            return self._forward_inline(ns, name, version, target, groups, attrs, flags, keep)
        st = _Staging(self, pool, inline_outputs)
        try:
            req = exec_pb2.ForwardRequest(namespace=ns, op=name, version=version, target=target,
                                          keep_output_bytes=keep)
            for g in groups:
                req.inputs.add().tensors.extend([st.tensor(a) for a in g])
            for k, v in attrs.items():
                req.attrs[k].CopyFrom(v)
            if flags and any(flags):
                req.requires_grad.extend(flags)
            in_bytes = sum(a.nbytes for g in groups for a in g)
            req.outputs.extend(st.placements(in_bytes + 64 * (len(groups) + 1)))
            resp = _rpc(self.executor.Forward, req, self.timeout)
            outs = st.results(resp.outputs)
            self.calls["grpc"] += 1
            return Forwarded(outs, resp.version, resp.context_id, resp.kernel_ms, "grpc")
        finally:
            st.done()

    def _forward_inline(self, ns, name, version, target, groups, attrs, flags, keep=False):
        """A plain forward with every tensor inline, both ways (see the wire
        helpers in opjit._tensors: one copy of the bytes each way). Inline
        outputs start zeroed whatever `keep` says."""
        req = exec_pb2.ForwardRequest(namespace=ns, op=name, version=version, target=target,
                                      keep_output_bytes=keep)
        for k, v in attrs.items():
            req.attrs[k].CopyFrom(v)
        if flags and any(flags):
            req.requires_grad.extend(flags)
        data = _rpc(self.raw_forward, T.encode_inline_request(req, groups), self.timeout)
        resp, views = T.split_inline_response(data)
        del data
        st = _Staging(self, None)
        outs = st.results(resp.outputs, views)
        self.calls["grpc"] += 1
        return Forwarded(outs, resp.version, resp.context_id, resp.kernel_ms, "grpc")

    def _forward_prepared(self, ns, pool, prep, groups, flags, keep=False):
        st = _Staging(self, pool)
        try:
            grad = flags is not None and any(flags)
            ch = self.channel(ns) if prep.fast and not grad else None
            if ch is not None and prep.n_tensors > ch.max_tensors:
                ch = None  # more tensors than a slot holds: gRPC with the handle
            if ch is not None:
                # Inputs in call order (a null slot for an absent optional
                # input when the handle counts one), then the outputs.
                refs = []
                ids_ok = True
                for g in groups:
                    if not g:
                        if prep.null_inputs:
                            refs += (0, 0)
                        continue
                    for a in g:
                        r, off = st.place(a)
                        ids_ok = ids_ok and r.id != 0
                        refs += (r.id, off)
                for _, _, nbytes in prep.outputs:
                    r, off = st.reserve(nbytes)
                    ids_ok = ids_ok and r.id != 0
                    refs += (r.id, off)
                if ids_ok:  # else: a server without region ids; gRPC below
                    timeout = self.timeout
                    reply = ch.call(prep.handle, refs,
                                    time.monotonic_ns() + int(timeout * 1e9) if timeout else 0,
                                    keep_output_bytes=keep)
                    if reply.code:
                        raise error_from_status(reply.code, reply.message, reason=reply.reason)
                    self.calls["fast"] += 1
                    return Forwarded(st.output_views(prep.outputs), prep.version, "",
                                     reply.kernel_ms, "fast")
                st.done()
                st = _Staging(self, pool)
            req = exec_pb2.ForwardRequest(namespace=ns, handle=prep.handle,
                                          client_id=self.client_id, keep_output_bytes=keep)
            for g in groups:
                arg = req.inputs.add()
                for a in g:
                    r, off = st.place(a)
                    arg.tensors.add(dtype=T.dtype_name(a.dtype), shape=list(a.shape),
                                    shm=exec_pb2.ShmRef(region=r.name, offset=off))
            outs = [st.reserve(nbytes) for _, _, nbytes in prep.outputs]
            for r, off in outs:
                req.outputs.add().shm.CopyFrom(exec_pb2.ShmRef(region=r.name, offset=off))
            if grad:
                req.requires_grad.extend(flags)
            resp = _rpc(self.executor.Forward, req, self.timeout)
            for t, (r, off) in zip(resp.outputs, outs):
                if t.WhichOneof("data") != "shm" or t.shm.region != r.name or t.shm.offset != off:
                    raise InvalidArgument("the server answered a prepared call with outputs "
                                          "elsewhere than the placements it was given")
            self.calls["handle"] += 1
            return Forwarded(st.output_views(prep.outputs), resp.version or prep.version,
                             resp.context_id, resp.kernel_ms, "handle")
        finally:
            st.done()

    # ---- backward, gradcheck --------------------------------------------------------------

    def backward(self, ns, context_id, grads, retain_context=False, grad_bytes=0,
                 keep_output_bytes=False, create_graph=False):
        """Runs Backward on a context; returns one list of arrays per forward input.

        grads: one array (or None: a missing grad) per forward output;
        grad_bytes: the space the input grads need (their inputs' sizes);
        keep_output_bytes: as for forward; create_graph: the server keeps a
        context on the bprop op too (double backward), whose id is the
        result's ``context_id`` ("" without create_graph).
        """
        inline = inline_outputs = False
        for attempt in range(4):
            pool = None if inline else self.pool(ns)
            st = _Staging(self, pool, inline_outputs)
            try:
                req = exec_pb2.BackwardRequest(namespace=ns, context_id=context_id,
                                               retain_context=bool(retain_context),
                                               keep_output_bytes=bool(keep_output_bytes),
                                               create_graph=bool(create_graph))
                for g in grads:
                    req.grad_outputs.append(exec_pb2.Tensor() if g is None else st.tensor(g))
                req.outputs.extend(st.placements(grad_bytes))
                resp = _rpc(self.executor.Backward, req, self.timeout)
                self.calls["backward"] += 1
                flat = st.results([t for arg in resp.grad_inputs for t in arg.tensors])
                out, k = BackwardGrads(), 0
                for arg in resp.grad_inputs:
                    out.append(flat[k:k + len(arg.tensors)])
                    k += len(arg.tensors)
                out.context_id = resp.context_id
                out.warnings = list(resp.warnings)
                return out
            except ShmUnavailable as e:
                if e.permanent:
                    self.shm_failed(str(e))
                else:
                    inline = True
            except OpjitError as err:
                if pool is None or attempt == 3:
                    raise
                if err.reason == "REGION_NOT_REGISTERED":
                    pool.forget_regions()
                elif err.reason == "REGION_TOO_SMALL" and not inline_outputs and \
                        err.metadata.get("tensor", "").startswith("outputs["):
                    inline_outputs = True
                else:
                    raise
            finally:
                st.done()
        raise OpjitError("the call could not be placed")  # pragma: no cover

    def gradcheck(self, request):
        """GradCheck (its tensors travel inline: the server perturbs them itself)."""
        return _rpc(self.executor.GradCheck, request, self.timeout)

    # ---- verify, benchmark (the Evaluator service) ------------------------------------------

    def verify(self, request):
        """Verify (the server makes the inputs; given cases travel inline)."""
        return self._evaluate("Verify", request)

    def benchmark(self, request):
        return self._evaluate("Benchmark", request)

    def _evaluate(self, method, request):
        if self.evaluator is None:
            raise Unimplemented("this transport was made without an Evaluator stub")
        try:
            return _rpc(getattr(self.evaluator, method), request, self.timeout)
        except Unimplemented as e:
            if e.reason or e.message:
                raise
            # gRPC's own answer for a service the server lacks says nothing.
            raise Unimplemented("this opjitd has no opjit.v1.Evaluator/%s (a daemon older than "
                                "verify and bench)" % method, details=e.details) from None

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self):
        """Closes the channels, releases handles and regions (ReleaseClient)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.flush_contexts()
        for ch in list(self._channels.values()):
            ch.close()
        with self._lock:
            handle_ns = set(self._handle_namespaces)
            self._prepared.clear()
            self._released_handles = []
        for ns in handle_ns:
            try:  # empty list: every handle of this client
                self.executor.ReleaseHandles(exec_pb2.ReleaseHandlesRequest(
                    namespace=ns, client_id=self.client_id), timeout=5.0)
            except grpc.RpcError as e:
                _log.debug("opjit: ReleaseHandles failed: %s", e.details())
        for ns, pool in list(self._pools.items()):
            pool.close(force=ns in self._channels or ns in handle_ns)
        with self._channel_lock:
            self._retired_bound += sum(ch.bound_calls for ch in self._channels.values())
            self._channels.clear()


class BackwardGrads(list):
    """Backward's answer: one list of arrays per forward input, and ``context_id``:
    the context kept on the bprop op when create_graph was asked ("" otherwise)."""

    context_id = ""
    warnings = ()  # BackwardResponse.warnings: issued by the caller as OpjitWarnings


class _NoChannelType:
    def close(self):
        pass


_NoChannel = _NoChannelType()


class Session:
    """A client's calls in one namespace: the surface Op, OpNode, gradcheck, verify and
    bench use.

    Get one with ``Client.session(namespace)``.
    """

    __slots__ = ("_t", "namespace")

    def __init__(self, transport, namespace):
        self._t = transport
        self.namespace = namespace

    def forward(self, op, groups, attrs=None, version=0, target=None, requires_grad=None,
                keep_output_bytes=False):
        """Runs op's forward. groups: per declared input, a list of ndarrays
        (empty: an absent optional input); attrs: {name: opjit.v1.AttrValue};
        requires_grad: one bool per declared input, or None; keep_output_bytes:
        outputs in this client's shared memory are not zero-filled first.
        Returns Forwarded."""
        return self._t.forward(self.namespace, op, version, target, groups, attrs or {},
                               requires_grad, keep_output_bytes)

    def backward(self, context_id, grads, retain_context=False, grad_bytes=0,
                 keep_output_bytes=False, create_graph=False):
        """Backward on a context kept by a forward; one list of arrays per input
        (a BackwardGrads: its ``context_id`` is the bprop's context with create_graph)."""
        return self._t.backward(self.namespace, context_id, grads, retain_context, grad_bytes,
                                keep_output_bytes, create_graph)

    def gradcheck(self, request):
        return self._t.gradcheck(request)

    def verify(self, request):
        """Evaluator.Verify: an opjit.v1.VerifyRequest -> VerifyResponse."""
        return self._t.verify(request)

    def benchmark(self, request):
        """Evaluator.Benchmark: an opjit.v1.BenchmarkRequest -> BenchmarkResponse."""
        return self._t.benchmark(request)

    def prepare_call(self, op, groups, attrs=None, version=0, target=None,
                     keep_output_bytes=False):
        """A PreparedCall of op's forward on `groups` (per declared input, a
        list of ndarrays), run again by calling it."""
        return self._t.prepare_call(self.namespace, op, version, target, groups, attrs or {},
                                    keep_output_bytes)

    def fast_channel_open(self):
        """Whether calls of this namespace can take the same-host fast channel
        (opened on first use): shared memory, a local server that offers one."""
        t = self._t
        return t._prepare_ok and t.pool(self.namespace) is not None and \
            t.channel(self.namespace) is not None

    def count(self, what):
        """Adds one to call_counts()[what]."""
        calls = self._t.calls
        calls[what] = calls.get(what, 0) + 1

    def release_context_later(self, context_id):
        """Queues a context for release; safe to call from a finalizer."""
        self._t.forget_context(self.namespace, context_id)

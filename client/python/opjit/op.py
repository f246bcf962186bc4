"""Calling registered ops: Op (forward), its backward (ClientOpNode: from tensors the
client keeps; OpNode: a context the daemon keeps), gradcheck."""

import collections
import threading
import warnings
import weakref

import numpy as np

from opjit import _tensors as T
from opjit._bprop import BpropPlan, bprop_args, bprop_groups, check_grad, check_stop_gradient
from opjit._proto import exec_pb2
from opjit.autograd import Node, Tensor, is_grad_enabled
from opjit.errors import (FailedPrecondition, InvalidArgument, NotFound, OpjitWarning,
                          Unimplemented)

__all__ = ["Op", "OpArgumentError", "gradcheck", "GradCheckResult", "GradCheckInput", "split_name"]

_RESERVED = ("version", "target", "requires_grad", "keep_output_bytes", "attrs")


def split_name(name, namespace):
    """("ns", "name") of "ns/name", else (namespace or "", name)."""
    if "/" in name:
        ns, name = name.split("/", 1)
        return ns, name
    return namespace or "", name


def _align(n):
    return (n + 63) & ~63


# Calls whose inputs total at most this many bytes run, on a fast channel,
# through a PreparedCall cached per (version, target, dtypes and shapes,
# attrs): the inputs are copied into its fixed arrays and the outputs copied
# out (two small copies instead of a block allocation, a tracked view and a
# handle lookup per call). Bigger calls place their tensors as usual.
_SMALL_CALL_BYTES = 64 * 1024
_SMALL_CALLS = 16  # cached PreparedCalls per Op (least recently used dropped)


class _SmallCall:
    __slots__ = ("call", "lock", "inputs", "attrs")

    def __init__(self, call, attrs):
        self.call = call
        self.lock = threading.Lock()
        self.inputs = [a for g in call.inputs for a in g]
        self.attrs = attrs  # keeps the AttrValues whose ids are in the key alive


class OpArgumentError(InvalidArgument, TypeError):
    """A call that does not fit the op's signature (too many positional arguments,
    an attr given twice): an InvalidArgument that is also a TypeError, as Python
    raises for a function called so."""


class Op:
    """A registered op, callable like a function.

    ``op(*inputs, **kw)``: inputs by position or by their declared names;
    attrs as keywords (or ``attrs={...}``), or positionally after all the
    inputs in their declaration order (MindSpore's ``program(x, y, 0.7)``),
    with Python values, typed by the op's declared value_type; a dynamic input takes a list; an optional input
    may be None or left out. Reserved keywords: ``version`` (0: latest),
    ``target`` ("CPU"/"GPU"), ``requires_grad`` (True: every ndarray input
    becomes a leaf Tensor that receives a gradient; or one bool per input),
    ``keep_output_bytes`` (True: outputs placed in this client's own shared
    memory are not zero-filled before the kernel, so what the kernel does
    not write holds whatever that memory held, as with torch's ``out=``;
    it saves a pass over big outputs. Inline outputs and workspaces are
    zeroed regardless. Default False).

    Returns an ndarray (a tuple of them for several outputs), or opjit.Tensor
    when an input is an opjit.Tensor or a gradient is being recorded.
    """

    def __init__(self, client, name, version=0, target=None):
        self.client = client
        self.namespace, self.name = split_name(name, client.namespace)
        self._session = client.session(self.namespace)
        self.version = version
        self.target = target
        self._defs = {}
        self._plans = {}   # id(OpDef) -> (OpDef, inputs by index, input names, attr defs)
        self._attr_pb = {}  # (name, type, value) -> AttrValue, for hashable attr values
        self._small = collections.OrderedDict()  # key -> _SmallCall, or None: not on a channel
        self._bplans = {}  # id(OpDef) -> (OpDef, BpropPlan or None)
        self._bprop_ops = {}  # bprop name -> Op
        self._lock = threading.Lock()

    def __repr__(self):
        return "opjit.Op(%r%s)" % (self.qualified_name,
                                   ", version=%d" % self.version if self.version else "")

    @property
    def qualified_name(self):
        return "%s/%s" % (self.namespace or "default", self.name)

    def definition(self, version=None):
        """The opjit.v1.OpRecord used to map arguments (cached; refresh() drops it)."""
        v = self.version if version is None else version
        with self._lock:
            rec = self._defs.get(v)
        if rec is None:
            rec = self.client.describe(self.qualified_name, v)
            with self._lock:
                self._defs[v] = rec
                self._defs[rec.version] = rec
        return rec

    def refresh(self):
        with self._lock:
            self._defs.clear()
            self._plans.clear()
            self._attr_pb.clear()
            self._small.clear()
            self._bplans.clear()

    def _plan(self, opdef):
        plan = self._plans.get(id(opdef))
        if plan is None or plan[0] is not opdef:
            inputs = sorted(opdef.inputs, key=lambda p: p.index)
            plan = (opdef, inputs, [p.name for p in inputs], {a.name: a for a in opdef.attrs})
            with self._lock:
                self._plans[id(opdef)] = plan
        return plan

    def _attr(self, k, v, attr_defs):
        try:
            key = (k, type(v), v)
            pb = self._attr_pb.get(key)
        except TypeError:  # unhashable (a list): converted each time
            key = pb = None
        if pb is None:
            d = attr_defs.get(k)
            pb = T.attr_value(k, v, d.value_type if d is not None else "")
            if key is not None and len(self._attr_pb) < 256:
                self._attr_pb[key] = pb
        return pb

    def _bind(self, opdef, args, kwargs):
        _, inputs, names, attr_defs = self._plan(opdef)
        attrs = dict(kwargs.pop("attrs", None) or {})
        if len(args) > len(inputs):
            # MindSpore's calling convention: program(x, y, 0.7) passes the
            # attrs after the inputs, in their declaration order.
            attr_names = list(attr_defs)
            extra = args[len(inputs):]
            if len(extra) > len(attr_names):
                raise OpArgumentError(
                    "op %s takes %d input(s) (%s) and %d attr(s) (%s) positionally: at most %d "
                    "positional arguments, got %d"
                    % (self.name, len(inputs), ", ".join(names) or "-", len(attr_names),
                       ", ".join(attr_names) or "-", len(inputs) + len(attr_names), len(args)))
            for k, v in zip(attr_names, extra):
                if k in attrs or k in kwargs:
                    raise OpArgumentError("attr %s of op %s given twice (positionally, after the "
                                          "%d input(s), and by name)" % (k, self.name, len(inputs)))
                attrs[k] = v
            args = args[:len(inputs)]
        values = list(args) + [None] * (len(inputs) - len(args))
        given = [True] * len(args) + [False] * (len(inputs) - len(args))
        for k, v in kwargs.items():
            if k in names:
                i = names.index(k)
                if given[i]:
                    raise InvalidArgument("input %s of op %s given twice" % (k, self.name))
                values[i], given[i] = v, True
            elif k in attr_defs:
                attrs[k] = v
            else:
                raise InvalidArgument("op %s has no input or attr named %r (inputs: %s; attrs: %s)"
                                      % (self.name, k, ", ".join(names) or "-",
                                         ", ".join(attr_defs) or "-"))
        groups = []  # per input: a list of values (Tensor or ndarray)
        for p, v in zip(inputs, values):
            ptype = p.param_type or "required"
            if v is None:
                if ptype == "required":
                    raise InvalidArgument("op %s: input %s is required" % (self.name, p.name))
                if ptype == "dynamic":
                    raise InvalidArgument("op %s: dynamic input %s needs at least one tensor"
                                          % (self.name, p.name))
                groups.append([])
            elif ptype == "dynamic":
                vs = list(v) if isinstance(v, (list, tuple)) else [v]
                if not vs:
                    raise InvalidArgument("op %s: dynamic input %s needs at least one tensor"
                                          % (self.name, p.name))
                groups.append(vs)
            else:
                if isinstance(v, (list, tuple)) and v and all(
                        isinstance(x, (np.ndarray, Tensor)) for x in v):
                    raise InvalidArgument("op %s: input %s is %s, not dynamic: pass one tensor"
                                          % (self.name, p.name, ptype))
                groups.append([v])
        pb_attrs = {k: self._attr(k, v, attr_defs) for k, v in attrs.items()}
        return inputs, groups, pb_attrs

    def __call__(self, *args, **kwargs):
        version = kwargs.pop("version", self.version)
        target = kwargs.pop("target", self.target)
        requires_grad = kwargs.pop("requires_grad", None)
        keep_output_bytes = bool(kwargs.pop("keep_output_bytes", False))
        record = self.definition(version)
        inputs, groups, pb_attrs = self._bind(record.op, args, dict(kwargs))
        return self._call_bound(record, inputs, groups, pb_attrs, version, target,
                                requires_grad, keep_output_bytes)

    def _call_bound(self, record, inputs, groups, pb_attrs, version, target, requires_grad,
                    keep_output_bytes):
        """A call after _bind: groups holds Tensors or ndarrays per declared
        input, pb_attrs the AttrValues."""
        opdef = record.op
        # Autograd: which inputs need a gradient, and which become leaves.
        record_grad = is_grad_enabled() and requires_grad is not False
        wrap = any(isinstance(v, Tensor) for g in groups for v in g) or bool(requires_grad)
        if isinstance(requires_grad, (list, tuple)):
            if len(requires_grad) != len(inputs):
                raise InvalidArgument("requires_grad: give one bool per input (%d)" % len(inputs))
            per_input = [bool(b) for b in requires_grad]
        else:
            per_input = [requires_grad is True] * len(inputs)
        tensors = []  # per input: Tensor objects (for the graph) or ndarrays
        flags = []
        for i, g in enumerate(groups):
            row = []
            for v in g:
                if isinstance(v, Tensor):
                    row.append(v)
                else:
                    arr = T.as_ndarray(v)
                    if per_input[i] and record_grad and arr.dtype.kind == "f":
                        row.append(Tensor(arr, requires_grad=True))
                    else:
                        row.append(arr)
            tensors.append(row)
            flags.append(record_grad and any(isinstance(v, Tensor) and v.requires_grad
                                             for v in row))
        arrays = [[v.data if isinstance(v, Tensor) else v for v in row] for row in tensors]
        grad = any(flags)
        plan = None
        if grad:
            # The client keeps what the bprop reads when a fast channel is
            # open (see ClientOpNode); else the daemon keeps a context.
            plan = self._client_plan(opdef)
        if not wrap and not grad:
            outs, _ = self._forward_arrays(arrays, pb_attrs, version, target, keep_output_bytes,
                                           small=False, record=record)
            return outs[0] if len(outs) == 1 else tuple(outs)
        context_id = ""
        if plan is not None or not grad:
            outs, ran = self._forward_arrays(arrays, pb_attrs, version, target, keep_output_bytes,
                                             small=True, record=record)
            if grad and ran and ran != record.version:
                # A newer version ran: its backward is the one to follow.
                record = self.definition(ran)
                opdef = record.op
                plan = self._client_plan(opdef)
                if plan is None:
                    raise FailedPrecondition(
                        "op %s changed while it ran (version %d ran, %d was described) and its "
                        "new backward cannot run from the client: call it again"
                        % (self.qualified_name, ran, record.version))
        else:
            fwd = self._session.forward(self.name, arrays, pb_attrs, version=version,
                                        target=target, requires_grad=flags,
                                        keep_output_bytes=keep_output_bytes)
            outs, context_id = fwd.outputs, fwd.context_id
            if version == 0 and fwd.version and fwd.version != record.version:
                self.refresh()  # a newer version ran; map arguments with it next time
        results = [Tensor(o) for o in outs]
        if grad:
            graph_inputs = []
            for p, row in zip(inputs, tensors):
                ts = [v if isinstance(v, Tensor) else None for v in row]
                graph_inputs.append(ts if (p.param_type == "dynamic") else (ts[0] if ts else None))
            metas = [(o.shape, o.dtype) for o in outs]
            if plan is not None and plan is not _NO_BPROP:
                saved_in = [[a.copy() for a in g] if i in plan.save_in else ([] if not g else None)
                            for i, g in enumerate(arrays)]
                saved_out = [outs[j].copy() if j in plan.save_out else None
                             for j in range(len(outs))]
                node = ClientOpNode(self, plan, graph_inputs, metas, saved_in, saved_out, flags,
                                    [len(g) for g in arrays], pb_attrs, target, record.version)
                non_diff = plan.non_diff
            else:
                node = OpNode(self, self.namespace, context_id, graph_inputs, metas, opdef,
                              record.version)
                nd = set(opdef.backward.non_differentiable)
                out_names = [q.name for q in sorted(opdef.outputs, key=lambda q: q.index)]
                non_diff = node.non_diff = {j for j, n in enumerate(out_names) if n in nd}
            for j, t in enumerate(results):
                if j in non_diff or t.dtype.kind not in "fc":
                    continue  # integer and bool outputs carry no gradient
                t.grad_fn = node
                t._output_index = j
                t.requires_grad = True
        return results[0] if len(results) == 1 else tuple(results)

    # -- the forward's paths
    def _forward_arrays(self, arrays, pb_attrs, version, target, keep, small, record):
        """Runs the forward without a server context: (outputs, version that ran)."""
        if small and not keep:
            r = self._small_forward(arrays, pb_attrs, version, target)
            if r is not None:
                outs, ran = r
                if version == 0 and ran and ran != record.version:
                    self.refresh()
                return outs, ran
        fwd = self._session.forward(self.name, arrays, pb_attrs, version=version, target=target,
                                    keep_output_bytes=keep)
        if version == 0 and fwd.version and fwd.version != record.version:
            self.refresh()  # a newer version ran; map arguments with it next time
        return fwd.outputs, fwd.version

    def _small_forward(self, arrays, pb_attrs, version, target):
        """A small call through a cached PreparedCall bound to the fast channel:
        (fresh output arrays, version that ran), or None (too big, no channel,
        the cached call busy in another thread)."""
        total = 0
        sig = []
        for g in arrays:
            row = []
            for a in g:
                total += a.nbytes
                row.append((a.dtype, a.shape))
            sig.append(tuple(row))
        if total > _SMALL_CALL_BYTES:
            return None
        key = (version, target, tuple(sig), tuple((k, id(v)) for k, v in pb_attrs.items()))
        small = self._small
        ent = small.get(key, False)
        if ent is False:
            if not self._session.fast_channel_open():
                return None
            call = self._session.prepare_call(
                self.name, [[np.empty(a.shape, a.dtype) for a in g] for g in arrays], pb_attrs,
                version=version, target=target)
            ent = _SmallCall(call, dict(pb_attrs)) if call.path == "fast" else None
            with self._lock:
                small[key] = ent
                while len(small) > _SMALL_CALLS:
                    small.popitem(last=False)
        if ent is None or not ent.lock.acquire(False):
            return None
        try:
            k = 0
            for g in arrays:
                for a in g:
                    np.copyto(ent.inputs[k], a)
                    k += 1
            call = ent.call
            call()
            outs = [o.copy() for o in call.outputs]
            prep = call._prep
            return outs, (prep.version if prep is not None else 0)
        finally:
            ent.lock.release()

    # -- backward from client-held tensors
    def _bprop_op(self, name):
        op = self._bprop_ops.get(name)
        if op is None:
            op = self._bprop_ops[name] = Op(
                self.client, "%s/%s" % (self.namespace, name) if self.namespace else name,
                target=self.target)
        return op

    def _client_plan(self, opdef):
        """The BpropPlan of a forward whose backward the client can run, or
        None: the daemon keeps a context (no fast channel open; the bprop not
        registered yet, so that its error comes at backward, as the daemon
        says it; a bprop call an op call cannot express: BpropPlan.why).
        _NO_BPROP for an op without a bprop (its backward fails as the
        daemon's would: NOT_DIFFERENTIABLE)."""
        got = self._bplans.get(id(opdef))
        if got is not None and got[0] is opdef:
            # Made while a channel was open: should it close for good, the
            # calls go over gRPC, still without a context (as correct, if slower).
            return got[1]
        if not self._session.fast_channel_open():
            return None
        if not opdef.backward.op:
            plan = _NO_BPROP
        else:
            try:
                bdef = self._bprop_op(opdef.backward.op).definition(0).op
            except NotFound:
                return None  # not registered (yet): not cached
            plan = BpropPlan(opdef, bdef)
            if not plan.ok:
                plan = None
        with self._lock:
            self._bplans[id(opdef)] = (opdef, plan)
        return plan

    def prepare(self, *args, **kwargs):
        """This call, ready to run again and again: an opjit.PreparedCall.

        Takes what a call takes (inputs, attrs, ``version``, ``target``,
        ``keep_output_bytes``; no gradient is recorded). Calling the result
        with no arguments runs the op on the current contents of its
        ``inputs`` (the arrays given here when they are in this client's
        shared memory, else copies there: write new values in place) and
        returns the outputs, the same arrays every call::

            x = client.empty(16, np.float32)
            leaky = client.op("leaky_relu").prepare(x, alpha=0.5)
            x[:] = ...
            y = leaky()          # y is leaky.outputs[0], overwritten by the next call

        On a same-host fast channel the handle and tensor refs are written
        once and each call is one slot write and wait (in C++ when the
        opjit._fastcall extension is built); elsewhere each call is an
        ordinary forward.
        """
        version = kwargs.pop("version", self.version)
        target = kwargs.pop("target", self.target)
        keep_output_bytes = bool(kwargs.pop("keep_output_bytes", False))
        if kwargs.pop("requires_grad", None):
            raise InvalidArgument("op %s: a prepared call records no gradient (requires_grad)"
                                  % self.name)
        record = self.definition(version)
        _, groups, pb_attrs = self._bind(record.op, args, dict(kwargs))
        arrays = [[v.data if isinstance(v, Tensor) else T.as_ndarray(v) for v in g]
                  for g in groups]
        return self._session.prepare_call(self.name, arrays, pb_attrs, version=version,
                                          target=target, keep_output_bytes=keep_output_bytes)


class OpNode(Node):
    """A forward kept on the server under context_id; backward is the Backward RPC."""

    def __init__(self, op, namespace, context_id, inputs, out_meta, opdef, version):
        super().__init__(inputs, out_meta)
        self.op = op
        self.namespace = namespace
        self.context_id = context_id
        self.bprop = opdef.backward.op if opdef is not None else ""
        self.opdef = opdef
        self.version = version
        self.non_diff = set()  # indices of outputs without a gradient
        self._finalizer = None
        if context_id:
            self._finalizer = weakref.finalize(self, op._session.release_context_later,
                                               context_id)

    def name(self):
        return "%sBackward" % self.op.name

    def input_name(self, i):
        if self.opdef is not None:
            names = [p.name for p in sorted(self.opdef.inputs, key=lambda p: p.index)]
            if i < len(names):
                return "input %s of op %s" % (names[i], self.op.qualified_name)
        return "input %d of op %s" % (i, self.op.qualified_name)

    def apply(self, grads, retain_graph, create_graph=False):
        if not self.context_id:
            if not self.bprop:
                # What opjitd answers for a backward through such an op's
                # outputs (its forward ran and kept a context that says so).
                raise FailedPrecondition(
                    "op %s (version %d) is not differentiable: it has no backward op "
                    "(backward.op is empty)" % (self.op.qualified_name, self.version),
                    reason="NOT_DIFFERENTIABLE",
                    metadata={"op": self.op.qualified_name, "version": str(self.version)})
            # The contract says a forward with requires_grad on an op with a
            # backward keeps a context; a server that ignored the flag predates it.
            raise Unimplemented(
                "opjitd kept no backward context for op %s although it has backward %r: "
                "this server does not implement autograd (UNIMPLEMENTED)"
                % (self.op.qualified_name, self.bprop))
        grad_tensors = list(grads)
        grads = [None if g is None else np.ascontiguousarray(
            g.data if isinstance(g, Tensor) else g) for g in grads]
        # The input grads have their inputs' shapes and dtypes.
        grad_bytes = sum(_align(a.nbytes) for row in self.inputs
                         for a in (row if isinstance(row, list) else [row])
                         if isinstance(a, Tensor)) + 64
        per_input = self.op._session.backward(self.context_id, grads,
                                              retain_context=bool(retain_graph),
                                              grad_bytes=grad_bytes,
                                              create_graph=bool(create_graph))
        if not retain_graph and self._finalizer is not None:
            self._finalizer.detach()  # the server dropped the context
        for w in getattr(per_input, "warnings", ()):
            warnings.warn("backward of %s: %s" % (self.op.qualified_name, w), OpjitWarning,
                          stacklevel=3)
        bprop_ctx = getattr(per_input, "context_id", "") if create_graph else ""
        if bprop_ctx:
            per_input = self._bprop_node(bprop_ctx, per_input, grad_tensors)
        out = []
        for i, got in enumerate(per_input):
            slot = self.inputs[i] if i < len(self.inputs) else None
            if isinstance(slot, list):
                out.append(got if got else None)
            else:
                out.append(got[0] if got else None)
        while len(out) < len(self.inputs):
            out.append(None)
        return out


    def _bprop_node(self, context_id, per_input, grad_tensors):
        """create_graph: the grads as Tensors made by the bprop op's call,
        recorded as an OpNode on the context the server kept for it.

        The bprop op took the forward inputs, outputs and output grads that
        backward.inputs names (by default all of them, in that order), so those
        are its node's inputs: a forward input as it is, a differentiable
        output as a stand-in Tensor routed to this node (its data is not kept
        here), an output grad as it reached this node.
        """
        n_out = len(self.out_meta)
        outputs = []
        for j, (shape, dtype) in enumerate(self.out_meta):
            if j in self.non_diff:
                outputs.append(None)
                continue
            y = Tensor(np.broadcast_to(np.zeros((), dtype), shape))
            y.grad_fn, y._output_index, y.requires_grad = self, j, True
            outputs.append(y)
        gslots = [g if isinstance(g, Tensor) else None for g in grad_tensors[:n_out]]
        gslots += [None] * (n_out - len(gslots))
        if self.opdef is None:  # a bprop's own node: ask for its backward (third order)
            self.opdef = self.op.definition().op
            self.bprop = self.opdef.backward.op
        inputs = []
        for kind, k in bprop_args(self.opdef):
            inputs.append(self.inputs[k] if kind == "in" else outputs[k] if kind == "out"
                          else gslots[k])
        cache = self.op.__dict__.setdefault("_bprop_ops", {})
        bprop_op = cache.get(self.bprop)
        if bprop_op is None:
            bprop_op = cache[self.bprop] = Op(
                self.op.client,
                "%s/%s" % (self.namespace, self.bprop) if self.namespace else self.bprop)
        declared = len(bprop_op.definition().op.inputs)  # cached by the Op
        if declared != len(inputs):
            # Its grads would land on the wrong tensors: say so instead.
            raise Unimplemented(
                "create_graph through op %s: its bprop %s declares %d inputs, but "
                "backward.inputs maps %d" % (self.op.qualified_name, self.bprop, declared,
                                             len(inputs)))
        metas = []
        for i, slot in enumerate(self.inputs):
            got = per_input[i] if i < len(per_input) else []
            if got:
                metas.append((got[0].shape, got[0].dtype))
            elif isinstance(slot, Tensor):
                metas.append((slot.shape, slot.dtype))
            else:
                metas.append(((), np.dtype(np.float32)))
        node = OpNode(bprop_op, self.namespace, context_id, inputs, metas, None, 0)
        out = []
        for i, got in enumerate(per_input):
            row = []
            for a in got:
                t = Tensor(a)
                t.grad_fn, t._output_index, t.requires_grad = node, i, True
                row.append(t)
            out.append(row)
        return out


_NO_BPROP = object()  # Op._client_plan: the op has no bprop


class ClientOpNode(Node):
    """A forward whose backward runs from tensors the client keeps.

    The forward was a plain call (the fast channel when one is open); the
    node holds copies of the inputs and outputs the bprop reads (those
    ``backward.inputs`` names, less what ``save_for_backward`` leaves out:
    what the daemon's context would hold), and its backward is one more op
    call, of the bprop, with the forward's attrs it declares: no Backward
    RPC and no context on the daemon. The daemon's rules hold: grads of
    non-differentiable outputs and missing grads are zeros (or null slots
    without ``materialize_grads``), a nonzero grad for an input that needs
    none is dropped with a StopGradientGradWarning or fails with
    STOP_GRADIENT_GRAD, an absent optional input gets none. With
    create_graph the bprop call is itself recorded (the bprop's own backward:
    double backward), its inputs routed back to the forward's tensors and to
    this node's outputs.
    """

    def __init__(self, op, plan, inputs, out_meta, saved_in, saved_out, flags, counts, attrs,
                 target, version):
        super().__init__(inputs, out_meta)
        self.op = op
        self.plan = plan
        self.saved_in = saved_in    # per input: list of arrays ([]: absent), or None: not saved
        self.saved_out = saved_out  # per output: an array, or None: not saved
        self.flags = flags          # per input: requires_grad
        self.counts = counts        # per input: tensors given
        self.attrs = attrs
        self.target = target
        self.version = version
        self.non_diff = plan.non_diff

    def name(self):
        return "%sBackward" % self.op.name

    def input_name(self, i):
        names = self.plan.in_names
        return "input %s of op %s" % (names[i] if i < len(names) else i, self.op.qualified_name)

    def apply(self, grads, retain_graph, create_graph=False):
        plan, op = self.plan, self.op
        if self.saved_in is None:
            raise FailedPrecondition(
                "trying to backward through %s a second time: its saved tensors were freed "
                "(pass retain_graph=True to the first backward)" % self.name())
        bprop = op._bprop_op(plan.bprop)
        brecord = bprop.definition(0)
        qual = op.qualified_name
        given = []
        for j, g in enumerate(grads):
            if g is None or j in plan.non_diff:
                given.append(None)
                continue
            given.append(check_grad(plan, j, g, self.out_meta[j], qual))
        battrs = {k: v for k, v in self.attrs.items() if k in plan.bprop_attrs}
        if create_graph:
            res = self._recorded_bprop(bprop, brecord, given, battrs)
        else:
            data = [None if g is None else np.ascontiguousarray(
                g.data if isinstance(g, Tensor) else g) for g in given]
            values = bprop_groups(plan, self.saved_in, self.saved_out, data, self.out_meta)
            groups = [[] if v is None else (v if isinstance(v, list) else [v]) for v in values]
            res, _ = bprop._forward_arrays(groups, battrs, 0, self.target, False, small=True,
                                           record=brecord)
        op._session.count("client_backward")
        if not retain_graph:
            self.saved_in = self.saved_out = None
        out = []
        for i, slot in enumerate(self.inputs):
            if i >= len(res) or not self.counts[i]:
                out.append(None)  # an absent optional input has no grad
                continue
            g = res[i]
            if not self.flags[i]:
                check_stop_gradient(plan, qual, i, g.data if isinstance(g, Tensor) else g)
                out.append(None)
                continue
            out.append([g] if isinstance(slot, list) else g)
        return out

    def _recorded_bprop(self, bprop, brecord, given, battrs):
        """create_graph: the bprop called on Tensors, so that the call is recorded."""
        plan = self.plan
        from opjit import _math
        values = []
        for (kind, i), dyn in zip(plan.args, plan.dynamic):
            if kind == "in":
                saved = self.saved_in[i]
                if not saved:
                    values.append(None)
                    continue
                slot = self.inputs[i]
                slots = slot if isinstance(slot, list) else [slot]
                row = []
                for t, a in zip(slots, saved):
                    if isinstance(t, Tensor) and t.requires_grad:
                        # The saved copy, its grads routed to the forward's tensor.
                        row.append(_math._record("saved", a, [t], lambda node, g: [g]))
                    else:
                        row.append(a)
                values.append(row if dyn else row[0])
            elif kind == "out":
                a = self.saved_out[i]
                if a is not None and i not in plan.non_diff:
                    y = Tensor(a)
                    y.grad_fn, y._output_index, y.requires_grad = self, i, True
                    a = y
                values.append(a)
            else:
                g = given[i]
                if g is None and plan.materialize:
                    shape, dtype = self.out_meta[i]
                    g = np.zeros(shape, dtype)
                values.append(g)
        _, binputs, _, _ = bprop._plan(brecord.op)
        groups = [[] if v is None else (v if isinstance(v, list) else [v]) for v in values]
        res = bprop._call_bound(brecord, binputs, groups, battrs, 0, self.target, None, False)
        return [res] if isinstance(res, Tensor) else list(res)


# ---- gradcheck -------------------------------------------------------------------

class GradCheckInput:
    """One input's comparison of analytic and numeric gradients."""

    def __init__(self, pb):
        self.name = pb.name
        self.max_abs_error = pb.max_abs_error
        self.max_rel_error = pb.max_rel_error
        self.passed = pb.passed
        self.worst_index = pb.worst_index
        self.analytic = pb.analytic
        self.numeric = pb.numeric

    def __repr__(self):
        return ("GradCheckInput(%s: %s, max_abs_error=%.3g, max_rel_error=%.3g, worst_index=%d, "
                "analytic=%.6g, numeric=%.6g)" % (
                    self.name, "passed" if self.passed else "FAILED", self.max_abs_error,
                    self.max_rel_error, self.worst_index, self.analytic, self.numeric))


class GradCheckResult:
    """Result of opjit.gradcheck: truthy when passed."""

    def __init__(self, pb):
        self.passed = pb.passed
        self.dtype = pb.dtype
        self.message = pb.message
        self.inputs = [GradCheckInput(i) for i in pb.inputs]
        self.response = pb

    def __bool__(self):
        return bool(self.passed)

    def __repr__(self):
        return "GradCheckResult(passed=%s, dtype=%r, inputs=%r%s)" % (
            self.passed, self.dtype, self.inputs,
            ", message=%r" % self.message if self.message else "")


def gradcheck(client_or_op, op_name=None, inputs=None, attrs=None, atol=0.0, rtol=0.0, eps=0.0,
              seed=0, random_shape=None, version=0):
    """Compares an op's registered backward with finite differences (GradCheck RPC).

    gradcheck(client, "square", inputs=[x]) or gradcheck(client.op("square"), inputs=[x]).
    gradcheck(fn, [x, ...]) with a Python function of Tensors checks the
    client's tape instead (opjit._check.check_function; see gradgradcheck).
    inputs: one array (or list, for a dynamic input; None for an absent
    optional one) per declared input; None: random inputs of `random_shape`.
    atol/rtol/eps: 0 means the server's defaults. Returns GradCheckResult.
    """
    if callable(client_or_op) and not isinstance(client_or_op, Op):
        from opjit._check import check_function
        return check_function(client_or_op, op_name if inputs is None else inputs,
                              eps=eps or None, atol=atol or None, rtol=rtol or None, seed=seed)
    if isinstance(client_or_op, Op):
        op = client_or_op
        if op_name is not None and not isinstance(op_name, str):
            inputs, op_name = op_name, None
        if op_name is not None:
            op = op.client.op(op_name, version=version)
    else:
        if op_name is None:
            raise InvalidArgument("gradcheck(client, op_name, ...): op_name is missing")
        op = client_or_op.op(op_name, version=version)
    pb_attrs = {}
    groups = []
    if inputs is not None or attrs:
        opdef = op.definition(version or op.version).op
        if inputs is not None:
            decl = sorted(opdef.inputs, key=lambda p: p.index)
            for p, v in zip(decl, inputs):
                if v is None:
                    groups.append([])
                elif p.param_type == "dynamic":
                    groups.append([T.as_ndarray(x) for x in v])
                else:
                    groups.append([T.as_ndarray(v)])
        attr_defs = {a.name: a for a in opdef.attrs}
        for k, v in (attrs or {}).items():
            d = attr_defs.get(k)
            pb_attrs[k] = T.attr_value(k, v, d.value_type if d is not None else "")

    req = exec_pb2.GradCheckRequest(namespace=op.namespace, op=op.name,
                                    version=version or op.version, atol=atol, rtol=rtol, eps=eps,
                                    seed=seed, random_shape=list(random_shape or ()))
    # The server perturbs the inputs itself, so GradCheck takes inline tensors only.
    for row in groups:
        req.inputs.add().tensors.extend([T.inline_tensor(a) for a in row])
    for k, v in pb_attrs.items():
        req.attrs[k].CopyFrom(v)
    return GradCheckResult(op._session.gradcheck(req))

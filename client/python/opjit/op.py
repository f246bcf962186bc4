"""Calling registered ops: Op (forward), OpNode (server-side backward), gradcheck."""

import threading
import weakref

import grpc
import numpy as np

from opjit import _tensors as T
from opjit._proto import exec_pb2
from opjit._shm import ShmUnavailable
from opjit.autograd import Node, Tensor, is_grad_enabled
from opjit.client import _split_name
from opjit.errors import (FailedPrecondition, InvalidArgument, OpjitError, Unimplemented,
                          error_from_rpc)

__all__ = ["Op", "gradcheck", "GradCheckResult", "GradCheckInput"]

_RESERVED = ("version", "target", "requires_grad", "attrs")


def _align(n):
    return (n + 63) & ~63


class _Staging:
    """Puts one call's tensors into shared memory (or inline) and reads outputs back."""

    def __init__(self, client, namespace, inline_outputs=False, inline=False):
        self.client = client
        self.pool = None if inline else client._pool(namespace)
        self.temps = []
        self.reserved = None
        self.inline_outputs = inline_outputs

    def tensor(self, arr):
        if self.pool is not None and arr.nbytes > 0:
            loc = self.pool.locate(arr)
            if loc is not None:
                return exec_pb2.Tensor(dtype=T.dtype_name(arr.dtype), shape=list(arr.shape),
                                       shm=exec_pb2.ShmRef(region=loc[0], offset=loc[1]))
            region, off = self.pool.alloc(arr.nbytes)
            self.temps.append((region, off))
            np.copyto(self.pool.view(region, off, arr.dtype, arr.shape, track=False), arr)
            return exec_pb2.Tensor(dtype=T.dtype_name(arr.dtype), shape=list(arr.shape),
                                   shm=exec_pb2.ShmRef(region=region.name, offset=off))
        return T.inline_tensor(arr)

    def placements(self, estimate):
        if self.pool is None or self.inline_outputs:
            return []
        region, off = self.pool.reserve_tail(estimate)
        self.reserved = (region, off)
        return [exec_pb2.OutputPlacement(alloc_in=exec_pb2.ShmRef(region=region.name, offset=off))]

    def results(self, tensors):
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
        for t in tensors:
            if t.WhichOneof("data") == "shm":
                v = views[k]
                k += 1
                out.append(v.copy() if self.client.copy_outputs else v)
            else:
                out.append(T.array_from_inline(t))
        return out

    def done(self):
        if self.pool is None:
            return
        for region, off in self.temps:
            self.pool.free(region, off)
        self.temps = []
        if self.reserved is not None:
            self.pool.free(*self.reserved)
            self.reserved = None


def run_call(client, namespace, fn, inline=False):
    """Runs fn(staging) -> response with shared-memory fallbacks.

    * CreateRegion refused or the mapping failed: switch the client to inline
      tensors and run again.
    * The server forgot our regions (lease lapsed, daemon restarted): new ones.
    * The outputs did not fit the space offered (a shape the client could not
      predict): run again with inline outputs.
    """
    inline_outputs = False
    for attempt in range(4):
        staging = _Staging(client, namespace, inline_outputs, inline)
        try:
            return fn(staging)
        except ShmUnavailable as e:
            if e.permanent:
                client._shm_failed(str(e))
            else:
                inline = True
        except grpc.RpcError as e:
            err = error_from_rpc(e)
            if staging.pool is None or attempt == 3:
                raise err from None
            # Decided on the server's reason, never on its wording.
            if err.reason == "REGION_NOT_REGISTERED":
                staging.pool.forget_regions()
            elif err.reason == "REGION_TOO_SMALL" and \
                    err.metadata.get("tensor", "").startswith("outputs[") and not inline_outputs:
                inline_outputs = True
            else:
                raise err from None
        finally:
            staging.done()
    raise OpjitError("the call could not be placed")  # pragma: no cover


def _nbytes(shape, dtype):
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    return n * np.dtype(dtype).itemsize


def estimate_output_bytes(opdef, groups):
    """Bytes to offer the server for the outputs (alloc_in), from the output rules."""
    total = 0
    first = [g[0] if g else None for g in groups]
    all_bytes = sum(a.nbytes for g in groups for a in g)
    rules = list(opdef.output_rules)
    for j in range(len(opdef.outputs)):
        rule = rules[j] if j < len(rules) else None
        kind = (rule.kind if rule is not None else "") or "same_as"
        nbytes = None
        try:
            if kind == "same_as":
                a = first[rule.input if rule is not None else 0]
                if a is not None:
                    dt = T.DTYPES.get(rule.dtype, a.dtype) if rule is not None and rule.dtype \
                        else a.dtype
                    nbytes = _nbytes(a.shape, dt)
            elif kind == "broadcast":
                idx = list(rule.inputs) or list(range(len(first)))
                arrs = [first[i] for i in idx if first[i] is not None]
                shape = np.broadcast_shapes(*[a.shape for a in arrs])
                dt = T.DTYPES.get(rule.dtype) if rule.dtype else max(
                    (a.dtype for a in arrs), key=lambda d: d.itemsize)
                nbytes = _nbytes(shape, dt)
            elif kind == "reduce":
                a = first[rule.input]
                nbytes = a.nbytes if a is not None else None
            elif kind == "explicit":
                nbytes = _nbytes(tuple(rule.shape), T.DTYPES.get(rule.dtype, np.float64))
        except (IndexError, ValueError, TypeError):
            nbytes = None
        if nbytes is None:
            nbytes = max(all_bytes, 4096)  # infer_shape: a guess; too small -> inline retry
        total += _align(nbytes)
    return total + 64


class Op:
    """A registered op, callable like a function.

    ``op(*inputs, **kw)``: inputs by position or by their declared names;
    attrs as keywords (or ``attrs={...}``) with Python values, typed by the
    op's declared value_type; a dynamic input takes a list; an optional input
    may be None or left out. Reserved keywords: ``version`` (0: latest),
    ``target`` ("CPU"/"GPU"), ``requires_grad`` (True: every ndarray input
    becomes a leaf Tensor that receives a gradient; or one bool per input).

    Returns an ndarray (a tuple of them for several outputs), or opjit.Tensor
    when an input is an opjit.Tensor or a gradient is being recorded.
    """

    def __init__(self, client, name, version=0, target=None):
        self.client = client
        self.namespace, self.name = _split_name(name, client.namespace)
        self.version = version
        self.target = target
        self._defs = {}
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

    def _bind(self, opdef, args, kwargs):
        inputs = sorted(opdef.inputs, key=lambda p: p.index)
        attr_defs = {a.name: a for a in opdef.attrs}
        names = [p.name for p in inputs]
        if len(args) > len(inputs):
            raise InvalidArgument("op %s takes %d input(s) (%s); got %d positional arguments"
                                  % (self.name, len(inputs), ", ".join(names), len(args)))
        values = list(args) + [None] * (len(inputs) - len(args))
        given = [True] * len(args) + [False] * (len(inputs) - len(args))
        attrs = dict(kwargs.pop("attrs", None) or {})
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
        pb_attrs = {}
        for k, v in attrs.items():
            d = attr_defs.get(k)
            pb_attrs[k] = T.attr_value(k, v, d.value_type if d is not None else "")
        return inputs, groups, pb_attrs

    def __call__(self, *args, **kwargs):
        if self.client._dead_contexts:
            self.client._flush_contexts()  # contexts of graphs dropped without backward
        version = kwargs.pop("version", self.version)
        target = kwargs.pop("target", self.target)
        requires_grad = kwargs.pop("requires_grad", None)
        record = self.definition(version)
        opdef = record.op
        inputs, groups, pb_attrs = self._bind(opdef, args, dict(kwargs))

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
        estimate = estimate_output_bytes(opdef, arrays)
        ns = self.namespace

        def go(st):
            req = exec_pb2.ForwardRequest(namespace=ns, op=self.name, version=version,
                                          target=target or "")
            for row in arrays:
                req.inputs.add().tensors.extend([st.tensor(a) for a in row])
            for k, v in pb_attrs.items():
                req.attrs[k].CopyFrom(v)
            if any(flags):
                req.requires_grad.extend(flags)
            req.outputs.extend(st.placements(estimate))
            resp = self.client._executor.Forward(req, timeout=self.client.timeout)
            return resp, st.results(resp.outputs)

        resp, outs = run_call(self.client, ns, go)
        if version == 0 and resp.version and resp.version != record.version:
            self.refresh()  # a newer version ran; map arguments with it next time

        if not wrap and not any(flags):
            return outs[0] if len(outs) == 1 else tuple(outs)
        results = [Tensor(o) for o in outs]
        if any(flags):
            graph_inputs = []
            for p, row in zip(inputs, tensors):
                ts = [v if isinstance(v, Tensor) else None for v in row]
                graph_inputs.append(ts if (p.param_type == "dynamic") else (ts[0] if ts else None))
            non_diff = set(opdef.backward.non_differentiable)
            node = OpNode(self, ns, resp.context_id, graph_inputs,
                          [(o.shape, o.dtype) for o in outs], opdef, record.version)
            for j, (t, p) in enumerate(zip(results, sorted(opdef.outputs, key=lambda q: q.index))):
                if p.name in non_diff:
                    continue
                t.grad_fn = node
                t._output_index = j
                t.requires_grad = True
        return results[0] if len(results) == 1 else tuple(results)


class OpNode(Node):
    """A forward kept on the server under context_id; backward is the Backward RPC."""

    def __init__(self, op, namespace, context_id, inputs, out_meta, opdef, version):
        super().__init__(inputs, out_meta)
        self.op = op
        self.namespace = namespace
        self.context_id = context_id
        self.bprop = opdef.backward.op
        self.version = version
        self._finalizer = None
        if context_id:
            self._finalizer = weakref.finalize(self, op.client._forget_context, namespace,
                                               context_id)

    def name(self):
        return "%sBackward" % self.op.name

    def apply(self, grads, retain_graph):
        client = self.op.client
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
        grads = [None if g is None else np.ascontiguousarray(g) for g in grads]
        estimate = sum(_align(a.nbytes) for row in self.inputs
                       for a in (row if isinstance(row, list) else [row])
                       if isinstance(a, Tensor)) + 64

        def go(st):
            req = exec_pb2.BackwardRequest(namespace=self.namespace, context_id=self.context_id,
                                           retain_context=bool(retain_graph))
            for g in grads:
                req.grad_outputs.append(exec_pb2.Tensor() if g is None else st.tensor(g))
            req.outputs.extend(st.placements(estimate))
            resp = client._executor.Backward(req, timeout=client.timeout)
            flat = [t for arg in resp.grad_inputs for t in arg.tensors]
            arrs = st.results(flat)
            return resp, arrs

        resp, arrs = run_call(client, self.namespace, go)
        if not retain_graph and self._finalizer is not None:
            self._finalizer.detach()  # the server dropped the context
        out, k = [], 0
        for i, arg in enumerate(resp.grad_inputs):
            n = len(arg.tensors)
            got = arrs[k:k + n]
            k += n
            slot = self.inputs[i] if i < len(self.inputs) else None
            if isinstance(slot, list):
                out.append(got if got else None)
            else:
                out.append(got[0] if got else None)
        while len(out) < len(self.inputs):
            out.append(None)
        return out


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
    inputs: one array (or list, for a dynamic input; None for an absent
    optional one) per declared input; None: random inputs of `random_shape`.
    atol/rtol/eps: 0 means the server's defaults. Returns GradCheckResult.
    """
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
    client = op.client
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

    def go(st):
        req = exec_pb2.GradCheckRequest(namespace=op.namespace, op=op.name,
                                        version=version or op.version, atol=atol, rtol=rtol,
                                        eps=eps, seed=seed,
                                        random_shape=list(random_shape or ()))
        for row in groups:
            req.inputs.add().tensors.extend([st.tensor(a) for a in row])
        for k, v in pb_attrs.items():
            req.attrs[k].CopyFrom(v)
        return client._executor.GradCheck(req, timeout=client.timeout)

    # The server perturbs the inputs itself, so GradCheck takes inline tensors only.
    return GradCheckResult(run_call(client, op.namespace, go, inline=True))

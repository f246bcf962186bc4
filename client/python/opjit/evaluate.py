"""Evaluating kernels in the daemon (the opjit.v1.Evaluator service): verify and bench.

    r = opjit.verify(client.op("scale_add"), "scale_add_ref")   # candidate against a reference
    assert r, r.table()
    t = opjit.bench("scale_add", "scale_add_ref", shape=[1 << 20], client=client)
    t.ratio, t.op.median_ms

Both run in the daemon, under the op's namespace (its executors, quotas and
the call's deadline). See client/python/README.md "Verify and bench".
"""

import json
import math
import numbers

import numpy as np

from opjit import _tensors as T
from opjit._proto import evaluate_pb2, exec_pb2
from opjit.errors import InvalidArgument
from opjit.op import Op, split_name

__all__ = ["verify", "bench", "VerifyResult", "VerifyCase", "BenchResult", "Timing"]


# ---- ops, clients, namespaces ---------------------------------------------------------

class _Target:
    """Where an evaluation goes: the client, its session of the namespace, and
    the ops as (name, version)."""

    def __init__(self, client, owned, namespace):
        self.client = client
        self.owned = owned          # made here: closed after the call
        self.namespace = namespace
        self._defs = {}

    def session(self):
        return self.client.session(self.namespace)

    def definition(self, op):
        """The OpDef of `op` (a (name, version, Op or None) triple), for attrs and inputs."""
        name, version, obj = op
        if obj is not None:
            return obj.definition(version).op
        key = (name, version)
        if key not in self._defs:
            self._defs[key] = self.client.describe("%s/%s" % (self.namespace or "default", name),
                                                   version).op
        return self._defs[key]

    def close(self):
        if self.owned:
            self.client.close()


def _op_ns(op):
    """(namespace or None, name, version, Op or None) of an Op or a name."""
    if isinstance(op, Op):
        return _norm_ns(op.namespace), op.name, op.version, op
    if isinstance(op, str) and op:
        if "/" in op:
            ns, name = split_name(op, None)
            return _norm_ns(ns), name, 0, None
        return None, op, 0, None
    raise InvalidArgument("an op is an opjit.Op or its name (\"name\" or \"namespace/name\"); "
                          "got %r" % (op,))


def _target(ops, namespace, client):
    """The _Target of a call on `ops` (the candidate first; None entries are
    left out), and each op as (name, version, Op or None).

    The client: `client`, else the first Op's, else a new opjit.Client()
    (closed after the call). An op's namespace: an Op's own, the one a name
    gives ("ns/name"), else `namespace`, else the client's (as client.op
    names them). The server runs both ops in one namespace: they must agree."""
    parsed = [_op_ns(op) for op in ops if op is not None]
    if client is None:
        client = next((p[3].client for p in parsed if p[3] is not None), None)
    owned = client is None
    if owned:
        from opjit.client import Client
        client = Client()
    try:
        default = _norm_ns(client.namespace if namespace is None else namespace)
        named = [default if p[0] is None else p[0] for p in parsed]
        if len(set(named)) > 1:
            raise InvalidArgument(
                "the ops are in different namespaces (%s): a reference must be an op of the "
                "candidate's namespace" % ", ".join(
                    "%s/%s" % (ns or "default", p[1]) for ns, p in zip(named, parsed)))
        return _Target(client, owned, named[0]), [(p[1], p[2], p[3]) for p in parsed]
    except BaseException:
        if owned:
            client.close()
        raise


def _norm_ns(ns):
    return "" if ns in (None, "default") else ns


def _ref(name_version):
    name, version, _ = name_version
    return evaluate_pb2.OpVersionRef(op=name, version=version or 0)


def _attrs(target, op, attrs):
    """{name: AttrValue}, typed by the op's declared attrs."""
    if not attrs:
        return {}
    defs = {a.name: a for a in target.definition(op).attrs}
    out = {}
    for k, v in attrs.items():
        d = defs.get(k)
        out[k] = T.attr_value(k, v, d.value_type if d is not None else "")
    return out


# ---- shapes, dtypes, cases ------------------------------------------------------------

def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _dims(shape, what):
    if _is_int(shape):
        return [int(shape)]
    try:
        dims = list(shape)
    except TypeError:
        raise InvalidArgument("%s: a shape is a list of ints; got %r" % (what, shape)) from None
    if not all(_is_int(d) for d in dims):
        raise InvalidArgument("%s: a shape is a list of ints; got %r" % (what, shape))
    return [int(d) for d in dims]


def shape_set(shapes, what="shape"):
    """A ShapeSet of one entry per input, or of one entry that stands for every
    input: `shapes` is a shape (ints: [1024], (4, 5); an int n is [n]) or a
    list of shapes, one per input ([[4, 5], [5]])."""
    if _is_int(shapes):
        return evaluate_pb2.ShapeSet(inputs=[exec_pb2.IntList(values=[int(shapes)])])
    try:
        items = list(shapes)
    except TypeError:
        raise InvalidArgument("%s: a shape or a list of shapes (one per input); got %r"
                              % (what, shapes)) from None
    if all(_is_int(d) for d in items):  # one shape (also (): a scalar) for every input
        return evaluate_pb2.ShapeSet(inputs=[exec_pb2.IntList(values=[int(d) for d in items])])
    return evaluate_pb2.ShapeSet(inputs=[
        exec_pb2.IntList(values=_dims(s, "%s[%d]" % (what, i))) for i, s in enumerate(items)])


def _shape_sets(shapes):
    if shapes is None:
        return []
    if _is_int(shapes):
        shapes = [shapes]
    return [shape_set(s, "shapes[%d]" % i) for i, s in enumerate(shapes)]


def _dtype_names(dtypes):
    if dtypes is None:
        return []
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = [dtypes]
    return [d if isinstance(d, str) else T.dtype_name(d) for d in dtypes]


def _input_names(target, op, inputs):
    """Input names of `inputs` (names, or indices of the op's declared inputs)."""
    if isinstance(inputs, (str, int)):
        inputs = [inputs]
    names = []
    for v in inputs or ():
        if _is_int(v):
            decl = sorted(target.definition(op).inputs, key=lambda p: p.index)
            if not 0 <= v < len(decl):
                raise InvalidArgument("inplace: input %d: the op declares %d inputs"
                                      % (v, len(decl)))
            names.append(decl[v].name)
        else:
            names.append(str(v))
    return names


def _given_case(decl, case, k):
    """A GivenCase from (inputs, outputs) or {"inputs": ..., "outputs": ...}:
    inputs one value per declared input (`decl`: the candidate's, in order;
    an array, a list of arrays for a dynamic input, None for an absent
    optional one); outputs an array or a list of them, one per output."""
    if isinstance(case, dict):
        inputs, outputs = case.get("inputs"), case.get("outputs")
    else:
        try:
            inputs, outputs = case
        except (TypeError, ValueError):
            raise InvalidArgument("given[%d]: a case is (inputs, outputs) or a dict with "
                                  "\"inputs\" and \"outputs\"" % k) from None
    if inputs is None or outputs is None:
        raise InvalidArgument("given[%d]: inputs and outputs are both needed" % k)
    pb = evaluate_pb2.GivenCase()
    for i, v in enumerate(inputs):
        arg = pb.inputs.add()
        dynamic = i < len(decl) and decl[i].param_type == "dynamic"
        if v is not None:
            arg.tensors.extend(T.inline_tensor(T.as_ndarray(a)) for a in (v if dynamic else [v]))
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    pb.outputs.extend(T.inline_tensor(T.as_ndarray(a, "output")) for a in outputs)
    return pb


# ---- results --------------------------------------------------------------------------

def _plain(v):
    """A JSON value: non-finite floats as proto3's JSON strings ("NaN", "Infinity")."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _g(v):
    return "%.3g" % v


class VerifyCase:
    """One case of a verify (opjit.v1.VerifyCase's fields as attributes, and
    as items: ``case.message`` or ``case["message"]``)."""

    FIELDS = tuple(f.name for f in evaluate_pb2.VerifyCase.DESCRIPTOR.fields)
    __slots__ = FIELDS

    def __init__(self, pb):
        for n in self.FIELDS:
            setattr(self, n, getattr(pb, n))

    def __getitem__(self, name):
        if name not in self.FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def keys(self):
        return list(self.FIELDS)

    def to_dict(self):
        return {n: getattr(self, n) for n in self.FIELDS}

    @property
    def status(self):
        return "skip" if self.skipped else ("ok" if self.passed else "FAIL")

    @property
    def compared(self):
        """Whether the worst element's values were compared: a case that failed
        before (an output never written, changed after return) says why in
        ``message``, and its value fields mean nothing."""
        return self.worst_index >= 0 and bool(self.max_abs_error or self.max_ulp_error
                                              or self.max_rel_error)

    def worst(self):
        """"output 0 [6]: candidate 1 vs reference 3" ("output 0 [6]" where no
        value was compared), or "" when no element was worst."""
        if self.worst_index < 0:
            return ""
        if not self.compared:
            return "output %d [%d]" % (self.worst_output, self.worst_index)
        return "output %d [%d]: candidate %.9g vs reference %.9g" % (
            self.worst_output, self.worst_index, self.candidate_value, self.reference_value)

    def __repr__(self):
        text = "VerifyCase(#%d %s %s %s: %s" % (self.index, self.kind, self.dtype, self.shapes,
                                                self.status)
        if self.worst():
            text += ", " + self.worst()
        if self.message:
            text += ", %r" % self.message
        return text + ")"


class VerifyResult:
    """What opjit.verify found: truthy when passed.

    passed, deterministic, seed (the base seed, to reproduce), cases_passed,
    cases_failed, cases_skipped, cases (VerifyCase), tolerances (one line per
    dtype), reproduce (an ``opjit verify`` command line), response (the
    opjit.v1.VerifyResponse). ``failures``: the cases that failed;
    ``table()``: the cases as text; ``to_json()``.
    """

    FIELDS = ("passed", "deterministic", "seed", "cases_passed", "cases_failed",
              "cases_skipped", "tolerances", "reproduce")

    def __init__(self, pb):
        self.response = pb
        for n in self.FIELDS:
            setattr(self, n, getattr(pb, n))
        self.tolerances = list(pb.tolerances)
        self.cases = [VerifyCase(c) for c in pb.cases]

    def __bool__(self):
        return bool(self.passed)

    @property
    def failures(self):
        return [c for c in self.cases if not c.passed and not c.skipped]

    def to_dict(self):
        d = {n: getattr(self, n) for n in self.FIELDS}
        d["cases"] = [c.to_dict() for c in self.cases]
        return d

    def to_json(self, indent=None):
        return json.dumps(_plain(self.to_dict()), indent=indent)

    def summary(self):
        head = "%s: %d passed, %d failed, %d skipped (seed %d%s)" % (
            "passed" if self.passed else "FAILED", self.cases_passed, self.cases_failed,
            self.cases_skipped, self.seed, "" if self.deterministic else ", not deterministic")
        bad = self.failures
        if bad:
            c = bad[0]
            head += "; first failure: case %d %s %s %s" % (c.index, c.kind, c.dtype, c.shapes)
            if c.worst():
                head += ", " + c.worst()
            if c.message:
                head += ": " + c.message
        return head

    def table(self):
        """The cases as a text table, then the tolerances, the seed and the command
        that reproduces the run."""
        head = ("#", "kind", "dtype", "shapes", "seed", "result", "det", "abs err", "rel err",
                "ulps", "worst", "candidate", "reference", "kernel ms", "message")
        rows = [head]
        for c in self.cases:
            worst = "" if c.worst_index < 0 else "%d[%d]" % (c.worst_output, c.worst_index)
            vals = ("", "") if not c.compared else (_g(c.candidate_value),
                                                     _g(c.reference_value))
            rows.append((str(c.index), c.kind, c.dtype, c.shapes, str(c.seed), c.status,
                         "yes" if c.deterministic else "NO", _g(c.max_abs_error),
                         _g(c.max_rel_error), _g(c.max_ulp_error), worst, vals[0], vals[1],
                         "%.3f" % c.candidate_kernel_ms, c.message))
        lines = [self.summary()] + _columns(rows)
        lines += ["tolerances: " + t for t in self.tolerances]
        if self.reproduce:
            lines.append("reproduce: " + self.reproduce)
        return "\n".join(lines)

    __str__ = table

    def __repr__(self):
        return "VerifyResult(%s)" % self.summary()


def _columns(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


class Timing:
    """opjit.v1.TimingStats as attributes: reps, median_ms, p10_ms, p90_ms,
    kernel_median_ms, kernel_p10_ms, kernel_p90_ms, spread."""

    FIELDS = tuple(f.name for f in evaluate_pb2.TimingStats.DESCRIPTOR.fields)
    __slots__ = FIELDS

    def __init__(self, pb):
        for n in self.FIELDS:
            setattr(self, n, getattr(pb, n))

    def to_dict(self):
        return {n: getattr(self, n) for n in self.FIELDS}

    def __repr__(self):
        return "Timing(reps=%d, median_ms=%.4g, p10_ms=%.4g, p90_ms=%.4g, kernel_median_ms=%.4g, " \
               "spread=%.3g)" % (self.reps, self.median_ms, self.p10_ms, self.p90_ms,
                                 self.kernel_median_ms, self.spread)


class BenchResult:
    """What opjit.bench measured: ``op`` and ``reference`` (Timing; reference
    None without one), ``ratio`` with ``ratio_p10``/``ratio_p90`` (op /
    reference kernel times of runs in alternation; 0 without a reference),
    flush_bytes, shapes, reproduce, response (opjit.v1.BenchmarkResponse);
    ``table()``, ``to_json()``."""

    FIELDS = ("ratio", "ratio_p10", "ratio_p90", "flush_bytes", "shapes", "reproduce")

    def __init__(self, pb):
        self.response = pb
        for n in self.FIELDS:
            setattr(self, n, getattr(pb, n))
        self.op = Timing(pb.op)
        self.reference = Timing(pb.reference) if pb.HasField("reference") else None

    def to_dict(self):
        d = {n: getattr(self, n) for n in self.FIELDS}
        d["op"] = self.op.to_dict()
        d["reference"] = self.reference.to_dict() if self.reference is not None else None
        return d

    def to_json(self, indent=None):
        return json.dumps(_plain(self.to_dict()), indent=indent)

    def table(self):
        rows = [("", "reps", "median ms", "p10 ms", "p90 ms", "kernel median ms",
                 "kernel p10 ms", "kernel p90 ms", "spread")]
        for name, t in (("op", self.op), ("reference", self.reference)):
            if t is not None:
                rows.append((name, str(t.reps)) + tuple(
                    "%.4g" % v for v in (t.median_ms, t.p10_ms, t.p90_ms, t.kernel_median_ms,
                                         t.kernel_p10_ms, t.kernel_p90_ms, t.spread)))
        lines = ["shapes: " + self.shapes] + _columns(rows)
        if self.reference is not None:
            lines.append("ratio op/reference: %.4g (p10 %.4g, p90 %.4g)"
                         % (self.ratio, self.ratio_p10, self.ratio_p90))
        if self.flush_bytes:
            lines.append("cache flush: %d bytes per repetition" % self.flush_bytes)
        if self.reproduce:
            lines.append("reproduce: " + self.reproduce)
        return "\n".join(lines)

    __str__ = table

    def __repr__(self):
        text = "BenchResult(op=%r" % (self.op,)
        if self.reference is not None:
            text += ", reference=%r, ratio=%.4g [%.4g, %.4g]" % (
                self.reference, self.ratio, self.ratio_p10, self.ratio_p90)
        return text + ")"


# ---- the calls ------------------------------------------------------------------------

def verify(candidate, against=None, *, given=None, shapes=None, dtypes=None, seeds=None,
           seed=None, low=None, high=None, special_values=True, atol=None, rtol=None, ulps=None,
           fp64_reference=False, inplace=(), attrs=None, settle_ms=None, namespace=None,
           client=None):
    """Verifies an op against a reference op, or against given outputs, in the daemon
    (the Verify RPC). Returns a VerifyResult (truthy when every case that ran passed).

    candidate, against: opjit.Op objects or names ("ns/name"; a bare "name" is
      of `namespace`, else the client's), both of one namespace.
    given: instead of `against`, cases as (inputs, outputs): inputs one array
      per declared input (a list for a dynamic input, None for an absent
      optional one), outputs an array or a list of them.
    shapes: shape sets to run on, each a shape for every input ([1031]; an
      int n is [n]) or a list of shapes, one per input ([[4, 5], [5]]).
      None: the server's edge cases (empty, 1, odd and prime sizes, a large one).
    dtypes: dtype rows to run (by the first input's dtype); None: every row
      both ops accept.
    seeds: random cases per shape and dtype (None: 2); seed: the base seed
      (None or 0: a fresh one, reported as ``.seed``).
    low, high: random inputs are uniform in [low, high] (None: the server's
      range for the dtype; give both or neither).
    special_values: a case per shape with NaN, ±Inf, -0.0, denormals, max and
      lowest (floats).
    atol, rtol, ulps: an element passes when |c - r| <= atol + rtol * |r| or
      when c and r are at most `ulps` units in the last place apart; None: the
      dtype's default. Integers and bool compare exactly.
    fp64_reference: run the reference in float64 where it accepts float64.
    inplace: inputs (names or indices) the candidate may change; the others
      must come back unchanged.
    attrs: {name: value}, typed by the candidate's declared attrs.
    settle_ms: how long after a call its outputs are read again (None: 10).
    client: the opjit.Client (default: an Op's, else a new opjit.Client()).

    A failing case is a result, not an error. Errors: NotFound (an unknown
    op), InvalidArgument (a bad request: a reference with other inputs,
    a shape set that does not fit), ResourceExhausted (too many cases, too
    big a shape), DeadlineExceeded (the client's timeout), Unimplemented (a
    daemon without the Evaluator service).
    """
    if against is not None and given is not None:
        raise InvalidArgument("verify: give a reference op (against) or given cases, not both")
    if against is None and given is None:
        raise InvalidArgument("verify: give a reference op (against) or given cases")
    if (low is None) != (high is None):
        raise InvalidArgument("verify: give low and high together (neither: the dtype's range)")
    target, ops = _target([candidate, against], namespace, client)
    try:
        req = evaluate_pb2.VerifyRequest(
            namespace=target.namespace, candidate=_ref(ops[0]), shapes=_shape_sets(shapes),
            dtypes=_dtype_names(dtypes), seeds=int(seeds or 0), seed=int(seed or 0),
            low=float(low or 0.0), high=float(high or 0.0), special_values=bool(special_values),
            fp64_reference=bool(fp64_reference),
            inplace_inputs=_input_names(target, ops[0], inplace),
            settle_ms=int(settle_ms or 0))
        if len(ops) > 1:
            req.reference.CopyFrom(_ref(ops[1]))
        else:
            decl = sorted(target.definition(ops[0]).inputs, key=lambda p: p.index)
            req.given.extend(_given_case(decl, c, k) for k, c in enumerate(given))
        for name, value in (("atol", atol), ("rtol", rtol), ("ulps", ulps)):
            if value is not None:
                setattr(req.tolerance, name, int(value) if name == "ulps" else float(value))
        for k, v in _attrs(target, ops[0], attrs).items():
            req.attrs[k].CopyFrom(v)
        return VerifyResult(target.session().verify(req))
    finally:
        target.close()


def bench(op, against=None, *, shape=None, dtype=None, warmup=None, min_reps=None,
          max_reps=None, min_time_ms=None, flush_cache=False, seed=None, attrs=None,
          namespace=None, client=None):
    """Times an op in the daemon (the Benchmark RPC), and `against` (a reference
    op) in alternation with it. Returns a BenchResult.

    op, against, namespace, client, attrs: as for verify.
    shape: a shape for every input ([1 << 20]; an int n is [n]) or a list of
      shapes, one per input; None: every input [1048576].
    dtype: the dtype row (by the first input's dtype); None: the first row.
    warmup (default 5), min_reps (10), max_reps (1000), min_time_ms (500):
      calls before timing, and how many timed repetitions: at least min_reps
      and min_time_ms, at most max_reps.
    flush_cache: sweep a buffer larger than the last-level cache before every
      repetition, so each starts cold.
    seed: of the generated inputs (None: the server's).
    """
    target, ops = _target([op, against], namespace, client)
    try:
        req = evaluate_pb2.BenchmarkRequest(
            namespace=target.namespace, op=_ref(ops[0]),
            dtype=_dtype_names(dtype)[0] if dtype is not None else "", seed=int(seed or 0),
            warmup=int(warmup or 0), min_reps=int(min_reps or 0), max_reps=int(max_reps or 0),
            min_time_ms=int(min_time_ms or 0), flush_cache=bool(flush_cache))
        if shape is not None:
            req.shape.CopyFrom(shape_set(shape))
        if len(ops) > 1:
            req.reference.CopyFrom(_ref(ops[1]))
        for k, v in _attrs(target, ops[0], attrs).items():
            req.attrs[k].CopyFrom(v)
        return BenchResult(target.session().benchmark(req))
    finally:
        target.close()

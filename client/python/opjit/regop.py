"""CustomRegOp: MindSpore's op-info builder, producing an opjit OpDef dict.

    info = (CustomRegOp("leaky_relu")
            .input(0, "x", "required")
            .output(0, "y", "required")
            .attr("alpha", "optional", "float", "0.01")
            .dtype_format(DataType.F32_Default, DataType.F32_Default)
            .dtype_format(DataType.F16_Default, DataType.F16_Default)
            .target("CPU")
            .impl(source_file="leaky_relu.cc", entry="CustomLeakyRelu")
            .output_rule("same_as", input=0)
            .bprop("leaky_relu_grad")
            .get_op_info())
    client.register(info)

get_op_info() returns protobuf's JSON mapping of opjit.v1.OpDef (snake_case
keys), the same dict Client.register takes.

MindSpore parity (what MindSpore's CustomRegOp accepts, and what it means here):

- ``CustomRegOp(op_name="Custom")``: MindSpore's default "Custom" is a
  placeholder (MindSpore names the op after the Custom primitive's function).
  An op left unnamed takes its name when registered: ``client.register(info,
  name="my_op")``, else the entry of its implementation (``impl(...,
  entry="CustomAdd")`` registers op "CustomAdd"), as MindSpore names an aot op
  after its function ("add.so:CustomAdd"). With no implementation entry, or
  implementations naming different entries, registration is refused with a
  message saying how to name it (see resolve_name).
- A list of infos (MindSpore's ``reg_info`` list), ``client.register([io_info,
  attr_info, impl_info])``, is merged into one op before registering: so an
  attr-only info (MindSpore's ``add_cpu_info_attr_only``) adds its attrs to
  the inputs and outputs another info declares (see merge_op_defs).
- ``input(index, name, param_type)`` / ``output(...)``: param_type None means
  "required". Outputs cannot be optional. Inputs (and outputs) are positional
  in the order they are declared, as in MindSpore, whose op library takes the
  k-th declared input's dtypes from column k of each dtype_format row and
  keeps ``index`` only as a label: get_op_info() numbers them 0..n-1 in
  declaration order, so upstream's fused kernel registration
  ``.input(0, "x1").input(0, "x2")`` (a repeated index) declares inputs x1
  and x2, in that order. (The server itself stays strict: a hand-written
  spec must index them 0..n-1 in order.)
- ``attr(name, param_type, value_type, default_value=None, value=V)``:
  ``value=`` (MindSpore's attr value for the op, passed through **kwargs) is
  stored as the attr's ``default_value``: the value a call gets when it does
  not pass the attr (a call may still pass one). Giving both value= and a
  different default_value is refused. MindSpore's list defaults "1,2,3" are
  sent as JSON lists ("[1, 2, 3]"). value_type "all" (any kind) is accepted:
  the value keeps the kind it comes with (see server/registry/attr_value.h).
  Other keyword arguments are MindSpore extension info that opjit has no use
  for: they are ignored with a warning, never silently.
- ``dtype_format(*args)`` takes every DataType constant. ``DataType.None_*``
  (an empty dtype) at a required or dynamic input means any dtype (and any
  format), as in MindSpore: the kernel checks what it gets. At an optional
  input it marks the input absent: the combination applies when that input is
  not given. At an output it means the output rule's ``dtype``, else the
  dtype of the call's first input given. Ascend's blocked formats (5HD, FracZ,
  ...) and complex/bfloat16 dtypes are not served: get_op_info() refuses those
  with the server's own message.
- ``target("CPU" | "GPU")``; MindSpore's "Ascend" is refused.
"""

import copy
import json
import os
import warnings

from opjit import _tensors as T
from opjit.errors import InvalidArgument

__all__ = ["CustomRegOp", "DataType"]

_PARAM_TYPES = ("required", "optional", "dynamic")
# The server's spellings (server/registry/op_def.cc), in its order.
_VALUE_TYPES = ("bool", "int", "float", "str", "listInt", "listFloat", "listBool", "listStr",
                "listListInt", "listListFloat", "all")
_LIST_TYPES = ("listInt", "listFloat", "listBool", "listStr")
# server/registry/op_def.cc KnownDtypes() and validate.cc KnownFormats(), in their order.
_KNOWN_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                 "uint16", "uint32", "uint64", "bool")
_KNOWN_FORMATS = ("DefaultFormat", "ND", "NCHW", "NHWC", "NCDHW", "NDHWC", "HWCN", "DHWCN",
                  "ChannelLast")
# MindSpore's placeholder name (CustomRegOp's default op_name).
_PLACEHOLDER_NAME = "Custom"


class DataType:
    """(dtype, format) pairs for dtype_format, named as in MindSpore: F32_Default, I64_NCHW...

    Every MindSpore constant exists. ``None_None`` / ``None_Default`` (an empty
    dtype): any dtype at a required or dynamic input and at an output (the
    kernel checks); an absent optional input.
    """

    None_None = ("", "")
    None_Default = ("", "DefaultFormat")


_PREFIX = {"BOOL": "bool", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
           "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
           "F16": "float16", "F32": "float32", "F64": "float64",
           # MindSpore names these too; opjit does not serve them.
           "BF16": "bfloat16", "C64": "complex64", "C128": "complex128"}
_FORMATS = {"None": "", "Default": "DefaultFormat", "ND": "ND", "NCHW": "NCHW", "NHWC": "NHWC",
            "NCDHW": "NCDHW", "NDHWC": "NDHWC", "HWCN": "HWCN", "DHWCN": "DHWCN",
            "ChannelLast": "ChannelLast",
            # Ascend's blocked layouts: MindSpore names them; opjit does not serve them.
            "5HD": "NC1HWC0", "NC1HWC0": "NC1HWC0", "FracZ": "FRACTAL_Z", "FracNZ": "FRACTAL_NZ",
            "C1HWNCoC0": "C1HWNCoC0", "NDC1HWC0": "NDC1HWC0", "FRACTAL_Z_3D": "FRACTAL_Z_3D",
            "FracZNLSTM": "FRACTAL_ZN_LSTM", "FracZNRNN": "FRACTAL_ZN_RNN",
            "ND_RNNBIAS": "ND_RNN_BIAS"}
for _p, _dt in _PREFIX.items():
    for _s, _fmt in _FORMATS.items():
        setattr(DataType, "%s_%s" % (_p, _s), (_dt, _fmt))
del _p, _dt, _s, _fmt


def _q(s):
    """The server's quoting of a value in a validation message (validate.cc Q)."""
    return '"%s..."' % s[:80] if len(s) > 80 else '"%s"' % s


def _unknown(field, value, expected):
    """The server's message for an unknown enum spelling (server/rpc/convert.cc)."""
    return InvalidArgument('%s: unknown "%s" (expected %s)' % (field, value, expected))


def _text_kind(s):
    """The kind the server reads text as under value_type "all" (attr_value.cc), roughly:
    "bool", "int", "float", "list", "mixed list" or "str"."""
    t = s.strip(" \t\r\n")
    if t in ("true", "false", "True", "False"):
        return "bool"
    u = t[1:] if t.startswith("+") else t
    if u and (u.isdigit() or (u[0] == "-" and u[1:].isdigit())):
        return "int"
    try:
        float(u)
        if "_" not in u and u.strip() == u:
            return "float"
    except ValueError:
        pass
    if t.startswith("["):
        try:
            v = json.loads(t)
        except ValueError:
            return "str"
        if isinstance(v, list):
            return "list" if _one_kind(v) else "mixed list"
    return "str"


_A_KIND = {"bool": "a bool", "int": "an int", "float": "a float", "list": "a list",
           "mixed list": "a list"}


def _one_kind(v):
    """Whether a JSON list is of one kind, as the server's "all" inference wants."""
    def kind(x):
        if isinstance(x, bool):
            return "bool"
        if isinstance(x, (int, float)):
            return "num"
        if isinstance(x, str):
            return "str"
        if isinstance(x, list) and all(isinstance(e, (int, float)) and not isinstance(e, bool)
                                       for e in x):
            return "row"
        return "other"
    kinds = {kind(x) for x in v}
    return len(kinds) <= 1 and "other" not in kinds


def _files_json(files):
    """impl(files=...) as the spec's JSON list of {"path"} / {"name", "content"}."""
    if isinstance(files, dict):
        return [{"name": str(n), "content": c} for n, c in files.items()]
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out = []
    for f in files:
        if isinstance(f, (str, os.PathLike)):
            out.append({"path": os.fspath(f)})
        elif isinstance(f, dict) and set(f) <= {"name", "content", "path"} and f:
            out.append({k: (os.fspath(v) if k == "path" else v) for k, v in f.items()})
        else:
            raise InvalidArgument("impl: each of files is a path or a dict with name and content "
                                  "(or path); got %r" % (f,))
    return out


class OpInfo(dict):
    """What get_op_info() returns: the OpDef dict, plus ``target``, the target the
    info names (``CustomRegOp.target(...)``; None when it names none), which the
    dict cannot carry when the info has no implementation. opjit.mindspore's
    Custom uses it to pick the infos of the target it runs on, as MindSpore does
    with a list of CPU and GPU infos."""

    target = None


class CustomRegOp:
    """Builder of an op's registration info (MindSpore's CustomRegOp API, plus opjit's extras).

    Methods return self so calls chain. ``target(t)`` selects the target that
    the next ``impl(...)`` describes; ``dtype_format`` rows apply to the op.
    """

    def __init__(self, op_name="Custom"):
        if not isinstance(op_name, str):
            raise InvalidArgument("CustomRegOp: op_name must be a str, got %s"
                                  % type(op_name).__name__)
        if "/" in op_name:
            ns, op_name = op_name.split("/", 1)
        else:
            ns = ""
        self._info = {"name": op_name}
        if ns:
            self._info["namespace"] = ns
        self._inputs = []
        self._outputs = []
        self._attrs = []
        self._dtype_formats = []
        self._impls = []
        self._rules = []
        self._target = None
        self._backward = None

    # -- tensors and attrs (MindSpore signatures)

    def input(self, index=None, name=None, param_type="required", **kwargs):
        p = self._param("inputs", self._inputs, index, name, param_type)
        self._ignored("input(%s)" % p["name"], kwargs)
        self._inputs.append(p)
        return self

    def output(self, index=None, name=None, param_type="required", **kwargs):
        p = self._param("outputs", self._outputs, index, name, param_type)
        if p["param_type"] == "optional":
            raise InvalidArgument("outputs[%d].param_type: an output cannot be optional "
                                  "(use required or dynamic)" % p["index"])
        self._ignored("output(%s)" % p["name"], kwargs)
        self._outputs.append(p)
        return self

    @staticmethod
    def _param(what, existing, index, name, param_type):
        if index is None:
            index = len(existing)
        if name is None:
            name = "%s%d" % (what[0], index)
        param_type = param_type or "required"
        if param_type not in _PARAM_TYPES:
            raise _unknown("%s[%d].param_type" % (what, int(index)), param_type,
                           "required, optional or dynamic")
        return {"index": int(index), "name": str(name), "param_type": param_type}

    @staticmethod
    def _ignored(where, kwargs):
        if kwargs:
            warnings.warn("CustomRegOp.%s: opjit does not use %s (MindSpore extension info); "
                          "ignored" % (where, ", ".join("%s=%r" % kv for kv in sorted(kwargs.items()))),
                          UserWarning, stacklevel=3)

    def attr(self, name=None, param_type=None, value_type=None, default_value=None, **kwargs):
        """An attr. MindSpore's ``value=V`` keyword sets the attr's value for the op; opjit
        stores it as the default_value (what a call gets when it leaves the attr out)."""
        i = len(self._attrs)
        if not name:
            raise InvalidArgument("attrs[%d].name: must not be empty" % i)
        param_type = param_type or "required"
        if param_type not in _PARAM_TYPES:
            raise _unknown("attrs[%d].param_type" % i, param_type, "required, optional or dynamic")
        if param_type == "dynamic":
            raise InvalidArgument("attrs[%d].param_type: an attr must be required or optional, "
                                  "not dynamic" % i)
        if value_type not in _VALUE_TYPES:
            raise _unknown("attrs[%d].value_type" % i, value_type or "",
                           ", ".join(_VALUE_TYPES[:-1]) + " or " + _VALUE_TYPES[-1])
        has_value = "value" in kwargs and kwargs["value"] is not None
        value = kwargs.pop("value", None)
        self._ignored("attr(%s)" % name, kwargs)
        a = {"name": name, "param_type": param_type, "value_type": value_type}
        text = self._default_text(value_type, default_value)
        if has_value:
            vtext = self._value_text(name, value_type, value)
            if text and text != vtext:
                raise InvalidArgument(
                    "attr %s: value=%r and default_value=%r disagree; opjit stores value= as the "
                    "attr's default_value, so give one of them" % (name, value, default_value))
            text = vtext
        if text:
            if value_type == "all" and _text_kind(text) == "mixed list":
                # The server's message (validate.cc, attr_value.cc).
                quoted = '"%s..."' % text[:64] if len(text) > 64 else '"%s"' % text
                raise InvalidArgument(
                    "attrs[%d].default_value: %s is not a valid all (expected a value of any kind "
                    "(bool, int, float, str or a list of one kind), got a list that mixes kinds "
                    "%s)" % (i, _q(text), quoted))
            a["default_value"] = text
        self._attrs.append(a)
        return self

    @staticmethod
    def _default_text(value_type, default_value):
        """default_value as the registry's text; MindSpore's "1,2,3" list form becomes JSON."""
        if default_value is None:
            return ""
        if (isinstance(default_value, str) and value_type in _LIST_TYPES
                and default_value.strip() and not default_value.strip().startswith("[")):
            items = [x.strip() for x in default_value.split(",")]
            if value_type == "listStr":
                return json.dumps(items)
            if value_type == "listBool":
                items = [x.lower() if x in ("True", "False") else x for x in items]
            return "[" + ", ".join(items) + "]"
        return T.default_text(default_value)

    @staticmethod
    def _value_text(name, value_type, value):
        if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
            value = value.tolist()  # numpy scalars and arrays
        text = T.default_text(value)
        if value_type == "all" and isinstance(value, str) and _text_kind(value) != "str":
            raise InvalidArgument(
                "attr %s: value=%r is a str, but under value_type \"all\" its text reads as %s; "
                "declare value_type \"str\"" % (name, value, _A_KIND[_text_kind(value)]))
        return text

    def dtype_format(self, *args):
        """One supported combination: a (dtype, format) pair per input then per output."""
        dtypes, formats = [], []
        for a in args:
            if isinstance(a, str):
                a = (a, "")
            if not isinstance(a, (tuple, list)) or len(a) != 2:
                raise InvalidArgument("dtype_format: each argument is a (dtype, format) pair "
                                      "such as DataType.F32_Default; got %r" % (a,))
            dtypes.append(a[0] or "")
            formats.append(a[1] or "")
        row = {"dtypes": dtypes}
        if any(formats):
            row["formats"] = [f or "DefaultFormat" for f in formats]
        self._dtype_formats.append(row)
        return self

    def target(self, target=None):
        """The target the next impl() describes: "CPU" or "GPU" (None: CPU)."""
        if target is not None and target not in ("CPU", "GPU", "cpu", "gpu"):
            raise _unknown("implementations[%d].target" % len(self._impls), target, "CPU or GPU")
        self._target = target.upper() if target else None
        return self

    # -- opjit extras

    def impl(self, source=None, entry=None, language=None, source_file=None, compile_options=(),
             libraries=(), attr_names=(), target=None, files=()):
        """The implementation for the current target (default CPU).

        ``files``: the kernel's extra files (headers it includes; for CPU also
        .c/.cc/.cpp/.cxx translation units linked with it). Each is a path (read
        at register time, relative to the spec's base directory, and named by
        that path: ``#include "detail/x.h"``), a dict ``{"name": ..., "content":
        ...}`` or ``{"path": ..., "name": ...}``; or give a dict mapping names to
        contents."""
        t = target or self._target or "CPU"
        if any(i["target"] == t for i in self._impls):
            raise InvalidArgument("one implementation per target: %s has one already" % t)
        if (source is None) == (source_file is None):
            raise InvalidArgument("impl: give exactly one of source and source_file")
        i = {"target": t, "language": language or ("cuda" if t == "GPU" else "c++")}
        if source is not None:
            i["source"] = source
        else:
            i["source_file"] = str(source_file)
        if entry:
            i["entry"] = entry
        if compile_options:
            i["compile_options"] = list(compile_options)
        if libraries:
            i["libraries"] = list(libraries)
        if attr_names:
            i["attr_names"] = list(attr_names)
        if files:
            i["files"] = _files_json(files)
        self._impls.append(i)
        return self

    def output_rule(self, kind="same_as", input=None, inputs=None, axis_attr=None, keep_dim=None,
                    keep_dim_attr=None, shape=None, dtype=None):
        """How the next output's shape/dtype is derived: same_as, broadcast, reduce,
        explicit or infer_shape (one call per output, in order)."""
        r = {"kind": kind}
        if input is not None:
            r["input"] = int(input)
        if inputs is not None:
            r["inputs"] = [int(i) for i in inputs]
        if axis_attr:
            r["axis_attr"] = axis_attr
        if keep_dim is not None:
            r["keep_dim"] = bool(keep_dim)
        if keep_dim_attr:
            r["keep_dim_attr"] = keep_dim_attr
        if shape is not None:
            r["shape"] = [int(d) for d in shape]
        if dtype:
            r["dtype"] = dtype
        self._rules.append(r)
        return self

    def bprop(self, op, save_for_backward=(), non_differentiable=(), materialize_grads=None,
              inputs=None, stop_gradient_grads=None):
        """The backward: another registered op returning one gradient per input.

        By default it takes (inputs..., outputs..., output grads...), MindSpore's
        ``bprop(x, out, dout)``; ``inputs`` names the ones it takes, in order, e.g.
        ``["x", "dout"]`` for ``square_grad(x, dout)`` (an input or output name,
        "grad:NAME" for an output's grad, "out"/"dout" for all outputs / grads).
        ``stop_gradient_grads``: "warn" (default) or "error" when it returns a
        nonzero grad for an input that needs none. It may be registered later:
        registering before it exists succeeds with a warning, and the two are
        checked against each other when both are registered."""
        b = {"op": op}
        if inputs is not None:
            b["inputs"] = list(inputs)
        if stop_gradient_grads is not None:
            b["stop_gradient_grads"] = str(stop_gradient_grads)
        if save_for_backward:
            b["save_for_backward"] = list(save_for_backward)
        if non_differentiable:
            b["non_differentiable"] = list(non_differentiable)
        if materialize_grads is not None:
            b["materialize_grads"] = bool(materialize_grads)
        self._backward = b
        return self

    def doc(self, text):
        self._info["doc"] = text
        return self

    def namespace(self, ns):
        self._info["namespace"] = ns
        return self

    # -- the result

    def _check(self, inputs, outputs):
        """What the server would refuse in the MindSpore-facing parts, with its messages."""
        for what, params in (("inputs", inputs), ("outputs", outputs)):
            for i, p in enumerate(params):
                if p["index"] != i:
                    raise InvalidArgument("%s[%d].index: is %d, expected %d (%s are indexed "
                                          "0..n-1 in order)" % (what, i, p["index"], i, what))
        want = len(inputs) + len(outputs)
        for r, row in enumerate(self._dtype_formats):
            dtypes = row["dtypes"]
            formats = row.get("formats", ["DefaultFormat"] * len(dtypes))
            if len(dtypes) != want:
                raise InvalidArgument(
                    "dtype_formats[%d] has %d (dtype, format) pairs, but the op has %d inputs + "
                    "%d outputs = %d" % (r, len(dtypes), len(inputs), len(outputs), want))
            for k, (dtype, fmt) in enumerate(zip(dtypes, formats)):
                is_input = k < len(inputs)
                p = inputs[k] if is_input else outputs[k - len(inputs)]
                path = "dtype_formats[%d][%d] (%s %s)" % (r, k, "input" if is_input else "output",
                                                          p["name"])
                known = "; known dtypes: " + ", ".join(_KNOWN_DTYPES)
                if dtype == "":
                    # MindSpore's DataType.None_None: any dtype (an absent optional input).
                    j = k - len(inputs)
                    if is_input or inputs or (j < len(self._rules) and self._rules[j].get("dtype")):
                        continue
                    raise InvalidArgument(
                        "%s: an empty dtype (MindSpore's DataType.None_None) at an output means "
                        "its output rule's dtype, else the dtype of the call's first input; the "
                        "op has no inputs and no output rule dtype for output %s%s"
                        % (path, _q(p["name"]), known))
                if dtype not in _KNOWN_DTYPES:
                    raise InvalidArgument("%s: unknown dtype %s%s" % (path, _q(dtype), known))
                if fmt and fmt not in _KNOWN_FORMATS:
                    raise InvalidArgument(
                        "%s: unknown format %s; known formats: %s (empty means DefaultFormat)"
                        % (path, _q(fmt), ", ".join(_KNOWN_FORMATS)))

    def get_op_info(self):
        """The op as a dict in protobuf's JSON mapping of opjit.v1.OpDef (an OpInfo,
        whose ``.target`` is the target named by the last ``target(...)``, or None).

        Refuses (InvalidArgument, with the server's message) what the server
        would refuse in the MindSpore-facing parts. An op left unnamed (MindSpore's
        placeholder "Custom") has no "name" key: Client.register names it (see
        resolve_name).
        """
        # MindSpore's positional order: declaration order, whatever the indexes say.
        inputs = [dict(p, index=i) for i, p in enumerate(self._inputs)]
        outputs = [dict(p, index=i) for i, p in enumerate(self._outputs)]
        self._check(inputs, outputs)
        info = OpInfo(copy.deepcopy(self._info))
        info.target = self._target
        if info.get("name") == _PLACEHOLDER_NAME:
            del info["name"]  # unnamed: named when registered (see resolve_name)
        for key, rows in (("inputs", inputs), ("outputs", outputs),
                          ("attrs", self._attrs), ("dtype_formats", self._dtype_formats),
                          ("implementations", self._impls), ("output_rules", self._rules)):
            if rows:
                info[key] = copy.deepcopy(rows)
        if self._backward:
            info["backward"] = dict(self._backward)
        return info


# ---- merging infos and naming the op (used by Client.register / load_spec) ------------------

def merge_op_defs(defs):
    """One opjit.v1.OpDef from several (MindSpore's ``reg_info`` list), in order.

    - name, namespace: the one they give (an unnamed info gives none); two
      different ones are refused.
    - inputs, outputs, output_rules, backward: from the info that declares
      them; two infos declaring different ones are refused (the same ones
      twice are fine).
    - attrs: the union, by name, in order; one attr declared differently
      twice is refused.
    - dtype_formats, implementations: concatenated (a repeated
      dtype_format counts once); the server checks the result as any op.
    - doc: the first given.

    So an attr-only info (MindSpore's ``add_cpu_info_attr_only``) merges with
    the info that declares the op's inputs and outputs.
    """
    from opjit._proto import op_pb2
    defs = list(defs)
    out = op_pb2.OpDef()
    if not defs:
        raise InvalidArgument("register: an empty list of infos (give at least one)")

    def where(i):
        return "reg_info[%d]" % i

    def one(field, i, d, present):
        if not present(d):
            return
        if present(out):
            if getattr(out, field) != getattr(d, field):
                first = next(k for k, e in enumerate(defs) if present(e))
                raise InvalidArgument(
                    "register: %s and %s both declare the op's %s, differently; declare them "
                    "in one info (an attr-only info, like MindSpore's attr-only reg_info, "
                    "declares only attrs)" % (where(first), where(i), field))
            return
        if field == "backward":
            out.backward.CopyFrom(d.backward)
        else:
            getattr(out, field).extend(getattr(d, field))

    for i, d in enumerate(defs):
        for field in ("namespace", "name"):
            if getattr(d, field) and getattr(out, field) and getattr(d, field) != getattr(out, field):
                raise InvalidArgument(
                    "register: the infos give the op two %ss, %s and %s (%s); give one, or "
                    "register(..., name=\"ns/name\")" % (field, _q(getattr(out, field)),
                                                          _q(getattr(d, field)), where(i)))
            if getattr(d, field):
                setattr(out, field, getattr(d, field))
        one("inputs", i, d, lambda e: len(e.inputs) > 0)
        one("outputs", i, d, lambda e: len(e.outputs) > 0)
        one("output_rules", i, d, lambda e: len(e.output_rules) > 0)
        one("backward", i, d, lambda e: e.HasField("backward"))
        for a in d.attrs:
            prev = next((x for x in out.attrs if x.name == a.name), None)
            if prev is None:
                out.attrs.add().CopyFrom(a)
            elif prev != a:
                raise InvalidArgument(
                    "register: attr %s is declared differently in %s and an earlier info"
                    % (_q(a.name), where(i)))
        for row in d.dtype_formats:
            if row not in out.dtype_formats:
                out.dtype_formats.add().CopyFrom(row)
        out.implementations.extend(d.implementations)
        if d.doc and not out.doc:
            out.doc = d.doc
    return out


def resolve_name(op, name=None):
    """Names `op` (an opjit.v1.OpDef) in place, MindSpore's way for an unnamed op.

    ``name`` ("op" or "ns/op") wins. Else an op without a name (an unnamed
    ``CustomRegOp()``, whose "Custom" is MindSpore's placeholder) takes the
    entry of its implementation(s): MindSpore names an aot Custom op after its
    function, "add.so:CustomAdd" -> CustomAdd. With no entry to take, or
    implementations naming different entries, InvalidArgument says so.
    """
    if name:
        if not isinstance(name, str):
            raise InvalidArgument("register: name must be a str, got %s" % type(name).__name__)
        if "/" in name:
            op.namespace, op.name = name.split("/", 1)
        else:
            op.name = name
        return op
    if op.name:
        return op
    entries = []
    for impl in op.implementations:
        if impl.entry and impl.entry not in entries:
            entries.append(impl.entry)
    if len(entries) == 1:
        op.name = entries[0]
        return op
    why = ("its implementations name different entries (%s)" % ", ".join(entries) if entries
           else "it has no implementation entry to take it from")
    raise InvalidArgument(
        "CustomRegOp: the op has no name, and %s. An unnamed CustomRegOp() (\"Custom\" is "
        "MindSpore's placeholder) takes the name of its implementation's entry, as MindSpore "
        "names a Custom op after its function; name it: CustomRegOp(\"my_op\") or "
        "client.register(info, name=\"my_op\")" % why)

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
"""

import copy

from opjit import _tensors as T
from opjit.errors import InvalidArgument

__all__ = ["CustomRegOp", "DataType"]

_PARAM_TYPES = ("required", "optional", "dynamic")
_VALUE_TYPES = ("bool", "int", "float", "str", "listInt", "listFloat", "listBool", "listStr",
                "listListInt", "listListFloat")


class DataType:
    """(dtype, format) pairs for dtype_format, named as in MindSpore: F32_Default, I64_NCHW...

    ``None_None`` / ``None_Default`` are accepted as in MindSpore (an empty dtype).
    """

    None_None = ("", "")
    None_Default = ("", "DefaultFormat")


_PREFIX = {"BOOL": "bool", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
           "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
           "F16": "float16", "F32": "float32", "F64": "float64"}
_FORMATS = {"Default": "DefaultFormat", "ND": "ND", "NCHW": "NCHW", "NHWC": "NHWC",
            "NCDHW": "NCDHW", "None": ""}
for _p, _dt in _PREFIX.items():
    for _s, _fmt in _FORMATS.items():
        setattr(DataType, "%s_%s" % (_p, _s), (_dt, _fmt))
del _p, _dt, _s, _fmt


class CustomRegOp:
    """Builder of an op's registration info (MindSpore's CustomRegOp API, plus opjit's extras).

    Methods return self so calls chain. ``target(t)`` selects the target that
    the next ``impl(...)`` describes; ``dtype_format`` rows apply to the op.
    """

    def __init__(self, op_name="Custom"):
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
        self._inputs.append(self._param("input", self._inputs, index, name, param_type))
        return self

    def output(self, index=None, name=None, param_type="required", **kwargs):
        if param_type == "optional":
            raise InvalidArgument("output %s: outputs cannot be optional" % name)
        self._outputs.append(self._param("output", self._outputs, index, name, param_type))
        return self

    @staticmethod
    def _param(what, existing, index, name, param_type):
        if index is None:
            index = len(existing)
        if name is None:
            name = "%s%d" % (what[0], index)
        param_type = param_type or "required"
        if param_type not in _PARAM_TYPES:
            raise InvalidArgument("%s %s: param_type %r (expected %s)"
                                  % (what, name, param_type, ", ".join(_PARAM_TYPES)))
        return {"index": int(index), "name": str(name), "param_type": param_type}

    def attr(self, name=None, param_type=None, value_type=None, default_value=None, **kwargs):
        if not name:
            raise InvalidArgument("attr: a name is required")
        if value_type not in _VALUE_TYPES:
            raise InvalidArgument("attr %s: value_type %r (expected %s)"
                                  % (name, value_type, ", ".join(_VALUE_TYPES)))
        a = {"name": name, "param_type": param_type or "required", "value_type": value_type}
        if default_value is not None:
            a["default_value"] = T.default_text(default_value)
        self._attrs.append(a)
        return self

    def dtype_format(self, *args):
        """One supported combination: a (dtype, format) pair per input then per output."""
        dtypes, formats = [], []
        for a in args:
            if isinstance(a, str):
                a = (a, "")
            if not isinstance(a, (tuple, list)) or len(a) != 2:
                raise InvalidArgument("dtype_format: each argument is a (dtype, format) pair "
                                      "such as DataType.F32_Default; got %r" % (a,))
            dtypes.append(a[0])
            formats.append(a[1])
        row = {"dtypes": dtypes}
        if any(formats):
            row["formats"] = [f or "DefaultFormat" for f in formats]
        self._dtype_formats.append(row)
        return self

    def target(self, target=None):
        if target not in ("CPU", "GPU"):
            raise InvalidArgument("target %r: opjit serves CPU and GPU" % (target,))
        self._target = target
        return self

    # -- opjit extras

    def impl(self, source=None, entry=None, language=None, source_file=None, compile_options=(),
             libraries=(), attr_names=(), target=None):
        """The implementation for the current target (default CPU)."""
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

    def bprop(self, op, save_for_backward=(), non_differentiable=(), materialize_grads=None):
        """The backward: another registered op taking (inputs..., outputs..., output grads...)
        and returning one gradient per input."""
        b = {"op": op}
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

    def get_op_info(self):
        """The op as a dict in protobuf's JSON mapping of opjit.v1.OpDef."""
        info = copy.deepcopy(self._info)
        for key, rows in (("inputs", self._inputs), ("outputs", self._outputs),
                          ("attrs", self._attrs), ("dtype_formats", self._dtype_formats),
                          ("implementations", self._impls), ("output_rules", self._rules)):
            if rows:
                info[key] = copy.deepcopy(sorted(rows, key=lambda r: r["index"])
                                          if key in ("inputs", "outputs") else rows)
        if self._backward:
            info["backward"] = dict(self._backward)
        return info

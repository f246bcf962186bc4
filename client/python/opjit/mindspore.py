"""opjit.mindspore: MindSpore's names over opjit, so MindSpore's aot custom-op code runs
with only its imports changed.

    from opjit.mindspore import context, Tensor          # from mindspore import ...
    from opjit.mindspore.common import dtype as mstype
    from opjit.mindspore.nn import Cell
    import opjit.mindspore.ops as ops
    from opjit.mindspore.ops import DataType, CustomRegOp
    import opjit.mindspore as ms

    class AddNet(Cell):
        def __init__(self):
            super().__init__()
            self.program = ops.Custom("./add.cc:CustomAdd", (shape,), (mstype.float32,), "aot",
                                      reg_info=add_cpu_info)
        def construct(self, x, y):
            return self.program(x, y)

    out = AddNet()(Tensor(x), Tensor(y))[0].asnumpy()

What is here (a stand-in: MindSpore's names, opjit's machinery):

- ``ops.Custom(func, out_shape=None, out_dtype=None, func_type="aot", bprop=None,
  reg_info=None)``, MindSpore's arguments (see Custom).
- ``ops.CustomRegOp``, ``ops.DataType`` (opjit.regop's), ``ops.custom_info_register``.
- ``Tensor`` (an opjit.Tensor with ``asnumpy()``, MindSpore's ``Tensor(input_data,
  dtype)`` and ``Tensor(shape=[4, None], dtype=...)`` placeholders for
  ``Cell.set_inputs``), ``nn.Cell`` (``construct``, ``__call__``, ``set_inputs``).
- ``mstype`` dtypes (``ms.float32``, ...): they are numpy dtypes, so ``out_dtype``
  callables get and return numpy dtypes and ``Tensor.dtype == ms.float32`` holds.
- ``context.set_context`` / ``ms.set_context``: checks its arguments as MindSpore does
  (unknown keys, modes and targets are refused), remembers them, and changes nothing
  else: opjit has no graph mode, and a kernel's target comes from its source
  (.cu: GPU, else CPU). ``device_target="Ascend"`` is refused.
- Gradients: ``ms.grad(fn, grad_position=0)``, ``ms.value_and_grad``,
  ``ops.GradOperation(get_all=False, sens_param=False)``; the sensitivity (the output
  gradient) defaults to ones, MindSpore's default. ``ops.Add/Sub/Mul/Div`` and Tensor
  arithmetic are recorded on opjit's tape. ``ops.operations._inner_ops.ConvertToDynamic``
  is the identity (every opjit call has its shapes at call time).

Which client: Custom ops run on ``get_client()``: the client given to
``set_client(client)``, else an ``opjit.Client()`` (``$OPJIT_SERVER`` or the default
socket) made on first use.

How ``func`` finds its source (opjit compiles kernels from source; it never loads a
prebuilt library):

- ``"path/add.cc:CustomAdd"`` (``.cc``, ``.cpp``, ``.cxx``, ``.c``; ``.cu`` for GPU,
  MindSpore's auto-compile suffixes): the file is read here, relative to the current
  directory, and registered. Headers it includes with quotes (``#include
  "helper.h"``) that exist beside it travel with it, except ``custom_aot_extra.h``:
  the daemon provides opjit's own, which is MindSpore's ABI (a copy of MindSpore's
  header beside the source is not sent).
- ``"path/add.so:CustomAdd"`` (any other suffix): a library name, mapped to a source:
  ``sources["add.so"] = "kernels/add.cc"`` (a key is the path as written, its
  absolute path, or its base name); else a source of the same stem beside it
  (``path/add.cc``, ``.cpp``, ``.cxx``, ``.c``, ``.cu``, in that order); else in each
  directory of ``source_path`` (a list) and of ``$OPJIT_MS_SOURCE_PATH``
  (``os.pathsep``-separated). The ``.so`` itself need not exist. Unmapped: NotFound,
  saying how to map it.

What a call registers: one opjit op per (kernel, reg_info, output rule, and, without
dtype rows, input dtypes), named ``ms_<Function>_<content hash>`` in the client's
namespace, registered on its first call and reused (an identical op is not
registered twice; the compile is cached by content, so each further variant costs a
registration, not a compile). See Custom for the rules.
"""

import hashlib
import json
import os
import re
import sys
import threading
import types

import numpy as np

from opjit import autograd as _ag
from opjit import _tensors as T
from opjit._grad_rules import differentiable, fit_grad
from opjit.errors import InvalidArgument, NotFound, FailedPrecondition
from opjit.regop import CustomRegOp, DataType

__all__ = [
    "Tensor", "Custom", "CustomRegOp", "DataType", "custom_info_register", "Cell",
    "set_context", "get_context", "GRAPH_MODE", "PYNATIVE_MODE", "grad", "value_and_grad",
    "GradOperation", "set_client", "get_client", "sources", "source_path",
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "half", "single", "double",
]


class CustomTypeError(InvalidArgument, TypeError):
    """An argument of the wrong type (MindSpore raises TypeError), as opjit's InvalidArgument."""


# ---- client ---------------------------------------------------------------------------------

_client = None
_client_lock = threading.Lock()


def set_client(client):
    """The opjit.Client (or an address for one) Custom ops run on; None: back to the default."""
    global _client
    if client is not None and not hasattr(client, "register"):
        from opjit.client import Client
        client = Client(client)
    with _client_lock:
        _client = client


def get_client():
    """The client Custom ops run on (an opjit.Client() on first use when none was set)."""
    global _client
    with _client_lock:
        if _client is None:
            from opjit.client import Client
            _client = Client()
        return _client


# ---- dtypes (mindspore.common.dtype) ----------------------------------------------------------

bool_ = np.dtype(np.bool_)
int8, int16, int32, int64 = (np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))
uint8, uint16, uint32, uint64 = (np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64))
float16, float32, float64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
half, single, double = float16, float32, float64
_DTYPE_NAMES = ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "half", "single", "double")


def _dtype(d, what):
    """d (an mstype, numpy dtype or name) as a numpy dtype opjit serves."""
    try:
        dt = np.dtype(d)
    except TypeError:
        raise CustomTypeError("%s: %r is not a dtype (give mstype.float32, ...)" % (what, d)) from None
    T.dtype_name(dt)  # InvalidArgument naming the dtypes opjit serves
    return dt


# ---- Tensor -----------------------------------------------------------------------------------

def _as_ms(x):
    """x with every opjit.Tensor in it made an opjit.mindspore.Tensor (in place: the
    object keeps its graph)."""
    if isinstance(x, _ag.Tensor):
        if not isinstance(x, Tensor):
            x.__class__ = Tensor
        return x
    if isinstance(x, np.ndarray):
        return Tensor(x)
    if isinstance(x, tuple):
        return tuple(_as_ms(e) for e in x)
    if isinstance(x, list):
        return [_as_ms(e) for e in x]
    return x


class Tensor(_ag.Tensor):
    """MindSpore's Tensor over opjit.Tensor: ``Tensor(input_data, dtype=None)``,
    ``asnumpy()``; ``Tensor(shape=[4, None], dtype=mstype.float32)`` is a placeholder
    for ``Cell.set_inputs`` (None: a dimension known at call time). Arithmetic is
    opjit's (client-side numpy, recorded on the tape) and gives opjit.mindspore Tensors."""

    def __init__(self, input_data=None, dtype=None, shape=None, init=None, const_arg=False,
                 **kwargs):
        self._placeholder = None
        if input_data is None:
            if shape is None or dtype is None:
                raise CustomTypeError("Tensor: give input_data, or shape and dtype for a "
                                      "placeholder (Tensor(shape=[4, None], dtype=ms.float32))")
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            for d in shape:
                if d is not None and (not isinstance(d, (int, np.integer)) or d < 0):
                    raise InvalidArgument("Tensor: shape %s: each dimension is an int >= 0 or None"
                                          % (list(shape),))
            dt = _dtype(dtype, "Tensor")
            super().__init__(np.zeros((0,), dt))
            self._placeholder = shape
            return
        if isinstance(input_data, _ag.Tensor):
            input_data = input_data.data
        elif dtype is None and isinstance(input_data, (float, list, tuple)):
            # MindSpore: Python floats make float32 Tensors (numpy would say float64).
            arr = np.asarray(input_data)
            input_data = arr.astype(np.float32) if arr.dtype == np.float64 else arr
        if dtype is not None:
            dtype = _dtype(dtype, "Tensor")
        super().__init__(input_data, requires_grad=bool(kwargs.pop("requires_grad", False)),
                         dtype=dtype)

    def asnumpy(self):
        """The values as an ndarray."""
        if self._is_placeholder():
            raise FailedPrecondition("Tensor: a placeholder (shape %s) has no values"
                                     % (list(self._placeholder),))
        return self.data

    def _is_placeholder(self):
        return getattr(self, "_placeholder", None) is not None

    def __repr__(self):
        if self._is_placeholder():
            return "Tensor(shape=%s, dtype=%s)" % (list(self._placeholder), self.dtype)
        return "Tensor(shape=%s, dtype=%s, value=%s)" % (list(self.shape), self.dtype,
                                                         np.array2string(self.data))


def _wrap_method(name):
    base = getattr(_ag.Tensor, name)

    def method(self, *args, **kwargs):
        return _as_ms(base(self, *args, **kwargs))
    method.__name__ = name
    method.__doc__ = getattr(base, "__doc__", None)
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__neg__", "__pos__", "__pow__", "__rpow__",
              "__matmul__", "__rmatmul__", "__getitem__", "sum", "mean", "reshape", "view",
              "astype", "clone", "tanh", "exp", "log", "sqrt", "square", "detach"):
    if hasattr(_ag.Tensor, _name):
        setattr(Tensor, _name, _wrap_method(_name))
del _name


def _is_tensor_like(a):
    return isinstance(a, (_ag.Tensor, np.ndarray))


def _array(a, what):
    if isinstance(a, Tensor) and a._is_placeholder():
        raise InvalidArgument("%s: a placeholder Tensor (shape %s) has no values; it only "
                              "declares a shape for Cell.set_inputs" % (what, list(a._placeholder)))
    if isinstance(a, _ag.Tensor):
        return a.data
    return T.as_ndarray(a)


# ---- context ----------------------------------------------------------------------------------

GRAPH_MODE = 0
PYNATIVE_MODE = 1
_context = {"mode": PYNATIVE_MODE, "device_target": "CPU", "device_id": 0}
# MindSpore's set_context keywords: accepted and remembered; only the checks below matter.
_CONTEXT_KEYS = frozenset((
    "mode", "device_target", "device_id", "save_graphs", "save_graphs_path", "max_call_depth",
    "jit_level", "jit_config", "jit_syntax_level", "enable_graph_kernel", "graph_kernel_flags",
    "precompile_only", "runtime_num_threads", "pynative_synchronize", "max_device_memory",
    "mempool_block_size", "enable_compile_cache", "compile_cache_path", "deterministic",
    "print_file_path", "enable_reduce_precision", "variable_memory_max_size",
    "memory_optimize_level", "inter_op_parallel_num", "op_timeout", "check_bprop",
    "enable_dump", "save_dump_path", "env_config_path", "auto_tune_mode", "ascend_config",
    "gpu_config", "aoe_tune_mode", "aoe_config", "disable_format_transform", "debug_level",
    "enable_profiling", "profiling_options", "max_call_depth", "reserve_class_name_in_scope",
    "grad_for_scalar", "enable_sparse", "support_binary", "recompute", "exec_order"))


def set_context(**kwargs):
    """MindSpore's set_context: checks its arguments (an unknown keyword, a mode other than
    GRAPH_MODE/PYNATIVE_MODE, a device_target other than CPU/GPU is refused) and remembers
    them; it changes nothing else (opjit runs every call as it comes, and a Custom
    kernel's target comes from its source)."""
    for k, v in kwargs.items():
        if k not in _CONTEXT_KEYS:
            raise InvalidArgument("For 'context.set_context', the keyword argument %s is not "
                                  "recognized" % k)
        if k == "mode" and (isinstance(v, bool) or v not in (GRAPH_MODE, PYNATIVE_MODE)):
            raise InvalidArgument("For 'context.set_context', mode must be GRAPH_MODE (0) or "
                                  "PYNATIVE_MODE (1), got %r" % (v,))
        if k == "device_target":
            if not isinstance(v, str):
                raise CustomTypeError("For 'context.set_context', device_target must be a str, "
                                      "got %s" % type(v).__name__)
            if v not in ("CPU", "GPU"):
                raise InvalidArgument(
                    "For 'context.set_context', device_target %r is not served by opjit: it runs "
                    "CPU and GPU kernels (MindSpore's targets are CPU, GPU and Ascend)" % v)
        if k == "device_id" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise InvalidArgument("For 'context.set_context', device_id must be an int >= 0, "
                                  "got %r" % (v,))
    _context.update(kwargs)


def get_context(attr_key):
    """A value given to set_context (mode, device_target, device_id have defaults)."""
    if attr_key not in _CONTEXT_KEYS:
        raise InvalidArgument("For 'context.get_context', the argument %s is not recognized"
                              % attr_key)
    return _context.get(attr_key)


# ---- nn.Cell ----------------------------------------------------------------------------------

class Cell:
    """MindSpore's nn.Cell: subclass it, define ``construct``, call the cell.

    ``set_inputs(*placeholders)`` declares the inputs' shapes (None: any size) and
    dtypes; later calls are checked against them."""

    def __init__(self, auto_prefix=True, flags=None):
        self._input_spec = None
        self.training = False

    def construct(self, *inputs, **kwargs):
        raise NotImplementedError("%s must define construct()" % type(self).__name__)

    def __call__(self, *inputs, **kwargs):
        spec = getattr(self, "_input_spec", None)
        if spec is not None:
            self._check_inputs(spec, inputs)
        return self.construct(*inputs, **kwargs)

    def set_inputs(self, *inputs):
        spec = []
        for k, t in enumerate(inputs):
            if not isinstance(t, _ag.Tensor):
                raise CustomTypeError("%s.set_inputs: input %d is a %s, not a Tensor"
                                      % (type(self).__name__, k, type(t).__name__))
            shape = t._placeholder if isinstance(t, Tensor) and t._is_placeholder() else t.shape
            spec.append((tuple(shape), t.dtype))
        self._input_spec = spec
        return self

    def _check_inputs(self, spec, inputs):
        name = type(self).__name__
        if len(inputs) != len(spec):
            raise InvalidArgument("%s: set_inputs declared %d input(s), the call gives %d"
                                  % (name, len(spec), len(inputs)))
        for k, ((shape, dtype), a) in enumerate(zip(spec, inputs)):
            if not _is_tensor_like(a):
                continue
            got = tuple(a.shape)
            if len(got) != len(shape) or any(d is not None and d != g for d, g in zip(shape, got)):
                raise InvalidArgument("%s: input %d has shape %s; set_inputs declared %s"
                                      % (name, k, list(got), list(shape)))
            if np.dtype(a.dtype) != dtype:
                raise InvalidArgument("%s: input %d has dtype %s; set_inputs declared %s"
                                      % (name, k, a.dtype, dtype))

    def set_train(self, mode=True):
        self.training = bool(mode)
        return self

    def set_grad(self, requires_grad=True):
        return self


# ---- Custom -----------------------------------------------------------------------------------

sources = {}      # ".so" name -> source path (see the module's doc)
source_path = []  # directories searched for <stem>.cc/.cpp/.cxx/.c/.cu

_SOURCE_SUFFIXES = {".cc": ("CPU", "c++"), ".cpp": ("CPU", "c++"), ".cxx": ("CPU", "c++"),
                    ".c": ("CPU", "c"), ".cu": ("GPU", "cuda")}
_SEARCH_ORDER = (".cc", ".cpp", ".cxx", ".c", ".cu")
_AKG = ("MindSpore's AKG compiler (ir_builder, tvm_compute and hybrid DSL kernels), which "
        "opjit does not have")
_REFUSED_FUNC_TYPES = {
    "akg": _AKG, "hybrid": _AKG, "ir_builder": _AKG, "tvm_compute": _AKG,
    "tbe": "CANN's TBE toolchain: TBE kernels are Ascend kernels, and opjit serves CPU and GPU",
    "aicpu": "Ascend's AI CPU: opjit serves CPU and GPU",
    "julia": "MindSpore's embedded Julia runtime, which opjit does not have",
}
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_AOT_EXTRA = "custom_aot_extra.h"
_registered_lock = threading.Lock()
_CLIENT_OPS = "_opjit_mindspore_ops"  # on each client: {(namespace, name): opjit.Op} it registered


def _library_source(path):
    """The source a library name ("add.so") maps to (see the module's doc)."""
    for key in (path, os.path.abspath(path), os.path.basename(path)):
        if key in sources:
            return os.fspath(sources[key])
    stem = os.path.splitext(os.path.basename(path))[0]
    dirs = [os.path.dirname(os.path.abspath(path))] + [os.fspath(d) for d in source_path]
    dirs += [d for d in os.environ.get("OPJIT_MS_SOURCE_PATH", "").split(os.pathsep) if d]
    for d in dirs:
        for ext in _SEARCH_ORDER:
            cand = os.path.join(d, stem + ext)
            if os.path.isfile(cand):
                return cand
    raise NotFound(
        "Custom: %s is a compiled library, and opjit compiles kernels from their source: map "
        "it to one with opjit.mindspore.sources[%r] = \"path/%s.cc\", or put %s.cc (.cpp, "
        ".cxx, .c, .cu) beside it or in a directory of opjit.mindspore.source_path or "
        "$OPJIT_MS_SOURCE_PATH (searched: %s)"
        % (path, os.path.basename(path), stem, stem, ", ".join(dirs)),
        reason="SOURCE_NOT_FOUND", metadata={"library": path})


def _read(path, what):
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise NotFound("Custom: cannot read %s %s: %s" % (what, path, e.strerror),
                       reason="SOURCE_NOT_FOUND", metadata={"path": path}) from None


def _local_headers(src, text):
    """{name: content} of the quoted includes found beside src (recursively), but
    custom_aot_extra.h (the daemon's own)."""
    base = os.path.dirname(os.path.abspath(src))
    found, todo = {}, [text]
    while todo:
        for name in _INCLUDE.findall(todo.pop()):
            if (name in found or os.path.basename(name) == _AOT_EXTRA or name.startswith("/")
                    or ".." in name.split("/")):
                continue
            p = os.path.join(base, name)
            if os.path.isfile(p):
                found[name] = _read(p, "header")
                todo.append(found[name])
    return found


def custom_info_register(*reg_info):
    """MindSpore's decorator binding reg_info to a Custom func (used when Custom gets none)."""
    def decorator(func):
        setattr(func, "reg_info", list(reg_info))
        return func
    return decorator


def _expand(infos):
    if infos is None:
        return []
    if isinstance(infos, (list, tuple)):
        out = []
        for i in infos:
            out.extend(_expand(i))
        return out
    if hasattr(infos, "get_op_info"):
        infos = infos.get_op_info()
    if isinstance(infos, str):
        try:
            parsed = json.loads(infos)
        except ValueError as e:
            raise InvalidArgument("Custom: reg_info is a str that is not JSON: %s" % e) from None
        infos = parsed
    if not isinstance(infos, dict):
        raise CustomTypeError("Custom: reg_info should be a CustomRegOp info (dict or JSON "
                              "str) or a list of them, got %s" % type(infos).__name__)
    return [infos]


def _renumber(params):
    for i, p in enumerate(params):
        p["index"] = i  # MindSpore's positional order (see opjit.regop)


class Custom:
    """MindSpore's ``ops.Custom``: a kernel made an operator, called like a function.

    func: for ``func_type="aot"``, ``"path/file.cc:Function"`` (a source opjit
      compiles) or ``"path/file.so:Function"`` (mapped to its source: see the
      module's doc). For ``func_type="pyfunc"``, a Python function of ndarrays
      (run here, with numpy) returning an ndarray or a tuple of them.
    out_shape: the output's shape (a list/tuple of ints), a tuple of shapes (one per
      output), a callable of the inputs' shapes (lists) returning either, or None:
      the kernel's own ``<Function>InferShape`` decides when its source defines one,
      else the output has the first input's shape (what MindSpore's dynamic-shape
      add test, whose add.cc has no InferShape, relies on). For pyfunc, None
      leaves the output's shape to the function.
    out_dtype: an mstype (one output), a tuple of them (a tuple of outputs, even of
      one: MindSpore's ``(mstype.float32,)`` gives a 1-tuple), a callable of the
      inputs' dtypes returning either, or None (the dtype row's output dtype, else
      the first input's dtype).
    func_type: "aot" or "pyfunc". MindSpore's "akg", "hybrid", "ir_builder",
      "tvm_compute", "tbe", "aicpu" and "julia" are refused (InvalidArgument, a
      ValueError) with the reason; any other value too.
    bprop: MindSpore's ``bprop(*inputs, out, dout)`` returning one gradient per input
      (a tuple; a bare Tensor for one input). It runs on opjit's tape, when an input
      needs a gradient, with Tensors (its arithmetic and the Custom ops it calls are
      recorded under create_graph, so gradients of gradients work). ``out``/``dout``
      are a tuple for a tuple of outputs. A missing output gradient is zeros
      (MindSpore's); a non-Tensor output's ``dout`` is None. Each gradient is summed
      to its input's shape where it broadcasts (``auto_reduce``) and cast to its
      dtype (``auto_cast``): opjit._grad_rules.fit_grad, which refuses any other
      shape naming the input; gradients for inputs that need none
      (``self.needs_input_grad``, one bool per call argument while bprop runs), for
      integer and bool inputs and for attrs are dropped. Without bprop, a gradient
      through the op is refused when it is asked for (FailedPrecondition).
    reg_info: a CustomRegOp info (or its dict/JSON), or a list of them (merged, as
      client.register merges them: an attr-only info adds attrs), or None. Infos
      naming another target than the kernel's are skipped (MindSpore's per-target
      infos). Inputs are positional in declaration order, so upstream's
      ``.input(0, "x1").input(0, "x2")`` declares two inputs. With no inputs
      declared (no reg_info, an attr-only one), the call's leading Tensors are the
      inputs; with no outputs, out_dtype/out_shape say how many; with no
      dtype_format rows, the call's dtypes make the row (MindSpore infers them from
      the call), registered once per combination.

    A call: ``program(x, y)`` or ``program(x, y, 0.7)`` (attrs positionally after the
    inputs, in declaration order, or by name). Returns a Tensor, or a tuple of them.
    """

    def __init__(self, func, out_shape=None, out_dtype=None, func_type="aot", bprop=None,
                 reg_info=None):
        if not isinstance(func_type, str):
            raise CustomTypeError("Custom: func_type should be a str, got %s"
                                  % type(func_type).__name__)
        if func_type in _REFUSED_FUNC_TYPES:
            raise InvalidArgument(
                "Custom: func_type %r is not served by opjit: it needs %s. Write the kernel in "
                "C++ or CUDA in MindSpore's aot ABI (func_type=\"aot\"), or as a Python function "
                "of ndarrays (func_type=\"pyfunc\")" % (func_type, _REFUSED_FUNC_TYPES[func_type]),
                reason="FUNC_TYPE_UNSUPPORTED", metadata={"func_type": func_type})
        if func_type not in ("aot", "pyfunc"):
            raise InvalidArgument(
                "Custom: func_type should be one of aot, pyfunc (opjit serves these of "
                "MindSpore's aot, pyfunc, akg, hybrid, ir_builder, tvm_compute, tbe, aicpu, "
                "julia), got %r" % func_type, reason="FUNC_TYPE_UNSUPPORTED",
                metadata={"func_type": func_type})
        if bprop is not None and not callable(bprop):
            raise CustomTypeError("Custom: bprop should be a function, got %s"
                                  % type(bprop).__name__)
        self.func = func
        self.func_type = func_type
        self.out_shape = out_shape
        self.out_dtype = out_dtype
        self.bprop = bprop
        self.needs_input_grad = ()
        self.attrs = {}
        self._variants = {}
        self._lock = threading.Lock()
        if func_type == "aot":
            if not isinstance(func, str):
                raise CustomTypeError("Custom: an aot func should be a str "
                                      "(\"path/file.cc:Function\"), got %s" % type(func).__name__)
            path, sep, entry = func.rpartition(":")
            if not sep or not path or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", entry):
                raise InvalidArgument(
                    "Custom: func %r: an aot func is \"path:Function\", e.g. "
                    "\"./add.cc:CustomAdd\" or \"./add.so:CustomAdd\"" % func)
            ext = os.path.splitext(path)[1].lower()
            src = path if ext in _SOURCE_SUFFIXES else _library_source(path)
            text = _read(src, "source")
            sext = os.path.splitext(src)[1].lower()
            if sext not in _SOURCE_SUFFIXES:
                raise InvalidArgument("Custom: %s (for %s) is not a C, C++ or CUDA source "
                                      "(.cc, .cpp, .cxx, .c, .cu)" % (src, path))
            self._target, self._language = _SOURCE_SUFFIXES[sext]
            self._entry = entry
            self._impl = {"target": self._target, "language": self._language, "source": text,
                          "source_file": os.path.basename(src), "entry": entry}
            headers = _local_headers(src, text)
            if headers:
                self._impl["files"] = [{"name": n, "content": c}
                                       for n, c in sorted(headers.items())]
            self.name = entry
            # out_shape=None: the kernel's InferShape when it defines one, else input 0's shape.
            self._infers = re.search(r"\b%sInferShape\b" % entry, text) is not None
        else:
            if not callable(func):
                raise CustomTypeError("Custom: a pyfunc func should be a function, got %s"
                                      % type(func).__name__)
            self._target, self._entry, self._impl, self._infers = "CPU", None, None, False
            self.name = getattr(func, "__name__", "pyfunc")
            if reg_info is None:
                reg_info = getattr(func, "reg_info", None)
        self._base = self._merge(reg_info)

    def __repr__(self):
        return "Custom(%r, func_type=%r)" % (self.func, self.func_type)

    def add_prim_attr(self, name, value):
        """MindSpore's Primitive.add_prim_attr: remembered, not used."""
        self.attrs[name] = value
        return self

    # -- registration info

    def _merge(self, reg_info):
        """The reg_info of this target merged into one OpDef dict (no name), or None."""
        infos = _expand(reg_info)
        if not infos:
            return None
        mine = [i for i in infos if getattr(i, "target", None) in (None, self._target)
                and not any(isinstance(m, dict) and m.get("target") not in (None, self._target)
                            for m in i.get("implementations", []))]
        if not mine:
            raise InvalidArgument(
                "Custom(%s): reg_info names only target(s) %s; the kernel runs on %s"
                % (self.name, ", ".join(sorted({str(getattr(i, "target", None)) for i in infos})),
                   self._target))
        from google.protobuf import json_format
        from opjit.client import load_spec
        plain = []
        for i in mine:
            d = json.loads(json.dumps(i))
            d.pop("name", None)
            d.pop("namespace", None)
            d.pop("implementations", None)
            for key in ("inputs", "outputs"):
                if isinstance(d.get(key), list):
                    _renumber(d[key])
            plain.append(d)
        op = load_spec(plain, name="unnamed")
        base = json_format.MessageToDict(op, preserving_proto_field_name=True)
        base.pop("name", None)
        return base

    # -- a call

    def __call__(self, *args, **kwargs):
        base = self._base or {}
        declared = base.get("inputs") or []
        if declared:
            n_in = min(len(declared), len(args))
        else:
            n_in = 0
            while n_in < len(args) and _is_tensor_like(args[n_in]):
                n_in += 1
        what = "Custom(%s)" % self.name
        arrays = [_array(a, "%s input %d" % (what, k)) for k, a in enumerate(args[:n_in])]
        extra = args[n_in:]
        shapes, dtypes, multi = self._out_spec([list(a.shape) for a in arrays],
                                               [a.dtype for a in arrays])
        if self.func_type == "pyfunc":
            outs, multi = self._run_pyfunc(arrays, extra, kwargs, shapes, dtypes, multi)
        else:
            op = self._variant(arrays, shapes, dtypes)
            outs = op(*arrays, *extra, **kwargs)
            outs = list(outs) if isinstance(outs, tuple) else [outs]
        results = [Tensor(o) if isinstance(o, np.ndarray) else o for o in outs]
        self._record(args, n_in, results, multi)
        return tuple(results) if multi else results[0]

    def _out_spec(self, in_shapes, in_dtypes):
        """(shapes, dtypes, multi): one shape (tuple or None) and dtype (or None) per output."""
        what = "Custom(%s)" % self.name
        s = self.out_shape(*in_shapes) if callable(self.out_shape) else self.out_shape
        d = self.out_dtype(*in_dtypes) if callable(self.out_dtype) else self.out_dtype
        if isinstance(s, Tensor) or isinstance(d, Tensor):
            raise CustomTypeError("%s: out_shape/out_dtype give shapes and dtypes, not Tensors"
                                  % what)
        s_multi = (isinstance(s, (list, tuple)) and len(s) > 0
                   and all(isinstance(e, (list, tuple)) for e in s))
        declared = (self._base or {}).get("outputs") or []
        if s is None and d is None and len(declared) > 1:
            d = [None] * len(declared)  # the reg_info's outputs (out_shape None: the rules)
        if isinstance(d, (list, tuple)):
            multi, n, dtypes = True, len(d), list(d)
            if n == 0:
                raise InvalidArgument("%s: out_dtype is an empty tuple" % what)
            if s is None:
                shapes = [None] * n
            elif s_multi and len(s) == n:
                shapes = list(s)
            elif not s_multi and n == 1:
                shapes = [s]
            else:
                raise InvalidArgument("%s: out_dtype gives %d dtype(s) but out_shape %r gives %s"
                                      % (what, n, s, "%d shape(s)" % len(s) if s_multi
                                         else "one shape"))
        elif s_multi:
            if d is not None and len(s) != 1:
                raise InvalidArgument(
                    "%s: out_shape gives %d shapes but out_dtype one dtype (%s): give a tuple of "
                    "%d dtypes" % (what, len(s), d, len(s)))
            multi, shapes, dtypes = True, list(s), [d] * len(s)
        else:
            multi, shapes, dtypes = False, [s], [d]
        norm_s = []
        for j, sh in enumerate(shapes):
            if sh is None:
                norm_s.append(None)
                continue
            if isinstance(sh, (int, np.integer)):
                sh = [sh]
            try:
                sh = tuple(int(x) for x in sh)
            except (TypeError, ValueError):
                raise CustomTypeError("%s: output %d's shape %r is not a list of ints"
                                      % (what, j, sh)) from None
            if any(x < 0 for x in sh):
                raise InvalidArgument("%s: output %d's shape %s has an unknown (negative) "
                                      "dimension: opjit needs it at call time (give out_shape "
                                      "as a function of the input shapes, or None for the "
                                      "kernel's InferShape)" % (what, j, list(sh)))
            norm_s.append(sh)
        norm_d = [None if dt is None else _dtype(dt, "%s out_dtype" % what) for dt in dtypes]
        if declared and len(declared) != len(norm_s):
            raise InvalidArgument("%s: reg_info declares %d output(s), out_shape/out_dtype give %d"
                                  % (what, len(declared), len(norm_s)))
        return norm_s, norm_d, multi

    def _variant(self, arrays, shapes, dtypes):
        """The registered op for this call's output rules (and dtypes, without rows)."""
        what = "Custom(%s)" % self.name
        rules = []
        for j, (sh, dt) in enumerate(zip(shapes, dtypes)):
            if sh is None and self._infers:
                r = {"kind": "infer_shape"}
            elif sh is None:
                if not arrays:
                    raise InvalidArgument(
                        "%s: output %d has no shape: give out_shape, or define %sInferShape in "
                        "the kernel (the op has no input to take a shape from)"
                        % (what, j, self._entry))
                r = {"kind": "same_as", "input": 0}
            else:
                same = next((i for i, a in enumerate(arrays) if tuple(a.shape) == sh), None)
                r = ({"kind": "same_as", "input": same} if same is not None
                     else {"kind": "explicit", "shape": list(sh)})
            if dt is not None:
                r["dtype"] = T.dtype_name(dt)
            elif r["kind"] == "explicit":
                if not arrays:
                    raise InvalidArgument("%s: output %d needs a dtype (out_dtype): the op has "
                                          "no input to take it from" % (what, j))
                r["dtype"] = T.dtype_name(arrays[0].dtype)
            rules.append(r)
        base = self._base or {}
        row = None
        if not base.get("dtype_formats"):
            row = [T.dtype_name(a.dtype) for a in arrays] + [r.get("dtype", "") for r in rules]
        key = (json.dumps(rules, sort_keys=True), tuple(row) if row else None)
        with self._lock:
            spec = self._variants.get(key)
        if spec is None:
            spec = self._spec(base, arrays, rules, row)
            with self._lock:
                self._variants[key] = spec
        client = get_client()
        rkey = (client.namespace or "", spec["name"])
        with _registered_lock:
            ops = client.__dict__.setdefault(_CLIENT_OPS, {})
            op = ops.get(rkey)
        if op is None:
            client.register(spec)
            op = client.op(spec["name"], target=self._target)
            with _registered_lock:
                ops[rkey] = op
        return op

    def _spec(self, base, arrays, rules, row):
        """The OpDef dict of one variant, named after its content."""
        spec = json.loads(json.dumps(base))
        if not spec.get("inputs"):
            spec["inputs"] = [{"index": i, "name": "x%d" % i, "param_type": "required"}
                              for i in range(len(arrays))]
        if not spec.get("outputs"):
            spec["outputs"] = [{"index": j, "name": "y%d" % j, "param_type": "required"}
                               for j in range(len(rules))]
        spec["output_rules"] = rules
        if row is not None:
            spec["dtype_formats"] = [{"dtypes": row}]
        spec["implementations"] = [dict(self._impl)]
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
        spec["name"] = "ms_%s_%s" % (self._entry[:80], digest)
        spec.setdefault("doc", "opjit.mindspore.Custom(%r)" % self.func)
        return spec

    def _run_pyfunc(self, arrays, extra, kwargs, shapes, dtypes, multi):
        what = "Custom(%s)" % self.name
        res = self.func(*arrays, *extra, **kwargs)
        if self.out_shape is None and self.out_dtype is None and isinstance(res, tuple):
            # Neither says how many outputs: the function's tuple does.
            multi, shapes, dtypes = True, [None] * len(res), [None] * len(res)
        items = list(res) if multi and isinstance(res, (tuple, list)) else [res]
        if len(items) != len(shapes):
            raise InvalidArgument("%s: the pyfunc returned %d output(s); out_shape/out_dtype say %d"
                                  % (what, len(items), len(shapes)))
        outs = []
        for j, (o, sh, dt) in enumerate(zip(items, shapes, dtypes)):
            if isinstance(o, _ag.Tensor):
                o = o.data
            if isinstance(o, (np.ndarray, np.generic)) or (
                    isinstance(o, (int, float, bool)) and (dt is not None or sh is not None)):
                a = np.asarray(o)
                if dt is not None:
                    a = a.astype(dt, copy=False)
                if sh is not None and tuple(a.shape) != sh:
                    raise InvalidArgument("%s: the pyfunc's output %d has shape %s; out_shape "
                                          "says %s" % (what, j, list(a.shape), list(sh)))
                outs.append(a)
            else:
                outs.append(o)  # a non-Tensor output: passed through, no gradient
        return outs, multi

    # -- autograd

    def _record(self, args, n_in, results, multi):
        ins = [a if isinstance(a, _ag.Tensor) else None for a in args[:n_in]]
        if not (_ag.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins)):
            return
        tensors = [r for r in results if isinstance(r, _ag.Tensor)]
        if not tensors:
            return
        node = _CustomNode(self, ins, list(args), results, multi)
        for k, t in enumerate(tensors):
            if differentiable(t.dtype):
                t.grad_fn = node
                t._output_index = k
                t.requires_grad = True


class _CustomNode(_ag.Node):
    """A Custom call on the tape: its backward is the Custom's bprop (MindSpore's rules)."""

    def __init__(self, prim, ins, args, results, multi):
        metas = [(r.shape, r.dtype) for r in results if isinstance(r, _ag.Tensor)]
        super().__init__(ins, metas)
        self.prim = prim
        self.args = args
        self.results = results
        self.multi = multi

    def name(self):
        return "Custom(%s)Backward" % self.prim.name

    def apply(self, grads, retain_graph, create_graph=False):
        prim = self.prim
        where = "Custom(%s).bprop" % prim.name
        if prim.bprop is None:
            raise FailedPrecondition(
                "Custom(%s) has no bprop, so it cannot be differentiated (MindSpore needs one "
                "too): pass Custom(..., bprop=fn), fn(*inputs, out, dout) returning one "
                "gradient per input" % prim.name, reason="NOT_DIFFERENTIABLE",
                metadata={"op": str(prim.func)})
        k = 0
        outs, douts = [], []
        for r in self.results:
            if not isinstance(r, _ag.Tensor):
                outs.append(r)
                douts.append(None)
                continue
            g = grads[k]
            k += 1
            if g is None:
                g = Tensor(np.zeros(r.shape, r.dtype))
            outs.append(r if create_graph else Tensor(r.data))
            douts.append(_as_ms(g) if isinstance(g, _ag.Tensor) else Tensor(g))
        call_args = []
        for a in self.args:
            if isinstance(a, _ag.Tensor):
                a = a if create_graph else Tensor(a.data)
            call_args.append(_as_ms(a))
        out = tuple(outs) if self.multi else outs[0]
        dout = tuple(douts) if self.multi else douts[0]
        prim.needs_input_grad = tuple(isinstance(t, _ag.Tensor) and t.requires_grad
                                      and differentiable(t.dtype) for t in self.inputs) + \
            (False,) * (len(self.args) - len(self.inputs))
        try:
            with _ag._GradMode(bool(create_graph)):
                res = prim.bprop(*call_args, out, dout)
        finally:
            prim.needs_input_grad = ()
        if isinstance(res, list):
            res = tuple(res)
        if not isinstance(res, tuple):
            res = (res,)
        n_in = len(self.inputs)
        if len(res) not in (n_in, len(self.args)):
            raise InvalidArgument(
                "%s returned %d gradient(s); the op was called with %d input(s)%s: return one "
                "per input" % (where, len(res), n_in,
                               " and %d attr(s)" % (len(self.args) - n_in)
                               if len(self.args) > n_in else ""), reason="GRAD_COUNT")
        out_grads = []
        for i, (t, g) in enumerate(zip(self.inputs, res)):
            if t is None or g is None or not t.requires_grad or not differentiable(t.dtype):
                out_grads.append(None)
                continue
            if isinstance(g, _ag.Tensor) and not create_graph:
                g = g.data
            elif not isinstance(g, (_ag.Tensor, np.ndarray)):
                g = np.asarray(g)
            out_grads.append(fit_grad(g, t.shape, t.dtype, "input %d" % i, where=where))
        if not retain_graph and not create_graph:
            self.args = [a if not isinstance(a, _ag.Tensor) else None for a in self.args]
            self.results = [r if not isinstance(r, _ag.Tensor) else Tensor(np.zeros((0,)))
                            for r in self.results]
        return out_grads


# ---- gradients ------------------------------------------------------------------------------

def _grads(fn, args, positions, sens=None, has_aux=False):
    """(value, grads): fn(*args) and its gradients w.r.t. args[p] for p in positions,
    with sensitivity `sens` (None: ones, MindSpore's default)."""
    call = list(args)
    leaves = []
    create_graph = False
    for p in positions:
        if p < 0 or p >= len(args):
            raise InvalidArgument("grad_position %d is out of range: the function gets %d "
                                  "argument(s)" % (p, len(args)))
        a = args[p]
        if isinstance(a, _ag.Tensor) and (a.requires_grad or a.grad_fn is not None):
            leaf = a  # inside another grad: differentiate the graph it is part of
            create_graph = True
        elif _is_tensor_like(a):
            leaf = Tensor(_array(a, "grad input %d" % p))
            leaf.requires_grad = True
        else:
            raise CustomTypeError("grad: argument %d is a %s, not a Tensor"
                                  % (p, type(a).__name__))
        call[p] = leaf
        leaves.append(leaf)
    with _ag.enable_grad():
        value = fn(*call)
    outs = value if isinstance(value, (tuple, list)) else (value,)
    aux = None
    if has_aux:
        outs, aux = outs[:1], tuple(outs[1:])
    if sens is None:
        sens_list = [None] * len(outs)
    else:
        sens_list = list(sens) if isinstance(sens, (tuple, list)) else [sens]
        if len(sens_list) != len(outs):
            raise InvalidArgument("grad: %d sensitivity value(s) for %d output(s)"
                                  % (len(sens_list), len(outs)))
    roots, gouts = [], []
    for o, s in zip(outs, sens_list):
        if isinstance(o, _ag.Tensor) and (o.grad_fn is not None or o.requires_grad):
            roots.append(o)
            if s is None:
                s = np.ones(o.shape, o.dtype)
            elif isinstance(s, _ag.Tensor) and not create_graph:
                s = s.data
            gouts.append(s)
    grads = [None] * len(leaves)
    if roots:
        grads = _ag.grad(roots, leaves, grad_outputs=gouts, retain_graph=create_graph,
                         create_graph=create_graph, allow_unused=True)
    result = []
    for leaf, g in zip(leaves, grads):
        if g is None:
            g = np.zeros(leaf.shape, leaf.dtype)
        result.append(_as_ms(g))
    if has_aux:
        return _as_ms(value), result, aux
    return _as_ms(value), result, None


def grad(fn, grad_position=0, weights=None, has_aux=False, return_ids=False):
    """MindSpore's ms.grad: a function returning fn's gradient w.r.t. its argument
    grad_position (an int: one gradient; a tuple: a tuple of them), with ones as the
    output's gradient. has_aux: fn returns (out, aux...); gives (grads, aux)."""
    if weights is not None or return_ids:
        raise InvalidArgument("grad: weights and return_ids (Parameters) are not served by "
                              "opjit.mindspore; differentiate w.r.t. arguments (grad_position)")
    single = isinstance(grad_position, int)
    positions = (grad_position,) if single else tuple(grad_position)

    def grad_fn(*args):
        _, g, aux = _grads(fn, args, positions, has_aux=has_aux)
        g = g[0] if single else tuple(g)
        return (g, aux) if has_aux else g
    return grad_fn


def value_and_grad(fn, grad_position=0, weights=None, has_aux=False, return_ids=False):
    """MindSpore's ms.value_and_grad: (fn(*args), its gradients), as grad."""
    if weights is not None or return_ids:
        raise InvalidArgument("value_and_grad: weights and return_ids (Parameters) are not "
                              "served by opjit.mindspore")
    single = isinstance(grad_position, int)
    positions = (grad_position,) if single else tuple(grad_position)

    def value_and_grad_fn(*args):
        value, g, _ = _grads(fn, args, positions, has_aux=has_aux)
        return value, (g[0] if single else tuple(g))
    return value_and_grad_fn


class GradOperation:
    """MindSpore's ops.GradOperation: ``GradOperation(get_all, sens_param)(net)(*inputs[,
    sens])`` gives the gradient w.r.t. the first input (get_all: a tuple, one per input);
    with sens_param the last argument is the output's gradient, else ones."""

    def __init__(self, get_all=False, get_by_list=False, sens_param=False):
        if get_by_list:
            raise InvalidArgument("GradOperation: get_by_list (gradients of Parameters) is not "
                                  "served by opjit.mindspore; use get_all")
        self.get_all = bool(get_all)
        self.sens_param = bool(sens_param)

    def __call__(self, fn, weights=None):
        if weights is not None:
            raise InvalidArgument("GradOperation: weights are not served by opjit.mindspore")

        def after_grad(*args):
            sens = None
            if self.sens_param:
                if not args:
                    raise InvalidArgument("GradOperation(sens_param=True): the last argument is "
                                          "the sensitivity; none was given")
                args, sens = args[:-1], args[-1]
            positions = [k for k, a in enumerate(args) if _is_tensor_like(a)]
            if not self.get_all:
                positions = positions[:1]
            _, g, _ = _grads(fn, args, positions, sens=sens)
            return tuple(g) if self.get_all else g[0]
        return after_grad


# ---- a few primitives (ops.Add ...) ---------------------------------------------------------

class _Primitive:
    def add_prim_attr(self, name, value):
        setattr(self, "_attr_" + name, value)
        return self


def _t(x):
    return x if isinstance(x, _ag.Tensor) else Tensor(x) if isinstance(x, np.ndarray) else x


class Add(_Primitive):
    def __call__(self, x, y):
        return _as_ms(_t(x) + _t(y))


class Sub(_Primitive):
    def __call__(self, x, y):
        return _as_ms(_t(x) - _t(y))


class Mul(_Primitive):
    def __call__(self, x, y):
        return _as_ms(_t(x) * _t(y))


class Div(_Primitive):
    def __call__(self, x, y):
        return _as_ms(_t(x) / _t(y))


class ConvertToDynamic(_Primitive):
    """MindSpore's inner op that makes a graph's input dynamic: the identity here (an
    opjit call always knows its shapes)."""

    def __init__(self, is_dynamic_rank=False):
        self.is_dynamic_rank = bool(is_dynamic_rank)

    def __call__(self, x):
        return x


# ---- the submodules MindSpore code imports ---------------------------------------------------

def _module(name, doc, **attrs):
    full = __name__ + "." + name
    m = sys.modules.get(full)
    if m is None:
        m = types.ModuleType(full, doc)
        sys.modules[full] = m
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


_dtypes = {n: globals()[n] for n in _DTYPE_NAMES}
dtype = _module("common.dtype", "mindspore.common.dtype (mstype): numpy dtypes", **_dtypes)
_inner_ops = _module("ops.operations._inner_ops", "mindspore.ops.operations._inner_ops",
                     ConvertToDynamic=ConvertToDynamic)
_operations = _module("ops.operations", "mindspore.ops.operations", Custom=Custom,
                      _inner_ops=_inner_ops, Add=Add, Sub=Sub, Mul=Mul, Div=Div)
ops = _module("ops", "mindspore.ops: Custom, CustomRegOp, DataType and a few primitives",
              Custom=Custom, CustomRegOp=CustomRegOp, DataType=DataType,
              custom_info_register=custom_info_register, GradOperation=GradOperation,
              Add=Add, Sub=Sub, Mul=Mul, Div=Div, operations=_operations)
nn = _module("nn", "mindspore.nn: Cell", Cell=Cell)
context = _module("context", "mindspore.context: set_context/get_context (checked, remembered)",
                  set_context=set_context, get_context=get_context, GRAPH_MODE=GRAPH_MODE,
                  PYNATIVE_MODE=PYNATIVE_MODE)
common = _module("common", "mindspore.common", dtype=dtype, Tensor=Tensor)
sys.modules[__name__ + ".dtype"] = dtype  # from mindspore import dtype as mstype

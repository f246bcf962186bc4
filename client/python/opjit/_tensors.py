"""numpy <-> opjit.v1.Tensor conversions, dtypes, attrs and DLPack."""

import json
import numbers

import numpy as np

from opjit._proto import exec_pb2
from opjit.errors import InvalidArgument

# opjit dtype name -> numpy dtype (native byte order).
DTYPES = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}

HAS_DLPACK = hasattr(np, "from_dlpack")


def dtype_name(dt):
    """The opjit name of a numpy dtype; InvalidArgument if opjit has none."""
    dt = np.dtype(dt)
    name = _NAMES.get(dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt)
    if name is None:
        raise InvalidArgument("dtype %s is not supported by opjit (supported: %s)"
                              % (dt, " ".join(DTYPES)))
    return name


def numpy_dtype(name):
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument("the server returned unknown dtype %r" % name) from None


def from_dlpack(x):
    """An ndarray over the memory of any object with ``__dlpack__`` (zero copy).

    CPU tensors only (numpy's limit). Needs numpy >= 1.22.
    """
    if not HAS_DLPACK:
        raise NotImplementedError(
            "opjit.from_dlpack needs numpy >= 1.22 (np.from_dlpack); this is numpy %s"
            % np.__version__)
    return np.from_dlpack(x)


def as_ndarray(x, what="input"):
    """Turns an input value into an ndarray (never copies an ndarray)."""
    if type(x) is np.ndarray and x.dtype in _NAMES:
        return x  # the common case: a supported dtype in native byte order
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "__opjit_array__"):
        arr = x.__opjit_array__()
    elif hasattr(x, "__dlpack__") and not isinstance(x, (list, tuple)):
        arr = from_dlpack(x)
    else:
        arr = np.asarray(x)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "<" and not _little()):
        arr = arr.astype(arr.dtype.newbyteorder("="))
    dtype_name(arr.dtype)  # raises for unsupported dtypes
    return arr


def _little():
    import sys
    return sys.byteorder == "little"


def inline_tensor(arr):
    t = exec_pb2.Tensor(dtype=dtype_name(arr.dtype), shape=list(arr.shape))
    t.inline_data = np.ascontiguousarray(arr).tobytes()
    return t


def array_from_inline(t, data=None):
    """A writable array of an inline output: `t`'s inline_data, or `data`
    (a bytes-like view of them, see split_inline_response) when given."""
    dt = numpy_dtype(t.dtype)
    shape = tuple(t.shape)
    if data is None:
        data = t.inline_data
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(data) != n * dt.itemsize:
        raise InvalidArgument("the server returned %d bytes for %s %s"
                              % (len(data), t.dtype, list(shape)))
    # A writable copy, like the shared-memory path's writable views: the
    # one copy the bytes take in this process after gRPC handed them over.
    return np.frombuffer(data, dtype=dt, count=n).reshape(shape).copy()


# ---- inline tensors on the wire, without intermediate copies ----------------------
#
# A big inline call through the generated messages copies its bytes three
# times on the way out (ndarray.tobytes, the message field, SerializeToString)
# and three times on the way in (parse, .inline_data, the writable copy).
# These two functions write and read the ForwardRequest/ForwardResponse wire
# format around the tensor bytes instead: everything but the bytes still goes
# through the generated messages, and the bytes are copied once each way
# (into the request, out of the response). Protobuf accepts fields in any
# order and concatenated encodings of one message merge, which is what makes
# this exact.

_INPUTS = 5        # ForwardRequest.inputs (InputArg)
_TENSORS = 1       # InputArg.tensors (Tensor)
_INLINE_DATA = 4   # Tensor.inline_data
_OUTPUTS = 1       # ForwardResponse.outputs (Tensor)


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field, n):
    """The key and length of a length-delimited field of n bytes."""
    return _varint((field << 3) | 2) + _varint(n)


def encode_inline_request(header, groups):
    """The serialized ForwardRequest `header` (no inputs set) with `groups`
    (per declared input, a list of ndarrays) as its inline inputs: bytes,
    built with one copy of each array's data."""
    parts = [header.SerializeToString()]
    for g in groups:
        arg_parts = []
        arg_len = 0
        for arr in g:
            arr = np.ascontiguousarray(arr)
            head = exec_pb2.Tensor(dtype=dtype_name(arr.dtype),
                                   shape=list(arr.shape)).SerializeToString()
            data = arr.reshape(-1).view(np.uint8).data if arr.nbytes else b""
            data_key = _len_field(_INLINE_DATA, arr.nbytes)
            t_len = len(head) + len(data_key) + arr.nbytes
            t_key = _len_field(_TENSORS, t_len)
            arg_parts += [t_key, head, data_key, data]
            arg_len += len(t_key) + t_len
        parts.append(_len_field(_INPUTS, arg_len))
        parts += arg_parts
    return b"".join(parts)


def _read_varint(buf, pos, end):
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise InvalidArgument("the server's answer is not a valid message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _records(buf, start, end):
    """(field, wire_type, record_start, value_start, record_end) of each
    field in buf[start:end]."""
    pos = start
    while pos < end:
        rec = pos
        key, pos = _read_varint(buf, pos, end)
        field, wt = key >> 3, key & 7
        if wt == 0:
            _, pos = _read_varint(buf, pos, end)
            val = pos
        elif wt == 1:
            val, pos = pos, pos + 8
        elif wt == 5:
            val, pos = pos, pos + 4
        elif wt == 2:
            n, val = _read_varint(buf, pos, end)
            pos = val + n
        else:
            raise InvalidArgument("the server's answer is not a valid message")
        if pos > end:
            raise InvalidArgument("the server's answer is not a valid message")
        yield field, wt, rec, val, pos


def split_inline_response(data):
    """Parses a serialized ForwardResponse; returns (response, views): the
    response with every output's inline_data left out, and per output a
    memoryview of its inline bytes inside `data` (None for a shm output)."""
    buf = memoryview(data)
    rest = []
    views = []
    for field, wt, rec, val, end in _records(buf, 0, len(buf)):
        if field != _OUTPUTS or wt != 2:
            rest.append(buf[rec:end])
            continue
        head = []
        view = None
        for f2, wt2, rec2, val2, end2 in _records(buf, val, end):
            if f2 == _INLINE_DATA and wt2 == 2:
                view = buf[val2:end2]  # the last one wins, as in protobuf
            else:
                head.append(buf[rec2:end2])
        head = b"".join(head)
        rest += [_len_field(_OUTPUTS, len(head)), head]
        views.append(view)
    return exec_pb2.ForwardResponse.FromString(b"".join(rest)), views


# ---- attributes -------------------------------------------------------------

def _is_int(v):
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_bool(v):
    return isinstance(v, (bool, np.bool_))


def _is_real(v):
    return isinstance(v, (numbers.Real, np.floating, np.integer)) and not _is_bool(v)


def attr_value(name, value, value_type=""):
    """A Python value as an opjit.v1.AttrValue, typed by the op's value_type when known."""
    V = exec_pb2.AttrValue
    if isinstance(value, V):
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    try:
        if value_type == "bool":
            return V(b=bool(value))
        if value_type == "int":
            if not _is_int(value):
                raise TypeError
            return V(i=int(value))
        if value_type == "float":
            if not _is_real(value):
                raise TypeError
            return V(f=float(value))
        if value_type == "str":
            if not isinstance(value, str):
                raise TypeError
            return V(s=value)
        if value_type == "listInt":
            return V(ints=exec_pb2.IntList(values=[_int(x) for x in value]))
        if value_type == "listFloat":
            return V(floats=exec_pb2.FloatList(values=[_real(x) for x in value]))
        if value_type == "listBool":
            return V(bools=exec_pb2.BoolList(values=[bool(x) for x in value]))
        if value_type == "listStr":
            return V(strs=exec_pb2.StringList(values=[_str(x) for x in value]))
        if value_type == "listListInt":
            return V(int_lists=exec_pb2.IntListList(
                values=[exec_pb2.IntList(values=[_int(x) for x in row]) for row in value]))
        if value_type == "listListFloat":
            return V(float_lists=exec_pb2.FloatListList(
                values=[exec_pb2.FloatList(values=[_real(x) for x in row]) for row in value]))
    except (TypeError, ValueError):
        raise InvalidArgument("attrs[%s]: %r is not a %s" % (name, value, value_type)) from None
    return _infer_attr(name, value)


def _int(x):
    if not _is_int(x):
        raise TypeError
    return int(x)


def _real(x):
    if not _is_real(x):
        raise TypeError
    return float(x)


def _str(x):
    if not isinstance(x, str):
        raise TypeError
    return x


def _infer_attr(name, value):
    """Types a value by its Python type (for attrs the op does not declare)."""
    V = exec_pb2.AttrValue
    if _is_bool(value):
        return V(b=bool(value))
    if _is_int(value):
        return V(i=int(value))
    if _is_real(value):
        return V(f=float(value))
    if isinstance(value, str):
        return V(s=value)
    if isinstance(value, list):
        if all(_is_bool(x) for x in value) and value:
            return V(bools=exec_pb2.BoolList(values=[bool(x) for x in value]))
        if all(_is_int(x) for x in value):
            return V(ints=exec_pb2.IntList(values=[int(x) for x in value]))
        if all(_is_real(x) for x in value):
            return V(floats=exec_pb2.FloatList(values=[float(x) for x in value]))
        if all(isinstance(x, str) for x in value):
            return V(strs=exec_pb2.StringList(values=value))
        if all(isinstance(x, (list, tuple)) for x in value):
            rows = [list(r) for r in value]
            if all(_is_int(x) for r in rows for x in r):
                return V(int_lists=exec_pb2.IntListList(
                    values=[exec_pb2.IntList(values=[int(x) for x in r]) for r in rows]))
            if all(_is_real(x) for r in rows for x in r):
                return V(float_lists=exec_pb2.FloatListList(
                    values=[exec_pb2.FloatList(values=[float(x) for x in r]) for r in rows]))
    raise InvalidArgument("attrs[%s]: cannot pass a value of type %s" % (name, type(value).__name__))


def default_text(value):
    """A Python default value as the registry's text form ("0.01", "[1, 2]", "true")."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if _is_bool(value):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(_plain(value))
    return str(value)


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if _is_bool(v):
        return bool(v)
    if _is_int(v):
        return int(v)
    if _is_real(v):
        return float(v)
    return v

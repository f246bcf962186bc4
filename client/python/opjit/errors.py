"""Exceptions: one class per gRPC status code family.

Every error the client raises for a failed call is an :class:`OpjitError`
carrying ``.code`` (a :class:`grpc.StatusCode`), ``.message`` (the
server's text, unchanged) and ``.reason``: the machine-readable reason from
the status details (``google.rpc.ErrorInfo``), e.g. ``"QUOTA_EXCEEDED"`` or
``"REGION_NOT_REGISTERED"``, with ``.metadata`` (a dict). Decide on
``.reason``, never on the message text. Compile failures also carry
``.diagnostics``: (file, line, column, severity, text) tuples, the first
ones that fit the status's bound (a few KiB), and ``.omitted_diagnostics``:
how many more the compiler printed. Errors found on the client before any RPC (a bad
spec, an unsupported dtype) use the same classes and codes, so one ``except``
clause covers both.
"""

import grpc

__all__ = [
    "OpjitError", "InvalidArgument", "NotFound", "AlreadyExists", "PermissionDenied",
    "FailedPrecondition", "ResourceExhausted", "Unavailable", "DeadlineExceeded",
    "Unimplemented", "Internal", "Cancelled", "Aborted", "OutOfRange", "DataLoss",
    "Unauthenticated", "Unknown", "error_from_rpc", "error_from_status", "Diagnostic",
    "GradRuleError", "SavedTensorModifiedError", "LeafInplaceError", "PyLayerError",
]

_ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
_DIAGNOSTICS_TYPE = "type.googleapis.com/opjit.v1.CompileDiagnostics"


class Diagnostic(tuple):
    """One compiler diagnostic: (file, line, column, severity, text)."""
    __slots__ = ()

    def __new__(cls, file, line, column, severity, text):
        return tuple.__new__(cls, (file, line, column, severity, text))

    file = property(lambda self: self[0])
    line = property(lambda self: self[1])
    column = property(lambda self: self[2])
    severity = property(lambda self: self[3])
    text = property(lambda self: self[4])


class OpjitError(Exception):
    """Base class of every opjit error.

    Attributes:
      code: the grpc.StatusCode.
      message: the server's (or client's) text.
      details: the raw grpc.RpcError when the error came from a call, else None.
      reason: the server's machine-readable reason ("" when none was sent).
      metadata: dict of the reason's metadata (e.g. quota, limit, namespace).
      diagnostics: list of Diagnostic for COMPILE_FAILED, else []: the first
        ones, as many as fit the status's bound.
      omitted_diagnostics: how many diagnostics the compiler printed past
        those (0 when all came, or for other errors).
    """

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, message, code=None, details=None, reason="", metadata=None,
                 diagnostics=None, omitted_diagnostics=0):
        self.code = code if code is not None else self.default_code
        self.message = message
        self.details = details
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.diagnostics = list(diagnostics or [])
        self.omitted_diagnostics = int(omitted_diagnostics or 0)
        super().__init__(message)

    def __str__(self):
        name = self.code.name if isinstance(self.code, grpc.StatusCode) else str(self.code)
        return "%s: %s" % (name, self.message)


class InvalidArgument(OpjitError, ValueError):
    """Bad input: a spec, an attr, a dtype no dtype_format allows, a compile error."""
    default_code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(OpjitError, ValueError):
    default_code = grpc.StatusCode.OUT_OF_RANGE


class NotFound(OpjitError, LookupError):
    """An unknown op, version, region or context."""
    default_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(OpjitError):
    default_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(OpjitError):
    default_code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(OpjitError):
    default_code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(OpjitError):
    """E.g. backward on a context that does not exist (any more)."""
    default_code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(OpjitError):
    default_code = grpc.StatusCode.ABORTED


class ResourceExhausted(OpjitError):
    """Memory, a quota or a message limit is full."""
    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(OpjitError, ConnectionError):
    """The daemon cannot be reached, or the target (GPU) is not there."""
    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(OpjitError, TimeoutError):
    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(OpjitError):
    default_code = grpc.StatusCode.CANCELLED


class Unimplemented(OpjitError, NotImplementedError):
    """The server does not offer this RPC (an older daemon)."""
    default_code = grpc.StatusCode.UNIMPLEMENTED


class Internal(OpjitError):
    default_code = grpc.StatusCode.INTERNAL


class DataLoss(OpjitError):
    default_code = grpc.StatusCode.DATA_LOSS


class Unknown(OpjitError):
    default_code = grpc.StatusCode.UNKNOWN


_BY_CODE = {cls.default_code: cls for cls in (
    InvalidArgument, OutOfRange, NotFound, AlreadyExists, PermissionDenied, Unauthenticated,
    FailedPrecondition, Aborted, ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled,
    Unimplemented, Internal, DataLoss, Unknown)}


def _rich_details(err):
    """(reason, metadata, diagnostics, omitted_diagnostics) from the status
    details trailer."""
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:
        return "", {}, [], 0
    blob = None
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            blob = value
    if not blob:
        return "", {}, [], 0
    try:
        from opjit.v1 import error_pb2
        status = error_pb2.Status()
        status.ParseFromString(blob)
    except Exception:  # not ours, or an older server
        return "", {}, [], 0
    reason, metadata, diagnostics, omitted = "", {}, [], 0
    for any_msg in status.details:
        if any_msg.type_url == _ERROR_INFO_TYPE:
            info = error_pb2.ErrorInfo()
            info.ParseFromString(any_msg.value)
            reason, metadata = info.reason, dict(info.metadata)
        elif any_msg.type_url == _DIAGNOSTICS_TYPE:
            diags = error_pb2.CompileDiagnostics()
            diags.ParseFromString(any_msg.value)
            diagnostics = [Diagnostic(d.file, d.line, d.column, d.severity, d.text)
                           for d in diags.diagnostics]
            omitted = diags.omitted_diagnostics
    return reason, metadata, diagnostics, omitted


_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def error_from_status(code, message, reason="", metadata=None, diagnostics=None, details=None,
                      omitted_diagnostics=0):
    """The OpjitError subclass for a status: the one constructor of every call error.

    code: a grpc.StatusCode or its number (as the fast channel's reply
    carries it). Both transports build their errors here, so a failure
    raises the same class with the same ``.code`` and ``.reason`` whichever
    path the call took.
    """
    if not isinstance(code, grpc.StatusCode):
        code = _CODE_BY_NUMBER.get(int(code), grpc.StatusCode.UNKNOWN)
    cls = _BY_CODE.get(code, OpjitError)
    return cls(message, code=code, details=details, reason=reason or "", metadata=metadata,
               diagnostics=diagnostics, omitted_diagnostics=omitted_diagnostics)


def error_from_rpc(err):
    """Converts a grpc.RpcError into the matching OpjitError subclass."""
    try:
        code = err.code()
        message = err.details() or ""
    except Exception:  # not a call error (should not happen)
        code, message = grpc.StatusCode.UNKNOWN, str(err)
    reason, metadata, diagnostics, omitted = _rich_details(err)
    return error_from_status(code, message, reason=reason, metadata=metadata,
                             diagnostics=diagnostics, details=err, omitted_diagnostics=omitted)


# ---- autograd rule errors (client side): each framework's exception type, as opjit errors

class GradRuleError(OpjitError, RuntimeError):
    """An autograd rule broken where torch raises RuntimeError: a Function's
    backward returned the wrong number of gradients, a gradient for an argument
    that is not a Tensor, something that is not a gradient; a tensor marked
    dirty that forward did not return; a second derivative through a backward
    marked @once_differentiable."""
    default_code = grpc.StatusCode.FAILED_PRECONDITION


class SavedTensorModifiedError(GradRuleError):
    """A tensor saved for backward was modified in place after it was saved
    (its version moved on). torch and Paddle both raise RuntimeError."""


class LeafInplaceError(GradRuleError, ValueError):
    """A leaf tensor that requires grad modified in place while grad is
    recorded, or returned as modified by a Function/PyLayer. torch raises
    RuntimeError, Paddle ValueError ("Leaf Var ... can't use inplace
    strategy"): this is both."""


class PyLayerError(InvalidArgument):
    """A PyLayer rule broken where Paddle raises ValueError: forward returned
    no Tensor, backward returned the wrong number of gradients, a gradient
    that is not a Tensor, or one for an input with stop_gradient."""


class OpjitWarning(UserWarning):
    """A problem the server (or the client) reported without failing the call:
    RegisterOpResponse.warnings, BackwardResponse.warnings."""


class StopGradientGradWarning(OpjitWarning):
    """A backward returned a nonzero gradient for an input that needs none
    (``stop_gradient`` / ``requires_grad=False``); the gradient was dropped."""

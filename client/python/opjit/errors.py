"""Exceptions: one class per gRPC status code family.

Every error the client raises for a failed call is an :class:`OpjitError`
carrying ``.code`` (a :class:`grpc.StatusCode`) and ``.message`` (the
server's text, unchanged). Errors found on the client before any RPC (a bad
spec, an unsupported dtype) use the same classes and codes, so one ``except``
clause covers both.
"""

import grpc

__all__ = [
    "OpjitError", "InvalidArgument", "NotFound", "AlreadyExists", "PermissionDenied",
    "FailedPrecondition", "ResourceExhausted", "Unavailable", "DeadlineExceeded",
    "Unimplemented", "Internal", "Cancelled", "Aborted", "OutOfRange", "DataLoss",
    "Unauthenticated", "Unknown", "error_from_rpc",
]


class OpjitError(Exception):
    """Base class of every opjit error.

    Attributes:
      code: the grpc.StatusCode.
      message: the server's (or client's) text.
      details: the raw grpc.RpcError when the error came from a call, else None.
    """

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, message, code=None, details=None):
        self.code = code if code is not None else self.default_code
        self.message = message
        self.details = details
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


def error_from_rpc(err):
    """Converts a grpc.RpcError into the matching OpjitError subclass."""
    try:
        code = err.code()
        message = err.details() or ""
    except Exception:  # not a call error (should not happen)
        code, message = grpc.StatusCode.UNKNOWN, str(err)
    cls = _BY_CODE.get(code, OpjitError)
    return cls(message, code=code, details=err)

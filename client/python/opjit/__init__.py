"""opjit: the Python client of the opjitd JIT kernel service.

    import numpy as np, opjit
    client = opjit.Client()                      # $OPJIT_SERVER or the default socket
    client.register("kernels/examples/leaky_relu.json")
    y = client.op("leaky_relu")(np.array([-1., 2.], np.float32), alpha=0.1)

See client/python/README.md for the tour: CustomRegOp, shared-memory tensors,
autograd (Tensor, its client-side arithmetic, Function, grad with create_graph,
gradcheck/gradgradcheck), verify/bench (kernels checked and timed in the
daemon), DLPack and errors.
"""

from opjit.errors import (OpjitError, InvalidArgument, NotFound, AlreadyExists, PermissionDenied,
                          FailedPrecondition, ResourceExhausted, Unavailable, DeadlineExceeded,
                          Unimplemented, Internal, Cancelled, Aborted, OutOfRange, DataLoss,
                          Unauthenticated, Unknown, OpjitWarning, StopGradientGradWarning,
                          GradRuleError, SavedTensorModifiedError, LeafInplaceError, PyLayerError)
from opjit.client import Client, ShmUnavailableError, default_address, load_spec
from opjit.regop import CustomRegOp, DataType
from opjit.autograd import (Tensor, tensor, to_tensor, Function, FunctionCtx, PyLayer,
                            PyLayerContext,
                            no_grad, enable_grad, is_grad_enabled, grad, once_differentiable)
from opjit.op import Op, gradcheck, GradCheckResult, GradCheckInput
from opjit._check import gradgradcheck, FunctionCheckResult
from opjit.evaluate import verify, bench, VerifyResult, VerifyCase, BenchResult, Timing
from opjit._math import tanh, exp, log, sqrt, square, randn, seed
from opjit._tensors import from_dlpack, DTYPES
from opjit._transport import PreparedCall

__version__ = "0.1.0"

__all__ = [
    "Client", "Op", "CustomRegOp", "DataType", "Tensor", "tensor", "to_tensor", "Function",
    "FunctionCtx",
    "PyLayer", "PyLayerContext", "no_grad", "enable_grad", "is_grad_enabled", "grad",
    "gradcheck", "GradCheckResult", "GradCheckInput", "gradgradcheck", "FunctionCheckResult",
    "verify", "bench", "VerifyResult", "VerifyCase", "BenchResult", "Timing",
    "tanh", "exp", "log", "sqrt", "square", "randn", "seed", "from_dlpack", "load_spec",
    "default_address", "DTYPES", "OpjitError", "InvalidArgument", "NotFound", "AlreadyExists",
    "PermissionDenied", "FailedPrecondition", "ResourceExhausted", "Unavailable",
    "DeadlineExceeded", "Unimplemented", "Internal", "Cancelled", "Aborted", "OutOfRange",
    "DataLoss", "Unauthenticated", "Unknown", "ShmUnavailableError", "OpjitWarning",
    "StopGradientGradWarning", "PreparedCall", "once_differentiable", "GradRuleError",
    "SavedTensorModifiedError", "LeafInplaceError", "PyLayerError",
]

"""Imports of the generated opjit.v1 stubs, with a clear error when missing."""

try:
    from opjit.v1 import compile_pb2, exec_pb2, memory_pb2, op_pb2, registry_pb2, server_pb2
    from opjit.v1 import compile_pb2_grpc, exec_pb2_grpc, memory_pb2_grpc, registry_pb2_grpc
    from opjit.v1 import evaluate_pb2, evaluate_pb2_grpc, server_pb2_grpc
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "opjit: the generated opjit.v1 protobuf modules are missing (%s). They are made at "
        "build time: build the CMake target `opjit_python` and put <build>/python on "
        "PYTHONPATH, or install the package." % e) from e

__all__ = [
    "compile_pb2", "exec_pb2", "memory_pb2", "op_pb2", "registry_pb2", "server_pb2",
    "evaluate_pb2", "compile_pb2_grpc", "exec_pb2_grpc", "memory_pb2_grpc", "registry_pb2_grpc",
    "evaluate_pb2_grpc", "server_pb2_grpc",
]

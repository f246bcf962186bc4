"""Generated protobuf and gRPC modules of the opjit.v1 contract.

The ``*_pb2.py`` and ``*_pb2_grpc.py`` files next to this one are produced at
build time (CMake target ``opjit_python``) from ``proto/opjit/v1/*.proto``;
none are committed.
"""

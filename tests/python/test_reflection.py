"""Generic gRPC tools can introspect opjitd: server reflection and health,
spoken with raw protobuf bytes (Debian ships no grpc_reflection package)."""
import grpc


def _identity(b):
    return b


def test_reflection_lists_opjit_services(daemon):
    with grpc.insecure_channel(daemon.unix_address) as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=_identity, response_deserializer=_identity)
        # ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
        replies = list(call(iter([b"\x3a\x00"]), timeout=30))
    assert len(replies) == 1
    listing = replies[0]
    for service in (b"opjit.v1.Registry", b"opjit.v1.Executor", b"opjit.v1.Memory",
                    b"opjit.v1.Compiler", b"opjit.v1.Server", b"grpc.health.v1.Health"):
        assert service in listing, listing


def test_reflection_serves_file_descriptors(daemon):
    with grpc.insecure_channel(daemon.unix_address) as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=_identity, response_deserializer=_identity)
        symbol = b"opjit.v1.Executor"
        # file_containing_symbol: field 4.
        req = b"\x22" + bytes([len(symbol)]) + symbol
        reply = list(call(iter([req]), timeout=30))[0]
    assert b"opjit/v1/exec.proto" in reply
    assert b"GradCheck" in reply


def test_health_check_serving(daemon):
    with grpc.insecure_channel(daemon.unix_address) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=_identity, response_deserializer=_identity)
        assert check(b"", timeout=30) == b"\x08\x01"  # status: SERVING

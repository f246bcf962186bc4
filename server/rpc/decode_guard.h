// Requests that do not decode. gRPC's callback API answers them UNIMPLEMENTED
// with an empty message, and libprotobuf logs an ERROR line for each (for a
// string field that is not UTF-8): one line per request an attacker sends.
// The decode guard answers them INVALID_ARGUMENT with a message naming the
// method, and both logs are routed to the "rpc" logger at most once a second.
#pragma once

#include <memory>

#include <grpcpp/support/server_interceptor.h>

namespace opjit::rpc {

// The interceptor factory to install on the server builder.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeDecodeGuardFactory();

// Sends libprotobuf's own log lines to the "rpc" logger, rate-limited.
// Process-wide; call once before serving.
void RouteProtobufLogs();

}  // namespace opjit::rpc

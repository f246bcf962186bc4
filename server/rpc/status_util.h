// The one place where absl::Status becomes grpc::Status. absl's codes have the
// same numbers as gRPC's.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"

namespace opjit::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);

// Answers a callback unary call now with `status`.
grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const absl::Status& status);

// The namespace a request names, or "default" when it names none.
std::string NamespaceOrDefault(const std::string& ns);

}  // namespace opjit::rpc

// The one place where absl::Status becomes grpc::Status. absl's codes have the
// same numbers as gRPC's.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace opjit::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace opjit::rpc

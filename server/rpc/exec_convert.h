// proto <-> exec domain types shared by the Executor and Evaluator services:
// tensors, inputs, attrs and the call's deadline. Inline bytes are views into
// the request, which must outlive the converted values.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "opjit/v1/exec.pb.h"
#include "server/exec/executor.h"

namespace opjit::rpc {

// `what` names the tensor in messages; called only on error.
absl::StatusOr<exec::TensorArg> TensorFromProto(const v1::Tensor& t,
                                                absl::FunctionRef<std::string()> what);
absl::StatusOr<std::vector<std::vector<exec::TensorArg>>> InputsFromProto(
    const google::protobuf::RepeatedPtrField<v1::InputArg>& inputs);
absl::StatusOr<std::map<std::string, exec::AttrArg>> AttrsFromProto(
    const google::protobuf::Map<std::string, v1::AttrValue>& attrs);
// The call's gRPC deadline on the steady clock (max: none).
std::chrono::steady_clock::time_point SteadyDeadline(const grpc::CallbackServerContext& ctx);

}  // namespace opjit::rpc

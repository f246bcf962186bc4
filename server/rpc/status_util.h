// The one place where absl::Status becomes grpc::Status. absl's codes have the
// same numbers as gRPC's. Every error carries an opjit.v1.Status in the
// status details: an ErrorInfo with the status's reason (see
// server/common/error_info.h; the code's name when none was attached) and,
// for COMPILE_FAILED, the parsed compiler diagnostics.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace opjit::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The ErrorInfo reason a status made by ToGrpcStatus carries ("" for OK or
// none).
std::string ReasonOf(const grpc::Status& status);

// Answers a callback unary call now with `status`.
grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const absl::Status& status);

// "INVALID_ARGUMENT" etc.: the status code's canonical name.
const char* StatusCodeName(absl::StatusCode code);

// The namespace a request names, or "default" when it names none.
std::string NamespaceOrDefault(const std::string& ns);

// One "file:line:col: severity: text" line of compiler output.
struct ParsedDiagnostic {
  std::string file;
  int line = 0;
  int column = 0;
  std::string severity;
  std::string text;
};
// The diagnostics in clang/NVRTC output (other lines are skipped).
std::vector<ParsedDiagnostic> ParseDiagnostics(const std::string& text);

}  // namespace opjit::rpc

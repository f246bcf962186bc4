// The one place where absl::Status becomes grpc::Status. absl's codes have the
// same numbers as gRPC's. Every error carries an opjit.v1.Status in the
// status details: an ErrorInfo with the status's reason (see
// server/common/error_info.h; the code's name when none was attached) and,
// for COMPILE_FAILED, the parsed compiler diagnostics.
//
// A status travels in HTTP/2 metadata (the trailers, or the only headers of a
// trailers-only response), which gRPC clients cap at 8 KiB by default;
// past it the client sees RESOURCE_EXHAUSTED "received initial metadata size
// exceeds limit" instead of the error. So ToGrpcStatus bounds what it sends:
// grpc-message (percent-encoded) at kMaxStatusMessageBytes and the serialized
// details (base64-encoded as grpc-status-details-bin) at
// kMaxStatusDetailsBytes, about 5.4 KiB on the wire in all.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace opjit::rpc {

// The most grpc-message may take as sent: a byte outside printable ASCII (and
// '%') is percent-encoded, three bytes.
inline constexpr size_t kMaxStatusMessageBytes = 1024;
// The most the serialized opjit.v1.Status (its message, ErrorInfo and
// diagnostics) may take; base64 makes it 4/3 as large on the wire.
inline constexpr size_t kMaxStatusDetailsBytes = 3072;

// `status` as gRPC's, bounded as above. A message past its bound keeps its
// first bytes (for compiler output: whole lines) and ends in
// "\n... (N KiB) not shown" (for COMPILE_FAILED: "\n... and K more
// diagnostics (N KiB) not shown"). COMPILE_FAILED's details carry the first
// diagnostics that fit and, in CompileDiagnostics.omitted_diagnostics, the
// count of the rest; ErrorInfo metadata values are cut to 128 bytes.
grpc::Status ToGrpcStatus(const absl::Status& status);

// How many bytes `text` takes as a percent-encoded grpc-message.
size_t GrpcMessageWireSize(absl::string_view text);

// `text` cut so that its grpc-message form fits `max` bytes (at least 128),
// marker included: itself when it fits; otherwise its first bytes (cut at a line end
// when one lies in the second half of the room, and never inside a UTF-8
// character) plus "\n... (N KiB) not shown", or "\n... and K more diagnostics
// (N KiB) not shown" when `text` is compiler output with K diagnostics past
// the cut.
std::string BoundStatusMessage(absl::string_view text, size_t max, bool compiler_output);

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
// The diagnostics in clang/NVRTC output (other lines are skipped): the first
// `max` of them, and in *total (when not null) how many the text holds.
std::vector<ParsedDiagnostic> ParseDiagnostics(
    absl::string_view text, size_t max = std::numeric_limits<size_t>::max(),
    size_t* total = nullptr);

}  // namespace opjit::rpc

#include "server/rpc/status_util.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "opjit/v1/error.pb.h"
#include "server/common/error_info.h"
#include "server/common/text.h"

namespace opjit::rpc {
namespace {

constexpr char kDomain[] = "opjit.dev";
constexpr char kErrorInfoType[] = "type.googleapis.com/google.rpc.ErrorInfo";
constexpr char kDiagnosticsType[] = "type.googleapis.com/opjit.v1.CompileDiagnostics";
constexpr size_t kMaxDiagnostics = 200;

}  // namespace

const char* StatusCodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal: return "INTERNAL";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss: return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

namespace {

bool AllDigits(absl::string_view s) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// Parses one "file:line:col: severity: text" line into *out (when not null);
// false for any other line.
bool ParseDiagnosticLine(absl::string_view line, ParsedDiagnostic* out) {
  // Longest first: "fatal error" before "error".
  static constexpr absl::string_view kMarkers[] = {": fatal error: ", ": error: ", ": warning: ",
                                                   ": note: ", ": remark: "};
  for (absl::string_view marker : kMarkers) {
    const size_t at = line.find(marker);
    if (at == absl::string_view::npos) continue;
    // file:line:col before the marker (file may hold ':' only before line).
    absl::string_view loc = line.substr(0, at);
    const size_t c2 = loc.rfind(':');
    if (c2 == absl::string_view::npos) return false;
    const size_t c1 = loc.rfind(':', c2 == 0 ? 0 : c2 - 1);
    if (c1 == absl::string_view::npos || c1 == 0) return false;
    absl::string_view l = loc.substr(c1 + 1, c2 - c1 - 1), c = loc.substr(c2 + 1);
    if (!AllDigits(l) || !AllDigits(c)) return false;
    if (out != nullptr) {
      out->file = std::string(loc.substr(0, c1));
      out->line = std::atoi(std::string(l).c_str());
      out->column = std::atoi(std::string(c).c_str());
      out->severity = std::string(marker.substr(2, marker.size() - 4));
      out->text = std::string(line.substr(at + marker.size()));
    }
    return true;
  }
  return false;
}

// What one byte costs in a percent-encoded grpc-message: printable ASCII but
// '%' goes as is, anything else as "%XX".
size_t WireCost(char c) {
  const auto u = static_cast<unsigned char>(c);
  return (u >= 0x20 && u <= 0x7E && u != '%') ? 1 : 3;
}

// The most the marker BoundStatusMessage appends can take on the wire.
constexpr size_t kMarkerRoom = 96;
// Cuts of what a COMPILE_FAILED status's details carry per diagnostic.
constexpr size_t kMaxDiagnosticFileBytes = 128;
constexpr size_t kMaxDiagnosticTextBytes = 512;
// Cuts of ErrorInfo: its metadata stops growing past kMaxErrorInfoBytes.
constexpr size_t kMaxMetadataKeyBytes = 64;
constexpr size_t kMaxMetadataValueBytes = 128;
constexpr size_t kMaxErrorInfoBytes = 768;

}  // namespace

std::vector<ParsedDiagnostic> ParseDiagnostics(absl::string_view text, size_t max, size_t* total) {
  std::vector<ParsedDiagnostic> out;
  size_t count = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (out.size() < max) {
      ParsedDiagnostic d;
      if (!ParseDiagnosticLine(line, &d)) continue;
      out.push_back(std::move(d));
      ++count;
    } else if (total == nullptr) {
      break;
    } else if (ParseDiagnosticLine(line, nullptr)) {
      ++count;
    }
  }
  if (total != nullptr) *total = count;
  return out;
}

size_t GrpcMessageWireSize(absl::string_view text) {
  size_t n = 0;
  for (char c : text) n += WireCost(c);
  return n;
}

std::string BoundStatusMessage(absl::string_view text, size_t max, bool compiler_output) {
  if (GrpcMessageWireSize(text) <= max) return std::string(text);
  const size_t room = max > kMarkerRoom ? max - kMarkerRoom : 0;
  size_t n = 0;
  for (size_t cost = 0; n < text.size(); ++n) {
    cost += WireCost(text[n]);
    if (cost > room) break;
  }
  absl::string_view kept = Utf8Prefix(text, n);
  // Whole lines where that loses little: compiler output is read by line.
  const size_t nl = kept.rfind('\n');
  if (nl != absl::string_view::npos && nl >= kept.size() / 2) kept = kept.substr(0, nl);
  const std::string omitted = HumanBytes(text.size() - kept.size());
  std::string out(kept);
  size_t total = 0, shown = 0;
  if (compiler_output) {
    ParseDiagnostics(text, 0, &total);
    ParseDiagnostics(kept, 0, &shown);
  }
  if (total > shown) {
    absl::StrAppend(&out, "\n... and ", total - shown, " more diagnostics (", omitted,
                    ") not shown");
  } else {
    absl::StrAppend(&out, "\n... (", omitted, ") not shown");
  }
  return out;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const std::optional<ErrorReason> r = GetReason(status);
  const bool compile_failed = r && r->reason == reason::kCompileFailed;
  const std::string message =
      BoundStatusMessage(status.message(), kMaxStatusMessageBytes, compile_failed);
  v1::Status rich;
  rich.set_code(static_cast<int>(status.code()));
  rich.set_message(message);
  v1::ErrorInfo info;
  info.set_domain(kDomain);
  if (r) {
    info.set_reason(Excerpt(r->reason, kMaxMetadataKeyBytes));
    for (const auto& [k, v] : r->metadata) {
      if (info.ByteSizeLong() > kMaxErrorInfoBytes) break;
      (*info.mutable_metadata())[Excerpt(k, kMaxMetadataKeyBytes)] =
          Excerpt(v, kMaxMetadataValueBytes);
    }
  } else {
    info.set_reason(StatusCodeName(status.code()));
  }
  auto* any = rich.add_details();
  any->set_type_url(kErrorInfoType);
  any->set_value(info.SerializeAsString());
  if (compile_failed) {
    // The first diagnostics that fit what is left of the details' bound (the
    // Any around them and its type URL take under 64 bytes, one entry's
    // framing under 4), and the count of the rest.
    size_t total = 0;
    const std::vector<ParsedDiagnostic> parsed =
        ParseDiagnostics(status.message(), kMaxDiagnostics, &total);
    v1::CompileDiagnostics diags;
    size_t used = rich.ByteSizeLong() + sizeof(kDiagnosticsType) + 64;
    for (const ParsedDiagnostic& d : parsed) {
      v1::Diagnostic one;
      one.set_file(Excerpt(d.file, kMaxDiagnosticFileBytes));
      one.set_line(d.line);
      one.set_column(d.column);
      one.set_severity(d.severity);
      one.set_text(Excerpt(d.text, kMaxDiagnosticTextBytes));
      const size_t size = one.ByteSizeLong() + 4;
      if (used + size > kMaxStatusDetailsBytes) break;
      used += size;
      *diags.add_diagnostics() = std::move(one);
    }
    diags.set_omitted_diagnostics(static_cast<int32_t>(
        std::min<size_t>(total - static_cast<size_t>(diags.diagnostics_size()), INT32_MAX)));
    auto* dany = rich.add_details();
    dany->set_type_url(kDiagnosticsType);
    dany->set_value(diags.SerializeAsString());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), message,
                      rich.SerializeAsString());
}

std::string ReasonOf(const grpc::Status& status) {
  v1::Status rich;
  if (status.ok() || !rich.ParseFromString(status.error_details())) return "";
  for (const auto& any : rich.details()) {
    v1::ErrorInfo info;
    if (any.type_url() == kErrorInfoType && info.ParseFromString(any.value())) return info.reason();
  }
  return "";
}

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::string NamespaceOrDefault(const std::string& ns) { return ns.empty() ? "default" : ns; }

}  // namespace opjit::rpc

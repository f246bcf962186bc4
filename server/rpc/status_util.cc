#include "server/rpc/status_util.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "opjit/v1/error.pb.h"
#include "server/common/error_info.h"

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

}  // namespace

std::vector<ParsedDiagnostic> ParseDiagnostics(const std::string& text) {
  std::vector<ParsedDiagnostic> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (out.size() >= kMaxDiagnostics) break;
    // file:line:col: severity: text  (file may hold ':' only before line)
    static constexpr absl::string_view kSeverities[] = {"fatal error", "error", "warning", "note",
                                                       "remark"};
    for (absl::string_view sev : kSeverities) {
      const std::string marker = absl::StrCat(": ", sev, ": ");
      const size_t at = line.find(marker);
      if (at == absl::string_view::npos) continue;
      absl::string_view loc = line.substr(0, at);
      const size_t c2 = loc.rfind(':');
      if (c2 == absl::string_view::npos) break;
      const size_t c1 = loc.rfind(':', c2 == 0 ? 0 : c2 - 1);
      if (c1 == absl::string_view::npos || c1 == 0) break;
      absl::string_view l = loc.substr(c1 + 1, c2 - c1 - 1), c = loc.substr(c2 + 1);
      if (!AllDigits(l) || !AllDigits(c)) break;
      ParsedDiagnostic d;
      d.file = std::string(loc.substr(0, c1));
      d.line = std::atoi(std::string(l).c_str());
      d.column = std::atoi(std::string(c).c_str());
      d.severity = std::string(sev);
      d.text = std::string(line.substr(at + marker.size()));
      out.push_back(std::move(d));
      break;
    }
  }
  return out;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  v1::Status rich;
  rich.set_code(static_cast<int>(status.code()));
  rich.set_message(std::string(status.message()));
  v1::ErrorInfo info;
  info.set_domain(kDomain);
  if (std::optional<ErrorReason> r = GetReason(status)) {
    info.set_reason(r->reason);
    for (const auto& [k, v] : r->metadata) (*info.mutable_metadata())[k] = v;
  } else {
    info.set_reason(StatusCodeName(status.code()));
  }
  auto* any = rich.add_details();
  any->set_type_url(kErrorInfoType);
  any->set_value(info.SerializeAsString());
  if (info.reason() == reason::kCompileFailed) {
    v1::CompileDiagnostics diags;
    for (const ParsedDiagnostic& d : ParseDiagnostics(std::string(status.message()))) {
      v1::Diagnostic* out = diags.add_diagnostics();
      out->set_file(d.file);
      out->set_line(d.line);
      out->set_column(d.column);
      out->set_severity(d.severity);
      out->set_text(d.text);
    }
    auto* dany = rich.add_details();
    dany->set_type_url(kDiagnosticsType);
    dany->set_value(diags.SerializeAsString());
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()),
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

#include "server/common/error_info.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace opjit {
namespace {

std::string OneLine(absl::string_view v) {
  std::string out(v);
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

}  // namespace

absl::Status WithReason(absl::Status status, absl::string_view reason,
                        std::initializer_list<std::pair<absl::string_view, std::string>> metadata) {
  if (status.ok()) return status;
  std::string text = OneLine(reason);
  for (const auto& [k, v] : metadata) absl::StrAppend(&text, "\n", OneLine(k), "=", OneLine(v));
  status.SetPayload(kReasonPayloadUrl, absl::Cord(text));
  return status;
}

std::optional<ErrorReason> GetReason(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kReasonPayloadUrl);
  if (!payload) return std::nullopt;
  ErrorReason out;
  bool first = true;
  const std::string text = std::string(*payload);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (first) {
      out.reason = std::string(line);
      first = false;
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) continue;
    out.metadata[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return out;
}

absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  if (status.ok()) return status;
  absl::Status out(status.code(), message);
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  return WithMessage(status, absl::StrCat(prefix, status.message()));
}

absl::Status QuotaExceeded(absl::string_view quota, absl::string_view limit, absl::string_view ns,
                           absl::string_view detail) {
  std::string msg = absl::StrCat("quota ", quota, " (", limit, ")");
  if (!ns.empty()) absl::StrAppend(&msg, " of namespace '", ns, "'");
  absl::StrAppend(&msg, " exceeded: ", detail);
  return WithReason(absl::ResourceExhaustedError(msg), reason::kQuotaExceeded,
                    {{"quota", std::string(quota)},
                     {"limit", std::string(limit)},
                     {"namespace", std::string(ns)}});
}

}  // namespace opjit

// Machine-readable reasons on absl::Status. A status that a client acts on
// carries a reason (an UPPER_SNAKE word such as "REGION_NOT_REGISTERED") and
// string metadata as a payload; the gRPC edge turns it into a
// google.rpc.ErrorInfo in the status details. Clients decide on the reason,
// never on the message text, so messages may be reworded freely.
//
// The payload is plain text so the core stays free of protobuf:
//   "<REASON>\n<key>=<value>\n..."   (values have '\n' replaced by ' ')
#pragma once

#include <map>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <utility>

#include "absl/status/status.h"

namespace opjit {

// The reasons clients act on. Stable: renaming one breaks clients.
namespace reason {
inline constexpr char kUnauthenticated[] = "UNAUTHENTICATED";
inline constexpr char kPermissionDenied[] = "PERMISSION_DENIED";
inline constexpr char kNamespaceNotFound[] = "NAMESPACE_NOT_FOUND";
inline constexpr char kOpNotFound[] = "OP_NOT_FOUND";
inline constexpr char kVersionNotFound[] = "VERSION_NOT_FOUND";
inline constexpr char kRegionNotRegistered[] = "REGION_NOT_REGISTERED";
inline constexpr char kRegionTooSmall[] = "REGION_TOO_SMALL";
inline constexpr char kContextNotFound[] = "CONTEXT_NOT_FOUND";
inline constexpr char kStaleHandle[] = "STALE_HANDLE";
inline constexpr char kQuotaExceeded[] = "QUOTA_EXCEEDED";
inline constexpr char kKernelCrashed[] = "KERNEL_CRASHED";
inline constexpr char kKernelFailed[] = "KERNEL_FAILED";
inline constexpr char kKernelTimeout[] = "KERNEL_TIMEOUT";
inline constexpr char kKernelQuarantined[] = "KERNEL_QUARANTINED";
inline constexpr char kCompileFailed[] = "COMPILE_FAILED";
inline constexpr char kInvalidSpec[] = "INVALID_SPEC";
inline constexpr char kMalformedRequest[] = "MALFORMED_REQUEST";
inline constexpr char kWorkerUnavailable[] = "WORKER_UNAVAILABLE";
// Client side only: the daemon itself exited while a call waited on its fast
// channel; the call was not answered (and may or may not have run).
inline constexpr char kDaemonExited[] = "DAEMON_EXITED";
// The registry database cannot be reached now; reads are served, writes are not.
inline constexpr char kStoreUnavailable[] = "STORE_UNAVAILABLE";
inline constexpr char kNotDifferentiable[] = "NOT_DIFFERENTIABLE";
// A forward op and the bprop it names disagree on the bprop's inputs,
// outputs or dtypes (see backward.inputs).
inline constexpr char kBpropMismatch[] = "BPROP_MISMATCH";
// A bprop returned a nonzero grad for an input that needs none, and the op
// says backward.stop_gradient_grads = "error".
inline constexpr char kStopGradientGrad[] = "STOP_GRADIENT_GRAD";
// A grad whose shape neither is its input's nor broadcasts to it (a grad that
// broadcasts is summed to the input's shape, as the frameworks do).
inline constexpr char kGradShape[] = "GRAD_SHAPE";
}  // namespace reason

// The type URL of opjit's reason payload on absl::Status.
inline constexpr char kReasonPayloadUrl[] = "opjit.dev/reason";

struct ErrorReason {
  std::string reason;
  std::map<std::string, std::string> metadata;
};

// `status` with `reason` and `metadata` attached (replacing an earlier
// reason). OK statuses are returned unchanged.
absl::Status WithReason(absl::Status status, absl::string_view reason,
                        std::initializer_list<std::pair<absl::string_view, std::string>> metadata = {});

// The reason attached to `status`, if any.
std::optional<ErrorReason> GetReason(const absl::Status& status);

// `status` with its message replaced by `message`, keeping its code, reason
// and every other payload.
absl::Status WithMessage(const absl::Status& status, absl::string_view message);

// `status` with `prefix` put before its message, keeping its code, reason
// and every other payload.
absl::Status Annotate(const absl::Status& status, absl::string_view prefix);

// RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED and metadata quota, limit
// and (when not empty) namespace. The message names the quota and its value.
absl::Status QuotaExceeded(absl::string_view quota, absl::string_view limit, absl::string_view ns,
                           absl::string_view detail);

}  // namespace opjit

// CallService: the call use cases of the Executor service (Forward, Prepare,
// Backward, GradCheck, ReleaseContext, ReleaseHandles), without gRPC.
//
//   admit (the namespace's calls_per_second) ─▶ the prepared handle, when
//   the call names one ─▶ the executor, or autograd when any input requires
//   a grad (autograd keeps a backward context) ─▶ done
//
// The rpc layer authenticates the caller and converts messages; it calls the
// steps one by one and converts the request between them, so a request that
// is refused for several reasons is refused for the same one as before:
// quota, then handle, then the request's own errors.
//
// Thread-safety: all methods are thread-safe (the service holds pointers
// only); callbacks run as the executor's and autograd's do: on the caller's
// thread (inline runs, early errors) or on their pools.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/autograd/autograd.h"
#include "server/exec/executor.h"
#include "server/exec/handles.h"

namespace opjit::access {
class QuotaManager;
}
namespace opjit::exec {
class ChannelManager;
}

namespace opjit::core {

class CallService {
 public:
  // No pointer is owned; all must outlive the service. `executor` must not
  // be null; the others may be: without `autograd` a call that requires a
  // grad, Backward, GradCheck and ReleaseContext answer UNIMPLEMENTED;
  // without `handles` FindHandle and PrepareAsync do; without `channels` no
  // handle is fast; without `quotas` every call is admitted.
  CallService(exec::Executor* executor, autograd::Autograd* autograd, exec::HandleTable* handles,
              exec::ChannelManager* channels, access::QuotaManager* quotas)
      : executor_(executor),
        autograd_(autograd),
        handles_(handles),
        channels_(channels),
        quotas_(quotas) {}

  // Admits one call (Forward, Backward, GradCheck) of namespace `ns`: OK, or
  // RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED naming "calls_per_second".
  absl::Status Admit(const std::string& ns) const;

  // OK, or UNIMPLEMENTED "this server has no prepared calls".
  absl::Status HandlesAvailable() const;

  // The prepared handle `id` of `owner` in `ns`. UNIMPLEMENTED without a
  // handle table; FAILED_PRECONDITION with reason STALE_HANDLE for one that
  // is unknown, released, another owner's or stale (see exec/handles.h).
  absl::StatusOr<std::shared_ptr<const exec::Handle>> FindHandle(const std::string& ns,
                                                                 const std::string& owner,
                                                                 uint64_t id) const;

  // The call of prepared handle `h` on `inputs`: op, version (the one
  // prepared), target, attrs and principal from the handle. INVALID_ARGUMENT
  // when the inputs' dtypes, shapes or count differ from what was prepared
  // ("inputs[0][0] is float32[3]; handle 7 was prepared for float32[4]
  // (prepare the new shape)"). Placements, deadline and request id are the
  // caller's to set.
  static absl::StatusOr<exec::ForwardCall> CallFromHandle(
      const exec::Handle& h, std::vector<std::vector<exec::TensorArg>> inputs);

  // Runs a forward: on the executor when no flag of `requires_grad` is set
  // (no backward context), else through autograd, which keeps one. Calls
  // `done(const absl::Status&, exec::ForwardResult* result, const
  // std::string& context_id)` exactly once; `result` is null on error and
  // may be moved from; `context_id` is "" when no context was kept. A
  // template so that the fast path wraps `done` in nothing more than the
  // executor's own callback.
  template <typename Done>
  void ForwardAsync(exec::ForwardCall call, absl::Span<const bool> requires_grad,
                    Done done) const;

  // Checks `call` as a forward would (its tensors' data is ignored: only
  // dtypes and shapes count) and keeps it as a handle of `owner`, fast when
  // it runs on the CPU and fast channels are enabled. UNIMPLEMENTED without a
  // handle table; the executor's errors; the handle table's
  // (RESOURCE_EXHAUSTED, QUOTA_EXCEEDED). `done` runs once.
  using PrepareCallback = std::function<void(absl::StatusOr<std::shared_ptr<const exec::Handle>>)>;
  void PrepareAsync(exec::ForwardCall call, const std::string& owner, PrepareCallback done) const;

  // Releases the given handles of `owner` (all when `ids` is empty); how
  // many. 0 without a handle table.
  int ReleaseHandles(const std::string& ns, const std::string& owner,
                     const std::vector<uint64_t>& ids) const;

  // Autograd's BackwardAsync (NOT_FOUND, CONTEXT_NOT_FOUND for an unknown
  // context).
  void BackwardAsync(autograd::BackwardCall call,
                     autograd::Autograd::BackwardCallback done) const;

  // Autograd's GradCheckAsync, after checking the random shape:
  // INVALID_ARGUMENT unless every dim is in [0, 4096].
  void GradCheckAsync(autograd::GradCheckCall call,
                      autograd::Autograd::GradCheckCallback done) const;

  // Releases a backward context: autograd's Release.
  absl::Status ReleaseContext(const std::string& ns, const std::string& context_id) const;

 private:
  static absl::Status NoAutograd();

  exec::Executor* const executor_;
  autograd::Autograd* const autograd_;
  exec::HandleTable* const handles_;
  exec::ChannelManager* const channels_;
  access::QuotaManager* const quotas_;
};

template <typename Done>
void CallService::ForwardAsync(exec::ForwardCall call, absl::Span<const bool> requires_grad,
                               Done done) const {
  if (std::find(requires_grad.begin(), requires_grad.end(), true) == requires_grad.end()) {
    // No input requires a grad: a plain forward, no backward context.
    executor_->ForwardAsync(std::move(call),
                            [done = std::move(done)](absl::StatusOr<exec::ForwardResult> r) mutable {
                              done(r.status(), r.ok() ? &*r : nullptr, std::string());
                            });
    return;
  }
  if (autograd_ == nullptr) return done(NoAutograd(), nullptr, std::string());
  autograd_->ForwardAsync(
      std::move(call), std::vector<bool>(requires_grad.begin(), requires_grad.end()),
      [done = std::move(done)](absl::StatusOr<autograd::GradForwardResult> r) mutable {
        if (!r.ok()) return done(r.status(), nullptr, std::string());
        done(r.status(), &r->forward, r->context_id);
      });
}

}  // namespace opjit::core

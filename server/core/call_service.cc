#include "server/core/call_service.h"

#include "absl/strings/str_cat.h"
#include "server/access/quotas.h"
#include "server/exec/channels.h"

namespace opjit::core {

absl::Status CallService::NoAutograd() {
  return absl::UnimplementedError("this server keeps no backward contexts");
}

absl::Status CallService::Admit(const std::string& ns) const {
  if (quotas_ == nullptr) return absl::OkStatus();
  return quotas_->AdmitCall(ns);
}

absl::Status CallService::HandlesAvailable() const {
  if (handles_ == nullptr) return absl::UnimplementedError("this server has no prepared calls");
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const exec::Handle>> CallService::FindHandle(
    const std::string& ns, const std::string& owner, uint64_t id) const {
  if (absl::Status s = HandlesAvailable(); !s.ok()) return s;
  return handles_->Get(ns, owner, id);
}

absl::StatusOr<exec::ForwardCall> CallService::CallFromHandle(
    const exec::Handle& h, std::vector<std::vector<exec::TensorArg>> inputs) {
  exec::ForwardCall call = h.call;
  call.version = h.prepared.record->version;
  call.inputs = std::move(inputs);
  size_t flat = 0;
  for (size_t i = 0; i < call.inputs.size(); ++i) {
    for (size_t k = 0; k < call.inputs[i].size(); ++k, ++flat) {
      const runner::TensorDesc& got = call.inputs[i][k].desc;
      if (flat >= h.prepared.inputs.size() || !(got == h.prepared.inputs[flat])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "inputs[", i, "][", k, "] is ", runner::DescString(got), "; handle ", h.id,
            " was prepared for ",
            flat < h.prepared.inputs.size() ? runner::DescString(h.prepared.inputs[flat])
                                            : std::string("fewer inputs"),
            " (prepare the new shape)"));
      }
    }
  }
  if (flat != h.prepared.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the call passes ", flat,
                                                   " input tensors; handle ", h.id,
                                                   " was prepared for ", h.prepared.inputs.size()));
  }
  return call;
}

void CallService::PrepareAsync(exec::ForwardCall call, const std::string& owner,
                               PrepareCallback done) const {
  if (absl::Status s = HandlesAvailable(); !s.ok()) return done(s);
  // Only dtypes and shapes count; data, if any, is ignored.
  for (auto& group : call.inputs) {
    for (auto& t : group) {
      if (!t.is_null()) t.data = exec::InlineBytes{};
    }
  }
  exec::ForwardCall kept = call;
  exec::HandleTable* handles = handles_;
  const bool channels = channels_ != nullptr && channels_->enabled();
  executor_->PrepareAsync(
      std::move(call), [handles, channels, owner, kept = std::move(kept),
                        done = std::move(done)](absl::StatusOr<exec::PreparedCall> p) mutable {
        if (!p.ok()) return done(p.status());
        const bool fast = p->target == registry::Target::kCpu && channels;
        const std::string ns = kept.ns;
        done(handles->Add(ns, owner, std::move(kept), *std::move(p), fast));
      });
}

int CallService::ReleaseHandles(const std::string& ns, const std::string& owner,
                                const std::vector<uint64_t>& ids) const {
  if (handles_ == nullptr) return 0;
  return handles_->Release(ns, owner, ids);
}

void CallService::BackwardAsync(autograd::BackwardCall call,
                                autograd::Autograd::BackwardCallback done) const {
  if (autograd_ == nullptr) return done(NoAutograd());
  autograd_->BackwardAsync(std::move(call), std::move(done));
}

void CallService::GradCheckAsync(autograd::GradCheckCall call,
                                 autograd::Autograd::GradCheckCallback done) const {
  for (int64_t d : call.random_shape) {
    if (d < 0 || d > 4096) {
      return done(absl::InvalidArgumentError(
          "random_shape dims must be in [0, 4096] (gradcheck runs 2 forwards per element)"));
    }
  }
  if (autograd_ == nullptr) return done(NoAutograd());
  autograd_->GradCheckAsync(std::move(call), std::move(done));
}

absl::Status CallService::ReleaseContext(const std::string& ns,
                                         const std::string& context_id) const {
  if (autograd_ == nullptr) return NoAutograd();
  return autograd_->Release(ns, context_id);
}

}  // namespace opjit::core

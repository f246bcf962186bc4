#include "server/exec/handles.h"

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/registry/registry.h"

namespace opjit::exec {
namespace {


absl::Status Stale(uint64_t id, absl::string_view why) {
  return WithReason(absl::FailedPreconditionError(absl::StrCat(
                        "handle ", id, " ", why, "; prepare the call again")),
                    reason::kStaleHandle);
}

}  // namespace

HandleTable::HandleTable(HandleTableOptions options, registry::Registry* registry)
    : options_(options), registry_(registry) {}

bool HandleTable::Current(const Handle& h) const {
  const uint64_t gen = registry_->generation();
  if (h.checked_generation.load(std::memory_order_acquire) == gen) return true;
  auto now = registry_->GetShared(h.ns, h.call.op, h.call.version);
  if (!now.ok() || now->get() != h.prepared.record.get()) return false;
  h.checked_generation.store(gen, std::memory_order_release);
  return true;
}

absl::StatusOr<std::shared_ptr<const Handle>> HandleTable::Add(const std::string& ns,
                                                               const std::string& owner,
                                                               ForwardCall call,
                                                               PreparedCall prepared, bool fast) {
  auto h = std::make_shared<Handle>();
  h->ns = ns;
  h->owner = owner;
  h->call = std::move(call);
  h->call.inputs.clear();
  h->call.outputs.clear();
  h->prepared = std::move(prepared);
  h->fast = fast;
  MutexLock lock(&mu_);
  size_t& used = per_namespace_[ns];
  if (used >= options_.max_per_namespace) {
    return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                          "namespace '", ns, "' holds ", used, " prepared handles, its limit; "
                          "release some (ReleaseHandles) or prepare fewer call shapes")),
                      reason::kQuotaExceeded,
                      {{"quota", "handles"},
                       {"limit", std::to_string(options_.max_per_namespace)},
                       {"namespace", ns}});
  }
  h->id = next_id_++;
  h->checked_generation.store(0);
  Owned& o = owners_[{ns, owner}];
  o.handles[h->id] = h;
  o.expires = options_.clock->Now() + std::chrono::milliseconds(options_.lease_ms);
  ++used;
  ++total_;
  return std::shared_ptr<const Handle>(std::move(h));
}

absl::StatusOr<std::shared_ptr<const Handle>> HandleTable::Get(const std::string& ns,
                                                               const std::string& owner,
                                                               uint64_t id) {
  std::shared_ptr<const Handle> h;
  {
    MutexLock lock(&mu_);
    auto o = owners_.find({ns, owner});
    if (o != owners_.end()) {
      auto it = o->second.handles.find(id);
      if (it != o->second.handles.end()) {
        h = it->second;
        o->second.expires = options_.clock->Now() + std::chrono::milliseconds(options_.lease_ms);
      }
    }
  }
  if (h == nullptr) return Stale(id, "is not one of this client's (released, or its lease lapsed)");
  if (!Current(*h)) {
    Release(ns, owner, {id});
    return Stale(id, absl::StrCat("is stale: op '", h->call.op,
                                  "' changed in the registry since it was prepared"));
  }
  return h;
}

int HandleTable::Release(const std::string& ns, const std::string& owner,
                         const std::vector<uint64_t>& ids) {
  MutexLock lock(&mu_);
  auto o = owners_.find({ns, owner});
  if (o == owners_.end()) return 0;
  int n = 0;
  if (ids.empty()) {
    n = static_cast<int>(o->second.handles.size());
    o->second.handles.clear();
  } else {
    for (uint64_t id : ids) n += static_cast<int>(o->second.handles.erase(id));
  }
  per_namespace_[ns] -= n;
  total_ -= n;
  if (o->second.handles.empty()) owners_.erase(o);
  if (per_namespace_[ns] == 0) per_namespace_.erase(ns);
  return n;
}

int HandleTable::ReleaseWhere(
    const std::function<bool(const std::string& ns, const std::string& owner)>& doomed) {
  std::vector<std::pair<std::string, std::string>> matched;
  {
    MutexLock lock(&mu_);
    for (const auto& [key, o] : owners_) {
      if (doomed(key.first, key.second)) matched.push_back(key);
    }
  }
  int n = 0;
  for (const auto& [ns, owner] : matched) n += Release(ns, owner, {});
  return n;
}

void HandleTable::Renew(const std::string& ns, const std::string& owner) {
  MutexLock lock(&mu_);
  auto o = owners_.find({ns, owner});
  if (o != owners_.end()) {
    o->second.expires = options_.clock->Now() + std::chrono::milliseconds(options_.lease_ms);
  }
}

int HandleTable::Expire(
    const std::function<bool(const std::string& ns, const std::string& owner)>& has_regions) {
  std::vector<std::pair<std::string, std::string>> lapsed;
  {
    MutexLock lock(&mu_);
    const auto now = options_.clock->Now();
    for (const auto& [key, o] : owners_) {
      if (o.expires <= now) lapsed.push_back(key);
    }
  }
  int n = 0;
  for (const auto& [ns, owner] : lapsed) {
    if (!has_regions(ns, owner)) n += Release(ns, owner, {});
  }
  return n;
}

size_t HandleTable::size() const {
  MutexLock lock(&mu_);
  return total_;
}

}  // namespace opjit::exec

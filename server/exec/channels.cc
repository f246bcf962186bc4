#include "server/exec/channels.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/random.h"
#include "server/common/status_macros.h"
#include "server/exec/handles.h"
#include "proto/opjit/wire/fast_channel.h"
#include "server/tensor/region.h"
#include "server/tensor/region_manager.h"

namespace opjit::exec {

ChannelManager::ChannelManager(ChannelOptions options, tensor::RegionManager* regions,
                               HandleTable* handles, runner::KernelRunner* runner)
    : options_(options), regions_(regions), handles_(handles), runner_(runner) {
  regions_->SetRemovalListener(
      [this](const std::vector<std::shared_ptr<const tensor::Region>>& removed) {
        OnRegionsRemoved(removed);
      });
}

ChannelManager::~ChannelManager() { Shutdown(); }

void ChannelManager::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  regions_->SetRemovalListener(nullptr);
  std::map<uint64_t, Entry> all;
  {
    MutexLock lock(&mu_);
    all.swap(channels_);
  }
  for (auto& [id, e] : all) e.channel->Close();
}

absl::StatusOr<ChannelInfo> ChannelManager::Open(const std::string& ns, const std::string& owner,
                                                 int64_t lease_ms,
                                                 std::optional<uid_t> client_uid,
                                                 runner::Caller caller) {
  if (!options_.enabled) {
    return absl::UnimplementedError("fast channels are disabled on this server ([fast] enabled)");
  }
  {
    MutexLock lock(&mu_);
    size_t used = 0;
    for (const auto& [id, e] : channels_) used += e.ns == ns;
    if (channels_.size() >= options_.total) {
      return QuotaExceeded("channels", std::to_string(options_.total), "",
                           "fast channels are open on this server; call over gRPC");
    }
    if (used >= options_.per_namespace) {
      return QuotaExceeded("channels", std::to_string(options_.per_namespace), ns,
                           "fast channels are open in this namespace; close some "
                           "(ReleaseClient) or call over gRPC");
    }
  }
  OPJIT_ASSIGN_OR_RETURN(std::string hex, RandomHex128());
  const std::string name = absl::StrCat("opjit-channel-", hex.substr(0, 16));
  OPJIT_ASSIGN_OR_RETURN(
      tensor::RegionInfo info,
      regions_->CreateRegion(ns, owner, name, fast::kChannelBytes, lease_ms, client_uid));
  auto region = regions_->Acquire(ns, name);
  if (!region.ok()) return region.status();
  const uint64_t region_id = info.id;

  runner::ChannelSpec spec;
  spec.ns = ns;
  spec.label = absl::StrCat("channel of ", owner);
  if (caller.principal.empty()) caller.principal = owner.substr(0, owner.find('/'));
  spec.caller = std::move(caller);
  spec.memory = *region;
  spec.spin_us = options_.spin_us;
  HandleTable* handles = handles_;
  tensor::RegionManager* regions = regions_;
  spec.resolve_handle = [handles, ns, owner](uint64_t id) -> absl::StatusOr<runner::HandleBinding> {
    auto h = handles->Get(ns, owner, id);
    if (!h.ok()) return h.status();
    if (!(*h)->fast) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handle ", id, " cannot run on a fast channel (a GPU call); call it over gRPC"));
    }
    runner::HandleBinding b;
    b.spec = (*h)->prepared.instance;
    b.input_bytes = (*h)->prepared.input_bytes;
    b.output_bytes = (*h)->prepared.output_bytes;
    b.op = (*h)->call.op;
    return b;
  };
  spec.resolve_region = [regions, ns, owner, region_id](uint64_t id)
      -> absl::StatusOr<std::shared_ptr<const tensor::Region>> {
    if (id == region_id) {
      return WithReason(absl::InvalidArgumentError("a channel's own memory cannot hold tensors"),
                        reason::kRegionNotRegistered);
    }
    return regions->AcquireById(ns, id, owner);
  };
  ChannelAccounting accounting;
  {
    MutexLock lock(&mu_);
    accounting = accounting_;
  }
  if (accounting.admit) spec.admit_calls = [admit = accounting.admit, ns] { return admit(ns); };
  if (accounting.record) {
    spec.record_calls = [record = accounting.record, ns](const std::string& op,
                                                         absl::StatusCode code, uint64_t calls,
                                                         double kernel_seconds) {
      record(ns, op, code, calls, kernel_seconds);
    };
  }
  auto channel = runner_->OpenChannel(spec);
  if (!channel.ok()) {
    (void)regions_->Unregister(ns, name);
    return channel.status();
  }
  ChannelInfo out;
  out.region = name;
  out.shm_key = info.shm_key;
  out.byte_size = info.byte_size;
  out.pid = (*channel)->pid();
  out.spin_us = options_.spin_us;
  {
    MutexLock lock(&mu_);
    out.id = next_id_++;
    channels_[out.id] = Entry{out.id, ns, owner, name, region_id, *channel};
  }
  Logger("exec")->debug("opened fast channel {} for {} in namespace {} (executor {})", out.id,
                        owner, ns, out.pid);
  return out;
}

void ChannelManager::SetAccounting(ChannelAccounting accounting) {
  MutexLock lock(&mu_);
  accounting_ = std::move(accounting);
}

void ChannelManager::OnRegistryChanged() {
  MutexLock lock(&mu_);
  for (auto& [id, e] : channels_) e.channel->InvalidateHandles();
}

void ChannelManager::OnRegionsRemoved(
    const std::vector<std::shared_ptr<const tensor::Region>>& removed) {
  std::vector<std::shared_ptr<runner::Channel>> doomed;
  std::set<std::pair<std::string, std::string>> owners;
  {
    MutexLock lock(&mu_);
    for (const auto& region : removed) {
      const tensor::RegionInfo& info = region->info();
      owners.insert({info.ns, info.owner});
      for (auto it = channels_.begin(); it != channels_.end();) {
        if (it->second.region_id == region->serial()) {
          doomed.push_back(it->second.channel);
          it = channels_.erase(it);
          continue;
        }
        if (it->second.ns == info.ns && it->second.owner == info.owner) {
          it->second.channel->InvalidateRegions();
        }
        ++it;
      }
    }
  }
  for (auto& c : doomed) c->Close();
  // A client whose last region went (it left, or its lease lapsed) leaves
  // no handles behind.
  for (const auto& [ns, owner] : owners) {
    if (!regions_->HasOwner(ns, owner)) handles_->Release(ns, owner, {});
  }
}

void ChannelManager::Maintain() {
  std::vector<std::pair<std::string, std::string>> dead;  // (ns, region)
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : channels_) {
      if (!e.channel->alive()) dead.push_back({e.ns, e.region});
    }
  }
  // Unregistering closes them (OnRegionsRemoved).
  for (const auto& [ns, region] : dead) (void)regions_->Unregister(ns, region);
}

int ChannelManager::CloseWhere(
    const std::function<bool(const std::string& ns, const std::string& owner)>& doomed) {
  std::vector<std::pair<std::string, std::string>> matched;  // (ns, region)
  {
    MutexLock lock(&mu_);
    for (const auto& [id, e] : channels_) {
      if (doomed(e.ns, e.owner)) matched.push_back({e.ns, e.region});
    }
  }
  // Unregistering closes them (OnRegionsRemoved).
  int n = 0;
  for (const auto& [ns, region] : matched) n += regions_->Unregister(ns, region).ok();
  return n;
}

size_t ChannelManager::size() const {
  MutexLock lock(&mu_);
  return channels_.size();
}

}  // namespace opjit::exec

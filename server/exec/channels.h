// Fast channels: same-host clients calling prepared handles through shared
// memory, with no gRPC and no daemon hop (proto/opjit/wire/fast_channel.h).
//
// A channel is
//   * a region of the client's ("opjit-channel-<hex>"), created here: it
//     shares the client's lease, counts against its namespace's shm quota,
//     and closing it (UnregisterRegion, ReleaseClient, a lapsed lease)
//     closes the channel;
//   * a dedicated, sandboxed executor process serving that ring
//     (KernelRunner::OpenChannel), which asks the daemon, the first time a
//     call names them, for the handle (only the owner's, only current ones)
//     and each region (only the owner's).
//
// Quota and metrics: calls on a channel never pass through the daemon, so
// the executor serves a call only on credit, which it asks the channel's
// thread for in batches (ChannelAccounting::admit: the namespace's
// [quota] calls_per_second bucket); with none granted the call answers
// QUOTA_EXCEEDED as a gRPC Forward would. Credit a channel holds unused
// lapses when it closes. What the executor served is read from its count
// table and handed to ChannelAccounting::record (at least once a second,
// and when the channel ends). The counts come from the executor, which also
// runs the namespace's kernels: a kernel that takes its executor over can
// make them wrong for its own namespace only, never higher than the credit
// granted; and it cannot mint credit, which only the daemon grants.
//
// Staleness: a registry change bumps every channel's handle epoch, so their
// executors ask again and a stale handle answers STALE_HANDLE; a region
// release bumps the region epoch of its owner's channels. The release of an
// owner's last region also releases its handles.
//
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/mutex.h"
#include "server/runner/kernel_runner.h"

namespace opjit::tensor {
class Region;
class RegionManager;
}  // namespace opjit::tensor

namespace opjit::exec {

class HandleTable;

struct ChannelOptions {
  // Fast channels at all ([fast] enabled). Default: true.
  bool enabled = true;
  // Open channels per namespace (each is one executor process). Default: 16.
  size_t per_namespace = 16;
  // Open channels in all, so that many namespaces cannot start an executor
  // process each without bound. Default: 64.
  size_t total = 64;
  // The executors' spin for their next call, and the spin advised to
  // clients, before they sleep on a futex. Default: 50 us.
  int64_t spin_us = 50;
};

// What channel calls cost and how they are counted (main wires these to the
// quota manager and the metrics registry). Either may be empty: no bound,
// not counted.
struct ChannelAccounting {
  // Call credit for namespace `ns`: how many calls (>= 1), or the status
  // of the call that waits for it (QUOTA_EXCEEDED).
  std::function<absl::StatusOr<uint64_t>(const std::string& ns)> admit;
  // `calls` calls of `op` in `ns` that answered `code`, and their kernels'
  // seconds. From the channels' threads.
  std::function<void(const std::string& ns, const std::string& op, absl::StatusCode code,
                     uint64_t calls, double kernel_seconds)>
      record;
};

struct ChannelInfo {
  uint64_t id = 0;
  std::string region;   // the channel's region name
  std::string shm_key;  // what the client maps
  uint64_t byte_size = 0;
  int pid = 0;
  int64_t spin_us = 0;
};

class ChannelManager {
 public:
  // None of the pointers is owned. Hooks itself into `regions` (removal
  // listener); the caller forwards registry changes to OnRegistryChanged.
  ChannelManager(ChannelOptions options, tensor::RegionManager* regions, HandleTable* handles,
                 runner::KernelRunner* runner);
  // Shutdown().
  ~ChannelManager();
  // Closes every channel and unhooks from the region manager (before that
  // goes). Idempotent.
  void Shutdown();

  // Opens a channel for `owner` ("<principal>/<client id>") in `ns`.
  // UNIMPLEMENTED when disabled or kernels run in the daemon;
  // RESOURCE_EXHAUSTED (QUOTA_EXCEEDED) past the namespace's channels; the
  // region manager's errors (shm quota). `client_uid` (SO_PEERCRED, where
  // known) is granted access to the ring as for RegionManager::CreateRegion.
  // `caller` is whom its calls' crashes count against (runner::Caller; its
  // principal defaults to the one `owner` names).
  absl::StatusOr<ChannelInfo> Open(const std::string& ns, const std::string& owner,
                                   int64_t lease_ms,
                                   std::optional<uid_t> client_uid = std::nullopt,
                                   runner::Caller caller = {});

  // Sets how channels opened from now on are charged and counted. Call it
  // before the first Open (channels already open keep what they had).
  void SetAccounting(ChannelAccounting accounting);

  void OnRegistryChanged();
  void OnRegionsRemoved(const std::vector<std::shared_ptr<const tensor::Region>>& removed);
  // Closes every channel for which `doomed(ns, owner)` holds (a config
  // reload revoking a principal): its region is unregistered, which stops
  // its executor and marks the ring closed, so the client's next call there
  // fails at once and its reopen over gRPC meets access control. Returns
  // how many.
  int CloseWhere(
      const std::function<bool(const std::string& ns, const std::string& owner)>& doomed);
  // Closes channels whose executor died (their regions are unregistered, so
  // their clients open new ones). About once a second.
  void Maintain();

  size_t size() const;
  bool enabled() const { return options_.enabled; }

 private:
  struct Entry {
    uint64_t id = 0;
    std::string ns, owner, region;
    uint64_t region_id = 0;
    std::shared_ptr<runner::Channel> channel;
  };

  const ChannelOptions options_;
  tensor::RegionManager* const regions_;
  HandleTable* const handles_;
  runner::KernelRunner* const runner_;
  mutable Mutex mu_;
  std::map<uint64_t, Entry> channels_ ABSL_GUARDED_BY(mu_);  // by id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool shut_down_ = false;  // Shutdown's caller only
  ChannelAccounting accounting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opjit::exec

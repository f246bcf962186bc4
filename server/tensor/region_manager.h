// The daemon's table of shared-memory regions, per namespace.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/tensor/region.h"

namespace opjit::tensor {

struct RegionManagerOptions {
  // Tags this daemon instance's shm objects: daemon-created objects are named
  // "/opjit.<instance_tag>.<32 random hex>", and Create() unlinks leftovers of
  // that pattern. Use e.g. the first 12 hex digits of sha256(state_dir).
  // Must match [A-Za-z0-9_-]{1,64} (no '.', so one tag is never a prefix of
  // another's pattern). At most one live RegionManager per tag, across all
  // processes: a second one would unlink the first one's objects.
  // Default: "" (required).
  std::string instance_tag;

  // Upper bound on the sum of byte sizes of one namespace's regions, created
  // and registered alike. Checked when a region is added; the bytes count
  // again the moment the region leaves the table (see Unregister).
  // Default: 4 GiB.
  uint64_t namespace_quota_bytes = 4ull << 30;

  // Upper bound on the bytes of all namespaces together, so that the sum of
  // the quotas cannot fill /dev/shm. 0: none.
  // Default: 0 (opjitd sets a quarter of /dev/shm).
  uint64_t total_quota_bytes = 0;

  // Upper bound on the number of regions in one namespace. Each region is one
  // mapping of the daemon's, and the kernel allows a process only about 65530
  // (vm.max_map_count); tiny regions would exhaust that long before the quota.
  // Default: 1024.
  uint64_t max_regions_per_namespace = 1024;

  // Lease given when a call passes lease_ms = 0. A region whose lease lapses
  // (its owner did not Renew in time) is unregistered by ExpireLeases.
  // Default: 300000 (5 minutes).
  int64_t default_lease_ms = 300000;

  // Longer leases asked for are cut to this.
  // Default: 86400000 (24 hours).
  int64_t max_lease_ms = 24 * 3600 * 1000;
};

// Registry of the shm regions that same-host clients use to pass tensors.
//
// Regions are keyed by (namespace, name). A region is either created by the
// daemon (CreateRegion: the daemon picks an unguessable shm key and the client
// maps it) or made by the client and registered (RegisterRegion: the daemon
// maps a window of the client's object). Calls take a region with Acquire(),
// which returns a shared_ptr<const Region>: while any call holds one, the
// mapping stays valid, whatever Unregister/ReleaseOwner/ExpireLeases or the
// destruction of the manager do meanwhile.
//
// Names are per namespace, so a namespace can only reach regions registered
// in it. Any shm key may be registered, the daemon's own "/opjit.<tag>.*"
// keys included: knowing such a key (128 random bits) means its namespace
// handed it out, and the registration lands in the caller's namespace only.
//
// Every region carries a lease owned by (namespace, owner): Renew extends all
// of the owner's regions, and ExpireLeases (called by the daemon from a timer)
// drops those whose lease lapsed, so a client that dies does not pin memory.
//
// Thread-safe. No syscall that may take long (creating, sizing, mapping,
// unmapping) runs under the table's lock.
class RegionManager {
 public:
  // Cumulative counters since Create, plus the current table size.
  struct Stats {
    uint64_t regions = 0;     // Regions in the table now.
    uint64_t bytes = 0;       // Sum of their byte sizes.
    uint64_t created = 0;     // Successful CreateRegion calls.
    uint64_t registered = 0;  // Successful RegisterRegion calls.
    uint64_t expired = 0;     // Regions dropped by ExpireLeases.
  };

  // Validates `options` (INVALID_ARGUMENT) and unlinks shm objects named
  // "opjit.<instance_tag>.<32 hex>" in /dev/shm that belong to this user:
  // leftovers of a previous run of this instance that crashed or was killed.
  static absl::StatusOr<std::unique_ptr<RegionManager>> Create(const RegionManagerOptions& options);

  // Unlinks every daemon-created shm object still in the table. Mappings held
  // by in-flight calls stay valid until those calls drop them.
  ~RegionManager();
  RegionManager(const RegionManager&) = delete;
  RegionManager& operator=(const RegionManager&) = delete;

  // Creates a zero-filled shm object of `bytes` bytes with a fresh unguessable
  // key (mode 0600 plus the client's ACL entry, pages reserved up front),
  // maps it, and registers it as `name` in `ns`, leased to `owner` for
  // `lease_ms` (0: the default; longer than the maximum: cut to it). Returns its info; the client maps
  // info.shm_key to fill it.
  // Errors: INVALID_ARGUMENT for a bad name ([A-Za-z0-9_.-]{1,128}), ns or
  // owner (at most 256 printable characters), zero bytes or a negative lease;
  // ALREADY_EXISTS if `name` is taken in `ns`; RESOURCE_EXHAUSTED over the
  // namespace's quota or region count, or when /dev/shm is full.
  //
  // `client_uid`: the uid of the connected client (SO_PEERCRED), where known.
  // When it is not the daemon's euid, that uid (and only it) is granted
  // read-write by an ACL on the object (Region::CreateShm); FAILED_PRECONDITION
  // where /dev/shm cannot hold ACLs. Unknown (TCP): mode 0600 only.
  absl::StatusOr<RegionInfo> CreateRegion(const std::string& ns, const std::string& owner,
                                          const std::string& name, uint64_t bytes,
                                          int64_t lease_ms,
                                          std::optional<uid_t> client_uid = std::nullopt);

  // Maps the window [offset, offset + byte_size) of the client's existing shm
  // object `shm_key` and registers it as `name` in `ns`. The key must start
  // with '/' and contain no other '/' (at most 255 characters). The window
  // must fit the object as fstat sees it now (INVALID_ARGUMENT naming the
  // sizes); the mapping's offset is page-aligned internally, so any `offset`
  // works. NOT_FOUND if the key does not exist, PERMISSION_DENIED if the
  // daemon cannot open it read-write. Other errors as for CreateRegion. The
  // daemon never unlinks a registered object.
  //
  // `caller_uid`: the uid of the connected client (SO_PEERCRED), where known.
  // When set, the object must be owned by that uid (PERMISSION_DENIED
  // otherwise), so a client cannot have the daemon map, and its kernels read
  // or overwrite, another user's object that the daemon happens to be able to
  // open.
  absl::StatusOr<RegionInfo> RegisterRegion(const std::string& ns, const std::string& owner,
                                            const std::string& name, const std::string& shm_key,
                                            uint64_t offset, uint64_t byte_size, int64_t lease_ms,
                                            std::optional<uid_t> caller_uid = std::nullopt);

  // Returns the region `name` of `ns` for one call to use; hold it for the
  // whole call. NOT_FOUND "region 'x' is not registered in namespace 'y'".
  //
  // `principal`: when not empty, only regions whose owner is
  // "<principal>/<client id>" are found; another principal's region is
  // NOT_FOUND exactly like a missing one. Every NOT_FOUND carries the reason
  // REGION_NOT_REGISTERED.
  absl::StatusOr<std::shared_ptr<const Region>> Acquire(const std::string& ns,
                                                        const std::string& name,
                                                        const std::string& principal = "") const;

  // Removes `name` from `ns` at once: later Acquires fail with NOT_FOUND, the
  // name may be reused, the bytes leave the quota, and a daemon-created key is
  // unlinked (no new client can map it). The mapping itself lives until the
  // last in-flight shared_ptr drops, so unregistering a region that a running
  // call uses never unmaps memory under its kernel; the memory goes when the
  // call finishes. NOT_FOUND if there is no such region.
  // `principal` restricts it as for Acquire.
  absl::Status Unregister(const std::string& ns, const std::string& name,
                          const std::string& principal = "");

  // Unregisters every region of `owner` in `ns` (as Unregister does); returns
  // how many. Zero is not an error.
  absl::StatusOr<int> ReleaseOwner(const std::string& ns, const std::string& owner);

  // Unregisters every region, in any namespace, for which `doomed(ns,
  // owner)` holds (as Unregister does, listener included); returns how
  // many. A config reload uses it to revoke a removed principal's regions.
  using OwnerPredicate = std::function<bool(const std::string& ns, const std::string& owner)>;
  int ReleaseWhere(const OwnerPredicate& doomed);

  // Sets the lease of every region of `owner` in `ns` to now + `lease_ms`
  // (0: the default; cut to the maximum) and returns that expiry (Unix ms).
  // NOT_FOUND if the owner has no regions in `ns` (e.g. they already
  // expired), so a client learns it must set them up again.
  absl::StatusOr<int64_t> Renew(const std::string& ns, const std::string& owner, int64_t lease_ms);

  // Unregisters every region whose lease expiry is <= `now_unix_ms`; returns
  // how many. The daemon calls it from a timer with the wall clock; tests pass
  // any time.
  int ExpireLeases(int64_t now_unix_ms);

  // The regions of `ns`, sorted by name, with current leases.
  // `principal` restricts it as for Acquire.
  std::vector<RegionInfo> List(const std::string& ns, const std::string& principal = "") const;

  // The region numbered `id` (RegionInfo::id) of `owner` in `ns`, for one
  // call; NOT_FOUND (REGION_NOT_REGISTERED) when there is none or it is
  // another owner's.
  absl::StatusOr<std::shared_ptr<const Region>> AcquireById(const std::string& ns, uint64_t id,
                                                            const std::string& owner) const;

  // Whether `owner` holds any region in `ns`.
  bool HasOwner(const std::string& ns, const std::string& owner) const;

  // Called, outside the table's lock, with the regions each Unregister,
  // ReleaseOwner or ExpireLeases removed. Set it before the manager is
  // shared; it must not call back into removal methods.
  using RemovalListener = std::function<void(const std::vector<std::shared_ptr<const Region>>&)>;
  void SetRemovalListener(RemovalListener listener) { removal_listener_ = std::move(listener); }

  // Bytes held (and being mapped) per namespace, for metrics.
  std::map<std::string, uint64_t> BytesByNamespace() const;

  Stats GetStats() const;

 private:
  struct Entry {
    std::shared_ptr<const Region> region;
    int64_t lease_expires_unix_ms = 0;
  };
  struct Namespace {
    std::map<std::string, Entry> regions;
    // Names being created or mapped right now (outside the lock); they count
    // as taken and their bytes count against the quota.
    std::set<std::string> pending;
    uint64_t bytes = 0;  // Of `regions` and `pending`.
  };

  explicit RegionManager(const RegionManagerOptions& options);
  void NotifyRemoved(const std::vector<std::shared_ptr<const Region>>& removed) const {
    if (removal_listener_ && !removed.empty()) removal_listener_(removed);
  }
  RemovalListener removal_listener_;

  // Checks the arguments common to CreateRegion and RegisterRegion and
  // reserves `name` and `bytes` in `ns`; returns the lease to grant.
  absl::StatusOr<int64_t> Reserve(const std::string& ns, const std::string& owner,
                                  const std::string& name, uint64_t bytes, int64_t lease_ms);
  // Turns a reservation into a table entry (region != nullptr) or drops it.
  absl::StatusOr<RegionInfo> Commit(const std::string& ns, const std::string& name, uint64_t bytes,
                                    int64_t lease_ms,
                                    absl::StatusOr<std::unique_ptr<Region>> region);
  absl::StatusOr<int64_t> EffectiveLeaseMs(int64_t lease_ms) const;
  // Removes `it` from `space`; returns the region so that the caller drops it
  // (munmap) after releasing mu_.
  std::shared_ptr<const Region> EraseLocked(Namespace& space,
                                            std::map<std::string, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases every entry for which `doomed_if(ns, entry)` holds, and every
  // namespace left with nothing; returns the regions to drop after mu_.
  std::vector<std::shared_ptr<const Region>> EraseWhereLocked(
      const std::function<bool(const std::string& ns, const Entry& entry)>& doomed_if)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static RegionInfo InfoOf(const Entry& entry);

  // Constant after construction.
  const RegionManagerOptions options_;
  const std::string key_prefix_;  // "/opjit.<tag>."

  mutable absl::Mutex mu_;
  std::map<std::string, Namespace> namespaces_ ABSL_GUARDED_BY(mu_);
  uint64_t total_regions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // Of table entries only.
  uint64_t created_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t registered_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace opjit::tensor

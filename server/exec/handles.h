// Prepared calls: call shapes checked once (Executor::PrepareAsync), kept as
// handles a client calls by number.
//
// A handle belongs to its owner, "<principal>/<client id>" (the owner of the
// client's regions), in one namespace: nobody else can call, see or release
// it; another owner's handle is answered exactly like a missing one. It runs
// what the registry held when it was prepared, and goes stale the moment the
// op changes there (a newer version for a handle of "latest", a delete):
// calls then answer FAILED_PRECONDITION with reason STALE_HANDLE, and the
// clients prepare again.
//
// Lifetime: until ReleaseHandles, ReleaseClient, the release of the owner's
// last region (a client that dies leaves nothing behind), or, for an owner
// with no regions, a lease (renewed by RenewLease and by every use).
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/clock.h"
#include "server/common/mutex.h"
#include "server/exec/executor.h"

namespace opjit::registry {
class Registry;
}

namespace opjit::exec {

struct Handle {
  uint64_t id = 0;
  std::string ns;
  std::string owner;
  // The call as prepared, without tensors: op, version as asked (0: latest),
  // target, attrs, principal.
  ForwardCall call;
  PreparedCall prepared;
  // Runs on a fast channel (CPU, executor processes).
  bool fast = false;
  // The registry generation at which it was last found current.
  mutable std::atomic<uint64_t> checked_generation{0};
};

struct HandleTableOptions {
  // Handles one namespace may hold, at most (RESOURCE_EXHAUSTED, reason
  // QUOTA_EXCEEDED beyond). Default: 4096.
  size_t max_per_namespace = 4096;
  // Life of the handles of an owner without regions, renewed by use and
  // RenewLease. Default: 300000 (the region lease's default).
  int64_t lease_ms = 300000;
  // Where leases read the time (tests pass a FakeClock). Never null.
  const Clock* clock = SteadyClock();
};

class HandleTable {
 public:
  HandleTable(HandleTableOptions options, registry::Registry* registry);

  // Stores a prepared call and returns its handle (ids are never reused).
  absl::StatusOr<std::shared_ptr<const Handle>> Add(const std::string& ns,
                                                    const std::string& owner, ForwardCall call,
                                                    PreparedCall prepared, bool fast);
  // The handle `id` of `owner` in `ns`, if it still runs what the registry
  // holds. FAILED_PRECONDITION with reason STALE_HANDLE otherwise (unknown,
  // released, another owner's, or stale: a stale one is dropped).
  absl::StatusOr<std::shared_ptr<const Handle>> Get(const std::string& ns,
                                                    const std::string& owner, uint64_t id);
  // Releases the given handles of `owner` (all of them when `ids` is empty);
  // returns how many.
  int Release(const std::string& ns, const std::string& owner, const std::vector<uint64_t>& ids);
  // Releases every handle of each owner for which `doomed(ns, owner)`
  // holds (a config reload revoking a principal); returns how many.
  int ReleaseWhere(
      const std::function<bool(const std::string& ns, const std::string& owner)>& doomed);
  // Extends the life of `owner`'s handles.
  void Renew(const std::string& ns, const std::string& owner);
  // Drops handles of owners without regions whose lease lapsed; `has_regions`
  // says whether an owner still holds regions (those are kept).
  int Expire(const std::function<bool(const std::string& ns, const std::string& owner)>& has_regions);

  size_t size() const;

 private:
  struct Owned {
    std::map<uint64_t, std::shared_ptr<const Handle>> handles;
    Clock::time_point expires;
  };
  bool Current(const Handle& h) const;

  const HandleTableOptions options_;
  registry::Registry* const registry_;
  mutable Mutex mu_;
  std::map<std::pair<std::string, std::string>, Owned> owners_ ABSL_GUARDED_BY(mu_);  // (ns, owner)
  std::map<std::string, size_t> per_namespace_ ABSL_GUARDED_BY(mu_);
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace opjit::exec

// The op-info registry: every registered version of every op, in memory,
// backed by a durable Store.
//
// Ops are keyed by (namespace, name). Registering a definition that differs
// from the latest version creates version latest+1; registering the latest
// definition again is a no-op that returns the existing version (idempotent),
// so clients can register on every start. Version numbers are never reused,
// even after a delete. A call returns only after its change is durable.
//
// Thread-safe. Reads (Get, List, Size) take a shared lock and never wait for
// disk; writes (Register, Delete) are serialised with each other and hold the
// read lock only for the in-memory update after the store commits.
#pragma once

#include <cstdint>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/registry/op_def.h"
#include "server/registry/store.h"

namespace opjit::registry {

class Registry {
 public:
  struct Options {
    // Path of the SQLite database file; its directory must exist. Required.
    std::string db_path;
    // Ops (names) one namespace may hold; registering a new name beyond it is
    // RESOURCE_EXHAUSTED (QUOTA_EXCEEDED "ops"). 0: no bound. Default: 1000.
    size_t max_ops_per_namespace = 1000;
    // Live versions of one op; beyond it, delete old versions first
    // (QUOTA_EXCEEDED "versions"). 0: no bound. Default: 100.
    size_t max_versions_per_op = 100;
  };

  struct RegisterResult {
    OpRecord record;
    // False when the latest version already had this exact definition.
    bool created = false;
  };

  // Opens the store at options.db_path and loads every version. Errors are the
  // store's (see Store::Open and Store::LoadAll); INVALID_ARGUMENT when
  // db_path is empty.
  static absl::StatusOr<std::unique_ptr<Registry>> Create(const Options& options);

  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Validates `def` (ValidateOpDef: INVALID_ARGUMENT naming the field). If the
  // latest version of (def.ns, def.name) has the same content hash, returns it
  // with created = false. Otherwise stores the definition as a new version
  // (the highest version ever used + 1, so 1 for a new op) and returns it with
  // created = true, after the store has committed. A store error is returned
  // as is and leaves the registry unchanged.
  absl::StatusOr<RegisterResult> Register(OpDef def);

  // Version `version` of (ns, name), or the latest when `version` is 0.
  // NOT_FOUND: `op "default/foo" not found` or
  //            `op "default/foo" has no version 7 (versions: 1, 2)`.
  absl::StatusOr<OpRecord> Get(const std::string& ns, const std::string& name,
                               int64_t version) const;

  // As Get, without copying the definition (sources can be large): the record
  // stays valid as long as the caller holds it, even if it is deleted.
  absl::StatusOr<std::shared_ptr<const OpRecord>> GetShared(const std::string& ns,
                                                            const std::string& name,
                                                            int64_t version) const;

  // Records of namespace `ns` (every namespace when empty), sorted by
  // (ns, name, version). Only the latest version of each op unless
  // `all_versions`.
  std::vector<OpRecord> List(const std::string& ns, bool all_versions) const;

  // Deletes version `version` of (ns, name), or all its versions when
  // `version` is 0, durably. Returns how many versions were deleted. NOT_FOUND
  // (with the messages of Get) when there was nothing to delete.
  absl::StatusOr<int> Delete(const std::string& ns, const std::string& name, int64_t version);

  // Problems with `def` that do not stop it being registered or served, one
  // sentence each, computed from the registry as it is now (not stored):
  //   backward.op: "square_grad" is not a registered op in namespace "default"; ...
  // A backward op may be registered after its forward op, so a dangling
  // backward.op is only a warning; it goes away once that op exists.
  std::vector<std::string> Warnings(const OpDef& def) const;

  // Number of ops (not versions) in the registry.
  size_t Size() const;

  // The namespaces that hold ops.
  std::vector<std::string> Namespaces() const;

  // OK when the store can be written now (a probe row is written).
  absl::Status ProbeStore() { return store_->Probe(); }

  // Changes (increases) whenever a version is added or deleted, after the
  // change is visible to Get. Anything derived from lookups made while it
  // had one value is current as long as it still has it.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Called after every change of generation() (with the writer's lock held:
  // it must be quick and must not call back into the registry). Set it
  // before the registry is shared.
  void SetChangeListener(std::function<void()> listener) { change_listener_ = std::move(listener); }

 private:
  using Key = std::pair<std::string, std::string>;  // (ns, name)
  struct OpEntry {
    std::map<int64_t, std::shared_ptr<const OpRecord>> versions;  // never empty
  };

  Registry(std::unique_ptr<Store> store, const Options& options)
      : options_(options), store_(std::move(store)) {}

  // NOT_FOUND status for a failed lookup of (ns, name, version).
  absl::Status NotFound(const std::string& ns, const std::string& name, int64_t version) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Serialises writers, so that a version number is chosen and persisted
  // without another writer in between. Acquired before mu_.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  const Options options_;
  const std::unique_ptr<Store> store_;  // its own locking

  mutable absl::Mutex mu_;
  std::map<Key, OpEntry> ops_ ABSL_GUARDED_BY(mu_);
  // Highest version ever assigned per op, including deleted ones. Written only
  // with write_mu_ held.
  std::map<Key, int64_t> high_water_ ABSL_GUARDED_BY(write_mu_);
  std::atomic<uint64_t> generation_{1};
  std::function<void()> change_listener_;
};

}  // namespace opjit::registry

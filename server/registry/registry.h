// The op-info registry: every registered version of every op, in memory,
// backed by a durable Store (a SQLite file, or a PostgreSQL database that
// several daemons share).
//
// Ops are keyed by (namespace, name). Registering a definition that differs
// from the latest version creates version latest+1; registering the latest
// definition again is a no-op that returns the existing version (idempotent),
// so clients can register on every start. Version numbers are never reused,
// even after a delete. A call returns only after its change is durable. The
// store decides versions and quotas in one transaction, so daemons sharing a
// database agree on them.
//
// Shared database: a sync thread with its own connection LISTENs for the
// other daemons' changes (NOTIFY) and also compares the stored generation
// every poll_ms; when it differs from the one the memory was loaded at, it
// reloads everything and swaps it in. Another daemon's change is visible here
// typically within ~10 ms of its commit (NOTIFY, then the reload; < 50 ms in
// tests on a loaded machine), and at most about poll_ms (+ the reload) if a
// notification was lost. A daemon's own writes update its memory directly
// and cause no reload. While the database is
// down, reads keep being served from memory and writes fail with UNAVAILABLE
// (reason STORE_UNAVAILABLE); ProbeStore() fails.
//
// Thread-safe. Reads (Get, List, Size) take a shared lock and never wait for
// the store; writes (Register, Delete) are serialised with each other and
// with reloads, and hold the read lock only for the in-memory update after the
// store commits.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/registry/op_def.h"
#include "server/registry/store.h"
#include "server/registry/validate.h"

namespace opjit::registry {

class Registry {
 public:
  struct Options {
    // Path of the SQLite database file; its directory must exist. Required
    // for the sqlite backend.
    std::string db_path;
    // Ops (names) one namespace may hold; registering a new name beyond it is
    // RESOURCE_EXHAUSTED (QUOTA_EXCEEDED "ops"). 0: no bound. Default: 1000.
    size_t max_ops_per_namespace = 1000;
    // Live versions of one op; beyond it, delete old versions first
    // (QUOTA_EXCEEDED "versions"). 0: no bound. Default: 100.
    size_t max_versions_per_op = 100;
    // "sqlite" (db_path) or "postgres" (url). Default: "sqlite".
    std::string backend = "sqlite";
    // postgres: a libpq connection string or URI. Never logged or returned.
    std::string url;
    // postgres: the password, given to libpq separately. Never logged.
    std::string password;
    // postgres: how often the sync thread compares generations, as a backstop
    // for a lost notification, in milliseconds (> 0). Default: 2000.
    int64_t poll_ms = 2000;
  };

  struct RegisterResult {
    OpRecord record;
    // False when the latest version already had this exact definition.
    bool created = false;
  };

  // Opens the store named by options and loads every version; for postgres,
  // starts the sync thread. Errors are the store's (SqliteStore::Open,
  // PostgresStore::Open, Store::LoadSnapshot); INVALID_ARGUMENT for an unknown
  // backend, an empty db_path (sqlite) or url (postgres), or poll_ms <= 0.
  static absl::StatusOr<std::unique_ptr<Registry>> Create(const Options& options);

  // Stops the sync thread, if any.
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Validates `def` (ValidateOpDef by `rules`, the compile backends' languages
  // and options: INVALID_ARGUMENT naming the field). If the
  // latest version of (def.ns, def.name) has the same content hash, returns it
  // with created = false. Otherwise stores the definition as a new version
  // (the highest version ever used + 1, so 1 for a new op) and returns it with
  // created = true, after the store has committed. Quotas (Options) give
  // RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED. A store error is returned
  // as is (UNAVAILABLE with reason STORE_UNAVAILABLE while the database
  // cannot be reached) and leaves the registry unchanged.
  //
  // Before it stores, Register checks the op's links with its bprops
  // (CheckBackwardLinks).
  absl::StatusOr<RegisterResult> Register(OpDef def,
                                          const TargetRules& rules = BuiltinTargetRules());

  // Checks `def` against the registry as it is now: when its backward.op is
  // registered, that bprop's inputs, outputs and dtypes against
  // def.backward.inputs; and for every latest op of def.ns whose backward.op
  // is def.name, `def` as that op's bprop (CheckBpropSignature).
  // FAILED_PRECONDITION with reason BPROP_MISMATCH naming both ops. A bprop
  // that is not registered yet is checked when it is.
  absl::Status CheckBackwardLinks(const OpDef& def) const;

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
  // (with the messages of Get, as the store sees it) when there was nothing
  // to delete; store errors as Register.
  absl::StatusOr<int> Delete(const std::string& ns, const std::string& name, int64_t version);

  // Problems with `def` that do not stop it being registered or served, one
  // sentence each, computed from the registry as it is now (not stored):
  //   backward.op: "square_grad" is not a registered op in namespace "default"; ...
  // A backward op may be registered after its forward op, so a dangling
  // backward.op is only a warning; it goes away once that op exists. An op
  // with no output_rules (and so no InferShape: OpService stores infer_shape
  // rules when its CPU kernel exports one) is warned that every output takes
  // the shape of input 0.
  std::vector<std::string> Warnings(const OpDef& def) const;

  // Number of ops (not versions) in the registry.
  size_t Size() const;

  // The namespaces that hold ops.
  std::vector<std::string> Namespaces() const;

  // OK when the store can be written now (a probe row is written). The
  // outcome is kept for StoreProbed() (GetServerInfo reports it).
  absl::Status ProbeStore() {
    absl::Status s = store_->Probe();
    store_probe_.store(s.ok() ? 1 : 2, std::memory_order_relaxed);
    return s;
  }
  // The last ProbeStore's outcome: 0 never probed, 1 OK, 2 failed.
  int StoreProbed() const { return store_probe_.load(std::memory_order_relaxed); }
  // The store's kind: "sqlite" or "postgres" (no path).
  std::string StoreBackend() const {
    const std::string d = store_->Describe();
    return d.substr(0, d.find(' '));
  }

  // How many times the memory was reloaded because the store changed under
  // it (another daemon's write). For tests and metrics.
  uint64_t reloads() const { return reloads_.load(std::memory_order_relaxed); }

  // Changes (increases) whenever a version is added or deleted, after the
  // change is visible to Get. Anything derived from lookups made while it
  // had one value is current as long as it still has it.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Called after every change of generation() (with the writer's lock held,
  // from the writing thread or the sync thread: it must be quick and must not
  // call back into the registry). Set it before the registry is shared.
  void SetChangeListener(std::function<void()> listener) {
    absl::MutexLock lock(&write_mu_);
    change_listener_ = std::move(listener);
  }

 private:
  using Key = std::pair<std::string, std::string>;  // (ns, name)
  struct OpEntry {
    std::map<int64_t, std::shared_ptr<const OpRecord>> versions;  // never empty
  };

  Registry(std::unique_ptr<Store> store, const Options& options)
      : options_(options), store_(std::move(store)) {}

  // NOT_FOUND status for a failed lookup of (ns, name, version), given the
  // op's live versions (empty: no such op).
  static absl::Status NotFound(const std::string& ns, const std::string& name, int64_t version,
                               const std::vector<int64_t>& versions);
  // The live versions of (ns, name) in memory.
  std::vector<int64_t> VersionsOf(const Key& key) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Replaces the memory by `snap`, keeping the records that did not change.
  void Apply(Store::Snapshot snap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // After a local write that the store numbered `store_generation`: the
  // memory is current if nothing else was written since the last one seen;
  // otherwise the sync thread is woken to reload. Then generation() moves.
  void NoteLocalWrite(uint64_t store_generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  void Changed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  // The sync thread (postgres): waits for notifications, polls, reloads.
  void SyncLoop();
  // Reloads when the store's generation differs from store_generation_.
  // Returns true when it must be called again (a local write raced it).
  absl::StatusOr<bool> CheckAndReload() ABSL_LOCKS_EXCLUDED(write_mu_);

  // Serialises writers and reloads, so that a version number is chosen and
  // persisted, and the memory updated, without another change in between.
  // Acquired before mu_.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  const Options options_;
  const std::unique_ptr<Store> store_;  // its own locking
  std::atomic<int> store_probe_{0};     // see StoreProbed()
  // Reports other daemons' changes; null for a store only we write.
  std::unique_ptr<ChangeWatcher> watcher_;
  std::thread sync_thread_;
  std::atomic<bool> stop_{false};

  mutable absl::Mutex mu_;
  std::map<Key, OpEntry> ops_ ABSL_GUARDED_BY(mu_);
  // The store generation the memory reflects (every write up to it).
  uint64_t store_generation_ ABSL_GUARDED_BY(write_mu_) = 0;
  // Local writes so far, and the highest store generation one of them got.
  uint64_t local_writes_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t max_local_generation_ ABSL_GUARDED_BY(write_mu_) = 0;
  std::atomic<uint64_t> generation_{1};
  std::atomic<uint64_t> reloads_{0};
  std::function<void()> change_listener_ ABSL_GUARDED_BY(write_mu_);
};

}  // namespace opjit::registry

// Durable storage of op versions: the interface the registry is written
// against, with two implementations:
//   SqliteStore (sqlite_store.h): one SQLite file, owned by one daemon;
//   PostgresStore (postgres_store.h): one PostgreSQL database, shared by
//     several daemons.
//
// Version numbers are chosen inside the store, in the same transaction that
// stores the version (RegisterVersion), so that daemons sharing a database
// agree on them. Every write transaction also bumps the store's generation
// counter; a daemon compares it with the generation its in-memory copy was
// loaded at to learn about changes made by others.
//
// Implementations are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/registry/op_def.h"

namespace opjit::registry {

class ChangeWatcher;

class Store {
 public:
  // The highest version ever given to (ns, name), kept after deletes so that a
  // version number is never reused for a different definition.
  struct HighWater {
    std::string ns;
    std::string name;
    int64_t max_version = 0;
  };

  // Quotas RegisterVersion checks in its transaction. 0: no bound.
  struct Limits {
    // Ops (names) one namespace may hold (QUOTA_EXCEEDED "ops").
    size_t max_ops_per_namespace = 0;
    // Live versions of one op (QUOTA_EXCEEDED "versions").
    size_t max_versions_per_op = 0;
  };

  struct InsertResult {
    // The new version, or the existing latest one when it has the same hash.
    OpRecord record;
    bool created = false;
    // The store's generation after the transaction; 0 when !created.
    uint64_t generation = 0;
  };

  struct DeleteResult {
    // Versions deleted; 0 when there was nothing to delete.
    int deleted = 0;
    // When deleted == 0: the live versions of the op (empty: no such op), so
    // that the caller can say what exists.
    std::vector<int64_t> live_versions;
    // The store's generation after the transaction; 0 when deleted == 0.
    uint64_t generation = 0;
  };

  // Everything, read in one consistent snapshot.
  struct Snapshot {
    uint64_t generation = 0;
    std::vector<OpRecord> records;      // sorted by (ns, name, version)
    std::vector<HighWater> high_water;  // sorted by (ns, name)
  };

  virtual ~Store() = default;

  // Every stored version, sorted by (ns, name, version). The records' `def` is
  // parsed from the stored JSON; a row whose JSON does not parse, whose hash
  // does not match its JSON, or whose (ns, name) disagree with the JSON gives
  // DATA_LOSS naming the row.
  virtual absl::StatusOr<std::vector<OpRecord>> LoadAll() = 0;

  // The high-water version of every op that ever had a version stored.
  virtual absl::StatusOr<std::vector<HighWater>> LoadHighWater() = 0;

  // LoadAll, LoadHighWater and the generation, from one snapshot, so that the
  // generation describes exactly the records returned.
  virtual absl::StatusOr<Snapshot> LoadSnapshot() = 0;

  // In one transaction: when the latest live version of (def.ns, def.name) has
  // `content_hash`, returns it (created = false, nothing written). Otherwise
  // checks `limits` (RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED, as
  // server/common/error_info.h's QuotaExceeded), stores `def` as version
  // max(high water, latest live) + 1 with created_unix_ms = now_ms, raises the
  // high-water mark and bumps the generation; returns once committed.
  // `content_hash` must be ContentHash(def) (INVALID_ARGUMENT otherwise).
  // Concurrent calls for one op, from any process, are serialised: the same
  // definition gets the same version, different ones distinct consecutive
  // versions. Store errors: UNAVAILABLE (reason STORE_UNAVAILABLE) when the
  // store cannot be reached or is busy, DATA_LOSS for a corrupt latest row,
  // INTERNAL otherwise; nothing is stored then.
  virtual absl::StatusOr<InsertResult> RegisterVersion(const OpDef& def,
                                                       const std::string& content_hash,
                                                       int64_t now_ms, const Limits& limits) = 0;

  // Deletes version `version` of (ns, name), or every version when `version`
  // is 0, in one transaction that bumps the generation when it deleted
  // anything. The high-water mark stays. Deleting nothing is not an error
  // (deleted == 0). Errors as RegisterVersion.
  virtual absl::StatusOr<DeleteResult> DeleteOp(const std::string& ns, const std::string& name,
                                                int64_t version) = 0;

  // Writes (and commits) one row of a probe table: OK when the store can be
  // written now. For the daemon's health checks.
  virtual absl::Status Probe() = 0;

  // For a store other processes write to: a watcher with its own connection
  // that reports their changes (see ChangeWatcher). nullptr (and OK) for a
  // store only this process writes. UNAVAILABLE when it cannot connect.
  virtual absl::StatusOr<std::unique_ptr<ChangeWatcher>> Watch() { return nullptr; }

  // A short description for logs ("sqlite /path/registry.db", "postgres");
  // never a password.
  virtual std::string Describe() const = 0;
};

// Learns about changes other processes make to a shared store. Used by one
// thread, except Interrupt(), which any thread may call. Every method that
// needs the connection reconnects when it was lost.
class ChangeWatcher {
 public:
  struct Event {
    enum Kind {
      kNotified,     // a change was announced; `generation` is the highest seen
      kTimeout,      // nothing within the timeout
      kInterrupted,  // Interrupt() was called
    };
    Kind kind = kTimeout;
    uint64_t generation = 0;
  };

  virtual ~ChangeWatcher() = default;

  // Waits up to `timeout_ms` for a change notification or Interrupt().
  // UNAVAILABLE when the connection is lost or cannot be made (after waiting
  // out the timeout, or less when interrupted, so that a caller looping on it
  // does not spin); notifications sent while it was lost are not reported, so
  // a caller should check Generation() after an error.
  virtual absl::StatusOr<Event> Wait(int64_t timeout_ms) = 0;

  // The store's current generation.
  virtual absl::StatusOr<uint64_t> Generation() = 0;

  // As Store::LoadSnapshot, on the watcher's connection.
  virtual absl::StatusOr<Store::Snapshot> LoadSnapshot() = 0;

  // Makes a pending or the next Wait() return kInterrupted. Thread-safe.
  virtual void Interrupt() = 0;
};

// Shared by the store implementations: the record of one stored row, after
// checking it. `where` names the store in messages. DATA_LOSS naming the row
// when `json` does not parse, holds another op, or does not match `hash` or
// the canonical form.
absl::StatusOr<OpRecord> DecodeRow(const std::string& where, const std::string& ns,
                                   const std::string& name, int64_t version,
                                   const std::string& hash, const std::string& json,
                                   int64_t created_unix_ms);

// The QUOTA_EXCEEDED statuses of RegisterVersion.
absl::Status VersionsQuotaExceeded(const OpDef& def, size_t limit);
absl::Status OpsQuotaExceeded(const OpDef& def, size_t limit);

}  // namespace opjit::registry

// A Store in one SQLite database file, written by one daemon (the state
// directory's lock file keeps a second one out).
//
// Durability: the database runs in WAL mode with synchronous=FULL, and every
// write is one transaction (BEGIN IMMEDIATE), so a write that returned OK
// survives a crash or a kill -9 of the process (and, as far as the file system
// honours fsync, a power loss), and a write that did not commit leaves no
// trace: there are no torn entries. Other processes opening the same file wait
// up to `kBusyTimeoutMs` for a lock before giving up with UNAVAILABLE.
//
// The generation is counted in memory (starting at 1 on open): nothing else
// writes the file while the daemon runs, so Watch() returns nullptr.
//
// Thread-safe: one connection, serialised by an internal mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/registry/op_def.h"
#include "server/registry/store.h"

struct sqlite3;

namespace opjit::registry {

class SqliteStore final : public Store {
 public:
  // The schema version this code writes (PRAGMA user_version).
  static constexpr int kSchemaVersion = 1;
  static constexpr int kBusyTimeoutMs = 5000;

  // Opens the database at `path`, creating the file and the schema when they
  // do not exist (the directory must exist). Errors, each naming the path:
  //   DATA_LOSS: the file is not a SQLite database or fails its integrity check;
  //   FAILED_PRECONDITION: it was written by a newer schema version;
  //   UNAVAILABLE / INTERNAL: SQLite could not open or set it up.
  static absl::StatusOr<std::unique_ptr<SqliteStore>> Open(const std::string& path);

  ~SqliteStore() override;
  SqliteStore(const SqliteStore&) = delete;
  SqliteStore& operator=(const SqliteStore&) = delete;

  absl::StatusOr<std::vector<OpRecord>> LoadAll() override;
  absl::StatusOr<std::vector<HighWater>> LoadHighWater() override;
  absl::StatusOr<Snapshot> LoadSnapshot() override;
  absl::StatusOr<InsertResult> RegisterVersion(const OpDef& def, const std::string& content_hash,
                                               int64_t now_ms, const Limits& limits) override;
  absl::StatusOr<DeleteResult> DeleteOp(const std::string& ns, const std::string& name,
                                        int64_t version) override;
  absl::Status Probe() override;
  std::string Describe() const override { return "sqlite " + path_; }

  // Stores `record` as given (its version chosen by the caller) in a single
  // transaction and returns once it has committed. ALREADY_EXISTS when
  // (ns, name, version) is taken; INVALID_ARGUMENT when content_hash is not
  // ContentHash(record.def). For tests and imports; the registry uses
  // RegisterVersion.
  absl::Status Insert(const OpRecord& record);

  const std::string& path() const { return path_; }

 private:
  SqliteStore(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}

  // Runs `sql` (no results) on the connection.
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(int rc, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Init() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<OpRecord>> LoadAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<HighWater>> LoadHighWaterLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The body of RegisterVersion, inside its transaction.
  absl::StatusOr<InsertResult> RegisterInTxn(const OpDef& def, const std::string& content_hash,
                                             int64_t now_ms, const Limits& limits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<int64_t>> LiveVersions(const std::string& ns, const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ROLLBACK of the open transaction.
  void Abort() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Abort(), returning `s`.
  absl::Status Rollback(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace opjit::registry

// Durable storage of op versions in one SQLite database file.
//
// Durability: the database runs in WAL mode with synchronous=FULL, and every
// write is one transaction, so a write that returned OK survives a crash or a
// kill -9 of the process (and, as far as the file system honours fsync, a
// power loss), and a write that did not commit leaves no trace: there are no
// torn entries. Other processes opening the same file wait up to
// `kBusyTimeoutMs` for a lock before giving up with UNAVAILABLE.
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

struct sqlite3;

namespace opjit::registry {

class Store {
 public:
  // The schema version this code writes (PRAGMA user_version).
  static constexpr int kSchemaVersion = 1;
  static constexpr int kBusyTimeoutMs = 5000;

  // The highest version ever given to (ns, name), kept after deletes so that a
  // version number is never reused for a different definition.
  struct HighWater {
    std::string ns;
    std::string name;
    int64_t max_version = 0;
  };

  // Opens the database at `path`, creating the file and the schema when they
  // do not exist (the directory must exist). Errors, each naming the path:
  //   DATA_LOSS: the file is not a SQLite database or fails its integrity check;
  //   FAILED_PRECONDITION: it was written by a newer schema version;
  //   UNAVAILABLE / INTERNAL: SQLite could not open or set it up.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& path);

  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Every stored version, sorted by (ns, name, version). The records' `def` is
  // parsed from the stored JSON; a row whose JSON does not parse, whose hash
  // does not match its JSON, or whose (ns, name) disagree with the JSON gives
  // DATA_LOSS naming the row.
  absl::StatusOr<std::vector<OpRecord>> LoadAll();

  // The high-water version of every op that ever had a version stored.
  absl::StatusOr<std::vector<HighWater>> LoadHighWater();

  // Stores `record` (its def as canonical JSON) in a single transaction and
  // returns once it has committed. ALREADY_EXISTS when (ns, name, version) is
  // taken. The caller computes content_hash (ContentHash(def)); it is checked.
  absl::Status Insert(const OpRecord& record);

  // Writes (and commits) one row of a probe table: OK when the store can be
  // written now. For the daemon's health checks.
  absl::Status Probe();

  // Deletes version `version` of (ns, name), or every version when `version`
  // is 0, in one transaction. Deleting nothing is not an error.
  absl::Status DeleteOp(const std::string& ns, const std::string& name, int64_t version);

  const std::string& path() const { return path_; }

 private:
  Store(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}

  // Runs `sql` (no results) on the connection.
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(int rc, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Init() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace opjit::registry

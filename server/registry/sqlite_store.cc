#include "server/registry/sqlite_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/registry/canonical.h"

namespace opjit::registry {
namespace {

constexpr const char* kSchemaSql = R"sql(
CREATE TABLE IF NOT EXISTS op_versions (
  ns TEXT NOT NULL,
  name TEXT NOT NULL,
  version INTEGER NOT NULL,
  content_hash TEXT NOT NULL,
  def_json TEXT NOT NULL,
  created_unix_ms INTEGER NOT NULL,
  PRIMARY KEY (ns, name, version)
);
CREATE TABLE IF NOT EXISTS op_high_water (
  ns TEXT NOT NULL,
  name TEXT NOT NULL,
  max_version INTEGER NOT NULL,
  PRIMARY KEY (ns, name)
);
)sql";

// Maps a SQLite result code to a status code.
absl::StatusCode CodeFor(int rc) {
  switch (rc & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return absl::StatusCode::kDataLoss;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_IOERR:
      return absl::StatusCode::kUnavailable;
    case SQLITE_FULL:
    case SQLITE_NOMEM:
      return absl::StatusCode::kResourceExhausted;
    case SQLITE_CANTOPEN:
    case SQLITE_PERM:
    case SQLITE_READONLY:
    case SQLITE_AUTH:
      return absl::StatusCode::kFailedPrecondition;
    case SQLITE_CONSTRAINT:
      return absl::StatusCode::kAlreadyExists;
    default:
      return absl::StatusCode::kInternal;
  }
}

// A prepared statement, finalized on destruction. Used only under SqliteStore::mu_.
class Stmt {
 public:
  Stmt() = default;
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  int Prepare(sqlite3* db, const char* sql) {
    return sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  sqlite3_stmt* get() { return stmt_; }
  void BindText(int i, const std::string& s) {
    sqlite3_bind_text(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }
  void BindInt64(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  std::string ColumnText(int i) {
    const unsigned char* p = sqlite3_column_text(stmt_, i);
    int n = sqlite3_column_bytes(stmt_, i);
    return p == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(p), n);
  }
  int64_t ColumnInt64(int i) { return sqlite3_column_int64(stmt_, i); }

 private:
  sqlite3_stmt* stmt_ = nullptr;
};

}  // namespace

absl::Status SqliteStore::Error(int rc, const std::string& what) {
  const char* msg = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
  absl::StatusCode code = CodeFor(rc);
  std::string text = absl::StrCat("registry database \"", path_, "\": ", what, ": ", msg);
  if (code == absl::StatusCode::kDataLoss) {
    absl::StrAppend(&text,
                    " (the file is corrupt or not a SQLite database; restore it from a "
                    "backup or move it away to start an empty registry)");
  }
  absl::Status status(code, text);
  if (code == absl::StatusCode::kUnavailable)
    status = WithReason(status, reason::kStoreUnavailable);
  return status;
}

absl::Status SqliteStore::Exec(const char* sql) {
  char* err = nullptr;
  int rc = sqlite3_exec(db_, sql, nullptr, nullptr, &err);
  sqlite3_free(err);  // sqlite3_errmsg() still holds the message
  if (rc != SQLITE_OK) return Error(rc, sql);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SqliteStore>> SqliteStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close_v2(db);
    return absl::Status(CodeFor(rc),
                        absl::StrCat("registry database \"", path, "\": cannot open: ", msg));
  }
  std::unique_ptr<SqliteStore> store(new SqliteStore(path, db));
  {
    absl::MutexLock lock(&store->mu_);
    OPJIT_RETURN_IF_ERROR(store->Init());
  }
  return store;
}

SqliteStore::~SqliteStore() { sqlite3_close_v2(db_); }

absl::Status SqliteStore::Init() {
  sqlite3_busy_timeout(db_, kBusyTimeoutMs);
  {
    // The first statement reads the file header: a file that is not a
    // database fails here with SQLITE_NOTADB.
    Stmt st;
    int rc = st.Prepare(db_, "PRAGMA journal_mode=WAL");
    if (rc != SQLITE_OK) return Error(rc, "setting WAL mode");
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_ROW) return Error(rc, "setting WAL mode");
    std::string mode = st.ColumnText(0);
    if (mode != "wal") {
      return absl::FailedPreconditionError(absl::StrCat(
          "registry database \"", path_, "\": cannot use WAL mode (journal_mode is ", mode, ")"));
    }
  }
  OPJIT_RETURN_IF_ERROR(Exec("PRAGMA synchronous=FULL"));
  {
    Stmt st;
    int rc = st.Prepare(db_, "PRAGMA quick_check");
    if (rc != SQLITE_OK) return Error(rc, "integrity check");
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_ROW) return Error(rc, "integrity check");
    std::string result = st.ColumnText(0);
    if (result != "ok") {
      return absl::DataLossError(
          absl::StrCat("registry database \"", path_, "\" fails its integrity check: ", result));
    }
  }
  int64_t user_version = 0;
  {
    Stmt st;
    int rc = st.Prepare(db_, "PRAGMA user_version");
    if (rc != SQLITE_OK || (rc = sqlite3_step(st.get())) != SQLITE_ROW) {
      return Error(rc, "reading the schema version");
    }
    user_version = st.ColumnInt64(0);
  }
  if (user_version > kSchemaVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("registry database \"", path_, "\" has schema version ", user_version,
                     ", newer than this opjit understands (", kSchemaVersion, ")"));
  }
  if (user_version < kSchemaVersion) {
    OPJIT_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
    absl::Status s = Exec(kSchemaSql);
    if (s.ok()) s = Exec(absl::StrCat("PRAGMA user_version=", kSchemaVersion).c_str());
    if (s.ok()) s = Exec("COMMIT");
    if (!s.ok()) {
      sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
      return s;
    }
  }
  return absl::OkStatus();
}

void SqliteStore::Abort() { sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr); }

absl::Status SqliteStore::Rollback(absl::Status s) {
  Abort();
  return s;
}

absl::StatusOr<std::vector<OpRecord>> SqliteStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  return LoadAllLocked();
}

absl::StatusOr<std::vector<OpRecord>> SqliteStore::LoadAllLocked() {
  Stmt st;
  int rc = st.Prepare(db_,
                      "SELECT ns, name, version, content_hash, def_json, created_unix_ms "
                      "FROM op_versions ORDER BY ns, name, version");
  if (rc != SQLITE_OK) return Error(rc, "loading op versions");
  std::vector<OpRecord> out;
  const std::string where = absl::StrCat("registry database \"", path_, "\"");
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) {
    OPJIT_ASSIGN_OR_RETURN(OpRecord rec,
                           DecodeRow(where, st.ColumnText(0), st.ColumnText(1), st.ColumnInt64(2),
                                     st.ColumnText(3), st.ColumnText(4), st.ColumnInt64(5)));
    out.push_back(std::move(rec));
  }
  if (rc != SQLITE_DONE) return Error(rc, "loading op versions");
  return out;
}

absl::StatusOr<std::vector<SqliteStore::HighWater>> SqliteStore::LoadHighWater() {
  absl::MutexLock lock(&mu_);
  return LoadHighWaterLocked();
}

absl::StatusOr<std::vector<SqliteStore::HighWater>> SqliteStore::LoadHighWaterLocked() {
  Stmt st;
  int rc = st.Prepare(db_, "SELECT ns, name, max_version FROM op_high_water ORDER BY ns, name");
  if (rc != SQLITE_OK) return Error(rc, "loading version high-water marks");
  std::vector<HighWater> out;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) {
    out.push_back(HighWater{st.ColumnText(0), st.ColumnText(1), st.ColumnInt64(2)});
  }
  if (rc != SQLITE_DONE) return Error(rc, "loading version high-water marks");
  return out;
}

absl::StatusOr<Store::Snapshot> SqliteStore::LoadSnapshot() {
  absl::MutexLock lock(&mu_);
  // One read transaction: both tables from the same state of the file.
  OPJIT_RETURN_IF_ERROR(Exec("BEGIN"));
  Snapshot snap;
  snap.generation = generation_;
  auto records = LoadAllLocked();
  if (!records.ok()) return Rollback(records.status());
  auto marks = LoadHighWaterLocked();
  if (!marks.ok()) return Rollback(marks.status());
  OPJIT_RETURN_IF_ERROR(Exec("COMMIT"));
  snap.records = std::move(*records);
  snap.high_water = std::move(*marks);
  return snap;
}

absl::Status SqliteStore::Probe() {
  absl::MutexLock lock(&mu_);
  return Exec(absl::StrCat("CREATE TABLE IF NOT EXISTS health_probe (id INTEGER PRIMARY KEY, "
                           "unix_ms INTEGER); INSERT OR REPLACE INTO health_probe VALUES (1, ",
                           std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count(),
                           ")")
                  .c_str());
}

absl::Status SqliteStore::Insert(const OpRecord& record) {
  std::string json = ToJson(record.def);
  if (Sha256Hex(json) != record.content_hash) {
    return absl::InvalidArgumentError(absl::StrCat("op ", record.def.ns, "/", record.def.name,
                                                   " version ", record.version,
                                                   ": content_hash does not match the definition"));
  }
  absl::MutexLock lock(&mu_);
  OPJIT_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "INSERT INTO op_versions (ns, name, version, content_hash, def_json, "
                        "created_unix_ms) VALUES (?, ?, ?, ?, ?, ?)");
    if (rc != SQLITE_OK) return Rollback(Error(rc, "preparing insert"));
    st.BindText(1, record.def.ns);
    st.BindText(2, record.def.name);
    st.BindInt64(3, record.version);
    st.BindText(4, record.content_hash);
    st.BindText(5, json);
    st.BindInt64(6, record.created_unix_ms);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) {
      return Rollback(Error(rc, absl::StrCat("inserting ", record.def.ns, "/", record.def.name,
                                             " version ", record.version)));
    }
  }
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "INSERT INTO op_high_water (ns, name, max_version) VALUES (?, ?, ?) "
                        "ON CONFLICT (ns, name) DO UPDATE SET "
                        "max_version = max(max_version, excluded.max_version)");
    if (rc != SQLITE_OK) return Rollback(Error(rc, "preparing high-water update"));
    st.BindText(1, record.def.ns);
    st.BindText(2, record.def.name);
    st.BindInt64(3, record.version);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) return Rollback(Error(rc, "updating the version high-water mark"));
  }
  absl::Status s = Exec("COMMIT");
  if (!s.ok()) return Rollback(s);
  ++generation_;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> SqliteStore::LiveVersions(const std::string& ns,
                                                               const std::string& name) {
  Stmt st;
  int rc =
      st.Prepare(db_, "SELECT version FROM op_versions WHERE ns = ? AND name = ? ORDER BY version");
  if (rc != SQLITE_OK) return Error(rc, "reading versions");
  st.BindText(1, ns);
  st.BindText(2, name);
  std::vector<int64_t> out;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) out.push_back(st.ColumnInt64(0));
  if (rc != SQLITE_DONE) return Error(rc, "reading versions");
  return out;
}

absl::StatusOr<Store::InsertResult> SqliteStore::RegisterVersion(const OpDef& def,
                                                                 const std::string& content_hash,
                                                                 int64_t now_ms,
                                                                 const Limits& limits) {
  absl::MutexLock lock(&mu_);
  // IMMEDIATE takes the write lock up front: the decision below and the
  // insert see the same state.
  OPJIT_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  auto result = RegisterInTxn(def, content_hash, now_ms, limits);
  if (!result.ok()) return Rollback(result.status());
  if (!result->created) {
    Abort();  // nothing was written
    return result;
  }
  absl::Status s = Exec("COMMIT");
  if (!s.ok()) return Rollback(s);
  result->generation = ++generation_;
  return result;
}

absl::StatusOr<Store::InsertResult> SqliteStore::RegisterInTxn(const OpDef& def,
                                                               const std::string& content_hash,
                                                               int64_t now_ms,
                                                               const Limits& limits) {
  std::string json = ToJson(def);
  if (Sha256Hex(json) != content_hash) {
    return absl::InvalidArgumentError(
        absl::StrCat("op ", def.ns, "/", def.name, ": content_hash does not match the definition"));
  }
  InsertResult result;
  int64_t latest = 0;
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "SELECT version, content_hash, def_json, created_unix_ms FROM op_versions "
                        "WHERE ns = ? AND name = ? ORDER BY version DESC LIMIT 1");
    if (rc != SQLITE_OK) return Error(rc, "reading the latest version");
    st.BindText(1, def.ns);
    st.BindText(2, def.name);
    rc = sqlite3_step(st.get());
    if (rc == SQLITE_ROW) {
      latest = st.ColumnInt64(0);
      if (st.ColumnText(1) == content_hash) {
        OPJIT_ASSIGN_OR_RETURN(
            result.record,
            DecodeRow(absl::StrCat("registry database \"", path_, "\""), def.ns, def.name, latest,
                      st.ColumnText(1), st.ColumnText(2), st.ColumnInt64(3)));
        return result;
      }
    } else if (rc != SQLITE_DONE) {
      return Error(rc, "reading the latest version");
    }
  }
  if (latest > 0 && limits.max_versions_per_op > 0) {
    OPJIT_ASSIGN_OR_RETURN(std::vector<int64_t> live, LiveVersions(def.ns, def.name));
    if (live.size() >= limits.max_versions_per_op) {
      return VersionsQuotaExceeded(def, limits.max_versions_per_op);
    }
  }
  if (latest == 0 && limits.max_ops_per_namespace > 0) {
    Stmt st;
    int rc = st.Prepare(db_, "SELECT COUNT(DISTINCT name) FROM op_versions WHERE ns = ?");
    if (rc != SQLITE_OK) return Error(rc, "counting ops");
    st.BindText(1, def.ns);
    if ((rc = sqlite3_step(st.get())) != SQLITE_ROW) return Error(rc, "counting ops");
    if (static_cast<size_t>(st.ColumnInt64(0)) >= limits.max_ops_per_namespace) {
      return OpsQuotaExceeded(def, limits.max_ops_per_namespace);
    }
  }
  int64_t mark = 0;
  {
    Stmt st;
    int rc = st.Prepare(db_, "SELECT max_version FROM op_high_water WHERE ns = ? AND name = ?");
    if (rc != SQLITE_OK) return Error(rc, "reading the version high-water mark");
    st.BindText(1, def.ns);
    st.BindText(2, def.name);
    rc = sqlite3_step(st.get());
    if (rc == SQLITE_ROW) {
      mark = st.ColumnInt64(0);
    } else if (rc != SQLITE_DONE) {
      return Error(rc, "reading the version high-water mark");
    }
  }
  result.record.def = def;
  result.record.version = std::max(mark, latest) + 1;
  result.record.content_hash = content_hash;
  result.record.created_unix_ms = now_ms;
  result.created = true;
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "INSERT INTO op_versions (ns, name, version, content_hash, def_json, "
                        "created_unix_ms) VALUES (?, ?, ?, ?, ?, ?)");
    if (rc != SQLITE_OK) return Error(rc, "preparing insert");
    st.BindText(1, def.ns);
    st.BindText(2, def.name);
    st.BindInt64(3, result.record.version);
    st.BindText(4, content_hash);
    st.BindText(5, json);
    st.BindInt64(6, now_ms);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) {
      return Error(rc, absl::StrCat("inserting ", def.ns, "/", def.name, " version ",
                                    result.record.version));
    }
  }
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "INSERT INTO op_high_water (ns, name, max_version) VALUES (?, ?, ?) "
                        "ON CONFLICT (ns, name) DO UPDATE SET max_version = excluded.max_version");
    if (rc != SQLITE_OK) return Error(rc, "preparing high-water update");
    st.BindText(1, def.ns);
    st.BindText(2, def.name);
    st.BindInt64(3, result.record.version);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) return Error(rc, "updating the version high-water mark");
  }
  return result;
}

absl::StatusOr<Store::DeleteResult> SqliteStore::DeleteOp(const std::string& ns,
                                                          const std::string& name,
                                                          int64_t version) {
  absl::MutexLock lock(&mu_);
  OPJIT_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  DeleteResult result;
  {
    Stmt st;
    int rc = st.Prepare(db_, version == 0 ? "DELETE FROM op_versions WHERE ns = ? AND name = ?"
                                          : "DELETE FROM op_versions WHERE ns = ? AND name = ? "
                                            "AND version = ?");
    if (rc != SQLITE_OK) return Rollback(Error(rc, "preparing delete"));
    st.BindText(1, ns);
    st.BindText(2, name);
    if (version != 0) st.BindInt64(3, version);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) return Rollback(Error(rc, absl::StrCat("deleting ", ns, "/", name)));
    result.deleted = sqlite3_changes(db_);
  }
  if (result.deleted == 0) {
    auto live = LiveVersions(ns, name);
    if (!live.ok()) return Rollback(live.status());
    result.live_versions = std::move(*live);
    Abort();
    return result;
  }
  absl::Status s = Exec("COMMIT");
  if (!s.ok()) return Rollback(s);
  result.generation = ++generation_;
  return result;
}

}  // namespace opjit::registry

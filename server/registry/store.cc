#include "server/registry/store.h"

#include <chrono>
#include <sqlite3.h>

#include <utility>

#include "absl/strings/str_cat.h"
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

// A prepared statement, finalized on destruction. Used only under Store::mu_.
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

absl::Status Store::Error(int rc, const std::string& what) {
  const char* msg = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
  absl::StatusCode code = CodeFor(rc);
  std::string text = absl::StrCat("registry database \"", path_, "\": ", what, ": ", msg);
  if (code == absl::StatusCode::kDataLoss) {
    absl::StrAppend(&text,
                    " (the file is corrupt or not a SQLite database; restore it from a "
                    "backup or move it away to start an empty registry)");
  }
  return absl::Status(code, text);
}

absl::Status Store::Exec(const char* sql) {
  char* err = nullptr;
  int rc = sqlite3_exec(db_, sql, nullptr, nullptr, &err);
  sqlite3_free(err);  // sqlite3_errmsg() still holds the message
  if (rc != SQLITE_OK) return Error(rc, sql);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path) {
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close_v2(db);
    return absl::Status(CodeFor(rc),
                        absl::StrCat("registry database \"", path, "\": cannot open: ", msg));
  }
  std::unique_ptr<Store> store(new Store(path, db));
  {
    absl::MutexLock lock(&store->mu_);
    OPJIT_RETURN_IF_ERROR(store->Init());
  }
  return store;
}

Store::~Store() { sqlite3_close_v2(db_); }

absl::Status Store::Init() {
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

absl::StatusOr<std::vector<OpRecord>> Store::LoadAll() {
  absl::MutexLock lock(&mu_);
  Stmt st;
  int rc = st.Prepare(db_,
                      "SELECT ns, name, version, content_hash, def_json, created_unix_ms "
                      "FROM op_versions ORDER BY ns, name, version");
  if (rc != SQLITE_OK) return Error(rc, "loading op versions");
  std::vector<OpRecord> out;
  while ((rc = sqlite3_step(st.get())) == SQLITE_ROW) {
    std::string ns = st.ColumnText(0);
    std::string name = st.ColumnText(1);
    OpRecord rec;
    rec.version = st.ColumnInt64(2);
    rec.content_hash = st.ColumnText(3);
    std::string json = st.ColumnText(4);
    rec.created_unix_ms = st.ColumnInt64(5);
    std::string row = absl::StrCat("registry database \"", path_, "\": row ", ns, "/", name,
                                   " version ", rec.version);
    auto def = FromJson(json);
    if (!def.ok()) {
      return absl::DataLossError(absl::StrCat(row, " does not parse: ", def.status().message()));
    }
    if (def->ns != ns || def->name != name) {
      return absl::DataLossError(
          absl::StrCat(row, " holds the definition of ", def->ns, "/", def->name));
    }
    // The stored text must be exactly the canonical form the hash covers.
    std::string hash = Sha256Hex(json);
    if (hash != rec.content_hash || ToJson(*def) != json) {
      return absl::DataLossError(absl::StrCat(row, " does not match its content hash"));
    }
    rec.def = std::move(*def);
    out.push_back(std::move(rec));
  }
  if (rc != SQLITE_DONE) return Error(rc, "loading op versions");
  return out;
}

absl::StatusOr<std::vector<Store::HighWater>> Store::LoadHighWater() {
  absl::MutexLock lock(&mu_);
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

absl::Status Store::Probe() {
  absl::MutexLock lock(&mu_);
  return Exec(absl::StrCat("CREATE TABLE IF NOT EXISTS health_probe (id INTEGER PRIMARY KEY, "
                           "unix_ms INTEGER); INSERT OR REPLACE INTO health_probe VALUES (1, ",
                           std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count(),
                           ")")
                  .c_str());
}

absl::Status Store::Insert(const OpRecord& record) {
  std::string json = ToJson(record.def);
  if (Sha256Hex(json) != record.content_hash) {
    return absl::InvalidArgumentError(absl::StrCat("op ", record.def.ns, "/", record.def.name,
                                                   " version ", record.version,
                                                   ": content_hash does not match the definition"));
  }
  absl::MutexLock lock(&mu_);
  OPJIT_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  auto rollback = [&](absl::Status s) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return s;
  };
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "INSERT INTO op_versions (ns, name, version, content_hash, def_json, "
                        "created_unix_ms) VALUES (?, ?, ?, ?, ?, ?)");
    if (rc != SQLITE_OK) return rollback(Error(rc, "preparing insert"));
    st.BindText(1, record.def.ns);
    st.BindText(2, record.def.name);
    st.BindInt64(3, record.version);
    st.BindText(4, record.content_hash);
    st.BindText(5, json);
    st.BindInt64(6, record.created_unix_ms);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) {
      return rollback(Error(rc, absl::StrCat("inserting ", record.def.ns, "/", record.def.name,
                                             " version ", record.version)));
    }
  }
  {
    Stmt st;
    int rc = st.Prepare(db_,
                        "INSERT INTO op_high_water (ns, name, max_version) VALUES (?, ?, ?) "
                        "ON CONFLICT (ns, name) DO UPDATE SET "
                        "max_version = max(max_version, excluded.max_version)");
    if (rc != SQLITE_OK) return rollback(Error(rc, "preparing high-water update"));
    st.BindText(1, record.def.ns);
    st.BindText(2, record.def.name);
    st.BindInt64(3, record.version);
    rc = sqlite3_step(st.get());
    if (rc != SQLITE_DONE) return rollback(Error(rc, "updating the version high-water mark"));
  }
  absl::Status s = Exec("COMMIT");
  if (!s.ok()) return rollback(s);
  return absl::OkStatus();
}

absl::Status Store::DeleteOp(const std::string& ns, const std::string& name, int64_t version) {
  absl::MutexLock lock(&mu_);
  Stmt st;
  int rc = st.Prepare(db_, version == 0 ? "DELETE FROM op_versions WHERE ns = ? AND name = ?"
                                        : "DELETE FROM op_versions WHERE ns = ? AND name = ? AND "
                                          "version = ?");
  if (rc != SQLITE_OK) return Error(rc, "preparing delete");
  st.BindText(1, ns);
  st.BindText(2, name);
  if (version != 0) st.BindInt64(3, version);
  // A single statement in autocommit mode is its own transaction.
  rc = sqlite3_step(st.get());
  if (rc != SQLITE_DONE) return Error(rc, absl::StrCat("deleting ", ns, "/", name));
  return absl::OkStatus();
}

}  // namespace opjit::registry

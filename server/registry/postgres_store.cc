#include "server/registry/postgres_store.h"

#include <libpq-fe.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/registry/canonical.h"

namespace opjit::registry {

// How to connect, shared by the store's connection and its watchers'.
struct PgConfig {
  // For PQconnectdbParams (expand_dbname = 1): our defaults, then the url as
  // "dbname" (its settings override the defaults), then the password.
  std::vector<std::string> keywords;
  std::vector<std::string> values;
  // Text that must never reach a log or a status (the passwords).
  std::vector<std::string> secrets;

  std::string Scrub(std::string text) const {
    for (const std::string& secret : secrets) {
      if (secret.empty()) continue;
      for (size_t pos = text.find(secret); pos != std::string::npos; pos = text.find(secret, pos)) {
        text.replace(pos, secret.size(), "***");
      }
    }
    return text;
  }
};

namespace {

using Clock = std::chrono::steady_clock;

// pg_advisory_xact_lock key that serialises schema creation ("opjitreg").
constexpr int64_t kSchemaLockKey = 0x6f706a6974726567;
constexpr char kWhere[] = "registry database (postgres)";

constexpr const char* kSchemaSql = R"sql(
CREATE TABLE IF NOT EXISTS opjit_schema (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS opjit_op_versions (
  ns TEXT NOT NULL,
  name TEXT NOT NULL,
  version BIGINT NOT NULL,
  content_hash TEXT NOT NULL,
  def_json TEXT NOT NULL,
  created_unix_ms BIGINT NOT NULL,
  PRIMARY KEY (ns, name, version)
);
CREATE TABLE IF NOT EXISTS opjit_op_high_water (
  ns TEXT NOT NULL,
  name TEXT NOT NULL,
  max_version BIGINT NOT NULL,
  PRIMARY KEY (ns, name)
);
CREATE TABLE IF NOT EXISTS opjit_generation (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  generation BIGINT NOT NULL
);
INSERT INTO opjit_generation (id, generation) VALUES (1, 1) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS opjit_health_probe (
  id INTEGER PRIMARY KEY,
  unix_ms BIGINT NOT NULL
);
)sql";

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What a client may be told when the database cannot be used now.
absl::Status Unavailable(absl::string_view what) {
  return WithReason(absl::UnavailableError(absl::StrCat(
                        "the registry database is unavailable (", what,
                        "); registered ops are still served, changes fail until it is back")),
                    reason::kStoreUnavailable);
}

// SQLSTATEs that mean "not now" rather than "wrong": connection problems
// (08), transaction rollbacks (40), operator intervention and shutdown (57),
// too many connections, a read-only server (a standby), a lock not available.
bool IsTransientState(const std::string& state) {
  if (state.size() != 5) return false;
  const std::string cls = state.substr(0, 2);
  return cls == "08" || cls == "40" || cls == "57" || state == "53300" || state == "25006" ||
         state == "55P03";
}

// Owns a PGresult.
class PgResult {
 public:
  explicit PgResult(PGresult* r) : r_(r) {}
  ~PgResult() { PQclear(r_); }
  PgResult(PgResult&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}
  PgResult& operator=(PgResult&& o) noexcept {
    std::swap(r_, o.r_);
    return *this;
  }
  PgResult(const PgResult&) = delete;
  PgResult& operator=(const PgResult&) = delete;

  const PGresult* get() const { return r_; }
  int rows() const { return PQntuples(r_); }
  std::string Text(int row, int col) const {
    return std::string(PQgetvalue(r_, row, col), PQgetlength(r_, row, col));
  }
  int64_t Int(int row, int col) const {
    return std::strtoll(PQgetvalue(r_, row, col), nullptr, 10);
  }
  // Rows an INSERT/UPDATE/DELETE touched.
  int64_t Affected() const { return std::strtoll(PQcmdTuples(r_), nullptr, 10); }

 private:
  PGresult* r_;
};

void IgnoreNotice(void*, const char*) {}

}  // namespace

// One libpq connection that reconnects itself. Not thread-safe: its owner
// serialises the calls.
class PgConnection {
 public:
  // Runs after every (re)connect, e.g. to LISTEN.
  using OnConnect = std::function<absl::Status(PgConnection&)>;

  PgConnection(std::shared_ptr<const PgConfig> config, std::string role,
               OnConnect on_connect = nullptr)
      : config_(std::move(config)), role_(std::move(role)), on_connect_(std::move(on_connect)) {}
  ~PgConnection() { Drop(); }
  PgConnection(const PgConnection&) = delete;
  PgConnection& operator=(const PgConnection&) = delete;

  bool connected() const { return conn_ != nullptr && PQstatus(conn_) == CONNECTION_OK; }
  PGconn* get() { return conn_; }

  void Drop() {
    if (conn_ != nullptr) PQfinish(conn_);
    conn_ = nullptr;
  }

  // OK when connected, reconnecting when the connection was lost: at once
  // the first time, then at most every backoff (doubling up to
  // PostgresStore::kMaxBackoffMs); in between, UNAVAILABLE at once. With
  // `detailed`, the status quotes libpq's reason (scrubbed), for the operator.
  absl::Status Ensure(bool detailed = false) {
    if (connected()) return absl::OkStatus();
    Clock::time_point now = Clock::now();
    if (conn_ != nullptr) {
      Drop();  // just found broken: try again now
      next_attempt_ = now;
    }
    if (now < next_attempt_) return Unavailable("reconnecting");
    std::vector<const char*> keys, values;
    for (size_t i = 0; i < config_->keywords.size(); ++i) {
      keys.push_back(config_->keywords[i].c_str());
      values.push_back(config_->values[i].c_str());
    }
    keys.push_back(nullptr);
    values.push_back(nullptr);
    PGconn* c = PQconnectdbParams(keys.data(), values.data(), /*expand_dbname=*/1);
    if (c == nullptr || PQstatus(c) != CONNECTION_OK) {
      std::string detail = c == nullptr ? "out of memory" : config_->Scrub(Trim(PQerrorMessage(c)));
      if (c != nullptr) PQfinish(c);
      backoff_ms_ = std::clamp<int64_t>(backoff_ms_ * 2, 50, PostgresStore::kMaxBackoffMs);
      next_attempt_ = now + std::chrono::milliseconds(backoff_ms_);
      NoteFailure("connecting", detail);
      absl::Status s = Unavailable("cannot connect");
      if (detailed) s = WithMessage(s, absl::StrCat(kWhere, ": cannot connect: ", detail));
      return s;
    }
    conn_ = c;
    PQsetNoticeProcessor(conn_, IgnoreNotice, nullptr);
    if (on_connect_) {
      if (absl::Status s = on_connect_(*this); !s.ok()) {
        Drop();
        return s;
      }
    }
    if (down_) Logger("registry")->info("{} ({}): connected again", kWhere, role_);
    down_ = false;
    backoff_ms_ = 0;
    return absl::OkStatus();
  }

  // Runs one statement with text parameters.
  absl::StatusOr<PgResult> Exec(absl::string_view what, const char* sql,
                                const std::vector<std::string>& params = {}) {
    if (!connected()) return Unavailable(what);
    std::vector<const char*> p;
    for (const std::string& s : params) p.push_back(s.c_str());
    PgResult result(PQexecParams(conn_, sql, static_cast<int>(p.size()), nullptr, p.data(), nullptr,
                                 nullptr, /*resultFormat=*/0));
    return Check(what, std::move(result));
  }

  // Runs `sql`, which may hold several statements and no parameters.
  absl::Status ExecScript(absl::string_view what, const char* sql) {
    if (!connected()) return Unavailable(what);
    return Check(what, PgResult(PQexec(conn_, sql))).status();
  }

  // Ends the open transaction, if any, ignoring errors.
  void Rollback() {
    if (connected() && PQtransactionStatus(conn_) != PQTRANS_IDLE)
      PQclear(PQexec(conn_, "ROLLBACK"));
  }

  // Logs a failure: the first after a success at warn, the rest at debug,
  // so that a database that is down for an hour does not flood the log.
  void NoteFailure(absl::string_view what, const std::string& detail) {
    auto log = Logger("registry");
    if (!down_) {
      log->warn("{} ({}): {}: {}", kWhere, role_, std::string(what), detail);
    } else {
      log->debug("{} ({}): {}: {}", kWhere, role_, std::string(what), detail);
    }
    if (!connected()) down_ = true;
  }

 private:
  absl::StatusOr<PgResult> Check(absl::string_view what, PgResult result) {
    // PQresultStatus(nullptr) is PGRES_FATAL_ERROR (out of memory).
    ExecStatusType st = PQresultStatus(result.get());
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return result;
    const PGresult* r = result.get();
    const char* state_field = r != nullptr ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
    std::string state = state_field != nullptr ? state_field : "";
    std::string detail = Trim(r != nullptr ? PQresultErrorMessage(r) : "");
    if (detail.empty()) detail = Trim(PQerrorMessage(conn_));
    detail = config_->Scrub(detail);
    NoteFailure(what, absl::StrCat(detail, state.empty() ? "" : " (SQLSTATE " + state + ")"));
    if (!connected() || IsTransientState(state)) return Unavailable(what);
    absl::StatusCode code = absl::StatusCode::kInternal;
    if (state == "23505") {
      code = absl::StatusCode::kAlreadyExists;
    } else if (state.rfind("53", 0) == 0) {
      code = absl::StatusCode::kResourceExhausted;  // disk full, out of memory
    } else if (state == "XX001" || state == "XX002") {
      code = absl::StatusCode::kDataLoss;
    }
    // The details (table names, the server's text) go to the log only.
    return absl::Status(code, absl::StrCat("registry database error while ", what, " (SQLSTATE ",
                                           state.empty() ? "none" : state, ")"));
  }

  const std::shared_ptr<const PgConfig> config_;
  const std::string role_;
  const OnConnect on_connect_;
  PGconn* conn_ = nullptr;
  bool down_ = false;
  int64_t backoff_ms_ = 0;
  Clock::time_point next_attempt_{};
};

namespace {

// Runs `body` in one transaction on `c`: BEGIN (`begin_sql`), body, COMMIT.
// `body` returns OK to commit, or an error, which rolls back and is returned;
// setting *commit = false rolls back and returns OK (nothing to write). A
// transaction that failed on a broken connection before COMMIT was sent is
// retried once on a fresh connection (the server discarded it); a failed
// COMMIT is not retried: its outcome is unknown.
absl::Status Transaction(PgConnection& c, absl::string_view what,
                         const std::function<absl::Status(bool* commit)>& body,
                         const char* begin_sql = "BEGIN") {
  for (int attempt = 0;; ++attempt) {
    OPJIT_RETURN_IF_ERROR(c.Ensure());
    bool commit = true;
    absl::Status s = c.Exec(what, begin_sql).status();
    if (s.ok()) s = body(&commit);
    if (s.ok() && commit) return c.Exec(what, "COMMIT").status();
    c.Rollback();
    if (s.ok()) return s;
    if (attempt == 0 && !c.connected() && s.code() == absl::StatusCode::kUnavailable) continue;
    return s;
  }
}

absl::StatusOr<Store::Snapshot> LoadSnapshotOn(PgConnection& c) {
  Store::Snapshot snap;
  OPJIT_RETURN_IF_ERROR(Transaction(
      c, "loading the registry",
      [&](bool* commit) -> absl::Status {
        snap = Store::Snapshot{};
        *commit = false;  // read only
        OPJIT_ASSIGN_OR_RETURN(
            PgResult gen,
            c.Exec("loading the registry", "SELECT generation FROM opjit_generation WHERE id = 1"));
        if (gen.rows() != 1)
          return absl::DataLossError(absl::StrCat(kWhere, ": no generation row"));
        snap.generation = static_cast<uint64_t>(gen.Int(0, 0));
        OPJIT_ASSIGN_OR_RETURN(
            PgResult rows,
            c.Exec("loading the registry",
                   "SELECT ns, name, version, content_hash, def_json, created_unix_ms FROM "
                   "opjit_op_versions ORDER BY ns COLLATE \"C\", name COLLATE \"C\", version"));
        snap.records.reserve(rows.rows());
        for (int i = 0; i < rows.rows(); ++i) {
          OPJIT_ASSIGN_OR_RETURN(OpRecord rec,
                                 DecodeRow(kWhere, rows.Text(i, 0), rows.Text(i, 1), rows.Int(i, 2),
                                           rows.Text(i, 3), rows.Text(i, 4), rows.Int(i, 5)));
          snap.records.push_back(std::move(rec));
        }
        OPJIT_ASSIGN_OR_RETURN(
            PgResult marks,
            c.Exec("loading the registry",
                   "SELECT ns, name, max_version FROM opjit_op_high_water WHERE max_version > 0 "
                   "ORDER BY ns COLLATE \"C\", name COLLATE \"C\""));
        for (int i = 0; i < marks.rows(); ++i) {
          snap.high_water.push_back({marks.Text(i, 0), marks.Text(i, 1), marks.Int(i, 2)});
        }
        return absl::OkStatus();
      },
      "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"));
  return snap;
}

// Bumps the generation row (which serialises every changing write) and
// queues the notification that goes out at commit. Returns the generation.
absl::StatusOr<uint64_t> BumpGeneration(PgConnection& c) {
  OPJIT_ASSIGN_OR_RETURN(PgResult gen, c.Exec("bumping the generation",
                                              "UPDATE opjit_generation SET generation = "
                                              "generation + 1 WHERE id = 1 RETURNING generation"));
  if (gen.rows() != 1) return absl::DataLossError(absl::StrCat(kWhere, ": no generation row"));
  std::string g = gen.Text(0, 0);
  OPJIT_RETURN_IF_ERROR(
      c.Exec("notifying", "SELECT pg_notify($1, $2)", {PostgresStore::kChannel, g}).status());
  return static_cast<uint64_t>(gen.Int(0, 0));
}

// Takes the op's row lock: every write to (ns, name) goes through it.
absl::StatusOr<int64_t> LockOp(PgConnection& c, const std::string& ns, const std::string& name) {
  OPJIT_RETURN_IF_ERROR(c.Exec("locking the op",
                               "INSERT INTO opjit_op_high_water (ns, name, max_version) "
                               "VALUES ($1, $2, 0) ON CONFLICT DO NOTHING",
                               {ns, name})
                            .status());
  OPJIT_ASSIGN_OR_RETURN(PgResult mark, c.Exec("locking the op",
                                               "SELECT max_version FROM opjit_op_high_water "
                                               "WHERE ns = $1 AND name = $2 FOR UPDATE",
                                               {ns, name}));
  return mark.rows() == 1 ? mark.Int(0, 0) : 0;
}

absl::StatusOr<std::vector<int64_t>> LiveVersions(PgConnection& c, const std::string& ns,
                                                  const std::string& name) {
  OPJIT_ASSIGN_OR_RETURN(PgResult rows, c.Exec("reading versions",
                                               "SELECT version FROM opjit_op_versions WHERE ns = "
                                               "$1 AND name = $2 ORDER BY version",
                                               {ns, name}));
  std::vector<int64_t> out;
  for (int i = 0; i < rows.rows(); ++i) out.push_back(rows.Int(i, 0));
  return out;
}

// Reports other daemons' changes: LISTEN on its own connection, woken by the
// socket or by Interrupt() (an eventfd).
class PgWatcher final : public ChangeWatcher {
 public:
  explicit PgWatcher(std::shared_ptr<const PgConfig> config)
      : conn_(
            std::move(config), "watcher",
            [](PgConnection& c) { return c.Exec("listening", "LISTEN opjit_registry").status(); }),
        efd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~PgWatcher() override {
    if (efd_ >= 0) close(efd_);
  }

  absl::Status Init(bool detailed) {
    if (efd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
    return conn_.Ensure(detailed);
  }

  absl::StatusOr<Event> Wait(int64_t timeout_ms) override {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    if (absl::Status s = conn_.Ensure(); !s.ok()) {
      SleepUntil(deadline);
      return s;
    }
    for (;;) {
      Event ev;
      if (Drain(&ev.generation)) {
        ev.kind = Event::kNotified;
        return ev;
      }
      int64_t left = std::max<int64_t>(
          0,
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      pollfd fds[2] = {{PQsocket(conn_.get()), POLLIN, 0}, {efd_, POLLIN, 0}};
      int n = poll(fds, 2, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (n < 0 && errno != EINTR)
        return absl::InternalError(absl::StrCat("poll: ", strerror(errno)));
      if (n > 0 && (fds[1].revents & POLLIN) != 0) {
        uint64_t count;
        (void)!read(efd_, &count, sizeof(count));
        ev.kind = Event::kInterrupted;
        return ev;
      }
      if (n > 0 && fds[0].revents != 0) {
        if (PQconsumeInput(conn_.get()) == 0 || !conn_.connected()) {
          conn_.NoteFailure("listening", Trim(PQerrorMessage(conn_.get())));
          conn_.Drop();
          return Unavailable("listening");
        }
        continue;  // drained at the top
      }
      if (n == 0 && left == 0) return ev;  // kTimeout
    }
  }

  absl::StatusOr<uint64_t> Generation() override {
    OPJIT_RETURN_IF_ERROR(conn_.Ensure());
    OPJIT_ASSIGN_OR_RETURN(PgResult gen,
                           conn_.Exec("reading the generation",
                                      "SELECT generation FROM opjit_generation WHERE id = 1"));
    if (gen.rows() != 1) return absl::DataLossError(absl::StrCat(kWhere, ": no generation row"));
    return static_cast<uint64_t>(gen.Int(0, 0));
  }

  absl::StatusOr<Store::Snapshot> LoadSnapshot() override { return LoadSnapshotOn(conn_); }

  void Interrupt() override {
    uint64_t one = 1;
    (void)!write(efd_, &one, sizeof(one));
  }

 private:
  // Takes the notifications libpq has buffered; true when there was one.
  bool Drain(uint64_t* max_generation) {
    bool any = false;
    while (PGnotify* n = PQnotifies(conn_.get())) {
      uint64_t g = 0;
      // An unreadable payload still means "something changed".
      if (!absl::SimpleAtoi(n->extra != nullptr ? n->extra : "", &g)) g = UINT64_MAX;
      *max_generation = std::max(*max_generation, g);
      any = true;
      PQfreemem(n);
    }
    return any;
  }

  void SleepUntil(Clock::time_point deadline) {
    int64_t left = std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    pollfd fd = {efd_, POLLIN, 0};
    // Left readable, so that the caller's next Wait() reports the interrupt.
    (void)poll(&fd, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
  }

  PgConnection conn_;
  const int efd_;
};

}  // namespace

PostgresStore::PostgresStore(std::shared_ptr<const PgConfig> config,
                             std::unique_ptr<PgConnection> conn)
    : config_(std::move(config)), conn_(std::move(conn)) {}

PostgresStore::~PostgresStore() = default;

absl::StatusOr<std::unique_ptr<PostgresStore>> PostgresStore::Open(const Options& options) {
  if (options.url.empty()) {
    return absl::InvalidArgumentError("registry: url must be set for the postgres backend");
  }
  auto config = std::make_shared<PgConfig>();
  config->secrets.push_back(options.password);
  {
    char* err = nullptr;
    PQconninfoOption* parsed = PQconninfoParse(options.url.c_str(), &err);
    if (parsed == nullptr) {
      // libpq's message may quote the string, password and all.
      if (err != nullptr) PQfreemem(err);
      return absl::InvalidArgumentError(
          "registry: url is not a valid libpq connection string or URI");
    }
    for (PQconninfoOption* o = parsed; o->keyword != nullptr; ++o) {
      if (o->val != nullptr && std::string(o->keyword) == "password") {
        config->secrets.push_back(o->val);
      }
    }
    PQconninfoFree(parsed);
  }
  auto add = [&](const char* k, std::string v) {
    config->keywords.push_back(k);
    config->values.push_back(std::move(v));
  };
  add("connect_timeout", absl::StrCat(std::max(1, options.connect_timeout_s)));
  add("fallback_application_name", "opjitd");
  add("client_encoding", "UTF8");
  // Notice a dead server or a cut network within about a minute, also in
  // the middle of a statement.
  add("keepalives", "1");
  add("keepalives_idle", "30");
  add("keepalives_interval", "10");
  add("keepalives_count", "3");
  add("tcp_user_timeout", "60000");
  add("options", "-c statement_timeout=60000 -c idle_in_transaction_session_timeout=60000");
  add("dbname", options.url);
  if (!options.password.empty()) add("password", options.password);

  auto conn = std::make_unique<PgConnection>(config, "store");
  OPJIT_RETURN_IF_ERROR(conn->Ensure(/*detailed=*/true));

  // Create the schema when it is missing, one daemon at a time.
  int64_t found_version = 0;
  absl::Status s = Transaction(*conn, "creating the schema", [&](bool*) -> absl::Status {
    OPJIT_ASSIGN_OR_RETURN(
        PgResult exists,
        conn->Exec("reading the schema version", "SELECT to_regclass('opjit_schema') IS NOT NULL"));
    if (exists.rows() == 1 && exists.Text(0, 0) == "t") {
      OPJIT_ASSIGN_OR_RETURN(
          PgResult v, conn->Exec("reading the schema version", "SELECT version FROM opjit_schema"));
      found_version = v.rows() == 1 ? v.Int(0, 0) : 0;
      // Up to date: nothing to create (and no CREATE privilege needed).
      if (found_version >= kSchemaVersion) return absl::OkStatus();
    }
    OPJIT_RETURN_IF_ERROR(conn->Exec("creating the schema", "SELECT pg_advisory_xact_lock($1)",
                                     {absl::StrCat(kSchemaLockKey)})
                              .status());
    OPJIT_RETURN_IF_ERROR(conn->ExecScript("creating the schema", kSchemaSql));
    OPJIT_ASSIGN_OR_RETURN(
        PgResult v, conn->Exec("reading the schema version", "SELECT version FROM opjit_schema"));
    found_version = v.rows() == 1 ? v.Int(0, 0) : 0;
    if (found_version == 0) {
      OPJIT_RETURN_IF_ERROR(conn->Exec("creating the schema",
                                       "INSERT INTO opjit_schema (id, version) VALUES (1, $1)",
                                       {absl::StrCat(kSchemaVersion)})
                                .status());
      found_version = kSchemaVersion;
    }
    return absl::OkStatus();
  });
  OPJIT_RETURN_IF_ERROR(s);
  if (found_version > kSchemaVersion) {
    return absl::FailedPreconditionError(absl::StrCat(kWhere, " has schema version ", found_version,
                                                      ", newer than this opjit understands (",
                                                      kSchemaVersion, ")"));
  }
  Logger("registry")->info("{}: connected, schema version {}", kWhere, found_version);
  return std::unique_ptr<PostgresStore>(new PostgresStore(std::move(config), std::move(conn)));
}

absl::StatusOr<Store::Snapshot> PostgresStore::LoadSnapshot() {
  absl::MutexLock lock(&mu_);
  return LoadSnapshotOn(*conn_);
}

absl::StatusOr<std::vector<OpRecord>> PostgresStore::LoadAll() {
  OPJIT_ASSIGN_OR_RETURN(Snapshot snap, LoadSnapshot());
  return std::move(snap.records);
}

absl::StatusOr<std::vector<Store::HighWater>> PostgresStore::LoadHighWater() {
  OPJIT_ASSIGN_OR_RETURN(Snapshot snap, LoadSnapshot());
  return std::move(snap.high_water);
}

absl::StatusOr<Store::InsertResult> PostgresStore::RegisterVersion(const OpDef& def,
                                                                   const std::string& content_hash,
                                                                   int64_t now_ms,
                                                                   const Limits& limits) {
  const std::string json = ToJson(def);
  if (Sha256Hex(json) != content_hash) {
    return absl::InvalidArgumentError(
        absl::StrCat("op ", def.ns, "/", def.name, ": content_hash does not match the definition"));
  }
  absl::MutexLock lock(&mu_);
  PgConnection& c = *conn_;
  InsertResult result;
  OPJIT_RETURN_IF_ERROR(Transaction(c, "registering an op", [&](bool* commit) -> absl::Status {
    result = InsertResult{};
    OPJIT_ASSIGN_OR_RETURN(int64_t mark, LockOp(c, def.ns, def.name));
    OPJIT_ASSIGN_OR_RETURN(
        PgResult latest,
        c.Exec("registering an op",
               "SELECT version, content_hash, def_json, created_unix_ms FROM opjit_op_versions "
               "WHERE ns = $1 AND name = $2 ORDER BY version DESC LIMIT 1",
               {def.ns, def.name}));
    int64_t latest_version = 0;
    if (latest.rows() == 1) {
      latest_version = latest.Int(0, 0);
      if (latest.Text(0, 1) == content_hash) {
        OPJIT_ASSIGN_OR_RETURN(
            result.record, DecodeRow(kWhere, def.ns, def.name, latest_version, latest.Text(0, 1),
                                     latest.Text(0, 2), latest.Int(0, 3)));
        *commit = false;  // unchanged
        return absl::OkStatus();
      }
      if (limits.max_versions_per_op > 0) {
        OPJIT_ASSIGN_OR_RETURN(PgResult n, c.Exec("registering an op",
                                                  "SELECT count(*) FROM opjit_op_versions "
                                                  "WHERE ns = $1 AND name = $2",
                                                  {def.ns, def.name}));
        if (static_cast<size_t>(n.Int(0, 0)) >= limits.max_versions_per_op) {
          return VersionsQuotaExceeded(def, limits.max_versions_per_op);
        }
      }
    }
    // From here on every other changing write waits for this one, so the
    // count below cannot miss a new op another daemon is adding.
    OPJIT_ASSIGN_OR_RETURN(result.generation, BumpGeneration(c));
    if (latest_version == 0 && limits.max_ops_per_namespace > 0) {
      OPJIT_ASSIGN_OR_RETURN(PgResult n, c.Exec("registering an op",
                                                "SELECT count(DISTINCT name) FROM "
                                                "opjit_op_versions WHERE ns = $1",
                                                {def.ns}));
      if (static_cast<size_t>(n.Int(0, 0)) >= limits.max_ops_per_namespace) {
        return OpsQuotaExceeded(def, limits.max_ops_per_namespace);
      }
    }
    const int64_t version = std::max(mark, latest_version) + 1;
    const std::string v = absl::StrCat(version);
    OPJIT_RETURN_IF_ERROR(c.Exec("registering an op",
                                 "INSERT INTO opjit_op_versions (ns, name, version, content_hash, "
                                 "def_json, created_unix_ms) VALUES ($1, $2, $3, $4, $5, $6)",
                                 {def.ns, def.name, v, content_hash, json, absl::StrCat(now_ms)})
                              .status());
    OPJIT_RETURN_IF_ERROR(c.Exec("registering an op",
                                 "UPDATE opjit_op_high_water SET max_version = $3 "
                                 "WHERE ns = $1 AND name = $2",
                                 {def.ns, def.name, v})
                              .status());
    result.created = true;
    result.record.def = def;
    result.record.version = version;
    result.record.content_hash = content_hash;
    result.record.created_unix_ms = now_ms;
    return absl::OkStatus();
  }));
  return result;
}

absl::StatusOr<Store::DeleteResult> PostgresStore::DeleteOp(const std::string& ns,
                                                            const std::string& name,
                                                            int64_t version) {
  absl::MutexLock lock(&mu_);
  PgConnection& c = *conn_;
  DeleteResult result;
  OPJIT_RETURN_IF_ERROR(Transaction(c, "deleting an op", [&](bool* commit) -> absl::Status {
    result = DeleteResult{};
    OPJIT_RETURN_IF_ERROR(LockOp(c, ns, name).status());
    OPJIT_ASSIGN_OR_RETURN(
        PgResult deleted,
        version == 0
            ? c.Exec("deleting an op", "DELETE FROM opjit_op_versions WHERE ns = $1 AND name = $2",
                     {ns, name})
            : c.Exec("deleting an op",
                     "DELETE FROM opjit_op_versions WHERE ns = $1 AND name = $2 AND version = $3",
                     {ns, name, absl::StrCat(version)}));
    result.deleted = static_cast<int>(deleted.Affected());
    if (result.deleted == 0) {
      OPJIT_ASSIGN_OR_RETURN(result.live_versions, LiveVersions(c, ns, name));
      *commit = false;  // also drops a high-water row LockOp may have made
      return absl::OkStatus();
    }
    OPJIT_ASSIGN_OR_RETURN(result.generation, BumpGeneration(c));
    return absl::OkStatus();
  }));
  return result;
}

absl::Status PostgresStore::Probe() {
  absl::MutexLock lock(&mu_);
  PgConnection& c = *conn_;
  return Transaction(c, "probing", [&](bool*) {
    return c
        .Exec("probing",
              "INSERT INTO opjit_health_probe (id, unix_ms) VALUES (1, $1) "
              "ON CONFLICT (id) DO UPDATE SET unix_ms = excluded.unix_ms",
              {absl::StrCat(NowUnixMs())})
        .status();
  });
}

absl::StatusOr<std::unique_ptr<ChangeWatcher>> PostgresStore::Watch() {
  auto watcher = std::make_unique<PgWatcher>(config_);
  OPJIT_RETURN_IF_ERROR(watcher->Init(/*detailed=*/true));
  return std::unique_ptr<ChangeWatcher>(std::move(watcher));
}

}  // namespace opjit::registry

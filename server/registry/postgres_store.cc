#include "server/registry/postgres_store.h"

#include <libpq-fe.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/registry/canonical.h"

namespace opjit::registry {

// How to connect, shared by the store's connection and its watchers'.
struct PgConfig {
  // For PQconnectStartParams (expand_dbname = 0): the url's settings, parsed
  // and bounded, our defaults, the password.
  std::vector<std::string> keywords;
  std::vector<std::string> values;
  // Text that must never reach a log or a status (the passwords).
  std::vector<std::string> secrets;
  // The bound on one call, and on connecting (PostgresStore::Options).
  int64_t timeout_ms = 10000;
  int64_t connect_timeout_ms = 5000;
  // How often a wait logs that the server has not answered yet.
  int64_t hang_log_ms = 2000;
  // Sessions run with synchronous_commit = local; when the url's options set
  // synchronous_commit (the operator asked for replication waits), its value,
  // which each write transaction sets locally (postgres_store.h).
  std::string write_synchronous_commit;
  std::function<void()> before_commit_for_test;

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

// The commit guard (see postgres_store.h), created on each store connection
// before its first write: per session, so that it needs no schema change and
// no privilege beyond TEMP. The row is gone at the end of the transaction
// (ON COMMIT DELETE ROWS runs after the deferred triggers).
constexpr const char* kCommitGuardSql = R"sql(
CREATE TEMP TABLE opjit_commit_guard (budget_ms BIGINT NOT NULL) ON COMMIT DELETE ROWS;
CREATE FUNCTION pg_temp.opjit_commit_guard() RETURNS trigger LANGUAGE plpgsql AS $guard$
BEGIN
  IF clock_timestamp() > transaction_timestamp() + NEW.budget_ms * interval '1 millisecond' THEN
    RAISE EXCEPTION 'opjit commit guard: the commit deadline has passed, rolling back'
      USING ERRCODE = '57014';
  END IF;
  RETURN NULL;
END
$guard$;
CREATE CONSTRAINT TRIGGER opjit_commit_guard AFTER INSERT ON pg_temp.opjit_commit_guard
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pg_temp.opjit_commit_guard();
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

int64_t MsUntil(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
}

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// "2.5 s" or "800 ms", for logs.
std::string Duration(int64_t ms) {
  if (ms < 1000) return absl::StrCat(ms, " ms");
  return absl::StrCat(ms / 1000, ms % 1000 >= 100 ? absl::StrCat(".", (ms % 1000) / 100) : "",
                      " s");
}

// What a client may be told when the database cannot be used now.
absl::Status Unavailable(absl::string_view what) {
  return WithReason(absl::UnavailableError(absl::StrCat(
                        "the registry database is unavailable (", what,
                        "); registered ops are still served, changes fail until it is back")),
                    reason::kStoreUnavailable);
}

// A write whose COMMIT was sent but not answered by the deadline: it may
// still be applied (postgres_store.h), so the caller is not told "refused".
absl::Status OutcomeUnknown(absl::string_view what, absl::string_view waited,
                            const std::string& txid) {
  return WithReason(
      absl::UnavailableError(absl::StrCat(
          "the outcome of this write is unknown: the registry database did not answer its "
          "COMMIT ",
          waited, " while ", what, " (transaction ", txid,
          "), so it may have been applied; ask again: an identical registration answers with "
          "the version it landed as (or registers it now), a deletion that landed finds "
          "nothing left to delete")),
      PostgresStore::kOutcomeUnknownReason, {{"transaction", txid}});
}

// `s`, when its outcome is unknown, with the op it was writing named.
absl::Status NameOp(absl::Status s, const std::string& ns, const std::string& name) {
  std::optional<ErrorReason> r = GetReason(s);
  if (!r.has_value() || r->reason != PostgresStore::kOutcomeUnknownReason) return s;
  return WithReason(std::move(s), r->reason,
                    {{"namespace", ns}, {"op", name}, {"transaction", r->metadata["transaction"]}});
}

// SQLSTATEs that mean "not now" rather than "wrong": connection problems
// (08), transaction rollbacks (40), operator intervention, cancels and
// shutdown (57; also the commit guard), too many connections, a read-only
// server (a standby), a lock not available.
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

// Sends a cancel request for `conn`'s running statement without waiting for
// it: PQcancel connects to the server and waits for it to close that
// connection, which a frozen server never does. At most one such request is
// in flight in the process, so a hung server holds at most one thread.
void CancelInBackground(PGconn* conn) {
  static std::atomic<bool> in_flight{false};
  if (conn == nullptr || PQstatus(conn) != CONNECTION_OK) return;
  bool expected = false;
  if (!in_flight.compare_exchange_strong(expected, true)) return;
  PGcancel* cancel = PQgetCancel(conn);
  if (cancel == nullptr) {
    in_flight.store(false);
    return;
  }
  try {
    std::thread([cancel] {
      char err[256];
      (void)PQcancel(cancel, err, sizeof(err));
      PQfreeCancel(cancel);
      in_flight.store(false);
    }).detach();
  } catch (const std::system_error&) {
    PQfreeCancel(cancel);
    in_flight.store(false);
  }
}

}  // namespace

// One libpq connection that reconnects itself, with every wait bounded by the
// deadline of the current operation (StartOperation). Not thread-safe: its
// owner serialises the calls.
class PgConnection {
 public:
  // Runs after every (re)connect, e.g. to LISTEN; within the deadline.
  using OnConnect = std::function<absl::Status(PgConnection&)>;

  PgConnection(std::shared_ptr<const PgConfig> config, std::string role,
               OnConnect on_connect = nullptr)
      : config_(std::move(config)), role_(std::move(role)), on_connect_(std::move(on_connect)) {}
  ~PgConnection() { Drop(); }
  PgConnection(const PgConnection&) = delete;
  PgConnection& operator=(const PgConnection&) = delete;

  bool connected() const { return conn_ != nullptr && PQstatus(conn_) == CONNECTION_OK; }
  PGconn* get() { return conn_; }
  const PgConfig& config() const { return *config_; }

  // Every wait until the next StartOperation ends by `deadline`.
  void StartOperation(Clock::time_point deadline) { deadline_ = deadline; }
  // StartOperation(now + the configured bound).
  void StartOperation() {
    StartOperation(Clock::now() + std::chrono::milliseconds(config_->timeout_ms));
  }
  Clock::time_point deadline() const { return deadline_; }

  void Drop() {
    if (conn_ != nullptr) PQfinish(conn_);  // non-blocking: never waits
    conn_ = nullptr;
  }

  // OK when connected; otherwise reconnects: at once the first time after
  // the connection was lost, then at most every backoff (doubling up to
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
    const Clock::time_point connect_deadline =
        std::min(deadline_, now + std::chrono::milliseconds(config_->connect_timeout_ms));
    std::string detail;
    if (!Connect(connect_deadline, &detail)) {
      Drop();
      backoff_ms_ = std::clamp<int64_t>(backoff_ms_ * 2, 50, PostgresStore::kMaxBackoffMs);
      next_attempt_ = Clock::now() + std::chrono::milliseconds(backoff_ms_);
      NoteFailure("connecting", detail);
      absl::Status s = Unavailable("cannot connect");
      if (detailed) s = WithMessage(s, absl::StrCat(kWhere, ": cannot connect: ", detail));
      return s;
    }
    PQsetNoticeProcessor(conn_, IgnoreNotice, nullptr);
    guard_ready_ = false;
    absl::Status s = on_connect_ ? on_connect_(*this) : absl::OkStatus();
    if (s.ok()) s = CheckUnansweredCommit();
    if (!s.ok()) {
      Drop();
      backoff_ms_ = std::clamp<int64_t>(backoff_ms_ * 2, 50, PostgresStore::kMaxBackoffMs);
      next_attempt_ = Clock::now() + std::chrono::milliseconds(backoff_ms_);
      return s;
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
    StartRequest();
    if (PQsendQueryParams(conn_, sql, static_cast<int>(p.size()), nullptr, p.data(), nullptr,
                          nullptr, /*resultFormat=*/0) == 0) {
      return Broken(what);
    }
    return Collect(what);
  }

  // Runs `sql`, which may hold several statements and no parameters.
  absl::Status ExecScript(absl::string_view what, const char* sql) {
    if (!connected()) return Unavailable(what);
    StartRequest();
    if (PQsendQuery(conn_, sql) == 0) return Broken(what);
    return Collect(what).status();
  }

  // Ends the open transaction, if any: ROLLBACK within the deadline, or, with
  // no time left or when that fails, by dropping the connection (the server
  // rolls back what a closed connection left open).
  void Rollback() {
    if (!connected() || PQtransactionStatus(conn_) == PQTRANS_IDLE) return;
    if (Clock::now() >= deadline_ || !Exec("rolling back", "ROLLBACK").ok()) Drop();
  }

  // Creates this session's commit guard (kCommitGuardSql) unless it exists:
  // at the first write, so that a connection that only reads (a standby)
  // needs no write.
  absl::Status EnsureCommitGuard() {
    if (guard_ready_) return absl::OkStatus();
    OPJIT_RETURN_IF_ERROR(ExecScript("preparing the connection", kCommitGuardSql));
    guard_ready_ = true;
    return absl::OkStatus();
  }

  // Remembers a transaction whose COMMIT went unanswered: checked (and the
  // outcome logged) once connected again.
  void NoteUnansweredCommit(std::string txid) { unanswered_txid_ = std::move(txid); }

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
  enum class Ready { kYes, kTimeout, kFailed };

  void StartRequest() {
    request_start_ = Clock::now();
    next_hang_log_ = request_start_ + std::chrono::milliseconds(config_->hang_log_ms);
  }

  // Waits until the socket is ready for `events` or `deadline` passes,
  // warning every hang_log_ms that the server has not answered yet.
  Ready WaitSocket(short events, Clock::time_point deadline, absl::string_view what) {
    for (;;) {
      const Clock::time_point now = Clock::now();
      if (now >= next_hang_log_) {
        Logger("registry")
            ->warn("{} ({}): PostgreSQL has not answered for {} ({})", kWhere, role_,
                   Duration(MsSince(request_start_)), std::string(what));
        next_hang_log_ = now + std::chrono::milliseconds(config_->hang_log_ms);
      }
      if (now >= deadline) return Ready::kTimeout;
      const int fd = PQsocket(conn_);
      if (fd < 0) return Ready::kFailed;
      const Clock::time_point wake = std::min(deadline, next_hang_log_);
      const int64_t ms =
          std::max<int64_t>(1, std::chrono::ceil<std::chrono::milliseconds>(wake - now).count());
      pollfd p = {fd, events, 0};
      const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
      if (n < 0 && errno != EINTR) return Ready::kFailed;
      if (n > 0) return Ready::kYes;  // POLLERR/POLLHUP too: libpq reports them
    }
  }

  // PQconnectStartParams/PQconnectPoll until connected or `deadline`.
  bool Connect(Clock::time_point deadline, std::string* detail) {
    std::vector<const char*> keys, values;
    for (size_t i = 0; i < config_->keywords.size(); ++i) {
      keys.push_back(config_->keywords[i].c_str());
      values.push_back(config_->values[i].c_str());
    }
    keys.push_back(nullptr);
    values.push_back(nullptr);
    conn_ = PQconnectStartParams(keys.data(), values.data(), /*expand_dbname=*/0);
    if (conn_ == nullptr) {
      *detail = "out of memory";
      return false;
    }
    StartRequest();
    PostgresPollingStatusType st =
        PQstatus(conn_) == CONNECTION_BAD ? PGRES_POLLING_FAILED : PGRES_POLLING_WRITING;
    while (st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED) {
      Ready r = WaitSocket(st == PGRES_POLLING_READING ? POLLIN : POLLOUT, deadline, "connecting");
      if (r == Ready::kTimeout) {
        *detail = absl::StrCat("no answer within ", Duration(MsSince(request_start_)));
        return false;
      }
      if (r == Ready::kFailed) break;
      st = PQconnectPoll(conn_);
    }
    if (st != PGRES_POLLING_OK || PQstatus(conn_) != CONNECTION_OK) {
      *detail = config_->Scrub(Trim(PQerrorMessage(conn_)));
      if (detail->empty()) *detail = "connection failed";
      return false;
    }
    // libpq's own waits (sending, PQfinish's goodbye) must never block.
    if (PQsetnonblocking(conn_, 1) != 0) {
      *detail = "cannot make the connection non-blocking";
      return false;
    }
    return true;
  }

  // Sends what libpq has buffered, then reads until a result is complete,
  // by the deadline.
  absl::Status Await(absl::string_view what) {
    for (;;) {
      const int f = PQflush(conn_);
      if (f == 0) break;
      if (f < 0) return Broken(what);
      Ready r = WaitSocket(POLLIN | POLLOUT, deadline_, what);
      if (r == Ready::kTimeout) return TimedOut(what);
      if (r == Ready::kFailed || PQconsumeInput(conn_) == 0) return Broken(what);
    }
    while (PQisBusy(conn_) != 0) {
      Ready r = WaitSocket(POLLIN, deadline_, what);
      if (r == Ready::kTimeout) return TimedOut(what);
      if (r == Ready::kFailed || PQconsumeInput(conn_) == 0) return Broken(what);
    }
    return absl::OkStatus();
  }

  // Every result of the request sent last: the first error, or the last
  // result.
  absl::StatusOr<PgResult> Collect(absl::string_view what) {
    PgResult last(nullptr);
    PgResult error(nullptr);
    for (;;) {
      OPJIT_RETURN_IF_ERROR(Await(what));
      PGresult* r = PQgetResult(conn_);
      if (r == nullptr) break;
      ExecStatusType st = PQresultStatus(r);
      if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK || st == PGRES_EMPTY_QUERY) {
        if (error.get() == nullptr) {
          last = PgResult(r);
        } else {
          PQclear(r);
        }
      } else if (error.get() == nullptr) {
        error = PgResult(r);
      } else {
        PQclear(r);
      }
    }
    return Check(what, error.get() != nullptr ? std::move(error) : std::move(last));
  }

  // The connection failed under a request.
  absl::Status Broken(absl::string_view what) {
    NoteFailure(what, conn_ != nullptr ? config_->Scrub(Trim(PQerrorMessage(conn_)))
                                       : std::string("no connection"));
    Drop();
    down_ = true;
    return Unavailable(what);
  }

  // The deadline passed with the request unanswered: cancel it and close the
  // connection, so that whatever it had open is rolled back.
  absl::Status TimedOut(absl::string_view what) {
    const std::string waited = Duration(MsSince(request_start_));
    Logger("registry")
        ->warn(
            "{} ({}): PostgreSQL has not answered for {} ({}): giving up, closing the connection",
            kWhere, role_, waited, std::string(what));
    CancelInBackground(conn_);
    Drop();
    down_ = true;
    return Unavailable(absl::StrCat("no answer within ", waited, " while ", what));
  }

  // After an unanswered COMMIT: what became of it.
  absl::Status CheckUnansweredCommit() {
    if (unanswered_txid_.empty()) return absl::OkStatus();
    OPJIT_ASSIGN_OR_RETURN(PgResult r, Exec("checking an unanswered commit",
                                            "SELECT txid_status($1)", {unanswered_txid_}));
    const std::string status = r.rows() == 1 ? r.Text(0, 0) : "";
    auto log = Logger("registry");
    if (status == "in progress") return absl::OkStatus();  // still open: ask next time
    if (status == "committed") {
      log->error(
          "{} ({}): a write whose COMMIT was not answered in time (its caller was told "
          "STORE_OUTCOME_UNKNOWN) committed after all (transaction {}); it is in the database "
          "and reaches every daemon's registry with the next sync",
          kWhere, role_, unanswered_txid_);
    } else {
      log->info("{} ({}): the unanswered COMMIT of transaction {} was rolled back",
                kWhere, role_, unanswered_txid_);
    }
    unanswered_txid_.clear();
    return absl::OkStatus();
  }

  absl::StatusOr<PgResult> Check(absl::string_view what, PgResult result) {
    // PQresultStatus(nullptr) is PGRES_FATAL_ERROR (out of memory).
    ExecStatusType st = PQresultStatus(result.get());
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK || st == PGRES_EMPTY_QUERY) return result;
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
  Clock::time_point deadline_{};
  Clock::time_point request_start_{};
  Clock::time_point next_hang_log_ = Clock::time_point::max();
  std::string unanswered_txid_;
  bool guard_ready_ = false;
};

namespace {

// Runs `body` in one transaction on `c`, within the connection's deadline:
// BEGIN (`begin_sql`), for a write the commit guard (postgres_store.h), body,
// COMMIT. `body` returns OK to commit, or an error, which rolls back and is
// returned; setting *commit = false rolls back and returns OK (nothing to
// write). A transaction that failed on a broken connection before COMMIT was
// sent is retried once on a fresh connection (the server discarded it) when
// time is left; a failed COMMIT is not retried: when it went unanswered, its
// transaction id is noted for a check after the reconnect, and the caller is
// told the outcome is unknown. An `op_write` (a registration or deletion)
// runs with the url's synchronous_commit, when it gives one.
absl::Status Transaction(PgConnection& c, absl::string_view what,
                         const std::function<absl::Status(bool* commit)>& body, bool write = true,
                         const char* begin_sql = "BEGIN", bool op_write = false) {
  const PgConfig& config = c.config();
  for (int attempt = 0;; ++attempt) {
    OPJIT_RETURN_IF_ERROR(c.Ensure());
    bool commit = true;
    std::string txid;
    absl::Status s = write ? c.EnsureCommitGuard() : absl::OkStatus();
    if (s.ok()) s = c.Exec(what, begin_sql).status();
    if (s.ok() && op_write && !config.write_synchronous_commit.empty()) {
      s = c.Exec(what, "SELECT set_config('synchronous_commit', $1, true)",
                 {config.write_synchronous_commit})
              .status();
    }
    if (s.ok() && write) {
      // transaction_timestamp() was taken before BEGIN was answered, so the
      // server's deadline (that + budget) comes before ours.
      const int64_t margin_ms = 20 + config.timeout_ms / 50;
      const int64_t budget_ms = MsUntil(c.deadline()) - margin_ms;
      if (budget_ms <= 0) {
        s = Unavailable(absl::StrCat("no time left to write within ", Duration(config.timeout_ms),
                                     " while ", what));
      } else {
        absl::StatusOr<PgResult> guard =
            c.Exec(what,
                   "INSERT INTO pg_temp.opjit_commit_guard (budget_ms) VALUES ($1) "
                   "RETURNING txid_current()",
                   {absl::StrCat(budget_ms)});
        if (guard.ok() && guard->rows() == 1) txid = guard->Text(0, 0);
        s = guard.status();
      }
    }
    if (s.ok()) s = body(&commit);
    if (s.ok() && commit) {
      if (config.before_commit_for_test) config.before_commit_for_test();
      const Clock::time_point sent = Clock::now();
      s = c.Exec(what, "COMMIT").status();
      // Refused by the server: rolled back. Unanswered (the connection is
      // gone): it may still land, so the caller is told the outcome is
      // unknown, and the store checks it once connected again.
      if (!s.ok() && !c.connected() && !txid.empty()) {
        c.NoteUnansweredCommit(txid);
        return OutcomeUnknown(what, absl::StrCat("within ", Duration(MsSince(sent))), txid);
      }
      return s;
    }
    c.Rollback();
    if (s.ok()) return s;
    if (attempt == 0 && !c.connected() && s.code() == absl::StatusCode::kUnavailable &&
        Clock::now() < c.deadline()) {
      continue;
    }
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
      /*write=*/false, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"));
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
    conn_.StartOperation();
    return conn_.Ensure(detailed);
  }

  absl::StatusOr<Event> Wait(int64_t timeout_ms) override {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    conn_.StartOperation();  // bounds a reconnect
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
          conn_.NoteFailure("listening", conn_.config().Scrub(Trim(PQerrorMessage(conn_.get()))));
          conn_.Drop();
          return Unavailable("listening");
        }
        continue;  // drained at the top
      }
      if (n == 0 && left == 0) return ev;  // kTimeout
    }
  }

  absl::StatusOr<uint64_t> Generation() override {
    conn_.StartOperation();
    OPJIT_RETURN_IF_ERROR(conn_.Ensure());
    OPJIT_ASSIGN_OR_RETURN(PgResult gen,
                           conn_.Exec("reading the generation",
                                      "SELECT generation FROM opjit_generation WHERE id = 1"));
    if (gen.rows() != 1) return absl::DataLossError(absl::StrCat(kWhere, ": no generation row"));
    return static_cast<uint64_t>(gen.Int(0, 0));
  }

  absl::StatusOr<Store::Snapshot> LoadSnapshot() override {
    conn_.StartOperation();
    return LoadSnapshotOn(conn_);
  }

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

namespace {

// A PostgreSQL time setting ("1500", "1500ms", "2s", "1min", "1h") in ms; -1
// when it does not parse.
int64_t ParsePgMs(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < text.size() && absl::ascii_isdigit(static_cast<unsigned char>(text[digits])))
    ++digits;
  int64_t n = 0;
  if (digits == 0 || digits > 12 || !absl::SimpleAtoi(text.substr(0, digits), &n)) return -1;
  const absl::string_view unit = absl::StripAsciiWhitespace(text.substr(digits));
  if (unit.empty() || unit == "ms") return n;
  if (unit == "s") return n * 1000;
  if (unit == "min") return n * 60000;
  if (unit == "h") return n * 3600000;
  return -1;
}

// libpq's "options": whitespace-separated words, a backslash escaping the
// next character.
std::vector<std::string> SplitWords(const std::string& text) {
  std::vector<std::string> words;
  std::string word;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\\' && i + 1 < text.size()) {
      word += ch;
      word += text[++i];
    } else if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') {
      if (!word.empty()) words.push_back(std::move(word));
      word.clear();
    } else {
      word += ch;
    }
  }
  if (!word.empty()) words.push_back(std::move(word));
  return words;
}

std::string Unescape(const std::string& word) {
  std::string out;
  for (size_t i = 0; i < word.size(); ++i) {
    if (word[i] == '\\' && i + 1 < word.size()) ++i;
    out += word[i];
  }
  return out;
}

// The server settings the store bounds (and synchronous_commit, which it
// applies to writes only), taken out of the url's "options" (the rest is
// kept as written).
struct ServerTimeouts {
  std::string other_options;
  std::map<std::string, std::string> found;  // name -> value as written
};

ServerTimeouts TakeTimeouts(const std::string& options) {
  static const std::set<std::string> kBounded = {"statement_timeout", "lock_timeout",
                                                 "idle_in_transaction_session_timeout",
                                                 "synchronous_commit"};
  ServerTimeouts out;
  const std::vector<std::string> words = SplitWords(options);
  std::vector<std::string> kept;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    std::string setting;
    size_t used = 1;
    if (w == "-c" && i + 1 < words.size()) {
      setting = Unescape(words[i + 1]);
      used = 2;
    } else if (absl::StartsWith(w, "-c") || absl::StartsWith(w, "--")) {
      setting = Unescape(w.substr(2));
    }
    const size_t eq = setting.find('=');
    if (eq != std::string::npos) {
      std::string name = absl::AsciiStrToLower(setting.substr(0, eq));
      std::replace(name.begin(), name.end(), '-', '_');
      if (kBounded.count(name) != 0) {
        out.found[name] = setting.substr(eq + 1);
        i += used - 1;
        continue;
      }
    }
    kept.push_back(w);
  }
  out.other_options = absl::StrJoin(kept, " ");
  return out;
}

// The url's integer setting `key`, bounded to [lo, hi]; `fallback` when it is
// absent; an error when it is not an integer.
absl::StatusOr<int64_t> BoundedInt(const std::map<std::string, std::string>& url,
                                   const std::string& key, int64_t lo, int64_t hi,
                                   int64_t fallback) {
  auto it = url.find(key);
  if (it == url.end()) return fallback;
  int64_t v = 0;
  if (!absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("registry: url: ", key, " is not a whole number"));
  }
  return std::clamp(v, lo, hi);
}

// How to connect: the url's settings, bounded, and our defaults (see
// postgres_store.h).
absl::StatusOr<std::shared_ptr<PgConfig>> MakeConfig(const PostgresStore::Options& options) {
  auto config = std::make_shared<PgConfig>();
  config->secrets.push_back(options.password);
  std::vector<std::pair<std::string, std::string>> given;  // in the url's order
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
      if (o->val == nullptr) continue;
      given.emplace_back(o->keyword, o->val);
      if (std::string(o->keyword) == "password") config->secrets.push_back(o->val);
    }
    PQconninfoFree(parsed);
  }
  std::map<std::string, std::string> url(given.begin(), given.end());

  // The bound on a call: the url's statement_timeout, else the option.
  ServerTimeouts server = TakeTimeouts(url.count("options") != 0 ? url["options"] : "");
  auto bound = [](int64_t ms, int64_t hi) {
    return ms == 0 ? hi : std::clamp<int64_t>(ms, PostgresStore::kMinTimeoutMs, hi);
  };
  auto given_ms = [&](const std::string& name) -> absl::StatusOr<int64_t> {
    auto it = server.found.find(name);
    if (it == server.found.end()) return -1;
    const int64_t ms = ParsePgMs(it->second);
    if (ms < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("registry: url: ", name, " in options is not a time (e.g. 2000, 2s)"));
    }
    return ms;
  };
  OPJIT_ASSIGN_OR_RETURN(int64_t statement_ms, given_ms("statement_timeout"));
  const int64_t timeout =
      bound(statement_ms >= 0 ? statement_ms : std::max<int64_t>(options.timeout_ms, 1),
            PostgresStore::kMaxTimeoutMs);
  OPJIT_ASSIGN_OR_RETURN(int64_t lock_ms, given_ms("lock_timeout"));
  const int64_t lock = lock_ms > 0 && lock_ms <= timeout ? lock_ms : timeout;
  OPJIT_ASSIGN_OR_RETURN(int64_t idle_ms, given_ms("idle_in_transaction_session_timeout"));
  const int64_t idle = std::clamp<int64_t>(idle_ms > 0 ? idle_ms : 2 * timeout, timeout, 600000);
  config->timeout_ms = timeout;
  if (server.found.count("synchronous_commit") != 0) {
    static const std::set<std::string> kValues = {"on",  "off", "local", "remote_write",
                                                  "remote_apply", "true", "false", "yes",
                                                  "no", "1", "0"};
    const std::string v = absl::AsciiStrToLower(server.found["synchronous_commit"]);
    if (kValues.count(v) == 0) {
      return absl::InvalidArgumentError(
          "registry: url: synchronous_commit in options is not one of on, off, local, "
          "remote_write, remote_apply");
    }
    config->write_synchronous_commit = v;
  }
  config->hang_log_ms = std::clamp<int64_t>(timeout / 4, 250, 2000);

  // libpq's connect_timeout is in seconds; 0 (or less) means "forever".
  int64_t connect = std::clamp<int64_t>(options.connect_timeout_ms, PostgresStore::kMinTimeoutMs,
                                        PostgresStore::kMaxConnectTimeoutMs);
  if (url.count("connect_timeout") != 0) {
    OPJIT_ASSIGN_OR_RETURN(int64_t s, BoundedInt(url, "connect_timeout", INT32_MIN, INT32_MAX, 0));
    connect = s <= 0 ? PostgresStore::kMaxConnectTimeoutMs
                     : std::clamp<int64_t>(s * 1000, 1000, PostgresStore::kMaxConnectTimeoutMs);
  }
  config->connect_timeout_ms = connect;

  // Keepalives notice a dead peer or a cut network on an idle connection
  // (the watcher's); a server that is merely frozen still answers them.
  OPJIT_ASSIGN_OR_RETURN(int64_t ka_idle, BoundedInt(url, "keepalives_idle", 1, 60, 10));
  OPJIT_ASSIGN_OR_RETURN(int64_t ka_interval, BoundedInt(url, "keepalives_interval", 1, 30, 5));
  OPJIT_ASSIGN_OR_RETURN(int64_t ka_count, BoundedInt(url, "keepalives_count", 1, 10, 3));
  OPJIT_ASSIGN_OR_RETURN(int64_t user_timeout,
                         BoundedInt(url, "tcp_user_timeout", 1000, 120000, 30000));
  if (url.count("tcp_user_timeout") != 0 && url["tcp_user_timeout"] == "0") user_timeout = 30000;

  std::map<std::string, std::string> ours = {
      {"connect_timeout", absl::StrCat((connect + 999) / 1000)},
      {"keepalives", "1"},
      {"keepalives_idle", absl::StrCat(ka_idle)},
      {"keepalives_interval", absl::StrCat(ka_interval)},
      {"keepalives_count", absl::StrCat(ka_count)},
      {"tcp_user_timeout", absl::StrCat(user_timeout)},
      {"options", absl::StrCat(server.other_options, server.other_options.empty() ? "" : " ",
                               "-c statement_timeout=", timeout, " -c lock_timeout=", lock,
                               " -c idle_in_transaction_session_timeout=", idle,
                               " -c synchronous_commit=local")},
  };
  if (!options.password.empty()) ours["password"] = options.password;
  auto add = [&](const std::string& k, const std::string& v) {
    config->keywords.push_back(k);
    config->values.push_back(v);
  };
  for (const auto& [k, v] : given) {
    if (ours.count(k) == 0) add(k, v);
  }
  for (const auto& [k, v] : ours) add(k, v);
  if (url.count("fallback_application_name") == 0) add("fallback_application_name", "opjitd");
  if (url.count("client_encoding") == 0) add("client_encoding", "UTF8");
  return config;
}

}  // namespace

// The store's connection for one call: waits at most timeout_ms for the call
// before it, then starts this call's deadline.
class PostgresStore::Lease {
 public:
  explicit Lease(PostgresStore& store) : store_(store) {}
  ~Lease() {
    if (!held_) return;
    absl::MutexLock lock(&store_.mu_);
    store_.busy_ = false;
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  absl::Status Take(absl::string_view what) {
    const int64_t timeout_ms = store_.config_->timeout_ms;
    {
      absl::MutexLock lock(&store_.mu_);
      if (!store_.mu_.AwaitWithTimeout(absl::Condition(&IsFree, &store_.busy_),
                                       absl::Milliseconds(timeout_ms))) {
        return Unavailable(
            absl::StrCat("its connection stayed busy for ", Duration(timeout_ms), " while ", what));
      }
      store_.busy_ = true;
    }
    held_ = true;
    store_.conn_->StartOperation();
    return absl::OkStatus();
  }

 private:
  static bool IsFree(bool* busy) { return !*busy; }

  PostgresStore& store_;
  bool held_ = false;
};

PostgresStore::PostgresStore(std::shared_ptr<const PgConfig> config,
                             std::unique_ptr<PgConnection> conn)
    : config_(std::move(config)), conn_(std::move(conn)) {}

PostgresStore::~PostgresStore() = default;

int64_t PostgresStore::timeout_ms() const { return config_->timeout_ms; }
int64_t PostgresStore::connect_timeout_ms() const { return config_->connect_timeout_ms; }

absl::StatusOr<std::unique_ptr<PostgresStore>> PostgresStore::Open(const Options& options) {
  if (options.url.empty()) {
    return absl::InvalidArgumentError("registry: url must be set for the postgres backend");
  }
  OPJIT_ASSIGN_OR_RETURN(std::shared_ptr<PgConfig> config, MakeConfig(options));
  config->before_commit_for_test = options.before_commit_for_test;

  auto conn = std::make_unique<PgConnection>(config, "store");
  conn->StartOperation();
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
  Logger("registry")
      ->info("{}: connected, schema version {}; a call waits at most {}, connecting at most {}",
             kWhere, found_version, Duration(config->timeout_ms),
             Duration(config->connect_timeout_ms));
  return std::unique_ptr<PostgresStore>(new PostgresStore(std::move(config), std::move(conn)));
}

absl::StatusOr<Store::Snapshot> PostgresStore::LoadSnapshot() {
  Lease lease(*this);
  OPJIT_RETURN_IF_ERROR(lease.Take("loading the registry"));
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
  Lease lease(*this);
  OPJIT_RETURN_IF_ERROR(lease.Take("registering an op"));
  PgConnection& c = *conn_;
  InsertResult result;
  absl::Status s = Transaction(c, "registering an op", [&](bool* commit) -> absl::Status {
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
  }, /*write=*/true, "BEGIN", /*op_write=*/true);
  if (!s.ok()) return NameOp(std::move(s), def.ns, def.name);
  return result;
}

absl::StatusOr<Store::DeleteResult> PostgresStore::DeleteOp(const std::string& ns,
                                                            const std::string& name,
                                                            int64_t version) {
  Lease lease(*this);
  OPJIT_RETURN_IF_ERROR(lease.Take("deleting an op"));
  PgConnection& c = *conn_;
  DeleteResult result;
  absl::Status s = Transaction(c, "deleting an op", [&](bool* commit) -> absl::Status {
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
  }, /*write=*/true, "BEGIN", /*op_write=*/true);
  if (!s.ok()) return NameOp(std::move(s), ns, name);
  return result;
}

absl::Status PostgresStore::Probe() {
  Lease lease(*this);
  OPJIT_RETURN_IF_ERROR(lease.Take("probing"));
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

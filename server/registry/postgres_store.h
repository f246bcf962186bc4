// A Store in a PostgreSQL database that several daemons share (libpq).
//
// Tables (created when missing, under an advisory lock so that daemons
// starting together do not race): opjit_schema, opjit_op_versions,
// opjit_op_high_water, opjit_generation (one row), opjit_health_probe.
//
// Every write is one transaction. RegisterVersion and DeleteOp first lock the
// op's high-water row (INSERT ... ON CONFLICT DO NOTHING, then SELECT ... FOR
// UPDATE), so that writes to one op from any daemon are serialised; a write
// that changes something then bumps the generation row (which also orders
// all such writes, so a snapshot at generation G holds exactly the writes
// numbered up to G) and sends pg_notify('opjit_registry', '<generation>'),
// delivered at commit.
//
// Connection loss: a call that finds its connection broken reconnects (a
// transaction that failed before its COMMIT was sent is retried once on a
// fresh connection, within the call's deadline); while the server cannot be
// reached, calls fail with UNAVAILABLE (reason STORE_UNAVAILABLE) at once,
// reconnecting at most every kMaxBackoffMs. Messages never quote the
// connection string or the password (libpq's own messages are scrubbed of
// it before they are logged).
//
// Time limits (a server that hangs, e.g. one stopped with SIGSTOP, still
// accepts TCP and answers keepalives, so only the client can bound a wait):
// - Every call has a deadline: the wait for the connection is bounded by
//   timeout_ms, and so is everything after it (connecting, every statement,
//   the COMMIT). All I/O is libpq's asynchronous API (PQconnectStartParams /
//   PQconnectPoll, PQsendQueryParams / PQconsumeInput / PQisBusy) under
//   poll() with that deadline; a non-blocking connection, so that nothing
//   in libpq waits on its own. Connecting is bounded by connect_timeout_ms
//   as well. Host names are still resolved synchronously by libpq (use
//   hostaddr or an IP address where that matters).
// - When the deadline passes, the call fails with UNAVAILABLE
//   (STORE_UNAVAILABLE), a cancel request is sent from a detached thread (at
//   most one in flight per process: PQcancel itself blocks on a hung
//   server), and the connection is closed. The server learns that at once
//   or, if it is frozen, when it runs again.
// - While a call waits, the registry logger warns every few seconds:
//   "PostgreSQL has not answered for N s (<what>)".
// - The server gets the same bound as statement_timeout and lock_timeout,
//   and idle_in_transaction_session_timeout, in the startup options; the
//   connection gets TCP keepalives and tcp_user_timeout.
// - Options in the url are respected but bounded: options=-c
//   statement_timeout=<t> (ms, or with a unit: 2s, 1min) sets timeout_ms
//   (200 ms to 60 s; 0, "no limit", means 60 s); connect_timeout=<seconds>
//   sets connect_timeout_ms (1 to 30 s; 0 means 30 s); lock_timeout and
//   idle_in_transaction_session_timeout stay if within (0, timeout] and
//   [timeout, 10 min]; keepalives_idle (1-60 s), keepalives_interval (1-30 s),
//   keepalives_count (1-10) and tcp_user_timeout (1-120 s) likewise;
//   keepalives is always 1.
//
// A write is acknowledged only once its COMMIT was answered. A write that
// failed before its COMMIT was sent was rolled back: UNAVAILABLE
// (STORE_UNAVAILABLE), and it never lands. A write whose COMMIT was sent but
// not answered by the deadline is answered UNAVAILABLE with reason
// STORE_OUTCOME_UNKNOWN (kOutcomeUnknownReason; metadata namespace, op and
// transaction): it is unlikely to land (see below) but it may, so it is never
// called refused. The caller can ask: registration is idempotent by content,
// so registering the same definition again answers with the version it
// landed as, or registers it now (GetOp/describe show it too, once synced).
//
// Two mechanisms make an unanswered COMMIT rare and one that lands rarer:
// - Replication waits. With synchronous_commit = on (or remote_*) and
//   synchronous_standby_names naming a standby that is not there, a COMMIT
//   writes and flushes its commit record locally, then waits for the standby
//   forever; cancelling that wait (our cancel request, or the connection
//   closing) does not undo it: PostgreSQL logs "canceling wait for synchronous
//   replication ... the transaction has already committed locally" and the
//   write becomes visible (issue 41, hole 6: 5 of 5 writes told refused
//   landed). The commit guard below runs before the commit record, so it
//   cannot help. Therefore the store's sessions run with synchronous_commit
//   = local (in the startup options, which win over postgresql.conf, ALTER
//   ROLE and ALTER DATABASE): opjit's writes (and its schema and guard) are
//   durable on the primary when acknowledged and never wait for a standby
//   they did not ask for. An operator who wants opjit's writes to wait for
//   replication says so in the url: options=-c synchronous_commit=<value>
//   (on, remote_write, remote_apply, ...; checked at Open) is then set in each
//   write transaction (set_config(..., is_local = true) after BEGIN); a COMMIT
//   held by a missing standby is answered STORE_OUTCOME_UNKNOWN at the
//   deadline, and it lands.
// - A frozen server or a lost answer. A COMMIT that was sent but not
//   answered in time (the server froze, or the network ate the answer) could
//   still be executed when the server runs again, so every write transaction
//   carries a commit guard: each connection creates, before its first write,
//   a temp table pg_temp.opjit_commit_guard(budget_ms) with a deferred
//   constraint trigger, and each write transaction inserts one row holding
//   its budget, right after BEGIN was answered. At COMMIT the trigger raises
//   (SQLSTATE 57014) when the server's clock_timestamp() is past
//   transaction_timestamp() + budget_ms. transaction_timestamp() was taken
//   before BEGIN was answered, and the budget is what was left of the call's
//   deadline at that moment, less a margin (20 ms + 2% of timeout_ms, for the
//   two clocks' rates); so the server can only start committing before the
//   client gives up. It can still land after: the server's clock stepped
//   back, a freeze or a slow WAL flush between the trigger and the end of the
//   commit, or the connection cut after the commit record was written (the
//   classic in-doubt commit).
// After an unanswered COMMIT the store remembers the transaction id
// (txid_current(), returned by the guard row's INSERT) and, once connected
// again, asks txid_status() and logs the outcome: "rolled back", or, at
// error level, "committed after all". A write that landed reaches every
// registry by the sync. The guard needs the TEMP privilege (PUBLIC has it by
// default) and plpgsql. Tested against a server frozen with SIGSTOP, before a
// write and between a write's last statement and its COMMIT
// (tests/unit/registry/postgres_store_test.cc, Frozen*), and against a
// missing synchronous standby (tests/python/test_store_commit.py).
//
// Thread-safe: one connection for writes and loads, used by one call at a
// time (the wait for it is bounded); each watcher has its own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/registry/op_def.h"
#include "server/registry/store.h"

namespace opjit::registry {

class PgConnection;
struct PgConfig;

class PostgresStore final : public Store {
 public:
  // The schema version this code writes (opjit_schema.version).
  static constexpr int kSchemaVersion = 1;
  // The NOTIFY channel; the payload is the new generation in decimal.
  static constexpr char kChannel[] = "opjit_registry";
  // Longest wait between reconnection attempts while the server is down.
  static constexpr int64_t kMaxBackoffMs = 1000;
  // The reason of an UNAVAILABLE answer to a write whose COMMIT was sent but
  // not answered in time (see above); metadata namespace, op, transaction.
  static constexpr char kOutcomeUnknownReason[] = "STORE_OUTCOME_UNKNOWN";

  struct Options {
    // A libpq connection string ("host=db dbname=opjit user=opjit") or URI
    // ("postgresql://opjit@db/opjit"). Required.
    std::string url;
    // Given to libpq as the password parameter (overriding one in `url`).
    // Empty: none (libpq may still use PGPASSWORD or ~/.pgpass).
    std::string password;
    // The bound on one call (see above); the url's statement_timeout
    // overrides it. Bounded to [kMinTimeoutMs, kMaxTimeoutMs].
    int64_t timeout_ms = 10000;
    // The bound on connecting; the url's connect_timeout overrides it.
    // Bounded to [kMinTimeoutMs, kMaxConnectTimeoutMs].
    int64_t connect_timeout_ms = 5000;
    // Tests only: runs right before a write's COMMIT is sent.
    std::function<void()> before_commit_for_test;
  };

  static constexpr int64_t kMinTimeoutMs = 200;
  static constexpr int64_t kMaxTimeoutMs = 60000;
  static constexpr int64_t kMaxConnectTimeoutMs = 30000;

  // Connects and creates the schema when it is missing. Errors:
  //   INVALID_ARGUMENT: url is empty or does not parse, or a time in its
  //     options does not;
  //   UNAVAILABLE (STORE_UNAVAILABLE): the server cannot be reached or refused us
  //     (libpq's reason, scrubbed of the password, is in the message);
  //   FAILED_PRECONDITION: the schema was written by a newer opjit;
  //   INTERNAL: creating the schema failed.
  static absl::StatusOr<std::unique_ptr<PostgresStore>> Open(const Options& options);

  ~PostgresStore() override;
  PostgresStore(const PostgresStore&) = delete;
  PostgresStore& operator=(const PostgresStore&) = delete;

  absl::StatusOr<std::vector<OpRecord>> LoadAll() override;
  absl::StatusOr<std::vector<HighWater>> LoadHighWater() override;
  absl::StatusOr<Snapshot> LoadSnapshot() override;
  absl::StatusOr<InsertResult> RegisterVersion(const OpDef& def, const std::string& content_hash,
                                               int64_t now_ms, const Limits& limits) override;
  absl::StatusOr<DeleteResult> DeleteOp(const std::string& ns, const std::string& name,
                                        int64_t version) override;
  absl::Status Probe() override;
  // A watcher with its own connection, LISTENing on kChannel.
  absl::StatusOr<std::unique_ptr<ChangeWatcher>> Watch() override;
  std::string Describe() const override { return "postgres"; }

  // The bounds in effect, after the url's options (for logs and tests).
  int64_t timeout_ms() const;
  int64_t connect_timeout_ms() const;

 private:
  class Lease;
  PostgresStore(std::shared_ptr<const PgConfig> config, std::unique_ptr<PgConnection> conn);

  const std::shared_ptr<const PgConfig> config_;
  absl::Mutex mu_;
  // Set while a call uses conn_; the wait for it is bounded.
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  // Used only by the call that set busy_.
  const std::unique_ptr<PgConnection> conn_;
};

}  // namespace opjit::registry

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
// fresh connection); while the server cannot be reached, calls fail with
// UNAVAILABLE (reason STORE_UNAVAILABLE) at once, reconnecting at most every
// kMaxBackoffMs. Messages never quote the connection string or the password
// (libpq's own messages are scrubbed of it before they are logged).
//
// Thread-safe: one connection for writes and loads, serialised by a mutex;
// each watcher has its own.
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

  struct Options {
    // A libpq connection string ("host=db dbname=opjit user=opjit") or URI
    // ("postgresql://opjit@db/opjit"). Required.
    std::string url;
    // Given to libpq as the password parameter (overriding one in `url`).
    // Empty: none (libpq may still use PGPASSWORD or ~/.pgpass).
    std::string password;
    // libpq connect_timeout, in seconds; `url` may override it. Default: 5.
    int connect_timeout_s = 5;
  };

  // Connects and creates the schema when it is missing. Errors:
  //   INVALID_ARGUMENT: url is empty or does not parse;
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

 private:
  PostgresStore(std::shared_ptr<const PgConfig> config, std::unique_ptr<PgConnection> conn);

  const std::shared_ptr<const PgConfig> config_;
  absl::Mutex mu_;
  const std::unique_ptr<PgConnection> conn_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace opjit::registry

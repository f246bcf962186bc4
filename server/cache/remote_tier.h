// RemoteTier: compiled artifacts shared by several opjitd daemons through one
// Redis, behind each daemon's memory and disk caches.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/logging.h"

struct redisContext;

namespace opjit::cache {

struct RemoteTierOptions {
  std::string url;            // "redis://host:port" or "unix:/path/redis.sock"; "" = off
  std::string key;            // the cluster HMAC key (raw bytes, >= 16 bytes)
  int64_t timeout_ms = 250;   // connect and per-command
  uint64_t max_bytes = 64ull << 20;  // larger payloads are not shared
  int64_t ttl_s = 7 * 24 * 3600;     // EXPIRE on put (0: none)
};

struct RemoteTierStats {
  uint64_t hits = 0;      // Get returned a verified payload.
  uint64_t misses = 0;    // Get returned NOT_FOUND (rejected, errors, backoff included).
  uint64_t rejected = 0;  // Entries that failed verification (magic, length, HMAC).
  uint64_t errors = 0;    // Connects and commands that failed or timed out.
  uint64_t puts = 0;      // Entries written (SET acknowledged).
  uint64_t dropped = 0;   // Puts not written: queue full, Redis down or backing off.
  uint64_t oversize = 0;  // Puts refused for a payload over max_bytes.
  // Reachability, as last seen: whether Redis ever answered or failed, and
  // the failures since it last answered (0: it answered last).
  bool contacted = false;
  int consecutive_failures = 0;
};

// A Redis-backed, authenticated blob tier. Entries live under
// "opjit:v1:<kind>:<key>"; each value is
//
//   "OPJR" | u32 format version (1) | u64 payload length |
//   HMAC-SHA256(cluster key, field(kind) | field(key) | field(payload)) | payload
//
// (integers little-endian, field(x) = u64 length of x, then x; the MAC covers
// the version too), so an entry only verifies under the key and kind it was put
// for, by a daemon that holds the cluster key. Anything that does not verify is
// a miss, counted as rejected and logged (rate-limited), never an error: whoever
// can write to the Redis can make daemons recompile, not run their bytes.
//
// Redis is an optimisation, never a dependency: a failed or timed-out connect or
// command is a miss (Get) or a dropped write (Put), counted in errors. After a
// failure no connection is attempted for a backoff (1 s, doubling per
// consecutive failure up to 30 s), so callers do not each pay the timeout; the
// first call after it reconnects, and while that probe runs other calls still
// miss at once.
//
// Put never waits on Redis: it queues the payload for one background writer
// thread (at most kMaxQueuedPuts entries and max(4 * max_bytes, kMinQueuedBytes)
// payload bytes; beyond that, it drops). Entries are written with SET ... EX ttl_s.
//
// Thread-safe. Connections come from a small pool, so concurrent Gets (and the
// writer) do not wait for each other.
class RemoteTier {
 public:
  static constexpr size_t kMaxQueuedPuts = 256;
  // The queue also holds at most max(4 * max_bytes, kMinQueuedBytes) bytes.
  static constexpr uint64_t kMinQueuedBytes = 16ull << 20;
  static constexpr std::chrono::milliseconds kFirstBackoff{1000};
  static constexpr std::chrono::milliseconds kMaxBackoff{30000};

  // Validates `options` and starts the writer thread; connects lazily (an
  // unreachable Redis is not an error here). INVALID_ARGUMENT if the url is
  // empty or not "redis://host[:port]" (port 1-65535, default 6379) or
  // "unix:/absolute/path", if the key is shorter than 16 bytes, if timeout_ms
  // is not positive, or if ttl_s is negative. The message never quotes the
  // url (the log line does).
  static absl::StatusOr<std::unique_ptr<RemoteTier>> Create(const RemoteTierOptions& options);

  // Writes what is queued unless Redis is failing (then drops it), and stops
  // the writer.
  ~RemoteTier();
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  // The verified payload stored for (`kind`, `key`). `kind` is [a-z0-9_]{1,32}
  // and `key` [0-9a-f]{16,128}, as for DiskCache; either malformed gives
  // INVALID_ARGUMENT. Every other failure is NOT_FOUND: no entry, an entry that
  // does not verify (rejected), Redis down, slow or backing off. Blocks for at
  // most about two timeouts (connect, command).
  absl::StatusOr<std::string> Get(std::string_view kind, std::string_view key);

  // Queues `payload` to be stored for (`kind`, `key`) and returns at once.
  // True if queued; false if it will not be stored: malformed kind or key,
  // payload over max_bytes (counted in oversize), or the queue full or Redis
  // backing off (counted in dropped). A queued entry may still be dropped if
  // Redis fails before it is written. Entries queued by one thread are written
  // in the order queued.
  bool Put(std::string_view kind, std::string_view key, std::string_view payload);

  // Waits until every Put queued before this call has been written or dropped.
  // For tests and orderly shutdown; never on a request path.
  void Flush();

  RemoteTierStats Stats() const;

  // Same value layout for tests and tools: the Redis key of (`kind`, `key`),
  // and the value Put would store for `payload` under `cluster_key`.
  static std::string RedisKey(std::string_view kind, std::string_view key);
  static std::string Seal(std::string_view cluster_key, std::string_view kind,
                          std::string_view key, std::string_view payload);

 private:
  struct PendingPut {
    std::string kind, key;
    std::string value;  // room for the header, then the payload
  };
  // A connection, tagged with the generation of the tier's connection state
  // when it was made; a failure bumps the generation, so pooled connections
  // made before it are discarded instead of reused.
  struct Connection {
    redisContext* ctx = nullptr;
    uint64_t generation = 0;
  };

  explicit RemoteTier(const RemoteTierOptions& options);

  // A usable connection, or nullptr when backing off or the connect failed.
  Connection Acquire();
  // Returns `c` to the pool if `ok` (and ends any backoff: Redis answered);
  // otherwise frees it and records the failure `what`.
  void Release(Connection c, bool ok, const std::string& what);
  // True while no connection may be attempted.
  bool BackingOff() const;
  // Starts (or extends) a backoff; counts an error and logs it, rate-limited.
  void RecordFailure(const std::string& what);
  // False if the payload is not an authentic value for (`kind`, `key`).
  bool Open(std::string_view kind, std::string_view key, std::string_view value,
            std::string* payload, std::string* why) const;
  void WriterLoop();
  // Seals `p` in place and sends it.
  void Write(PendingPut& p);
  uint64_t QueueByteLimit() const;

  // Constant after construction.
  const RemoteTierOptions options_;
  bool unix_ = false;
  std::string host_;  // host, or the socket path
  int port_ = 0;
  std::shared_ptr<spdlog::logger> log_;

  mutable absl::Mutex conn_mu_;
  std::vector<Connection> idle_ ABSL_GUARDED_BY(conn_mu_);
  uint64_t generation_ ABSL_GUARDED_BY(conn_mu_) = 0;
  int consecutive_failures_ ABSL_GUARDED_BY(conn_mu_) = 0;
  bool contacted_ ABSL_GUARDED_BY(conn_mu_) = false;  // answered or failed once
  // No connect is attempted before this.
  std::chrono::steady_clock::time_point retry_at_ ABSL_GUARDED_BY(conn_mu_);

  absl::Mutex queue_mu_;
  std::deque<PendingPut> queue_ ABSL_GUARDED_BY(queue_mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(queue_mu_) = 0;
  // Puts accepted into and taken out of the queue (written or dropped), for
  // Flush.
  uint64_t enqueued_ ABSL_GUARDED_BY(queue_mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(queue_mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(queue_mu_) = false;
  absl::CondVar queue_cv_;  // queue_ not empty, or stop_
  absl::CondVar done_cv_;   // done_ grew
  std::thread writer_;

  LogLimiter reject_log_{5000};
  LogLimiter error_log_{5000};

  std::atomic<uint64_t> hits_{0}, misses_{0}, rejected_{0}, errors_{0}, puts_{0}, dropped_{0},
      oversize_{0};
};

}  // namespace opjit::cache

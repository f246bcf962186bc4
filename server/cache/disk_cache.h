// Content-addressed blob store on local disk, shared by several opjitd
// processes (compiled objects, manifests, PCHs, cubins).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace opjit::cache {

struct DiskCacheOptions {
  // Root directory of the cache. Created (with parents) if missing.
  // Default: "" (required).
  std::string dir;

  // Soft bound on the bytes of all entry files (header included). When a Put
  // pushes the total over it, least-recently-used entries are evicted until
  // the total is under 90% of the bound. Other daemons sharing `dir` may push
  // the directory over the bound briefly, until one of them next evicts.
  // Default: 2 GiB.
  uint64_t max_bytes = 2ull << 30;
};

struct DiskCacheStats {
  uint64_t entries = 0;    // Estimate: Create's scan, this instance's changes,
  uint64_t bytes = 0;      // and the last eviction pass's rescan.
  uint64_t hits = 0;       // Get returned a verified payload.
  uint64_t misses = 0;     // Get returned NOT_FOUND (corrupt entries included).
  uint64_t corrupt = 0;    // Entries found corrupt by Get (and deleted).
  uint64_t evictions = 0;  // Entries this instance evicted.
  uint64_t puts = 0;       // Successful Puts.
};

// What VerifyDiskCache found.
struct DiskCacheVerification {
  uint64_t entries = 0;
  uint64_t bytes = 0;
  // "<kind>/<shard>/<key>: why", one per entry that does not verify.
  std::vector<std::string> corrupt;
};

// Reads every entry under `dir` and checks its header, length and checksum,
// changing nothing (Get deletes what does not verify; this only reports).
// For a cache at rest, e.g. after a crash: `opjitd --verify-cache`.
DiskCacheVerification VerifyDiskCache(const std::string& dir);

// A content-addressed blob store under one directory.
//
// Layout: <dir>/<kind>/<key[0:2]>/<key>, plus <dir>/.lock. Each entry file is
// a fixed header (magic "OPJC", format version, payload length, SHA-256 of the
// payload) followed by the payload. Writers publish with temp file + fsync +
// rename(), so readers only ever see whole files, and two daemons that write
// the same key both leave a valid entry. A file that fails verification is
// treated as a miss and deleted, so the caller recompiles and Puts it again.
// Recency is the file's mtime: a hit touches it, and eviction removes the
// oldest first.
//
// Cross-process safety: renames into place hold a shared flock on
// <dir>/.lock; eviction, Clear() and deleting a corrupt file hold it
// exclusively, so none of them can delete a file another daemon just put.
//
// Thread-safe. Get never takes the flock unless the entry is corrupt; Put may
// block briefly while another daemon evicts, so call it from a worker thread,
// not from an RPC reactor.
class DiskCache {
 public:
  // Creates `options.dir` and its lock file, removes temp files older than an
  // hour left behind by crashed writers, and scans the tree to initialise the
  // entry/byte estimate. Fails with INVALID_ARGUMENT if `dir` is empty, and
  // with the OS error (PERMISSION_DENIED, ...) naming the path if the
  // directory cannot be created or written.
  static absl::StatusOr<std::unique_ptr<DiskCache>> Create(const DiskCacheOptions& options);

  ~DiskCache();
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  // Returns the payload stored for (`kind`, `key`).
  // `kind` is a short namespace such as "obj", "manifest", "pch" or "cubin"
  // ([a-z0-9_]{1,32}); `key` is lowercase hex, [0-9a-f]{16,128}. Either one
  // malformed gives INVALID_ARGUMENT. No entry gives NOT_FOUND, and so does a
  // corrupt entry (bad magic, version, length or checksum), which is also
  // deleted (only if the path still names the file that was read) and counted
  // in Stats().corrupt. A hit sets the file's mtime to now.
  absl::StatusOr<std::string> Get(std::string_view kind, std::string_view key);

  // Stores `bytes` for (`kind`, `key`), replacing any existing entry.
  // Atomic: readers see the old entry, no entry, or the new one, never part of
  // one. Durable once it returns OK (file and directory fsynced). If the
  // tracked total then exceeds max_bytes, evicts least-recently-used entries
  // (never this one) down to 90% of it. INVALID_ARGUMENT for a malformed kind
  // or key; RESOURCE_EXHAUSTED if the disk is full; other OS errors as their
  // absl codes. A failed eviction is logged, not returned: the entry is stored.
  absl::Status Put(std::string_view kind, std::string_view key, std::string_view bytes);

  // Deletes the entry for (`kind`, `key`). OK if it was removed, NOT_FOUND if
  // there was none, INVALID_ARGUMENT for a malformed kind or key.
  absl::Status Remove(std::string_view kind, std::string_view key);

  // Deletes every entry (of every kind) under the directory; the directory,
  // its subdirectories and the lock file stay. Other daemons' in-progress
  // Puts may land afterwards.
  absl::Status Clear();

  // Counters since Create, and the entry/byte estimate.
  DiskCacheStats Stats() const;

  // The cache's root directory.
  const std::string& dir() const { return dir_; }

 private:
  DiskCache(std::string dir, uint64_t max_bytes);

  std::string EntryPath(std::string_view kind, std::string_view key) const;
  // Deletes `path` if it is still the inode (`dev`, `ino`) that was read.
  void DeleteCorrupt(const std::string& path, uint64_t dev, uint64_t ino);
  // Runs one eviction pass if the estimate or the bytes written since the last
  // rescan call for it. `keep` is never evicted.
  void MaybeEvict(const std::string& keep);
  absl::Status Evict(const std::string& keep);
  void AddEstimate(int64_t entries, int64_t bytes);

  // Constant after construction.
  const std::string dir_;
  const std::string lock_path_;
  const uint64_t max_bytes_;

  // Serialises eviction passes within this process (flock serialises them
  // across processes).
  absl::Mutex evict_mu_;

  mutable absl::Mutex mu_;
  uint64_t entries_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes this instance put since the last rescan. Other daemons' writes are
  // invisible to the estimate, so a rescan is forced every max_bytes/8 of our
  // own writes to notice a directory that others have filled.
  uint64_t written_since_scan_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
  std::atomic<uint64_t> corrupt_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> puts_{0};
};

}  // namespace opjit::cache

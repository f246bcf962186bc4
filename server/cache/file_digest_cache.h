// Memoised SHA-256 digests of files (the headers a kernel includes).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace opjit::cache {

struct FileDigestStats {
  uint64_t entries = 0;  // Paths memoised.
  uint64_t lookups = 0;  // Digest() calls.
  uint64_t stats = 0;    // stat() calls made.
  uint64_t hashes = 0;   // Times a file's content was read and hashed.
};

// SHA-256 of a file's content, memoised by the file's identity and change
// stamps (dev, ino, size, mtime_ns, ctime_ns), so that a header is rehashed
// only when it may have changed. Used to check that the headers a cached
// kernel included still have the content they had when it was compiled.
//
// A file whose mtime is within two seconds of the moment it was hashed is
// hashed again on every check: a write landing in the same timestamp tick as
// the read would otherwise leave the stamps unchanged and the memo stale.
//
// Thread-safe. Hashing happens outside the lock.
class FileDigestCache {
 public:
  // Within `recheck_interval_ms` of the last stat() of a path, Digest() returns
  // the memoised digest without looking at the file at all, which keeps hot
  // lookups to a hash-map probe. 0 stats on every call.
  // Default: 1000 ms.
  explicit FileDigestCache(int64_t recheck_interval_ms = 1000);

  FileDigestCache(const FileDigestCache&) = delete;
  FileDigestCache& operator=(const FileDigestCache&) = delete;

  // Returns the SHA-256 of the content of `path` as 64 lowercase hex
  // characters. NOT_FOUND if the file does not exist (any memo for it is
  // dropped), INVALID_ARGUMENT if it is not a regular file, other OS errors
  // as their absl codes. Within the recheck interval of the last stat the
  // result may be up to that old.
  absl::StatusOr<std::string> Digest(const std::string& path);

  // Forgets every memoised digest.
  void Clear();

  FileDigestStats Stats() const;

 private:
  struct Stamp {
    uint64_t dev = 0;
    uint64_t ino = 0;
    int64_t size = 0;
    int64_t mtime_ns = 0;
    int64_t ctime_ns = 0;
    bool operator==(const Stamp&) const = default;
  };
  struct Entry {
    Stamp stamp;
    std::string digest;
    int64_t checked_at_ns = 0;  // Monotonic time of the last stat.
    bool racy = false;          // Modified too close to hashing to trust the stamp.
  };

  // Constant after construction.
  const int64_t recheck_interval_ns_;

  mutable absl::Mutex mu_;
  std::unordered_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t lookups_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stats_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hashes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace opjit::cache

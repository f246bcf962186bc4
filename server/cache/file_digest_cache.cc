#include "server/cache/file_digest_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <string_view>

#include "server/common/sha256.h"

namespace opjit::cache {
namespace {

constexpr int64_t kNsPerMs = 1'000'000;
constexpr int64_t kNsPerS = 1'000'000'000;
// Timestamps are taken from a coarse clock (a few ms), so a write that lands
// in the tick of our read leaves the stamps unchanged. Two seconds covers
// coarse clocks and filesystems with 1 s timestamps.
constexpr int64_t kRacyWindowNs = 2 * kNsPerS;
constexpr int kHashAttempts = 3;

int64_t ClockNs(clockid_t clock) {
  struct timespec ts;
  ::clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * kNsPerS + ts.tv_nsec;
}

int64_t ToNs(const struct timespec& ts) {
  return static_cast<int64_t>(ts.tv_sec) * kNsPerS + ts.tv_nsec;
}

absl::Status StatError(int err, const std::string& path) {
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError("no such file: " + path);
  return absl::ErrnoToStatus(err, "stat " + path);
}

}  // namespace

FileDigestCache::FileDigestCache(int64_t recheck_interval_ms)
    : recheck_interval_ns_(recheck_interval_ms * kNsPerMs) {}

absl::StatusOr<std::string> FileDigestCache::Digest(const std::string& path) {
  const int64_t now = ClockNs(CLOCK_MONOTONIC);
  {
    absl::MutexLock lock(&mu_);
    ++lookups_;
    auto it = entries_.find(path);
    if (it != entries_.end() && now - it->second.checked_at_ns < recheck_interval_ns_) {
      return it->second.digest;
    }
    ++stats_;
  }

  auto stamp_of = [](const struct stat& st) {
    return Stamp{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                 static_cast<int64_t>(st.st_size), ToNs(st.st_mtim), ToNs(st.st_ctim)};
  };
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    int err = errno;
    absl::MutexLock lock(&mu_);
    entries_.erase(path);
    return StatError(err, path);
  }
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError("not a regular file: " + path);
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(path);
    if (it != entries_.end() && !it->second.racy && it->second.stamp == stamp_of(st)) {
      it->second.checked_at_ns = now;
      return it->second.digest;
    }
  }

  // Hash, and trust the result only if the stamps did not move while reading.
  std::string digest;
  Stamp stamp;
  bool stable = false;
  int attempts = 0;
  for (; attempts < kHashAttempts && !stable; ++attempts) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return StatError(errno, path);
    struct stat before;
    struct stat after;
    Sha256 sha;
    char buf[64 * 1024];
    int err = 0;
    if (::fstat(fd, &before) != 0) err = errno;
    while (err == 0) {
      ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) err = errno;
      if (n <= 0) break;
      sha.Update(std::string_view(buf, static_cast<size_t>(n)));
    }
    if (err == 0 && ::fstat(fd, &after) != 0) err = errno;
    ::close(fd);
    if (err != 0) return absl::ErrnoToStatus(err, "read " + path);
    digest = sha.HexDigest();
    stamp = stamp_of(after);
    stable = stamp_of(before) == stamp;
  }
  const bool racy = !stable || stamp.mtime_ns >= ClockNs(CLOCK_REALTIME) - kRacyWindowNs;

  absl::MutexLock lock(&mu_);
  hashes_ += static_cast<uint64_t>(attempts);
  entries_[path] = Entry{stamp, digest, now, racy};
  return digest;
}

void FileDigestCache::Clear() {
  absl::MutexLock lock(&mu_);
  entries_.clear();
}

FileDigestStats FileDigestCache::Stats() const {
  absl::MutexLock lock(&mu_);
  return FileDigestStats{entries_.size(), lookups_, stats_, hashes_};
}

}  // namespace opjit::cache

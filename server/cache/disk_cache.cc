#include "server/cache/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <random>
#include <system_error>
#include <utility>
#include <vector>

#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"

namespace opjit::cache {
namespace {

// Entry file header: magic, format version (u32 LE), payload length (u64 LE),
// SHA-256 of the payload as 64 lowercase hex characters.
constexpr char kMagic[4] = {'O', 'P', 'J', 'C'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kDigestSize = 64;
constexpr size_t kHeaderSize = sizeof(kMagic) + 4 + 8 + kDigestSize;

constexpr std::string_view kTmpPrefix = ".tmp.";
constexpr int64_t kStaleTmpSeconds = 3600;
constexpr size_t kMaxKindLength = 32;
constexpr size_t kMinKeyLength = 16;
constexpr size_t kMaxKeyLength = 128;

bool IsLowerHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

bool ValidKind(std::string_view kind) {
  if (kind.empty() || kind.size() > kMaxKindLength) return false;
  return std::all_of(kind.begin(), kind.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

bool ValidKey(std::string_view key) {
  if (key.size() < kMinKeyLength || key.size() > kMaxKeyLength) return false;
  return std::all_of(key.begin(), key.end(), IsLowerHex);
}

absl::Status ValidateKindKey(std::string_view kind, std::string_view key) {
  if (!ValidKind(kind)) {
    return absl::InvalidArgumentError("cache kind must match [a-z0-9_]{1,32}, got \"" +
                                      std::string(kind.substr(0, 64)) + "\"");
  }
  if (!ValidKey(key)) {
    return absl::InvalidArgumentError("cache key must match [0-9a-f]{16,128}, got \"" +
                                      std::string(key.substr(0, 160)) + "\"");
  }
  return absl::OkStatus();
}

absl::Status ErrnoError(int err, const std::string& what) { return absl::ErrnoToStatus(err, what); }

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string MakeHeader(std::string_view payload) {
  std::string h;
  h.reserve(kHeaderSize);
  h.append(kMagic, sizeof(kMagic));
  PutLe(h, kFormatVersion, 4);
  PutLe(h, payload.size(), 8);
  h += Sha256Hex(payload);
  return h;
}

// Closes an fd on scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  // Closes now; returns close()'s errno, or 0.
  int Reset() {
    int err = 0;
    if (fd_ >= 0 && ::close(fd_) != 0) err = errno;
    fd_ = -1;
    return err;
  }

 private:
  int fd_;
};

// A flock held on its own open file description, so that two threads of one
// process exclude each other just as two processes do.
class ScopedFlock {
 public:
  static absl::StatusOr<ScopedFlock> Acquire(const std::string& path, int op) {
    Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (fd.get() < 0) return ErrnoError(errno, "open cache lock " + path);
    while (::flock(fd.get(), op) != 0) {
      if (errno != EINTR) return ErrnoError(errno, "flock cache lock " + path);
    }
    return ScopedFlock(std::move(fd));
  }

 private:
  explicit ScopedFlock(Fd fd) : fd_(std::move(fd)) {}
  Fd fd_;  // Closing it releases the lock.
};

absl::Status WriteAll(int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write " + path);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Reads exactly `size` bytes into `out`; false on a short read or error.
bool ReadExactly(int fd, char* out, size_t size) {
  while (size > 0) {
    ssize_t n = ::read(fd, out, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

absl::Status FsyncDir(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, "open directory " + path);
  if (::fsync(fd.get()) != 0) return ErrnoError(errno, "fsync directory " + path);
  return absl::OkStatus();
}

// mkdir that treats "already there" as success. Returns true via `created`
// when this call made the directory.
absl::Status MakeDir(const std::string& path, bool* created) {
  *created = false;
  if (::mkdir(path.c_str(), 0755) == 0) {
    *created = true;
    return absl::OkStatus();
  }
  if (errno == EEXIST) return absl::OkStatus();
  return ErrnoError(errno, "mkdir " + path);
}

std::string RandomSuffix() {
  static absl::Mutex mu(absl::kConstInit);
  static std::mt19937_64 rng ABSL_GUARDED_BY(mu){
      std::random_device{}() ^ (static_cast<uint64_t>(::time(nullptr)) << 20)};
  uint64_t v;
  {
    absl::MutexLock lock(&mu);
    v = rng();
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[i] = kHex[(v >> (4 * i)) & 0xf];
  return s;
}

// Lists a directory's names, skipping "." and "..". Empty on error: callers
// walk a tree that other processes change underneath them.
std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return names;
  while (struct dirent* e = ::readdir(d)) {
    std::string_view name(e->d_name);
    if (name == "." || name == "..") continue;
    names.emplace_back(name);
  }
  ::closedir(d);
  return names;
}

struct ScannedFile {
  std::string path;
  uint64_t size;
  int64_t mtime_ns;
};

struct ScanResult {
  std::vector<ScannedFile> files;
  uint64_t bytes = 0;
};

// Walks <root>/<kind>/<shard>/<key> and returns every entry file. Temp files
// older than kStaleTmpSeconds are deleted when `remove_stale_tmp`.
ScanResult ScanTree(const std::string& root, bool remove_stale_tmp) {
  ScanResult result;
  const int64_t stale_before_s = static_cast<int64_t>(::time(nullptr)) - kStaleTmpSeconds;
  for (const std::string& kind : ListDir(root)) {
    if (!ValidKind(kind)) continue;
    const std::string kind_dir = root + "/" + kind;
    for (const std::string& shard : ListDir(kind_dir)) {
      if (shard.size() != 2 || !IsLowerHex(shard[0]) || !IsLowerHex(shard[1])) continue;
      const std::string shard_dir = kind_dir + "/" + shard;
      for (const std::string& name : ListDir(shard_dir)) {
        const std::string path = shard_dir + "/" + name;
        struct stat st;
        if (name.starts_with(kTmpPrefix)) {
          if (remove_stale_tmp && ::lstat(path.c_str(), &st) == 0 &&
              st.st_mtim.tv_sec < stale_before_s) {
            ::unlink(path.c_str());
          }
          continue;
        }
        if (!ValidKey(name) || name.compare(0, 2, shard) != 0) continue;
        if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        result.files.push_back({path, static_cast<uint64_t>(st.st_size), MtimeNs(st)});
        result.bytes += static_cast<uint64_t>(st.st_size);
      }
    }
  }
  return result;
}

// Reads an entry from `fd` (a file of `file_size` bytes) and checks its
// header and checksum. Returns "" and fills `payload` when it verifies, else
// why not.
std::string ReadEntry(int fd, uint64_t file_size, std::string* payload) {
  char header[kHeaderSize];
  if (file_size < kHeaderSize || !ReadExactly(fd, header, kHeaderSize)) return "short header";
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) return "bad magic";
  if (GetLe(header + 4, 4) != kFormatVersion) {
    return "format version " + std::to_string(GetLe(header + 4, 4));
  }
  if (GetLe(header + 8, 8) != file_size - kHeaderSize) {
    return "length " + std::to_string(GetLe(header + 8, 8)) + " != file payload " +
           std::to_string(file_size - kHeaderSize);
  }
  payload->resize(file_size - kHeaderSize);
  if (!ReadExactly(fd, payload->data(), payload->size())) return "short payload";
  if (Sha256Hex(*payload) != std::string_view(header + 16, kDigestSize)) {
    return "checksum mismatch";
  }
  return "";
}

}  // namespace

DiskCache::DiskCache(std::string dir, uint64_t max_bytes)
    : dir_(std::move(dir)), lock_path_(dir_ + "/.lock"), max_bytes_(max_bytes) {}

DiskCache::~DiskCache() = default;

absl::StatusOr<std::unique_ptr<DiskCache>> DiskCache::Create(const DiskCacheOptions& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("cache directory is empty");
  std::string dir = options.dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ErrnoError(ec.value(), "cannot create cache directory " + dir);
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::FailedPreconditionError("cache path " + dir + " is not a directory");
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return ErrnoError(errno, "cache directory " + dir + " is not writable");
  }
  // Creating the lock file doubles as a write probe (access() says yes to
  // root even on some read-only mounts).
  {
    Fd lock(::open((dir + "/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (lock.get() < 0) {
      return ErrnoError(errno, "cache directory " + dir + " is not writable (lock file)");
    }
  }

  std::unique_ptr<DiskCache> cache(new DiskCache(dir, options.max_bytes));
  ScanResult scan = ScanTree(dir, /*remove_stale_tmp=*/true);
  {
    absl::MutexLock lock(&cache->mu_);
    cache->entries_ = scan.files.size();
    cache->bytes_ = scan.bytes;
  }
  Logger("cache")->info("disk cache at {}: {} entries, {} bytes, bound {} bytes", dir,
                        scan.files.size(), scan.bytes, options.max_bytes);
  return cache;
}

std::string DiskCache::EntryPath(std::string_view kind, std::string_view key) const {
  std::string path;
  path.reserve(dir_.size() + kind.size() + key.size() + 6);
  path.append(dir_).append("/").append(kind).append("/").append(key.substr(0, 2));
  path.append("/").append(key);
  return path;
}

void DiskCache::AddEstimate(int64_t entries, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  // Other daemons change the directory too, so the estimate may undershoot;
  // clamp instead of wrapping.
  entries_ = entries < 0 && static_cast<uint64_t>(-entries) > entries_ ? 0 : entries_ + entries;
  bytes_ = bytes < 0 && static_cast<uint64_t>(-bytes) > bytes_ ? 0 : bytes_ + bytes;
}

absl::StatusOr<std::string> DiskCache::Get(std::string_view kind, std::string_view key) {
  OPJIT_RETURN_IF_ERROR(ValidateKindKey(kind, key));
  const std::string path = EntryPath(kind, key);

  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    int err = errno;
    misses_.fetch_add(1, std::memory_order_relaxed);
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError("no cache entry " + path);
    return ErrnoError(err, "open cache entry " + path);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    misses_.fetch_add(1, std::memory_order_relaxed);
    return ErrnoError(errno, "fstat cache entry " + path);
  }

  // Entries are immutable once renamed into place, so anything that does not
  // verify was torn by a crash, the disk, or a foreign writer.
  std::string payload;
  const std::string why = ReadEntry(fd.get(), static_cast<uint64_t>(st.st_size), &payload);
  if (!why.empty()) {
    misses_.fetch_add(1, std::memory_order_relaxed);
    corrupt_.fetch_add(1, std::memory_order_relaxed);
    Logger("cache")->warn("corrupt cache entry {} ({}); deleting it", path, why);
    fd.Reset();
    DeleteCorrupt(path, st.st_dev, st.st_ino);
    return absl::NotFoundError("corrupt cache entry " + path + " (" + why + ")");
  }

  // LRU by mtime. Failure (a read-only cache someone else owns) only costs
  // recency.
  ::futimens(fd.get(), nullptr);
  hits_.fetch_add(1, std::memory_order_relaxed);
  return payload;
}

void DiskCache::DeleteCorrupt(const std::string& path, uint64_t dev, uint64_t ino) {
  // Under the exclusive lock no daemon can rename a fresh entry into place
  // between the inode check and the unlink.
  auto lock = ScopedFlock::Acquire(lock_path_, LOCK_EX);
  if (!lock.ok()) {
    Logger("cache")->warn("not deleting corrupt entry {}: {}", path, lock.status().ToString());
    return;
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || st.st_dev != dev || st.st_ino != ino) return;
  if (::unlink(path.c_str()) == 0) AddEstimate(-1, -static_cast<int64_t>(st.st_size));
}

absl::Status DiskCache::Put(std::string_view kind, std::string_view key, std::string_view bytes) {
  OPJIT_RETURN_IF_ERROR(ValidateKindKey(kind, key));
  const std::string kind_dir = dir_ + "/" + std::string(kind);
  const std::string shard_dir = kind_dir + "/" + std::string(key.substr(0, 2));
  const std::string path = shard_dir + "/" + std::string(key);

  bool created_kind = false;
  bool created_shard = false;
  OPJIT_RETURN_IF_ERROR(MakeDir(kind_dir, &created_kind));
  OPJIT_RETURN_IF_ERROR(MakeDir(shard_dir, &created_shard));
  // Make the new directories themselves durable, or a crash could lose
  // entries that were fsynced into them.
  if (created_kind) OPJIT_RETURN_IF_ERROR(FsyncDir(dir_));
  if (created_shard) OPJIT_RETURN_IF_ERROR(FsyncDir(kind_dir));

  const std::string header = MakeHeader(bytes);
  std::string tmp;
  Fd fd;
  for (int attempt = 0; attempt < 4 && fd.get() < 0; ++attempt) {
    tmp = shard_dir + "/" + std::string(kTmpPrefix) + std::to_string(::getpid()) + "." +
          RandomSuffix();
    fd = Fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0 && errno != EEXIST) break;
  }
  if (fd.get() < 0) return ErrnoError(errno, "create temp file in " + shard_dir);

  absl::Status status = WriteAll(fd.get(), header, tmp);
  if (status.ok()) status = WriteAll(fd.get(), bytes, tmp);
  if (status.ok() && ::fsync(fd.get()) != 0) status = ErrnoError(errno, "fsync " + tmp);
  if (int err = fd.Reset(); status.ok() && err != 0) status = ErrnoError(err, "close " + tmp);
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }

  struct stat old;
  bool replaced = false;
  {
    auto lock = ScopedFlock::Acquire(lock_path_, LOCK_SH);
    if (!lock.ok()) {
      ::unlink(tmp.c_str());
      return lock.status();
    }
    replaced = ::lstat(path.c_str(), &old) == 0;
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      status = ErrnoError(errno, "rename " + tmp + " to " + path);
      ::unlink(tmp.c_str());
      return status;
    }
  }
  OPJIT_RETURN_IF_ERROR(FsyncDir(shard_dir));

  const int64_t size = static_cast<int64_t>(kHeaderSize + bytes.size());
  AddEstimate(replaced ? 0 : 1, replaced ? size - static_cast<int64_t>(old.st_size) : size);
  {
    absl::MutexLock lock(&mu_);
    written_since_scan_ += static_cast<uint64_t>(size);
  }
  puts_.fetch_add(1, std::memory_order_relaxed);
  MaybeEvict(path);
  return absl::OkStatus();
}

void DiskCache::MaybeEvict(const std::string& keep) {
  {
    absl::MutexLock lock(&mu_);
    if (bytes_ <= max_bytes_ && written_since_scan_ <= max_bytes_ / 8) return;
  }
  // One pass at a time per process; a pass already running rescans the
  // directory after acquiring the flock, so it sees this Put's file.
  if (!evict_mu_.TryLock()) return;
  absl::Status status = Evict(keep);
  evict_mu_.Unlock();
  if (!status.ok()) Logger("cache")->warn("cache eviction failed: {}", status.ToString());
}

absl::Status DiskCache::Evict(const std::string& keep) {
  OPJIT_ASSIGN_OR_RETURN(ScopedFlock lock, ScopedFlock::Acquire(lock_path_, LOCK_EX));
  ScanResult scan = ScanTree(dir_, /*remove_stale_tmp=*/false);
  uint64_t entries = scan.files.size();
  uint64_t bytes = scan.bytes;
  uint64_t evicted = 0;
  if (bytes > max_bytes_) {
    const uint64_t target = max_bytes_ - max_bytes_ / 10;
    std::sort(scan.files.begin(), scan.files.end(), [](const ScannedFile& a, const ScannedFile& b) {
      return a.mtime_ns != b.mtime_ns ? a.mtime_ns < b.mtime_ns : a.path < b.path;
    });
    for (const ScannedFile& f : scan.files) {
      if (bytes <= target) break;
      if (f.path == keep) continue;
      if (::unlink(f.path.c_str()) != 0 && errno != ENOENT) {
        Logger("cache")->warn("{}", ErrnoError(errno, "cannot evict " + f.path).ToString());
        continue;
      }
      bytes -= f.size;
      --entries;
      ++evicted;
    }
    evictions_.fetch_add(evicted, std::memory_order_relaxed);
    Logger("cache")->debug("evicted {} entries from {}; {} entries, {} bytes left", evicted, dir_,
                           entries, bytes);
  }
  absl::MutexLock l(&mu_);
  entries_ = entries;
  bytes_ = bytes;
  written_since_scan_ = 0;
  return absl::OkStatus();
}

absl::Status DiskCache::Remove(std::string_view kind, std::string_view key) {
  OPJIT_RETURN_IF_ERROR(ValidateKindKey(kind, key));
  const std::string path = EntryPath(kind, key);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || ::unlink(path.c_str()) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return absl::NotFoundError("no cache entry " + path);
    return ErrnoError(errno, "remove cache entry " + path);
  }
  AddEstimate(-1, -static_cast<int64_t>(st.st_size));
  return absl::OkStatus();
}

absl::Status DiskCache::Clear() {
  absl::MutexLock evict_lock(&evict_mu_);
  OPJIT_ASSIGN_OR_RETURN(ScopedFlock lock, ScopedFlock::Acquire(lock_path_, LOCK_EX));
  ScanResult scan = ScanTree(dir_, /*remove_stale_tmp=*/false);
  absl::Status status;
  uint64_t kept_entries = 0;
  uint64_t kept_bytes = 0;
  for (const ScannedFile& f : scan.files) {
    if (::unlink(f.path.c_str()) == 0 || errno == ENOENT) continue;
    if (status.ok()) status = ErrnoError(errno, "remove cache entry " + f.path);
    ++kept_entries;
    kept_bytes += f.size;
  }
  Logger("cache")->info("cleared {}: removed {} entries", dir_, scan.files.size() - kept_entries);
  absl::MutexLock l(&mu_);
  entries_ = kept_entries;
  bytes_ = kept_bytes;
  written_since_scan_ = 0;
  return status;
}

DiskCacheVerification VerifyDiskCache(const std::string& dir) {
  DiskCacheVerification v;
  for (const ScannedFile& f : ScanTree(dir, /*remove_stale_tmp=*/false).files) {
    Fd fd(::open(f.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) continue;  // removed meanwhile (eviction, another daemon)
    struct stat st;
    std::string payload;
    std::string why = ::fstat(fd.get(), &st) != 0
                          ? "cannot stat"
                          : ReadEntry(fd.get(), static_cast<uint64_t>(st.st_size), &payload);
    ++v.entries;
    v.bytes += f.size;
    if (!why.empty()) v.corrupt.push_back(f.path.substr(dir.size() + 1) + ": " + why);
  }
  return v;
}

DiskCacheStats DiskCache::Stats() const {
  DiskCacheStats s;
  {
    absl::MutexLock lock(&mu_);
    s.entries = entries_;
    s.bytes = bytes_;
  }
  s.hits = hits_.load(std::memory_order_relaxed);
  s.misses = misses_.load(std::memory_order_relaxed);
  s.corrupt = corrupt_.load(std::memory_order_relaxed);
  s.evictions = evictions_.load(std::memory_order_relaxed);
  s.puts = puts_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace opjit::cache

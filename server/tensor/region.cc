#include "server/tensor/region.h"

#include <atomic>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/common/logging.h"
#include "server/common/posix_acl.h"

namespace opjit::tensor {
namespace {

// Closes an fd on scope exit.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// strerror() is not thread-safe; this is.
std::string ErrnoText(int err) {
  char buf[128];
  return ::strerror_r(err, buf, sizeof(buf));  // GNU strerror_r: returns the text.
}

uint64_t PageSize() {
  long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<uint64_t>(page) : 4096;
}

absl::Status ShmError(int err, const std::string& what, const std::string& key) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, " shared memory object '", key, "'"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Region>> Region::CreateShm(const std::string& shm_key,
                                                          uint64_t byte_size, RegionInfo info,
                                                          std::optional<uid_t> client_uid) {
  if (byte_size == 0) return absl::InvalidArgumentError("region size must be > 0 bytes");
  if (byte_size > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) ||
      byte_size > std::numeric_limits<size_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("region size ", byte_size, " is too large"));
  }
  int raw = ::shm_open(shm_key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (raw < 0) return ShmError(errno, "create", shm_key);
  ScopedFd fd(raw);
  // From here on every failure must unlink what we created.
  auto fail = [&](absl::Status status) {
    ::shm_unlink(shm_key.c_str());
    return status;
  };
  // The umask may have cleared bits of 0600; the client needs exactly rw.
  if (::fchmod(fd.get(), 0600) != 0) return fail(ShmError(errno, "chmod", shm_key));
  // A client of another user (the daemon runs as its own service user) can
  // open the object only through an ACL entry for its uid. The daemon stays
  // the owner: in the sticky /dev/shm only the owner may unlink.
  if (client_uid.has_value() && *client_uid != ::geteuid()) {
    absl::Status granted = GrantUserReadWrite(fd.get(), *client_uid);
    if (!granted.ok()) {
      Logger("tensor")->warn("cannot grant uid {} access to shm object {}: {}", *client_uid,
                             shm_key, granted.ToString());
      if (absl::IsFailedPrecondition(granted)) {
        return fail(absl::FailedPreconditionError(
            "the client runs as another user than the daemon, and the shared-memory file "
            "system (/dev/shm) does not support the POSIX ACLs that would let it open the "
            "daemon's regions. Mount /dev/shm with ACL support, run the client as the "
            "daemon's user, or use inline transfers (transport \"grpc\")"));
      }
      return fail(absl::Status(
          granted.code(), absl::StrCat("cannot grant the client access to a shared-memory region: ",
                                       granted.message())));
    }
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(byte_size)) != 0) {
    return fail(ShmError(errno, "size", shm_key));
  }
  int err;
  do {
    err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(byte_size));
  } while (err == EINTR);
  if (err == ENOSPC) {
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("not enough shared memory (/dev/shm) for a region of ", byte_size, " bytes")));
  }
  // EOPNOTSUPP/EINVAL: a filesystem without fallocate; pages come on first touch.
  if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
    return fail(ShmError(err, "reserve pages of", shm_key));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return fail(ShmError(errno, "stat", shm_key));
  void* base = ::mmap(nullptr, static_cast<size_t>(byte_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                      fd.get(), 0);
  if (base == MAP_FAILED) {
    int e = errno;
    if (e == ENOMEM) {
      return fail(absl::ResourceExhaustedError(
          absl::StrCat("cannot map a region of ", byte_size, " bytes: out of address space")));
    }
    return fail(ShmError(e, "map", shm_key));
  }
  std::unique_ptr<Region> region(new Region());
  region->fd_ = fd.release();
  region->map_base_ = base;
  region->map_length_ = static_cast<size_t>(byte_size);
  region->data_ = static_cast<uint8_t*>(base);
  info.shm_key = shm_key;
  info.offset = 0;
  info.byte_size = byte_size;
  info.daemon_owned = true;
  info.lease_expires_unix_ms = 0;
  region->info_ = std::move(info);
  region->dev_ = st.st_dev;
  region->ino_ = st.st_ino;
  region->unlink_on_destroy_ = true;
  return region;
}

absl::StatusOr<std::unique_ptr<Region>> Region::MapExisting(const std::string& shm_key,
                                                            uint64_t offset, uint64_t byte_size,
                                                            RegionInfo info,
                                                            std::optional<uid_t> required_uid) {
  if (byte_size == 0) return absl::InvalidArgumentError("region size must be > 0 bytes");
  uint64_t end;
  if (__builtin_add_overflow(offset, byte_size, &end) ||
      end > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("region window at offset ", offset, " of ", byte_size, " bytes overflows"));
  }
  int raw = ::shm_open(shm_key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (raw < 0) {
    int e = errno;
    if (e == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("shared memory object '", shm_key, "' does not exist"));
    }
    return ShmError(e, "open", shm_key);
  }
  ScopedFd fd(raw);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ShmError(errno, "stat", shm_key);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", shm_key, "' is not a shared memory object"));
  }
  if (required_uid.has_value() && st.st_uid != *required_uid) {
    // Do not say who owns it: that is not the caller's business.
    return absl::PermissionDeniedError(
        absl::StrCat("shared memory object '", shm_key, "' is not owned by the caller"));
  }
  const uint64_t object_size = static_cast<uint64_t>(st.st_size);
  if (end > object_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "window [", offset, ", ", end, ") (offset ", offset, " + byte_size ", byte_size,
        ") does not fit in shared memory object '", shm_key, "' of ", object_size, " bytes"));
  }
  const uint64_t page = PageSize();
  const uint64_t map_offset = offset - offset % page;
  const uint64_t delta = offset - map_offset;
  uint64_t map_length = delta + byte_size;  // <= end, so no overflow.
  if (map_length > std::numeric_limits<size_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("region size ", byte_size, " is too large"));
  }
  void* base = ::mmap(nullptr, static_cast<size_t>(map_length), PROT_READ | PROT_WRITE, MAP_SHARED,
                      fd.get(), static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    int e = errno;
    if (e == ENOMEM) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map a region of ", byte_size, " bytes: out of address space"));
    }
    return ShmError(e, "map", shm_key);
  }
  std::unique_ptr<Region> region(new Region());
  region->fd_ = fd.release();
  region->map_base_ = base;
  region->map_length_ = static_cast<size_t>(map_length);
  region->data_ = static_cast<uint8_t*>(base) + delta;
  info.shm_key = shm_key;
  info.offset = offset;
  info.byte_size = byte_size;
  info.daemon_owned = false;
  info.lease_expires_unix_ms = 0;
  region->info_ = std::move(info);
  region->dev_ = st.st_dev;
  region->ino_ = st.st_ino;
  region->unlink_on_destroy_ = false;
  return region;
}

Region::Region() {
  static std::atomic<uint64_t> next_serial{1};
  serial_ = next_serial.fetch_add(1, std::memory_order_relaxed);
}

Region::~Region() {
  if (fd_ >= 0) ::close(fd_);
  if (map_base_ != nullptr && ::munmap(map_base_, map_length_) != 0) {
    Logger("tensor")->error("munmap of region '{}' ({}) failed: {}", info_.name, info_.shm_key,
                            ErrnoText(errno));
  }
  if (unlink_on_destroy_ && ::shm_unlink(info_.shm_key.c_str()) != 0 && errno != ENOENT) {
    Logger("tensor")->warn("shm_unlink {} failed: {}", info_.shm_key, ErrnoText(errno));
  }
}

}  // namespace opjit::tensor

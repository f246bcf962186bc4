#include "client/cpp/shm_region.h"

#include "server/common/posix_acl.h"
#include "server/common/random.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <string>

namespace opjit::client {
namespace {

absl::Status ValidateKey(const std::string& key) {
  if (key.size() < 2 || key.size() > 255 || key[0] != '/' ||
      key.find('/', 1) != std::string::npos || key.find('\0') != std::string::npos || key == "/." ||
      key == "/..") {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm key '", key.substr(0, 64),
        "' must start with '/', contain no other '/', and be 2 to 255 characters long"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSize(uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shm size must be > 0 bytes");
  if (bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("shm size ", bytes, " is too large"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> Map(int fd, uint64_t bytes, const std::string& key) {
  void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return absl::ErrnoToStatus(errno, absl::StrCat("mmap ", key));
  return static_cast<uint8_t*>(p);
}

// Gives the daemon's `uid` read-write on `fd` (server/common/posix_acl.h),
// with a message that tells the user what to do instead.
absl::Status GrantReadWrite(int fd, uid_t uid, const std::string& key) {
  absl::Status s = GrantUserReadWrite(fd, uid);
  if (s.ok()) return s;
  if (absl::IsFailedPrecondition(s)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot grant the daemon's uid ", uid, " access to shm ", key,
        ": /dev/shm does not support POSIX ACLs; run as the daemon's user or use CreateRegion"));
  }
  return absl::Status(s.code(), absl::StrCat("set the ACL of shm ", key, ": ", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Create(const std::string& key,
                                                               uint64_t bytes,
                                                               std::optional<uid_t> grant_uid) {
  if (absl::Status s = ValidateKey(key); !s.ok()) return s;
  if (absl::Status s = ValidateSize(bytes); !s.ok()) return s;
  int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("create shm ", key));
  auto fail = [&](absl::Status status) {
    ::close(fd);
    ::shm_unlink(key.c_str());
    return status;
  };
  if (::fchmod(fd, 0600) != 0) return fail(absl::ErrnoToStatus(errno, "chmod shm " + key));
  if (grant_uid.has_value() && *grant_uid != ::geteuid()) {
    if (absl::Status s = GrantReadWrite(fd, *grant_uid, key); !s.ok()) return fail(s);
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(absl::ErrnoToStatus(errno, "size shm " + key));
  }
  int err;
  do {
    err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err == ENOSPC) {
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("not enough shared memory (/dev/shm) for ", bytes, " bytes")));
  }
  if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
    return fail(absl::ErrnoToStatus(err, "reserve shm " + key));
  }
  absl::StatusOr<uint8_t*> data = Map(fd, bytes, key);
  if (!data.ok()) return fail(data.status());
  ::close(fd);
  return std::unique_ptr<ShmMapping>(new ShmMapping(key, *data, bytes, /*owns_key=*/true));
}

absl::StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Open(const std::string& key,
                                                             uint64_t bytes) {
  if (absl::Status s = ValidateKey(key); !s.ok()) return s;
  if (absl::Status s = ValidateSize(bytes); !s.ok()) return s;
  int fd = ::shm_open(key.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open shm ", key));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return absl::ErrnoToStatus(e, "stat shm " + key);
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shm ", key, " has ", st.st_size,
                                                   " bytes, fewer than the ", bytes, " asked for"));
  }
  absl::StatusOr<uint8_t*> data = Map(fd, bytes, key);
  ::close(fd);
  if (!data.ok()) return data.status();
  return std::unique_ptr<ShmMapping>(new ShmMapping(key, *data, bytes, /*owns_key=*/false));
}

absl::StatusOr<std::string> ShmMapping::RandomKey(const std::string& prefix) {
  bool ok = !prefix.empty() && prefix.size() <= 64;
  for (char c : prefix) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '.' || c == '-');
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("shm key prefix '", prefix.substr(0, 64),
                                                   "' must match [A-Za-z0-9_.-]{1,64}"));
  }
  auto hex = RandomHex128();
  if (!hex.ok()) return hex.status();
  return "/" + prefix + "." + *hex;
}

ShmMapping::~ShmMapping() {
  ::munmap(data_, static_cast<size_t>(size_));
  if (owns_key_) ::shm_unlink(key_.c_str());
}

}  // namespace opjit::client

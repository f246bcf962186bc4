#include "server/common/uid_claims.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace opjit {
namespace {

constexpr char kLockFile[] = "uids.lock";

absl::Status Unusable(const std::string& dir, const std::string& why) {
  return absl::FailedPreconditionError(
      absl::StrCat("the uid claim directory ", dir, " cannot be used: ", why));
}

// A write lock on byte `uid` (F_OFD_SETLK) or the question whether another
// descriptor holds one (F_OFD_GETLK).
struct flock ByteOf(uint32_t uid) {
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(uid);
  fl.l_len = 1;
  fl.l_pid = 0;  // OFD locks require 0
  return fl;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UidClaims>> UidClaims::Open(const std::string& dir) {
  if (dir.empty() || dir[0] != '/') return Unusable(dir, "it is not an absolute path");
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Unusable(dir, absl::StrCat("it is missing and cannot be created (", std::strerror(errno),
                                      ")"));
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    return Unusable(dir, errno == ELOOP || errno == ENOTDIR
                             ? std::string("it is a symlink or not a directory")
                             : std::string(std::strerror(errno)));
  }
  struct stat ds {};
  if (::fstat(dfd, &ds) != 0) {
    const int e = errno;
    ::close(dfd);
    return Unusable(dir, std::strerror(e));
  }
  const uid_t me = ::geteuid();
  // Only its owner may put files there (no one else can swap the lock
  // file); a daemon that is not root uses its own directory or root's.
  if ((ds.st_mode & 022) != 0) {
    ::close(dfd);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%o", static_cast<unsigned>(ds.st_mode & 07777));
    return Unusable(dir, absl::StrCat("others than its owner may write it (mode ", mode,
                                      "); chmod 700 it"));
  }
  if (me != 0 && ds.st_uid != me && ds.st_uid != 0) {
    ::close(dfd);
    return Unusable(dir, absl::StrCat("it belongs to uid ", ds.st_uid, ", not to this daemon's (",
                                      me, ") or root"));
  }
  const int fd = ::openat(dfd, kLockFile, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  const int open_errno = errno;
  if (fd < 0) {
    ::close(dfd);
    return Unusable(dir, absl::StrCat("its ", kLockFile, " cannot be opened for writing (",
                                      std::strerror(open_errno), ")"));
  }
  struct stat fs {};
  if (::fstat(fd, &fs) != 0 || !S_ISREG(fs.st_mode)) {
    ::close(fd);
    ::close(dfd);
    return Unusable(dir, absl::StrCat("its ", kLockFile, " is not a regular file"));
  }
  // The lock file belongs to the directory's owner, so that the daemons of
  // that user (the package's opjit) open it as well as root's.
  if (me == 0 && (fs.st_uid != ds.st_uid || fs.st_gid != ds.st_gid)) {
    (void)::fchown(fd, ds.st_uid, ds.st_gid);
  }
  if ((fs.st_mode & 077) != 0 && (me == 0 || fs.st_uid == me)) (void)::fchmod(fd, 0600);
  ::close(dfd);
  // OFD locks work here (Linux 3.15 and later, on a local file system).
  struct flock probe = ByteOf(0);
  if (::fcntl(fd, F_OFD_GETLK, &probe) != 0) {
    const int e = errno;
    ::close(fd);
    return Unusable(dir, absl::StrCat("open file description locks fail there (",
                                      std::strerror(e), ")"));
  }
  return std::unique_ptr<UidClaims>(new UidClaims(dir, fd));
}

UidClaims::~UidClaims() { ::close(fd_); }

absl::StatusOr<uint32_t> UidClaims::Claim(uint32_t first, uint32_t last) {
  MutexLock lock(&mu_);
  // A range found full a moment ago is refused again without another scan
  // (up to 64 Ki lock calls): a refused namespace's calls come quickly.
  const auto now = std::chrono::steady_clock::now();
  if (!full_.ok() && full_first_ == first && full_last_ == last && now < full_until_) {
    return full_;
  }
  uint64_t mine = 0;
  for (uint64_t uid = first; uid <= last; ++uid) {
    // A byte this descriptor holds would lock again without a conflict.
    if (held_.count(static_cast<uint32_t>(uid)) != 0) {
      ++mine;
      continue;
    }
    struct flock fl = ByteOf(static_cast<uint32_t>(uid));
    if (::fcntl(fd_, F_OFD_SETLK, &fl) == 0) {
      held_.insert(static_cast<uint32_t>(uid));
      return static_cast<uint32_t>(uid);
    }
    if (errno != EAGAIN && errno != EACCES) {
      return absl::InternalError(
          absl::StrCat("claiming uid ", uid, " in ", dir_, ": ", std::strerror(errno)));
    }
  }
  full_ = absl::ResourceExhaustedError(absl::StrCat(
      "every uid of ", first, "-", last, " is taken: ", mine, " by this server's namespaces, ",
      uint64_t{last} - first + 1 - mine, " by other opjitd servers on this host (claimed in ",
      dir_, ")"));
  full_first_ = first;
  full_last_ = last;
  full_until_ = now + std::chrono::seconds(1);
  return full_;
}

bool UidClaims::HeldElsewhere(uint32_t uid) const {
  struct flock fl = ByteOf(uid);
  return ::fcntl(fd_, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

std::set<uint32_t> UidClaims::held() const {
  MutexLock lock(&mu_);
  return held_;
}

}  // namespace opjit

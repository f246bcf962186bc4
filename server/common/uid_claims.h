// Host-wide claims on executor uids, so that no two daemons on one host give
// their tenants the same uid (and with it one RLIMIT_NPROC, one set of
// signal and ptrace rights): every daemon's namespace k used to take the
// k-th uid of the same default [exec] uid_range.
//
// A claim is an open-file-description lock (fcntl F_OFD_SETLK, F_WRLCK) on
// byte `uid` of one lock file, `<dir>/uids.lock`, held on one descriptor for
// the object's life. The kernel drops it when the descriptor closes, so a
// daemon that dies, however it dies, gives its uids back at once; its
// executors die with it (PR_SET_DEATHSIG). Every daemon of the host that
// hands out uids (root ones from [exec] uid_range, non-root ones from their
// user's subordinate ids) claims in the same file, so the numbers are the
// host's uids whoever the daemon runs as.
//
// The directory ([exec] uid_claim_dir, default /run/opjit-uids) must be one
// that every daemon of the host reaches (one mount namespace's /run: daemons
// in separate containers claim apart only where they share a host directory
// there) and that nobody else may write: a root daemon creates it (mode 0700)
// where it is missing; the package's tmpfiles.d makes it for its opjit user,
// whose daemon cannot create it in /run. Its owner owns the lock file (mode
// 0600): a root daemon that creates the file gives it to the directory's
// owner, so that user's daemons open it too. Nobody else can open it, so
// nobody else can hold a byte of it.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/common/mutex.h"

namespace opjit {

class UidClaims {
 public:
  // The claims of this process in `dir` (created, mode 0700, when missing
  // and this process may). FAILED_PRECONDITION, saying why, when the
  // directory or its lock file cannot be used: a symlink, not a directory,
  // writable by others than its owner, owned (as a non-root process) by
  // another user, or a file system without OFD locks.
  static absl::StatusOr<std::unique_ptr<UidClaims>> Open(const std::string& dir);
  ~UidClaims();  // gives every claim back
  UidClaims(const UidClaims&) = delete;
  UidClaims& operator=(const UidClaims&) = delete;

  // The lowest uid of [first, last] that neither this object nor any other
  // process holds, now held by this object; RESOURCE_EXHAUSTED when every
  // one is held (saying how many by this object; for a second after, the
  // same range is refused again without a scan), INTERNAL when the lock
  // call fails otherwise.
  absl::StatusOr<uint32_t> Claim(uint32_t first, uint32_t last);

  // Whether another process (another descriptor) holds `uid` now.
  bool HeldElsewhere(uint32_t uid) const;

  const std::string& dir() const { return dir_; }
  // The uids this object holds.
  std::set<uint32_t> held() const;

 private:
  UidClaims(std::string dir, int fd) : dir_(std::move(dir)), fd_(fd) {}
  const std::string dir_;
  const int fd_;
  mutable Mutex mu_;
  std::set<uint32_t> held_ ABSL_GUARDED_BY(mu_);
  // The last range found full, and until when that answer stands (1 s).
  absl::Status full_ ABSL_GUARDED_BY(mu_);
  uint32_t full_first_ ABSL_GUARDED_BY(mu_) = 0, full_last_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point full_until_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opjit

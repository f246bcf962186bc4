#include "server/common/sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

// Debian 12's <linux/landlock.h> describes ABI 2; newer rights by number.
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif
#ifndef LANDLOCK_ACCESS_FS_IOCTL_DEV
#define LANDLOCK_ACCESS_FS_IOCTL_DEV (1ULL << 15)
#endif
#define OPJIT_LANDLOCK_NET_BIND_TCP (1ULL << 0)
#define OPJIT_LANDLOCK_NET_CONNECT_TCP (1ULL << 1)
#define OPJIT_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define OPJIT_LANDLOCK_SCOPE_SIGNAL (1ULL << 1)

namespace opjit::sandbox {
namespace {

// The ruleset attribute of ABI >= 6 (fs, net, scoped).
struct RulesetAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
  uint64_t scoped;
};

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat("sandbox: ", what, ": ", std::strerror(errno)));
}

int CountThreads() {
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n;
}

uint64_t FsRights(int abi) {
  uint64_t r = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE |
               LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR |
               LANDLOCK_ACCESS_FS_REMOVE_DIR | LANDLOCK_ACCESS_FS_REMOVE_FILE |
               LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_DIR |
               LANDLOCK_ACCESS_FS_MAKE_REG | LANDLOCK_ACCESS_FS_MAKE_SOCK |
               LANDLOCK_ACCESS_FS_MAKE_FIFO | LANDLOCK_ACCESS_FS_MAKE_BLOCK |
               LANDLOCK_ACCESS_FS_MAKE_SYM;
  if (abi >= 2) r |= LANDLOCK_ACCESS_FS_REFER;
  if (abi >= 3) r |= LANDLOCK_ACCESS_FS_TRUNCATE;
  if (abi >= 5) r |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
  return r;
}

absl::Status AddPath(int ruleset, const std::string& path, uint64_t rights, uint64_t handled) {
  int fd = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (fd < 0) return absl::OkStatus();  // absent: nothing to allow
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Errno(absl::StrCat("stat ", path));
  }
  if (!S_ISDIR(st.st_mode)) {
    // Files take only file rights.
    rights &= LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE |
              LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_TRUNCATE |
              LANDLOCK_ACCESS_FS_IOCTL_DEV;
  }
  landlock_path_beneath_attr attr{};
  attr.allowed_access = rights & handled;
  attr.parent_fd = fd;
  long r = ::syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &attr, 0);
  ::close(fd);
  if (r != 0) return Errno(absl::StrCat("landlock rule for ", path));
  return absl::OkStatus();
}

absl::Status ApplyLandlock(const Policy& p) {
  const int abi = LandlockAbi();
  if (abi <= 0) {
    if (p.require_landlock) {
      return absl::FailedPreconditionError("sandbox: this kernel has no Landlock");
    }
    return absl::OkStatus();
  }
  RulesetAttr attr{};
  attr.handled_access_fs = FsRights(abi);
  size_t size = sizeof(uint64_t);
  if (abi >= 4) {
    // No TCP at all (seccomp refuses sockets too).
    attr.handled_access_net = OPJIT_LANDLOCK_NET_BIND_TCP | OPJIT_LANDLOCK_NET_CONNECT_TCP;
    size = 2 * sizeof(uint64_t);
  }
  if (abi >= 6) {
    // No signals to, and no abstract sockets of, processes outside.
    attr.scoped = OPJIT_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | OPJIT_LANDLOCK_SCOPE_SIGNAL;
    size = sizeof attr;
  }
  int ruleset = static_cast<int>(::syscall(SYS_landlock_create_ruleset, &attr, size, 0));
  if (ruleset < 0) return Errno("landlock ruleset");
  const uint64_t handled = attr.handled_access_fs;
  const uint64_t ro = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_READ_FILE |
                      LANDLOCK_ACCESS_FS_READ_DIR;
  const uint64_t dev = LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_WRITE_FILE |
                       LANDLOCK_ACCESS_FS_IOCTL_DEV | LANDLOCK_ACCESS_FS_TRUNCATE;
  absl::Status s;
  for (const auto& path : p.read_only_paths) {
    if (s.ok()) s = AddPath(ruleset, path, ro, handled);
  }
  for (const auto& path : p.read_write_paths) {
    if (s.ok()) s = AddPath(ruleset, path, handled, handled);
  }
  for (const auto& path : p.device_paths) {
    if (s.ok()) s = AddPath(ruleset, path, dev, handled);
  }
  if (s.ok() && ::syscall(SYS_landlock_restrict_self, ruleset, 0) != 0) {
    s = Errno("landlock_restrict_self");
  }
  ::close(ruleset);
  return s;
}

// A seccomp program: refuse (EPERM) what a kernel or compiler never needs
// and an attacker wants; allow the rest.
class Bpf {
 public:
  void Add(sock_filter f) { prog_.push_back(f); }
  void Deny(int nr) {
    Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1));
    Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)));
  }
  void Return(int nr, uint32_t action) {
    Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1));
    Add(BPF_STMT(BPF_RET | BPF_K, action));
  }
  std::vector<sock_filter>& prog() { return prog_; }

 private:
  std::vector<sock_filter> prog_;
};

absl::Status ApplySeccomp(const Policy& p) {
  Bpf b;
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
  b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  // x32 system calls (bit 30) would bypass the numbers below.
  b.Add(BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1));
  b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)));
  for (int nr : {SYS_socket, SYS_socketpair, SYS_connect, SYS_bind, SYS_listen, SYS_accept,
                 SYS_accept4, SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_mount,
                 SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_bpf, SYS_keyctl, SYS_add_key,
                 SYS_request_key, SYS_unshare, SYS_setns, SYS_perf_event_open, SYS_io_uring_setup,
                 SYS_io_uring_enter, SYS_io_uring_register, SYS_userfaultfd, SYS_open_by_handle_at,
                 SYS_name_to_handle_at, SYS_kexec_load, SYS_kexec_file_load, SYS_init_module,
                 SYS_finit_module, SYS_delete_module, SYS_kill, SYS_tkill, SYS_pidfd_send_signal,
                 SYS_pidfd_open, SYS_pidfd_getfd, SYS_setpgid, SYS_setsid}) {
    b.Deny(nr);
  }
  if (!p.allow_exec) {
    b.Deny(SYS_execve);
    b.Deny(SYS_execveat);
  }
  if (!p.allow_processes) {
    b.Deny(SYS_fork);
    b.Deny(SYS_vfork);
    // clone3's flags live in memory seccomp cannot read: ENOSYS makes glibc
    // fall back to clone, whose flags it can.
    b.Return(SYS_clone3, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA));
    // clone: allowed only with CLONE_THREAD (a thread, not a process).
    b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 4));
    b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
    b.Add(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_THREAD, 0, 1));
    b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
    b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)));
    // (the accumulator now holds args[0]; reload nr for what follows)
    b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  }
  // tgkill only to this process (abort() and raise() use it on themselves).
  const uint32_t self = static_cast<uint32_t>(::getpid());
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_tgkill, 0, 4));
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, self, 0, 1));
  b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)));
  b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  sock_fprog prog{static_cast<unsigned short>(b.prog().size()), b.prog().data()};
  if (::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) != 0) {
    return Errno("seccomp");
  }
  return absl::OkStatus();
}

absl::Status SetLimit(int resource, uint64_t value, const char* name) {
  if (value == 0) return absl::OkStatus();
  rlimit lim{value, value};
  if (::setrlimit(resource, &lim) != 0) return Errno(name);
  return absl::OkStatus();
}

}  // namespace

int LandlockAbi() {
  long v = ::syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
  return v < 0 ? 0 : static_cast<int>(v);
}

absl::Status Apply(const Policy& p) {
  if (CountThreads() != 1) {
    return absl::FailedPreconditionError("sandbox: apply it while the process has one thread");
  }
  rlimit core{0, 0};
  if (::setrlimit(RLIMIT_CORE, &core) != 0) return Errno("RLIMIT_CORE");
#ifndef OPJIT_SANITIZED
  if (auto s = SetLimit(RLIMIT_AS, p.address_space_bytes, "RLIMIT_AS"); !s.ok()) return s;
  if (auto s = SetLimit(RLIMIT_DATA, p.data_bytes, "RLIMIT_DATA"); !s.ok()) return s;
#else
  // ASan reserves terabytes of shadow address space at start: under either
  // limit a sanitizer build could not run. Memory limits are off in such
  // builds, and the tests of them say so (GTEST_SKIP).
#endif
  if (auto s = SetLimit(RLIMIT_CPU, p.cpu_seconds, "RLIMIT_CPU"); !s.ok()) return s;
  if (auto s = SetLimit(RLIMIT_NOFILE, p.max_open_files, "RLIMIT_NOFILE"); !s.ok()) return s;
  ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  if (::geteuid() == 0 && p.uid >= 0) {
    const gid_t gid = static_cast<gid_t>(p.gid >= 0 ? p.gid : p.uid);
    if (::setgroups(0, nullptr) != 0) return Errno("setgroups");
    if (::setresgid(gid, gid, gid) != 0) return Errno("setresgid");
    if (::setresuid(static_cast<uid_t>(p.uid), static_cast<uid_t>(p.uid),
                    static_cast<uid_t>(p.uid)) != 0) {
      return Errno("setresuid");
    }
  }
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return Errno("no_new_privs");
  if (auto s = ApplyLandlock(p); !s.ok()) return s;
  return ApplySeccomp(p);
}

}  // namespace opjit::sandbox

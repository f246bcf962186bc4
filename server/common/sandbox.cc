#include "server/common/sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/mount.h>
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
// and an attacker wants; allow the rest. The program is linear: each rule
// compares the system call number (in the accumulator) and, on a match,
// returns; only a rule that matched may load an argument.
class Bpf {
 public:
  static constexpr uint32_t kAllow = SECCOMP_RET_ALLOW;
  static constexpr uint32_t kEperm = SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA);

  void Add(sock_filter f) { prog_.push_back(f); }
  void Deny(int nr) { Return(nr, kEperm); }
  void Return(int nr, uint32_t action) {
    Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1));
    Add(BPF_STMT(BPF_RET | BPF_K, action));
  }
  // One condition of AllowOnly: argument `arg` (its low 32 bits, all the
  // kernel reads of an int, pid_t or id_t) is one of `values`.
  struct ArgIn {
    int arg;
    std::vector<uint32_t> values;
  };
  // System call `nr` is allowed only when every condition holds; else EPERM.
  void AllowOnly(int nr, const std::vector<ArgIn>& conditions) {
    size_t body = 1;  // the final RET ALLOW
    for (const auto& c : conditions) body += 2 + c.values.size();
    Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0,
                 static_cast<uint8_t>(body)));
    for (const auto& c : conditions) {
      Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ArgOffset(c.arg)));
      const size_t m = c.values.size();
      for (size_t j = 0; j < m; ++j) {
        // A match jumps over the remaining comparisons and the refusal.
        Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, c.values[j], static_cast<uint8_t>(m - j), 0));
      }
      Add(BPF_STMT(BPF_RET | BPF_K, kEperm));
    }
    Add(BPF_STMT(BPF_RET | BPF_K, kAllow));
  }
  static uint32_t ArgOffset(int i) {
    // Little-endian x86-64: the low half comes first.
    return static_cast<uint32_t>(offsetof(seccomp_data, args) + 8 * i);
  }
  std::vector<sock_filter>& prog() { return prog_; }

 private:
  std::vector<sock_filter> prog_;
};

// Values of the arguments below, by number (not every header names them).
constexpr uint32_t kPrioProcess = 0;      // setpriority: PRIO_PROCESS
constexpr uint32_t kIoprioWhoProcess = 1;  // ioprio_set: IOPRIO_WHO_PROCESS
constexpr uint32_t kFSetOwn = 8;           // fcntl: F_SETOWN
constexpr uint32_t kFSetOwnEx = 15;        // fcntl: F_SETOWN_EX
constexpr uint32_t kFioSetOwn = 0x8901;    // ioctl: FIOSETOWN
constexpr uint32_t kSiocSPgrp = 0x8902;    // ioctl: SIOCSPGRP

absl::Status InstallSeccomp(const Policy& p) {
  Bpf b;
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
  b.Add(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  // x32 system calls (bit 30) would bypass the numbers below.
  b.Add(BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1));
  b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kEperm));
  // This process's pid, with one thread (its tid too); see below.
  const uint32_t self = static_cast<uint32_t>(::getpid());
  // fcntl and ioctl come first: the kernel's seccomp cache answers a call
  // at once only when no rule reads its arguments, otherwise the program
  // runs up to its rule, and these two a kernel (or a GPU driver) may make
  // often. A file's owner receives its SIGIO (and the signal F_SETSIG picks,
  // even SIGKILL): fcntl F_SETOWN only to nobody (0) or this process;
  // F_SETOWN_EX and the ioctls that set the owner: EPERM.
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_fcntl, 0, 8));
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, Bpf::ArgOffset(1)));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kFSetOwnEx, 4, 0));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kFSetOwn, 0, 4));
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, Bpf::ArgOffset(2)));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 2, 0));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, self, 1, 0));
  b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kEperm));
  b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kAllow));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_ioctl, 0, 5));
  b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, Bpf::ArgOffset(1)));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kFioSetOwn, 1, 0));
  b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kSiocSPgrp, 0, 1));
  b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kEperm));
  b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kAllow));
  // Refused outright: networking, mounts and namespaces, kernel keys and
  // modules, BPF and perf, io_uring, file handles, and whatever reaches
  // into another process (tracing, its memory, its file descriptors,
  // comparing its resources, signals by pid or pidfd, process groups).
  for (int nr : {SYS_socket, SYS_socketpair, SYS_connect, SYS_bind, SYS_listen, SYS_accept,
                 SYS_accept4, SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_mount,
                 SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_bpf, SYS_keyctl, SYS_add_key,
                 SYS_request_key, SYS_unshare, SYS_setns, SYS_perf_event_open, SYS_io_uring_setup,
                 SYS_io_uring_enter, SYS_io_uring_register, SYS_userfaultfd, SYS_open_by_handle_at,
                 SYS_name_to_handle_at, SYS_kexec_load, SYS_kexec_file_load, SYS_init_module,
                 SYS_finit_module, SYS_delete_module, SYS_kill, SYS_tkill, SYS_pidfd_send_signal,
                 SYS_pidfd_open, SYS_pidfd_getfd, SYS_process_madvise, SYS_process_mrelease,
                 SYS_kcmp, SYS_setpgid, SYS_setsid}) {
    b.Deny(nr);
  }
  if (p.refuse_shared_memory) {
    b.Deny(SYS_memfd_create);
    b.Deny(SYS_memfd_secret);
    b.Deny(SYS_shmget);
    // mmap: MAP_ANONYMOUS together with MAP_SHARED (or
    // MAP_SHARED_VALIDATE, which has its bit) is refused.
    b.Add(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_mmap, 0, 5));
    b.Add(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, Bpf::ArgOffset(3)));
    b.Add(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, MAP_ANONYMOUS, 0, 2));
    b.Add(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, MAP_SHARED, 0, 1));
    b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kEperm));
    b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kAllow));
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
    b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kEperm));
  }
  // Calls that name a process: allowed only aimed at the caller itself, by
  // 0 ("the calling thread" or "this process") or by this process's pid as
  // it is when the filter is installed (with one thread: its pid is its
  // tid). Another process, a process group or a user's processes: EPERM.
  // A thread other than the first can name itself only by 0: seccomp cannot
  // tell its tid from another process's pid (pthread_setaffinity_np,
  // pthread_setschedparam and pthread attributes with an affinity or an
  // explicit scheduling policy pass the tid, so they fail with EPERM in such
  // threads). A child process (where allow_processes) also names itself by 0.
  const std::vector<uint32_t> me = {0, self};
  for (int nr : {SYS_prlimit64, SYS_sched_setaffinity, SYS_sched_setscheduler,
                 SYS_sched_setparam, SYS_sched_setattr, SYS_migrate_pages, SYS_move_pages,
                 SYS_get_robust_list}) {
    b.AllowOnly(nr, {{0, me}});
  }
  b.AllowOnly(SYS_setpriority, {{0, {kPrioProcess}}, {1, me}});
  b.AllowOnly(SYS_ioprio_set, {{0, {kIoprioWhoProcess}}, {1, me}});
  // Signals only to this process (abort() and raise() use tgkill on
  // themselves; sigqueue and pthread_sigqueue pass this pid too).
  for (int nr : {SYS_tgkill, SYS_rt_sigqueueinfo, SYS_rt_tgsigqueueinfo}) {
    b.AllowOnly(nr, {{0, {self}}});
  }
  b.Add(BPF_STMT(BPF_RET | BPF_K, Bpf::kAllow));
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

// Writes `text` to the /proc file `path` (uid_map and friends).
absl::Status WriteProcFile(const char* path, const std::string& text) {
  const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return Errno(path);
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const int err = errno;
  ::close(fd);
  if (!ok) {
    errno = err;
    return Errno(path);
  }
  return absl::OkStatus();
}

// The capabilities a user namespace gave: none left (but
// CAP_DAC_READ_SEARCH with `keep_read_search`, which there reaches only
// files of the ids the namespace maps), none to regain.
absl::Status DropUserNamespaceCapabilities(bool keep_read_search) {
  for (int cap = 0; cap <= 63; ++cap) {
    if (!(keep_read_search && cap == CAP_DAC_READ_SEARCH)) ::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
  }
  ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (keep_read_search) {
    data[CAP_TO_INDEX(CAP_DAC_READ_SEARCH)].effective = CAP_TO_MASK(CAP_DAC_READ_SEARCH);
    data[CAP_TO_INDEX(CAP_DAC_READ_SEARCH)].permitted = CAP_TO_MASK(CAP_DAC_READ_SEARCH);
  }
  if (::syscall(SYS_capset, &header, data) != 0) return Errno("capset");
  return absl::OkStatus();
}

absl::Status EnterPrivateNamespaces(const Policy& p) {
  const int common = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS;
  // The host's root (not the root of a user namespace the spawner made).
  const bool root = ::geteuid() == 0 && !p.user_namespace_root;
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  if (root || p.user_namespace_root) {
    if (::unshare(common) != 0) return Errno("unshare");
  } else {
    // Not root: a user namespace of its own first (unprivileged), in which
    // it keeps its own uid and gid (mapped to themselves) and holds the
    // capabilities that the other namespaces and the mount need; they are
    // all dropped below, once the mounts are done.
    if (::unshare(CLONE_NEWUSER | common) != 0) return Errno("unshare");
    if (auto s = WriteProcFile("/proc/self/setgroups", "deny"); !s.ok()) return s;
    if (auto s = WriteProcFile("/proc/self/uid_map", absl::StrCat(uid, " ", uid, " 1")); !s.ok()) {
      return s;
    }
    if (auto s = WriteProcFile("/proc/self/gid_map", absl::StrCat(gid, " ", gid, " 1")); !s.ok()) {
      return s;
    }
  }
  // Nothing mounted here reaches the host, and nothing the host mounts
  // later reaches here.
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return Errno("mount propagation");
  }
  if (!p.scratch_dir.empty() && p.scratch_bytes != 0 && ::access(p.scratch_dir.c_str(), F_OK) == 0) {
    const int64_t owner = root && p.uid >= 0 ? p.uid : uid;
    const int64_t group = root && p.uid >= 0 ? (p.gid >= 0 ? p.gid : p.uid) : gid;
    const std::string data = absl::StrCat("size=", p.scratch_bytes,
                                          ",nr_inodes=4096,mode=0700,uid=", owner, ",gid=", group);
    if (::mount("opjit-scratch", p.scratch_dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV,
                data.c_str()) != 0) {
      return Errno("scratch tmpfs");
    }
  }
  if (!root) return DropUserNamespaceCapabilities(p.user_namespace_root && p.keep_read_search);
  return absl::OkStatus();
}

// keep_read_search, in two steps around the uid switch. Before it (root,
// every capability effective): the bounding set loses every capability but
// CAP_DAC_READ_SEARCH, and PR_SET_KEEPCAPS keeps the permitted set across
// setresuid. After it: KEEPCAPS off again, no ambient capability, and
// CAP_DAC_READ_SEARCH alone effective and permitted (and, `across_exec`,
// inheritable and ambient, for what the process execs), or
// no capability at all where the permitted set lacked it (a root without
// it, e.g. in a container: nothing to keep).
absl::Status KeepReadSearchOnly(bool before_uid, bool across_exec = false) {
  if (before_uid) {
    // PR_CAPBSET_READ fails (EINVAL) past the kernel's last capability.
    for (int cap = 0; ::prctl(PR_CAPBSET_READ, cap, 0, 0, 0) >= 0; ++cap) {
      if (cap != CAP_DAC_READ_SEARCH && ::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
        return Errno(absl::StrCat("dropping capability ", cap, " from the bounding set"));
      }
    }
    if (::prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0) return Errno("PR_SET_KEEPCAPS");
    return absl::OkStatus();
  }
  if (::prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0) != 0) return Errno("PR_SET_KEEPCAPS");
  if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0) {
    return Errno("clearing the ambient capabilities");
  }
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return Errno("capget");
  const uint32_t index = CAP_TO_INDEX(CAP_DAC_READ_SEARCH), mask = CAP_TO_MASK(CAP_DAC_READ_SEARCH);
  const uint32_t kept = data[index].permitted & mask;
  for (auto& d : data) d = {};
  data[index].effective = data[index].permitted = kept;
  // A process that execs (nvcc, under the GPU sandbox) passes it on as an
  // ambient capability: inheritable too, then raised.
  if (across_exec) data[index].inheritable = kept;
  if (::syscall(SYS_capset, &header, data) != 0) return Errno("capset CAP_DAC_READ_SEARCH");
  if (across_exec && kept != 0 &&
      ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0) != 0) {
    return Errno("raising the ambient CAP_DAC_READ_SEARCH");
  }
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
  if (p.private_namespaces) {
    if (auto s = EnterPrivateNamespaces(p); !s.ok()) return s;
  } else if (p.user_namespace_root) {
    if (auto s = DropUserNamespaceCapabilities(p.keep_read_search); !s.ok()) return s;
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
  if (auto s = SetLimit(RLIMIT_FSIZE, p.file_size_bytes, "RLIMIT_FSIZE"); !s.ok()) return s;
  if (auto s = SetLimit(RLIMIT_NPROC, p.max_processes, "RLIMIT_NPROC"); !s.ok()) return s;
  ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  if (::geteuid() == 0 && !p.user_namespace_root && p.uid >= 0) {
    const gid_t gid = static_cast<gid_t>(p.gid >= 0 ? p.gid : p.uid);
    // While still root: the bounding set down to CAP_DAC_READ_SEARCH, and
    // the permitted set kept across setresuid (which clears the effective).
    if (p.keep_read_search) {
      if (auto s = KeepReadSearchOnly(/*before_uid=*/true); !s.ok()) return s;
    }
    if (::setgroups(0, nullptr) != 0) return Errno("setgroups");
    if (::setresgid(gid, gid, gid) != 0) return Errno("setresgid");
    if (::setresuid(static_cast<uid_t>(p.uid), static_cast<uid_t>(p.uid),
                    static_cast<uid_t>(p.uid)) != 0) {
      return Errno("setresuid");
    }
    if (p.keep_read_search) {
      if (auto s = KeepReadSearchOnly(/*before_uid=*/false, p.allow_exec); !s.ok()) return s;
    }
  }
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return Errno("no_new_privs");
  if (auto s = ApplyLandlock(p); !s.ok()) return s;
  return InstallSeccomp(p);
}

absl::Status DenyFilesToThisThread() {
  const int abi = LandlockAbi();
  if (abi <= 0) return absl::FailedPreconditionError("sandbox: this kernel has no Landlock");
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return Errno("no_new_privs");
  RulesetAttr attr{};
  attr.handled_access_fs = FsRights(abi);
  // File rights only (the first field): no rule follows, so nothing is allowed.
  int ruleset = static_cast<int>(::syscall(SYS_landlock_create_ruleset, &attr,
                                           sizeof(uint64_t), 0));
  if (ruleset < 0) return Errno("landlock ruleset");
  absl::Status s;
  if (::syscall(SYS_landlock_restrict_self, ruleset, 0) != 0) s = Errno("landlock_restrict_self");
  ::close(ruleset);
  return s;
}

absl::Status ApplySystemCallFilter(const Policy& p) {
  if (CountThreads() != 1) {
    return absl::FailedPreconditionError("sandbox: apply it while the process has one thread");
  }
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return Errno("no_new_privs");
  return InstallSeccomp(p);
}

}  // namespace opjit::sandbox

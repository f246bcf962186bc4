// Locking a process in: rlimits, an unprivileged uid, no_new_privs,
// Landlock (file-system access) and seccomp (system calls).
//
// Used by every process that runs or compiles strangers' code: the
// executor workers (server/runner) and the compile workers. Apply() is
// one-way: nothing can lift the rules afterwards, in this process or in
// anything it starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace opjit::sandbox {

struct Policy {
  // Landlock file-system rules. Everything not listed is inaccessible (open
  // fails with EACCES). Paths that do not exist are skipped. Files or
  // directories.
  std::vector<std::string> read_only_paths;   // read, list, map executable
  std::vector<std::string> read_write_paths;  // directories: full access beneath
  std::vector<std::string> device_paths;      // existing files opened read-write, no create
  // Fail (FAILED_PRECONDITION) if the kernel has no Landlock.
  bool require_landlock = true;
  // seccomp. Threads (clone with CLONE_THREAD) are always allowed. Calls
  // aimed at another process are always refused with EPERM (see
  // ApplySystemCallFilter).
  bool allow_exec = false;       // execve, execveat
  bool allow_processes = false;  // fork, vfork, clone without CLONE_THREAD
  // rlimits; 0 = leave unchanged.
  // Neither of the next two is applied in a sanitizer build (OPJIT_SANITIZED):
  // ASan's shadow memory cannot live under them.
  uint64_t address_space_bytes = 0;  // RLIMIT_AS
  uint64_t data_bytes = 0;           // RLIMIT_DATA (malloc and private memory, not shm)
  uint64_t cpu_seconds = 0;          // RLIMIT_CPU
  uint64_t max_open_files = 0;       // RLIMIT_NOFILE
  uint64_t file_size_bytes = 0;      // RLIMIT_FSIZE (ignore SIGXFSZ to get EFBIG)
  // RLIMIT_NPROC: processes and threads of the uid the process switches to
  // (the kernel counts them per real uid, at each clone, and not for root),
  // so it caps everything that runs as that uid together.
  uint64_t max_processes = 0;
  // Namespaces, first of all: new mount, IPC, network and UTS namespaces.
  // Not root: inside a new user namespace (unprivileged; the process keeps
  // its uid and gid, mapped to themselves, and every capability the user
  // namespace gave it is dropped once the mounts are done).
  // subprocess::PrivateNamespaces() says whether this works here. No network interface but a
  // loopback that is down, no System V IPC or message queue of anyone
  // else's, mounts of its own. (A PID namespace is the spawner's part:
  // subprocess::SpawnOptions::new_pid_namespace.)
  bool private_namespaces = false;
  // The process is uid 0 of a user namespace its spawner made
  // (subprocess::SpawnOptions::user_namespace: a daemon without root), and
  // so holds every capability there. With private_namespaces, the other
  // namespaces are made in that one (no new user namespace), and every
  // capability is dropped once the mounts are done, as for a non-root
  // process. The uid switch (uid, gid) is skipped: the spawner chose the ids.
  bool user_namespace_root = false;
  // With private_namespaces and a non-empty existing scratch_dir: a tmpfs
  // of at most scratch_bytes is mounted over it, owned by uid/gid, mode
  // 0700, nosuid and nodev (e.g. over /dev/shm). Only this process sees it (it
  // hides the host's directory; nothing reaches the host), a write past its
  // size fails with ENOSPC, and it is gone with the process. Add it to read_write_paths to let the process use it.
  std::string scratch_dir;
  uint64_t scratch_bytes = 0;
  // Memory that no rlimit counts: memfd_create, System V shared memory
  // (shmget) and shared anonymous mappings (mmap MAP_SHARED|MAP_ANONYMOUS)
  // fail with EPERM, so RLIMIT_DATA bounds what the process can hold, with
  // the scratch tmpfs. (POSIX shm lives in /dev/shm, which Landlock shuts.)
  bool refuse_shared_memory = false;
  // When running as root, switch to this uid/gid (and no supplementary
  // groups) before no_new_privs. -1: keep.
  int64_t uid = -1, gid = -1;
  // With uid, when running as root: keep CAP_DAC_READ_SEARCH across the
  // switch, and no other capability (effective and permitted; the bounding
  // set, the inheritable and ambient sets lose the rest too), so that the
  // process still reads files and searches directories its new uid could
  // not (the operator's 0700 include directories) while Landlock still
  // limits it to the paths above. The filter refuses open_by_handle_at
  // (which, with this capability, opens any file of a mounted file system
  // by a handle, past Landlock) and name_to_handle_at, as for every
  // policy. A root process whose permitted set lacks CAP_DAC_READ_SEARCH
  // (a container's) keeps no capability. Ignored when not root or without
  // uid (the compile workers). With user_namespace_root: CAP_DAC_READ_SEARCH
  // is the one capability kept in that namespace, where it reaches only
  // files of the ids it maps (a non-root daemon's compile workers, whose
  // namespace maps the daemon's ids too). With allow_exec (the GPU
  // sandbox's nvcc), it is also inheritable and ambient, so the programs the
  // process execs keep it, and nothing else.
  bool keep_read_search = false;
};

// The Landlock ABI version the running kernel offers (0: none).
int LandlockAbi();

// Applies `policy` to the calling process, irreversibly, in this order:
// namespaces and the scratch tmpfs, RLIMIT_CORE = 0 and the rlimits, not dumpable, uid/gid
// (and the capabilities, see keep_read_search), no_new_privs,
// Landlock, seccomp (synchronised to all threads). Landlock binds only the
// calling thread and its future children, so call it while the process has
// one thread: FAILED_PRECONDITION otherwise. Other errors: INTERNAL naming
// the step that failed.
absl::Status Apply(const Policy& policy);

// Locks the calling thread (and threads it starts later) out of the whole
// file system with a Landlock domain of its own that allows nothing: no file
// or directory can be opened, created, executed or listed from it (what was
// open stays usable). Irreversible for that thread; other threads are
// unaffected. Sets the thread's no_new_privs first. For work on hostile input
// that needs no file (the compile worker's code generation, where the
// integrated assembler would open `.incbin` and `.include` files itself).
// FAILED_PRECONDITION without Landlock; INTERNAL when a step fails.
absl::Status DenyFilesToThisThread();

// The seccomp step of Apply() alone (with no_new_privs, which it needs), for
// tests of the filter without the Landlock domain (whose signal scope, on
// kernels that have it, refuses signals to outside processes too). The
// filter refuses with EPERM (never kills, so a kernel sees an error):
//  - sockets, mounts, namespaces, keys, modules, bpf, perf_event_open,
//    io_uring, userfaultfd, file handles, setpgid, setsid; execve and
//    execveat unless allow_exec; fork, vfork and clone without CLONE_THREAD
//    unless allow_processes (clone3: ENOSYS, so that glibc uses clone);
//  - everything aimed at another process: ptrace, process_vm_readv/writev,
//    process_madvise, process_mrelease, kcmp, kill, tkill, pidfd_open,
//    pidfd_send_signal, pidfd_getfd outright; tgkill, rt_sigqueueinfo and
//    rt_tgsigqueueinfo unless aimed at this process's pid; prlimit64,
//    sched_setaffinity, sched_setscheduler, sched_setparam, sched_setattr,
//    migrate_pages, move_pages and get_robust_list unless their pid is 0 or
//    this process's pid; setpriority unless PRIO_PROCESS of 0 or this pid;
//    ioprio_set unless IOPRIO_WHO_PROCESS of 0 or this pid; fcntl F_SETOWN
//    unless to 0 or this pid, F_SETOWN_EX, and ioctl FIOSETOWN/SIOCSPGRP
//    (a file's owner receives its signals).
// "This process's pid" is getpid() when the filter is installed, with one
// thread. A thread started later names itself by 0 (its tid is refused:
// seccomp cannot tell it from another process's pid); so does a child.
// Getters (getpriority, sched_getaffinity, ...) stay allowed.
absl::Status ApplySystemCallFilter(const Policy& policy);

}  // namespace opjit::sandbox

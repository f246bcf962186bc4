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
  // seccomp. Threads (clone with CLONE_THREAD) are always allowed.
  bool allow_exec = false;       // execve, execveat
  bool allow_processes = false;  // fork, vfork, clone without CLONE_THREAD
  // rlimits; 0 = leave unchanged.
  // Neither of the next two is applied in a sanitizer build (OPJIT_SANITIZED):
  // ASan's shadow memory cannot live under them.
  uint64_t address_space_bytes = 0;  // RLIMIT_AS
  uint64_t data_bytes = 0;           // RLIMIT_DATA (malloc and private memory, not shm)
  uint64_t cpu_seconds = 0;          // RLIMIT_CPU
  uint64_t max_open_files = 0;       // RLIMIT_NOFILE
  // When running as root, switch to this uid/gid (and no supplementary
  // groups) before no_new_privs. -1: keep.
  int64_t uid = -1, gid = -1;
};

// The Landlock ABI version the running kernel offers (0: none).
int LandlockAbi();

// Applies `policy` to the calling process, irreversibly, in this order:
// RLIMIT_CORE = 0 and the rlimits, not dumpable, uid/gid, no_new_privs,
// Landlock, seccomp (synchronised to all threads). Landlock binds only the
// calling thread and its future children, so call it while the process has
// one thread: FAILED_PRECONDITION otherwise. Other errors: INTERNAL naming
// the step that failed.
absl::Status Apply(const Policy& policy);

}  // namespace opjit::sandbox

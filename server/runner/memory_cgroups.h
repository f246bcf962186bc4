// One memory cap per opjit namespace over all of its executors, through
// cgroups: what they hold together (heap, the scratch tmpfs, page cache,
// kernel memory) stays under `[exec] namespace_memory_mb`, where one
// executor's RLIMIT_DATA bounds only itself.
//
// Where the daemon may create cgroups:
//  - cgroup v2 (production: the systemd unit has Delegate=yes): its own
//    cgroup must be writable and offer the memory controller. The daemon
//    moves itself into a leaf "<own>/opjitd" (a cgroup with children holds
//    no process), enables +memory for the children, and puts each
//    namespace's executors in "<own>/ns-<hash>" with memory.max (and
//    memory.swap.max = 0).
//  - cgroup v1 (a root daemon on a hybrid host, like the development
//    machines): "<memory hierarchy>/<own>/opjit-<instance tag>/ns-<hash>"
//    with memory.limit_in_bytes.
//  - neither: Open() returns null and the daemon logs what that means
//    (per-executor limits only).
//
// An executor is moved into its namespace's cgroup right after it starts,
// before it says hello (before any user code runs). The cgroups are
// removed when the object goes, and a restart on the same state dir
// removes those a killed predecessor left.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "server/common/mutex.h"

namespace opjit::runner {

class MemoryCgroups {
 public:
  // `tag` names this daemon's cgroups (its instance tag); `bytes` is each
  // namespace's cap. Null when no hierarchy is writable here.
  static std::unique_ptr<MemoryCgroups> Open(const std::string& tag, uint64_t bytes);
  ~MemoryCgroups();

  // Moves `pid` into `ns`'s cgroup (created on first use with the cap).
  // INTERNAL, naming the step, on failure (the caller stops the executor).
  absl::Status Place(const std::string& ns, pid_t pid);

  // How many times the kernel's OOM killer acted in `ns`'s cgroup so far
  // (0 when unknown): a rise says an executor's SIGKILL was the cap's.
  uint64_t OomKills(const std::string& ns);

  // "cgroup2" or "cgroup1", and the directory holding the namespaces'.
  const std::string& mode() const { return mode_; }
  const std::string& dir() const { return dir_; }
  uint64_t bytes() const { return bytes_; }

  // cgroup v2 with the pids controller delegated too: each namespace's
  // cgroup also gets pids.max = `tasks` (threads and processes of all its
  // executors together: what RLIMIT_NPROC of a namespace's own uid gives a
  // root daemon, which a non-root daemon's user namespaces cannot). Call
  // before the first Place. Returns whether it will be applied.
  bool CapTasks(uint64_t tasks);

 private:
  MemoryCgroups(std::string mode, std::string dir, uint64_t bytes)
      : mode_(std::move(mode)), dir_(std::move(dir)), bytes_(bytes) {}
  std::string PathOf(const std::string& ns) const;

  const std::string mode_, dir_;
  const uint64_t bytes_;
  Mutex mu_;
  uint64_t tasks_ ABSL_GUARDED_BY(mu_) = 0;  // pids.max per namespace (cgroup v2 only); 0: none
  std::map<std::string, std::string> made_ ABSL_GUARDED_BY(mu_);  // ns -> cgroup dir
};

}  // namespace opjit::runner

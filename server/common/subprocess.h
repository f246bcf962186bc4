// One way to start, watch and end a child process.
//
// Every child of opjitd (executors, compile workers, the GPU sandboxes, the
// health probes) is started with Spawn() and ended with Wait()/Reap():
//  - an explicit descriptor map: the child gets exactly the descriptors
//    listed (0, 1 and 2 default to /dev/null), nothing else of the daemon's,
//    CLOEXEC or not;
//  - an explicit environment: nothing of the daemon's is inherited unless
//    the caller lists it;
//  - its own process group, an empty signal mask and default dispositions;
//  - started from one long-lived thread of the process (SpawnThread), so a
//    child's PR_SET_PDEATHSIG means "the daemon died" and not "the thread
//    that happened to start it exited".
//
// Parent death. Linux clears a child's parent-death signal when the child
// changes its credentials (the executor drops to [exec] worker_user), so a
// helper sets it itself, after any uid change: DieWithParent(). Loops that
// wait for the daemon also check that it is still their parent
// (ParentIs()).
//
// Restarts. A helper started with `tag_instance` carries
// "--instance <tag>" (SetInstanceTag: derived from the state dir) on its
// command line. A daemon starting on a state dir ends whatever its killed
// predecessor left there (EndLeftovers), and nothing of another state dir.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace opjit::subprocess {

// As a FdMapping's parent_fd: the child gets /dev/null (read and write).
inline constexpr int kDevNull = -1;

// Descriptor `child_fd` of the child is the parent's `parent_fd`.
struct FdMapping {
  int child_fd = -1;
  int parent_fd = kDevNull;
};

struct SpawnOptions {
  // The program, by path; no PATH search. Required.
  std::string path;
  // Its arguments after argv[0] (which is `path`).
  std::vector<std::string> args;
  // Its whole environment, "NAME=value" each. Nothing of the daemon's
  // environment is inherited unless listed here (see FromEnvironment).
  // Default: empty.
  std::vector<std::string> env;
  // Its descriptors. 0, 1 and 2 not listed are /dev/null; every descriptor
  // not listed above 2 is closed. A parent fd may be listed more than once.
  std::vector<FdMapping> fds;
  // Its own process group (pgid = pid): a signal to the daemon's group
  // spares it, and a kill of its group ends what it started. Default: true.
  bool own_process_group = true;
  // Start it with "--instance <InstanceTag()>" before `args`, so a restart
  // on this state dir can find it (EndLeftovers). Only for opjit's helper
  // programs, which accept that flag. No-op while no tag is set.
  // Default: false.
  bool tag_instance = false;
  // Start it as process 1 of a new PID namespace: it sees (and can signal)
  // no process of the host, and everything it starts dies with it. Needs
  // CAP_SYS_ADMIN (a root daemon): where PidNamespaces() is false the child
  // starts in the daemon's PID namespace instead, and the caller says so
  // (it logs a warning once; see PidNamespaces()). As process 1 a child
  // cannot die of a signal it raises itself (abort()): it calls ActAsInit()
  // at start, and Wait() and Reap() report its abort as SIGABRT.
  bool new_pid_namespace = false;
  // Start it as uid 0 of a new user namespace, and as process 1 of a PID
  // namespace that namespace owns: what a daemon without root uses for the
  // walls `new_pid_namespace` gives a root one. Its uid 0 and gid 0 stand
  // for `uid` and `gid` on the host: the daemon's own ids are mapped
  // directly; any other (a subordinate id of the daemon's user, from
  // /etc/subuid and /etc/subgid) through newuidmap and newgidmap, which
  // check that the user owns it. The child holds every capability inside
  // its user namespace and none outside; it must drop them once its mounts
  // are made (sandbox::Policy::user_namespace_root). Overrides
  // new_pid_namespace. Where UserNamespaces() is false, Spawn fails.
  struct UserNamespace {
    uint32_t uid = 0, gid = 0;
    // Also map the daemon's own uid and gid, as 1 inside: a capability the
    // child keeps there (CAP_DAC_READ_SEARCH) then reaches the daemon's
    // files, which it could not as `uid` alone.
    bool map_own_ids = false;
  };
  std::optional<UserNamespace> user_namespace;
};

// Whether Spawn(new_pid_namespace) can start children in PID namespaces of
// their own (probed once: root, and a kernel that allows it), and the
// operator has not turned them off (AllowNamespaces(false)).
bool PidNamespaces();
// Whether a helper can enter mount, IPC, network and UTS namespaces of its
// own (sandbox::Policy::private_namespaces): as root, or through an
// unprivileged user namespace (probed once, in a short-lived child), and
// the operator has not turned them off.
bool PrivateNamespaces();
// The operator's choice (exec.namespaces); call it at startup. Default: true.
void AllowNamespaces(bool allowed);
// Whether Spawn(user_namespace) works here with the daemon's own ids
// (probed once: a kernel that lets this user make user and PID namespaces),
// and the operator has not turned namespaces off.
bool UserNamespaces();

// For a helper that takes "--isolate 1" and "--userns 1" (compile workers,
// NVRTC sandboxes): namespaces of its own where the daemon can make them.
// Root: a PID namespace (new_pid_namespace), the rest its own. Not root:
// user and PID namespaces from the spawn (user_namespace: `as`, with the
// daemon's own ids mapped too, or else the daemon's own ids), the rest its
// own. Neither: nothing (the daemon warned at start).
void IsolateHelper(SpawnOptions* spawn,
                   std::optional<SpawnOptions::UserNamespace> as = std::nullopt);

// The ids IsolateHelper takes for a daemon that is not root: `uid` and
// `gid` (-1: uid's number) when uid > 0, else none (the daemon's own).
std::optional<SpawnOptions::UserNamespace> CompileIds(int64_t uid, int64_t gid);

// For a compile helper that takes "--uid N" (CPU compile workers, NVRTC
// workers): IsolateHelper as CompileIds(uid, gid), and, when the daemon is
// root and uid > 0, "--uid <uid>": the helper drops to the compile uid,
// never runs as root's.
void IsolateCompileHelper(SpawnOptions* spawn, int64_t uid, int64_t gid);

// A compile helper started on a new socketpair: the daemon's end and the
// helper's pid.
struct HelperChannel {
  pid_t pid = -1;
  int fd = -1;  // CLOEXEC; the caller closes it
};

// Starts `spawn` (its path, args and fds; the environment, the instance
// tag and IsolateCompileHelper(uid, gid) are set here) with the other end of
// a new socketpair as each of its descriptors `socket_fds`. UNAVAILABLE when
// the socketpair or the spawn fails (Spawn's message).
absl::StatusOr<HelperChannel> SpawnCompileHelper(SpawnOptions spawn,
                                                 const std::vector<int>& socket_fds, int64_t uid,
                                                 int64_t gid);

// Starts a child; returns its pid. The caller reaps it (Wait, Reap).
// INVALID_ARGUMENT for a bad fd map or an empty path, UNAVAILABLE when the
// program cannot be started (its errno in the message, never the path).
absl::StatusOr<pid_t> Spawn(const SpawnOptions& options);

// "NAME=value" for each of `names` set in this process's environment.
std::vector<std::string> FromEnvironment(const std::vector<std::string>& names);

// The environment opjit's helpers get: PATH=/usr/bin:/bin, plus the
// sanitizer settings (ASAN_OPTIONS, UBSAN_OPTIONS, LSAN_OPTIONS) where set,
// so a sanitizer build's helpers run as its tests ask.
std::vector<std::string> HelperEnvironment();

// How a child ended.
struct Exit {
  int wait_status = 0;     // as from wait4
  struct rusage usage {};  // the child's, as from wait4
  bool killed = false;     // Reap() sent it SIGKILL

  bool exited() const;     // it called exit (code() is valid)
  int code() const;        // its exit code; -1 if it did not exit
  int signal() const;      // the signal that ended it; 0 if it exited
  uint64_t peak_rss_bytes() const;
  std::string Describe() const;
};

// "SIGSEGV", or "signal 77" for a number without a name.
std::string SignalName(int sig);

// The one description of an exit, for users and logs, to follow "the
// process": "exited with status 3", "was killed by SIGSEGV (signal 11)",
// "was killed by SIGABRT (signal 6) and dumped core".
std::string DescribeExit(int wait_status);

// Waits for `pid` to end (EINTR-safe). INTERNAL if it is not our child.
absl::StatusOr<Exit> Wait(pid_t pid);

// Waits up to `timeout` for `pid` to end; nullopt if it still runs then.
// INTERNAL if it is not our child.
absl::StatusOr<std::optional<Exit>> WaitFor(pid_t pid, absl::Duration timeout);

// Ends `pid` and reaps it: it gets `grace` to exit by itself (none: it is
// killed unless it has already ended), then SIGKILL (its whole process group
// with `kill_group`: sent before the reap, while the group cannot have been
// reused). Exit::killed says whether SIGKILL was sent. INTERNAL if it is not
// our child.
absl::StatusOr<Exit> Reap(pid_t pid, absl::Duration grace = absl::ZeroDuration(),
                          bool kill_group = false);

// The address space of `pid` (what RLIMIT_AS bounds), from /proc; 0 when
// unknown.
uint64_t AddressSpaceBytes(pid_t pid);

// --- parent death, in a helper --------------------------------------------

// The flag a helper reads its expected parent from, and the instance flag.
inline constexpr char kParentPidFlag[] = "--parent-pid";
inline constexpr char kInstanceFlag[] = "--instance";

// In a helper: asks for SIGKILL when the parent dies, then checks that the
// parent is still `expected_parent` (0: skip the check). Call it after every
// credential change (setuid clears the setting). Returns false when the
// parent is already gone: the helper exits at once.
bool DieWithParent(pid_t expected_parent);

// In a helper's waiting loop: false once `expected_parent` (0: any) is no
// longer the parent, i.e. the daemon died.
bool ParentIs(pid_t expected_parent);

// In a helper started with new_pid_namespace, first thing: when it is
// process 1 of its namespace, an abort() (whose SIGABRT the kernel does not
// deliver to a namespace's process 1) ends it with kInitAbortExit, which
// Wait() and Reap() report as death by SIGABRT. No-op elsewhere.
inline constexpr int kInitAbortExit = 128 + SIGABRT;
void ActAsInit();

// In a helper: `fd` is a connection to the parent (a socket the parent
// holds until it reaps the helper). Process 1 of a PID namespace cannot see
// its parent (getppid() is 0), so DieWithParent() and ParentIs() look at
// this link instead: a hung-up link means the parent is gone.
void SetParentLink(int fd);

// --- instances and leftovers ------------------------------------------------

// Sets the tag that Spawn(tag_instance) puts on helpers: letters, digits,
// '-' or '_' only (anything else is dropped). Call once, at startup, before
// any helper starts.
void SetInstanceTag(const std::string& tag);
std::string InstanceTag();

// Sends SIGKILL to every process that carries "--instance `tag`" on its
// command line, whose program (argv[0]) is named one of `program_names`
// (base names), and whose parent is not this process; returns how many.
// Call it while holding the state dir's lock, so no live daemon of this tag
// exists. Processes of other tags are never touched.
int EndLeftovers(const std::string& tag, const std::vector<std::string>& program_names);

}  // namespace opjit::subprocess

#include "server/common/subprocess.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sched.h>
#include <linux/close_range.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"
#include "server/common/paths.h"

namespace opjit::subprocess {
namespace {

using Clock = std::chrono::steady_clock;

// Debian's uidmap package: the set-uid tools that map subordinate ids.
constexpr char kNewUidMap[] = "/usr/bin/newuidmap";
constexpr char kNewGidMap[] = "/usr/bin/newgidmap";

// strerror() is not thread-safe; this is.
std::string ErrnoText(int err) {
  char buf[128];
  return ::strerror_r(err, buf, sizeof(buf));  // GNU strerror_r: returns the text
}

// One long-lived thread that starts every child. PR_SET_PDEATHSIG is tied
// to the *thread* that created a child, not its process: a child started
// from a short-lived thread (a gRPC or pool thread that later exits) would
// be killed with that thread. This thread lives as long as the process, so
// a child's parent-death signal means "the daemon died".
class SpawnThread {
 public:
  SpawnThread() : thread_([this] { Loop(); }) { thread_.detach(); }

  // Runs `fn` on the spawning thread and returns its result.
  int Call(std::function<int()> fn) {
    std::packaged_task<int()> task(std::move(fn));
    std::future<int> result = task.get_future();
    {
      MutexLock lock(&mu_);
      queue_.push_back([&task] { task(); });
    }
    cv_.Signal();
    return result.get();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> job;
      {
        MutexLock lock(&mu_);
        while (queue_.empty()) cv_.Wait(&mu_);
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;                        // last: starts after the rest exists
};

// The process's spawn thread, created on first use and never destroyed (it
// must outlive every child). A forked copy of this process (tests do that)
// gets its own.
SpawnThread& TheSpawnThread() {
  static Mutex mu;
  static SpawnThread* thread ABSL_GUARDED_BY(mu) = nullptr;
  static pid_t owner ABSL_GUARDED_BY(mu) = 0;
  MutexLock lock(&mu);
  if (thread == nullptr || owner != ::getpid()) {
    thread = new SpawnThread();  // never freed, on purpose
    owner = ::getpid();
  }
  return *thread;
}

std::atomic<int> g_parent_link{-1};
std::atomic<bool> g_namespaces_allowed{true};

// Children started as process 1 of a PID namespace (their abort() exits
// with kInitAbortExit; Wait reports SIGABRT).
Mutex g_init_mu;
std::set<pid_t>* g_init_pids ABSL_GUARDED_BY(g_init_mu) = nullptr;  // never freed

void NoteInit(pid_t pid) {
  MutexLock lock(&g_init_mu);
  if (g_init_pids == nullptr) g_init_pids = new std::set<pid_t>();
  g_init_pids->insert(pid);
}

// `e` is how `pid` ended: an init's abort exit becomes death by SIGABRT.
void Reaped(pid_t pid, int* wait_status) {
  MutexLock lock(&g_init_mu);
  if (g_init_pids == nullptr || g_init_pids->erase(pid) == 0) return;
  if (WIFEXITED(*wait_status) && WEXITSTATUS(*wait_status) == kInitAbortExit) *wait_status = SIGABRT;
}

Mutex g_tag_mu;
std::string* g_tag ABSL_GUARDED_BY(g_tag_mu) = nullptr;  // never freed

// The parent pid in /proc/<pid>/stat, or -1.
pid_t ParentOf(const std::string& pid) {
  const std::string stat = ReadSmallFile("/proc/" + pid + "/stat");
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 4 > stat.size()) return -1;
  // ") S 123 ..."
  const char* p = stat.c_str() + close + 2;
  while (*p != '\0' && *p != ' ') ++p;
  return static_cast<pid_t>(std::strtol(p, nullptr, 10));
}

}  // namespace

namespace {

// Reads what `fd` gives until EOF (at most 4 KiB kept).
std::string ReadAll(int fd) {
  std::string out;
  char buf[512];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (out.size() < 4096) out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Waits for a child started here outside Spawn (EINTR-safe).
int WaitStatus(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// Makes id 0 of `pid`'s user namespace stand for `outer` ("uid_map" or
// "gid_map"). A daemon maps its own ids, or any as root, by writing the
// file; any other id goes through newuidmap or newgidmap, which check
// /etc/subuid or /etc/subgid. Empty on success, else why not.
std::string MapId(pid_t pid, bool uid, uint32_t outer, bool map_own) {
  const uint32_t self = uid ? ::geteuid() : ::getegid();
  const bool own = outer == self;
  map_own = map_own && !own;  // (then it is mapped as 0 already)
  if (own || ::geteuid() == 0) {
    const std::string dir = absl::StrCat("/proc/", pid, "/");
    if (!uid && ::geteuid() != 0) {
      // Without CAP_SETGID a gid map needs setgroups denied first.
      const int fd = ::open((dir + "setgroups").c_str(), O_WRONLY | O_CLOEXEC);
      const bool ok = fd >= 0 && ::write(fd, "deny", 4) == 4;
      const int err = errno;
      if (fd >= 0) ::close(fd);
      if (!ok) return "setgroups: " + ErrnoText(err);
    }
    const std::string line =
        absl::StrCat("0 ", outer, " 1", map_own ? absl::StrCat("\n1 ", self, " 1") : "");
    const int fd = ::open((dir + (uid ? "uid_map" : "gid_map")).c_str(), O_WRONLY | O_CLOEXEC);
    const bool ok = fd >= 0 && ::write(fd, line.data(), line.size()) ==
                                   static_cast<ssize_t>(line.size());
    const int err = errno;
    if (fd >= 0) ::close(fd);
    return ok ? "" : absl::StrCat(uid ? "uid_map: " : "gid_map: ", ErrnoText(err));
  }
  const char* tool = uid ? kNewUidMap : kNewGidMap;
  const std::string target = std::to_string(pid), id = std::to_string(outer);
  std::vector<std::string> args = {tool, target, "0", id, "1"};
  if (map_own) args.insert(args.end(), {"1", std::to_string(self), "1"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  char env_path[] = "PATH=/usr/bin:/bin";
  char* envp[] = {env_path, nullptr};
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return "pipe: " + ErrnoText(errno);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_adddup2(&fa, out[1], 2);
  posix_spawn_file_actions_addclosefrom_np(&fa, 3);
  pid_t tool_pid = -1;
  const int err = ::posix_spawn(&tool_pid, tool, &fa, nullptr, argv.data(), envp);
  posix_spawn_file_actions_destroy(&fa);
  ::close(out[1]);
  if (err != 0) {
    ::close(out[0]);
    return absl::StrCat(uid ? "newuidmap" : "newgidmap", " cannot start: ", ErrnoText(err));
  }
  std::string said = ReadAll(out[0]);
  ::close(out[0]);
  const int status = WaitStatus(tool_pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  while (!said.empty() && (said.back() == '\n' || said.back() == ' ')) said.pop_back();
  return absl::StrCat(uid ? "newuidmap" : "newgidmap", " ", DescribeExit(status),
                      said.empty() ? "" : ": ", said);
}

// The child half of SpawnInUserNamespace, between clone and exec: only
// system calls (the daemon has other threads, whose locks it shares).
[[noreturn]] void UserNamespaceChild(const SpawnOptions& o, const std::vector<int>& sources,
                                     const std::set<int>& targets, int max_child, int go_fd,
                                     int err_fd, char* const* argv, char* const* envp) {
  auto fail = [err_fd](int step) {
    const int report[2] = {step, errno};
    (void)!::write(err_fd, report, sizeof(report));
    ::_exit(127);
  };
  char go = 0;
  while (::read(go_fd, &go, 1) < 0 && errno == EINTR) {
  }
  if (go != 'g') ::_exit(127);  // the daemon gave up on it
  // Become the namespace's uid 0 and gid 0 (the mapped ids): directly, as
  // the raw calls (glibc's wrappers would signal the daemon's threads,
  // which this copy does not have). No supplementary group of the daemon's
  // stays where the namespace allows dropping them.
  if (::syscall(SYS_setresgid, 0, 0, 0) != 0) fail(1);
  (void)::syscall(SYS_setgroups, 0, nullptr);
  if (::syscall(SYS_setresuid, 0, 0, 0) != 0) fail(2);
  if (o.own_process_group && ::setpgid(0, 0) != 0) fail(3);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);  // EINVAL for some
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (size_t i = 0; i < o.fds.size(); ++i) {
    int from = sources[i];
    if (from < 0) {
      from = ::open("/dev/null", O_RDWR);
      if (from < 0) fail(4);
    }
    if (::dup2(from, o.fds[i].child_fd) < 0) fail(5);
    if (sources[i] < 0 && from != o.fds[i].child_fd) ::close(from);
  }
  for (int fd = 0; fd <= max_child; ++fd) {
    if (targets.count(fd) != 0) continue;
    if (fd <= 2) {
      const int null_fd = ::open("/dev/null", O_RDWR);
      if (null_fd < 0) fail(4);
      if (null_fd != fd) {
        if (::dup2(null_fd, fd) < 0) fail(5);
        ::close(null_fd);
      }
    } else {
      ::close(fd);
    }
  }
  // Nothing else of the daemon's survives the exec (the error pipe, open
  // until then, included).
  ::syscall(SYS_close_range, static_cast<unsigned>(max_child + 1), ~0u, CLOSE_RANGE_CLOEXEC);
  ::execve(o.path.c_str(), argv, envp);
  fail(6);
  ::_exit(127);
}

// Spawn() with o.user_namespace, on the spawn thread: the child is cloned
// into new user and PID namespaces, waits until its ids are mapped, takes
// them and execs. Returns 0 and sets `*pid`, or an errno-like failure with
// `*why` set.
int SpawnInUserNamespace(const SpawnOptions& o, const std::vector<int>& sources,
                         const std::set<int>& targets, int max_child, char* const* argv,
                         char* const* envp, pid_t* pid, std::string* why) {
  // Both pipes above every target, so that no dup2 in the child lands on
  // them.
  int go[2], err[2];
  if (::pipe2(go, O_CLOEXEC) != 0) return errno;
  if (::pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(go[0]);
    ::close(go[1]);
    return e;
  }
  for (int* fd : {&go[0], &err[1]}) {
    const int high = ::fcntl(*fd, F_DUPFD_CLOEXEC, max_child + 1);
    if (high >= 0) {
      ::close(*fd);
      *fd = high;
    }
  }
  const long child = ::syscall(SYS_clone, CLONE_NEWUSER | CLONE_NEWPID | SIGCHLD, nullptr, nullptr,
                               nullptr, nullptr);
  if (child == 0) {
    // The parent's ends: with them open here, neither side would see the
    // other's end of file.
    ::close(go[1]);
    ::close(err[0]);
    UserNamespaceChild(o, sources, targets, max_child, go[0], err[1], argv, envp);
  }
  const int clone_err = errno;
  ::close(go[0]);
  ::close(err[1]);
  if (child < 0) {
    ::close(go[1]);
    ::close(err[0]);
    *why = "clone: " + ErrnoText(clone_err);
    return clone_err;
  }
  const pid_t p = static_cast<pid_t>(child);
  const SpawnOptions::UserNamespace& ids = *o.user_namespace;
  std::string mapped = MapId(p, /*uid=*/true, ids.uid, ids.map_own_ids);
  if (mapped.empty()) mapped = MapId(p, /*uid=*/false, ids.gid, ids.map_own_ids);
  if (mapped.empty()) (void)!::write(go[1], "g", 1);
  ::close(go[1]);  // without "g" the child exits
  if (!mapped.empty()) {
    ::close(err[0]);
    ::kill(p, SIGKILL);
    (void)WaitStatus(p);
    *why = mapped;
    return EPERM;
  }
  int report[2] = {0, 0};
  const std::string got = ReadAll(err[0]);  // EOF at its exec
  ::close(err[0]);
  if (!got.empty()) {
    ::kill(p, SIGKILL);
    (void)WaitStatus(p);
    std::memcpy(report, got.data(), std::min(got.size(), sizeof(report)));
    static const char* const kSteps[] = {"", "setresgid", "setresuid", "setpgid", "/dev/null",
                                         "dup2", "exec"};
    *why = absl::StrCat(kSteps[report[0] >= 1 && report[0] <= 6 ? report[0] : 0], ": ",
                        ErrnoText(report[1]));
    return report[1] != 0 ? report[1] : EPERM;
  }
  *pid = p;
  return 0;
}

// Spawn(), with the PID namespace decided by the caller; `*in_namespace`
// (if given) says whether the child got one.
absl::StatusOr<pid_t> SpawnImpl(const SpawnOptions& o, bool pid_namespace, bool* in_namespace) {
  if (o.path.empty()) return absl::InvalidArgumentError("spawn: no program");
  int max_child = 2;
  std::set<int> targets;
  for (const FdMapping& m : o.fds) {
    if (m.child_fd < 0 || m.child_fd > 1024 || (m.parent_fd < 0 && m.parent_fd != kDevNull) ||
        !targets.insert(m.child_fd).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("spawn: bad descriptor map entry ", m.child_fd, " <- ", m.parent_fd));
    }
    max_child = std::max(max_child, m.child_fd);
  }
  // Every source moves above every target first, so that no dup2 can
  // overwrite a source a later one needs, and dup2(fd, fd) (which would keep
  // FD_CLOEXEC) never happens. The copies are CLOEXEC: no other child
  // started meanwhile inherits them.
  std::vector<int> sources(o.fds.size(), -1);
  auto close_sources = [&sources] {
    for (int fd : sources) {
      if (fd >= 0) ::close(fd);
    }
  };
  for (size_t i = 0; i < o.fds.size(); ++i) {
    if (o.fds[i].parent_fd == kDevNull) continue;
    sources[i] = ::fcntl(o.fds[i].parent_fd, F_DUPFD_CLOEXEC, max_child + 1);
    if (sources[i] < 0) {
      const int err = errno;
      close_sources();
      return err == EBADF ? absl::InvalidArgumentError(absl::StrCat(
                                "spawn: descriptor ", o.fds[i].parent_fd, " is not open"))
                          : absl::UnavailableError(absl::StrCat("spawn: ", ErrnoText(err)));
    }
  }

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  for (size_t i = 0; i < o.fds.size(); ++i) {
    if (sources[i] >= 0) posix_spawn_file_actions_adddup2(&fa, sources[i], o.fds[i].child_fd);
  }
  for (const FdMapping& m : o.fds) {
    if (m.parent_fd == kDevNull) {
      posix_spawn_file_actions_addopen(&fa, m.child_fd, "/dev/null", O_RDWR, 0);
    }
  }
  for (int fd = 0; fd <= max_child; ++fd) {
    if (targets.count(fd) != 0) continue;
    if (fd <= 2) {
      posix_spawn_file_actions_addopen(&fa, fd, "/dev/null", O_RDWR, 0);
    } else {
      posix_spawn_file_actions_addclose(&fa, fd);  // not open: glibc ignores it
    }
  }
  // Nothing else of the daemon's, CLOEXEC or not.
  posix_spawn_file_actions_addclosefrom_np(&fa, max_child + 1);

  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
  if (o.own_process_group) {
    flags |= POSIX_SPAWN_SETPGROUP;
    posix_spawnattr_setpgroup(&attr, 0);
  }
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  sigdelset(&all, SIGKILL);
  sigdelset(&all, SIGSTOP);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, flags);

  std::vector<std::string> args = {o.path};
  const std::string tag = o.tag_instance ? InstanceTag() : "";
  if (!tag.empty()) args.insert(args.end(), {kInstanceFlag, tag});
  args.insert(args.end(), o.args.begin(), o.args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env = o.env;
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  pid_t pid = -1;
  bool isolated = false;
  if (o.user_namespace.has_value()) {
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    std::string why;
    const int err = TheSpawnThread().Call([&] {
      return SpawnInUserNamespace(o, sources, targets, max_child, argv.data(), envp.data(), &pid,
                                  &why);
    });
    close_sources();
    if (err != 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot start the program in a user namespace: ", why.empty() ? ErrnoText(err) : why));
    }
    NoteInit(pid);
    if (in_namespace != nullptr) *in_namespace = true;
    return pid;
  }
  const int err = TheSpawnThread().Call([&] {
    // The spawn thread's children go to a new PID namespace (unshare
    // changes only where this thread's next child goes), and back to ours
    // once it is started. The thread has nothing else to do meanwhile.
    static const int own_ns = ::open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    if (pid_namespace && own_ns >= 0 && ::unshare(CLONE_NEWPID) == 0) isolated = true;
    const int r = ::posix_spawn(&pid, o.path.c_str(), &fa, &attr, argv.data(), envp.data());
    if (isolated && ::setns(own_ns, CLONE_NEWPID) != 0) {
      // Cannot happen (our own namespace is always allowed); if it did,
      // every later child would share this one's namespace: stop here.
      std::abort();
    }
    return r;
  });
  if (in_namespace != nullptr) *in_namespace = isolated && err == 0;
  if (isolated && err == 0) NoteInit(pid);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  close_sources();
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat("cannot start the program: ", ErrnoText(err)));
  }
  return pid;
}

}  // namespace

absl::StatusOr<pid_t> Spawn(const SpawnOptions& o) {
  return SpawnImpl(o, o.new_pid_namespace && PidNamespaces(), nullptr);
}

std::vector<std::string> FromEnvironment(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names) {
    if (const char* v = std::getenv(n.c_str()); v != nullptr) out.push_back(n + "=" + v);
  }
  return out;
}

std::vector<std::string> HelperEnvironment() {
  std::vector<std::string> env = {"PATH=/usr/bin:/bin"};
  for (std::string& e : FromEnvironment({"ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"})) {
    env.push_back(std::move(e));
  }
  return env;
}

bool Exit::exited() const { return WIFEXITED(wait_status); }
int Exit::code() const { return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1; }
int Exit::signal() const { return WIFSIGNALED(wait_status) ? WTERMSIG(wait_status) : 0; }
uint64_t Exit::peak_rss_bytes() const {
  return usage.ru_maxrss > 0 ? static_cast<uint64_t>(usage.ru_maxrss) * 1024 : 0;
}
std::string Exit::Describe() const { return DescribeExit(wait_status); }

std::string SignalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig);
}

std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    return absl::StrCat("was killed by ", SignalName(sig), " (signal ", sig, ")",
                        WCOREDUMP(wait_status) ? " and dumped core" : "");
  }
  return absl::StrCat("ended with wait status ", wait_status);
}

absl::StatusOr<Exit> Wait(pid_t pid) {
  Exit e;
  for (;;) {
    const pid_t r = ::wait4(pid, &e.wait_status, 0, &e.usage);
    if (r == pid) {
      Reaped(pid, &e.wait_status);
      return e;
    }
    if (r < 0 && errno == EINTR) continue;
    return absl::InternalError(absl::StrCat("wait for process ", pid, ": ", ErrnoText(errno)));
  }
}

absl::StatusOr<std::optional<Exit>> WaitFor(pid_t pid, absl::Duration timeout) {
  const auto deadline =
      Clock::now() + absl::ToChronoNanoseconds(
                         std::clamp(timeout, absl::ZeroDuration(), absl::Hours(24 * 365)));
  // A pidfd becomes readable when the process ends: no polling loop. Older
  // kernels (ENOSYS) fall back to short sleeps.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  absl::StatusOr<std::optional<Exit>> result;
  for (;;) {
    Exit e;
    const pid_t r = ::wait4(pid, &e.wait_status, WNOHANG, &e.usage);
    if (r == pid) {
      Reaped(pid, &e.wait_status);
      result = std::optional<Exit>(e);
      break;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      result = absl::InternalError(absl::StrCat("wait for process ", pid, ": ", ErrnoText(errno)));
      break;
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      result = std::optional<Exit>();
      break;
    }
    const int64_t ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(left).count() + 1;  // round up
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000)));  // EINTR: just look again
    } else {
      ::usleep(static_cast<useconds_t>(std::min<int64_t>(ms, 2) * 1000));
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  return result;
}

absl::StatusOr<Exit> Reap(pid_t pid, absl::Duration grace, bool kill_group) {
  // (With no grace: one look, so one that already ended is not "killed".)
  absl::StatusOr<std::optional<Exit>> done = WaitFor(pid, grace);
  if (!done.ok()) return done.status();
  if (done->has_value()) return **done;
  // Not reaped yet, so neither its pid nor its group can have been reused.
  if (!kill_group || ::kill(-pid, SIGKILL) != 0) ::kill(pid, SIGKILL);
  absl::StatusOr<Exit> e = Wait(pid);
  if (e.ok()) e->killed = true;
  return e;
}

uint64_t AddressSpaceBytes(pid_t pid) {
  const std::string statm = ReadSmallFile(absl::StrCat("/proc/", pid, "/statm"));
  const uint64_t pages = std::strtoull(statm.c_str(), nullptr, 10);  // the first field
  return pages * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

bool DieWithParent(pid_t expected_parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The parent may have died before the line above: then no signal comes,
  // and the parent is now init or a subreaper.
  return ParentIs(expected_parent);
}

bool ParentIs(pid_t expected_parent) {
  if (expected_parent == 0) return true;
  const pid_t parent = ::getppid();
  if (parent == expected_parent) return true;
  if (parent != 0) return false;
  // Process 1 of a PID namespace: the parent is outside it, out of sight.
  // Its link to us hangs up when it dies (with no link: trust PDEATHSIG).
  const int link = g_parent_link.load(std::memory_order_relaxed);
  if (link < 0) return true;
  pollfd p{link, POLLRDHUP, 0};
  return !(::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0);
}

void SetParentLink(int fd) { g_parent_link.store(fd, std::memory_order_relaxed); }

void ActAsInit() {
  if (::getpid() != 1) return;
  struct sigaction sa {};
  sa.sa_handler = [](int) { ::_exit(kInitAbortExit); };
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGABRT, &sa, nullptr);
}

bool PrivateNamespaces() {
  if (!g_namespaces_allowed.load()) return false;
  static const bool works = [] {
    int flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS;
    if (::geteuid() != 0) flags |= CLONE_NEWUSER;
    const pid_t pid = ::fork();  // the child makes one system call and exits
    if (pid == 0) ::_exit(::unshare(flags) == 0 ? 0 : 1);
    if (pid < 0) return false;
    absl::StatusOr<Exit> e = Wait(pid);
    return e.ok() && e->exited() && e->code() == 0;
  }();
  return works;
}

void AllowNamespaces(bool allowed) { g_namespaces_allowed.store(allowed); }

std::optional<SpawnOptions::UserNamespace> CompileIds(int64_t uid, int64_t gid) {
  if (uid <= 0 || uid > 0xFFFFFFFEll) return std::nullopt;
  const int64_t g = gid >= 0 ? gid : uid;
  return SpawnOptions::UserNamespace{static_cast<uint32_t>(uid), static_cast<uint32_t>(g)};
}

void IsolateHelper(SpawnOptions* spawn, std::optional<SpawnOptions::UserNamespace> as) {
  if (!PrivateNamespaces()) return;
  spawn->args.insert(spawn->args.end(), {"--isolate", "1"});
  if (::geteuid() != 0 && UserNamespaces()) {
    if (as.has_value()) as->map_own_ids = true;
    spawn->user_namespace = as.value_or(SpawnOptions::UserNamespace{
        static_cast<uint32_t>(::geteuid()), static_cast<uint32_t>(::getegid())});
    spawn->args.insert(spawn->args.end(), {"--userns", "1"});
  } else {
    spawn->new_pid_namespace = PidNamespaces();
  }
}

void IsolateCompileHelper(SpawnOptions* spawn, int64_t uid, int64_t gid) {
  IsolateHelper(spawn, CompileIds(uid, gid));
  if (uid > 0 && ::geteuid() == 0) {
    spawn->args.insert(spawn->args.end(), {"--uid", std::to_string(uid)});
  }
}

absl::StatusOr<HelperChannel> SpawnCompileHelper(SpawnOptions spawn,
                                                 const std::vector<int>& socket_fds, int64_t uid,
                                                 int64_t gid) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::UnavailableError(absl::StrCat("socketpair: ", ErrnoText(errno)));
  }
  for (int fd : socket_fds) spawn.fds.push_back({fd, sv[1]});
  // Nothing else of the daemon's (descriptors, environment) leaks into it;
  // tagged with this daemon's state dir; from the spawn thread (its
  // PDEATHSIG means the daemon died).
  spawn.env = HelperEnvironment();
  spawn.tag_instance = true;
  IsolateCompileHelper(&spawn, uid, gid);
  absl::StatusOr<pid_t> pid = Spawn(spawn);
  ::close(sv[1]);
  if (!pid.ok()) {
    ::close(sv[0]);
    return pid.status();
  }
  return HelperChannel{*pid, sv[0]};
}

bool UserNamespaces() {
  if (!g_namespaces_allowed.load()) return false;
  static const bool works = [] {
    // Try it: one short-lived child, as the daemon's own ids.
    SpawnOptions probe;
    probe.path = "/bin/true";
    probe.own_process_group = false;
    probe.user_namespace = SpawnOptions::UserNamespace{static_cast<uint32_t>(::geteuid()),
                                                       static_cast<uint32_t>(::getegid())};
    absl::StatusOr<pid_t> pid = Spawn(probe);
    if (!pid.ok()) return false;
    absl::StatusOr<Exit> e = Wait(*pid);
    return e.ok() && e->exited() && e->code() == 0;
  }();
  return works;
}

bool PidNamespaces() {
  if (!g_namespaces_allowed.load()) return false;
  static const bool works = [] {
    if (::geteuid() != 0) return false;
    // Try it: one short-lived child in a namespace of its own.
    SpawnOptions probe;
    probe.path = "/bin/true";
    probe.new_pid_namespace = true;
    probe.own_process_group = false;
    bool ok = false;
    absl::StatusOr<pid_t> pid = SpawnImpl(probe, /*pid_namespace=*/true, &ok);
    if (pid.ok()) (void)Wait(*pid);
    return pid.ok() && ok;
  }();
  return works;
}

void SetInstanceTag(const std::string& tag) {
  std::string clean;
  for (char c : tag) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
        c == '_') {
      clean.push_back(c);
    }
  }
  MutexLock lock(&g_tag_mu);
  if (g_tag == nullptr) g_tag = new std::string();  // never freed: read by any thread until exit
  *g_tag = clean;
}

std::string InstanceTag() {
  MutexLock lock(&g_tag_mu);
  return g_tag != nullptr ? *g_tag : "";
}

int EndLeftovers(const std::string& tag, const std::vector<std::string>& program_names) {
  if (tag.empty()) return 0;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return 0;
  const pid_t self = ::getpid();
  int ended = 0;
  // readdir is safe here: no other thread uses this DIR stream.
  while (struct dirent* ent = ::readdir(dir)) {  // NOLINT(concurrency-mt-unsafe)
    const std::string name = ent->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::strtol(name.c_str(), nullptr, 10));
    if (pid == self) continue;
    // Hold the process first: what is read below is then about this very
    // process, and the signal cannot reach a later owner of its pid.
    const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0 && errno != ENOSYS) continue;  // gone
    std::vector<std::string> argv;
    const std::string cmdline = ReadSmallFile("/proc/" + name + "/cmdline");
    for (size_t at = 0; at < cmdline.size();) {
      size_t end = cmdline.find('\0', at);
      if (end == std::string::npos) end = cmdline.size();
      argv.push_back(cmdline.substr(at, end - at));
      at = end + 1;
    }
    bool ours = false;
    if (argv.size() >= 3) {
      const std::string base = argv[0].substr(argv[0].rfind('/') + 1);
      const bool helper =
          std::find(program_names.begin(), program_names.end(), base) != program_names.end();
      for (size_t i = 1; helper && i + 1 < argv.size() && !ours; ++i) {
        ours = argv[i] == kInstanceFlag && argv[i + 1] == tag;
      }
    }
    if (ours && ParentOf(name) != self) {
      const long rc = pidfd >= 0 ? ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0)
                                 : ::kill(pid, SIGKILL);
      if (rc == 0) ++ended;
    }
    if (pidfd >= 0) ::close(pidfd);
  }
  ::closedir(dir);
  return ended;
}

}  // namespace opjit::subprocess

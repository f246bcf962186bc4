// The sandbox's system call filter (issue 27): every call aimed at another
// process fails with EPERM, the same calls aimed at the caller itself work,
// and what worked before (threads, abort(), signals to itself) still does.
//
// Each case forks: a child installs the filter (one-way), tries the calls
// and writes what went wrong to a pipe; the parent reads it. The "victim"
// is another child of the test, of the same uid as the attacker (both drop
// to nobody when the test runs as root): without the filter every attack
// below succeeds, with it none may.
//
// KeepReadSearch: the compile workers' policy on a root daemon (a uid of
// their own with CAP_DAC_READ_SEARCH alone, inside Landlock), as root only.
#include "server/common/sandbox.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/kcmp.h>
#include <grp.h>
#include <linux/sockios.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace opjit::sandbox {
namespace {

constexpr uid_t kNobody = 65534;
constexpr int kIoprioWhoProcess = 1, kIoprioWhoPgrp = 2, kIoprioWhoUser = 3;
constexpr int kIoprioBe4 = (2 << 13) | 4;  // IOPRIO_CLASS_BE, level 4
// struct sched_attr (its first version), which glibc 2.36 does not declare
// and <linux/sched/types.h> declares beside a conflicting sched_param.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime, sched_deadline, sched_period;
};
// A uid and a process group that no process has: without the filter the
// user- and group-wide calls fail with ESRCH and touch nothing.
constexpr int kNoSuchId = 0x7ffffff0;

// The child's findings, one line each; empty: all as expected.
class Report {
 public:
  explicit Report(int fd) : fd_(fd) {}
  // `r` is what the call returned: -1 with EPERM expected.
  void Refused(const char* what, long r) {
    if (r == -1 && errno == EPERM) return;
    Line(what, r, "expected -1/EPERM");
  }
  // Expected to succeed (>= 0).
  void Works(const char* what, long r) {
    if (r >= 0) return;
    Line(what, r, "expected success");
  }
  void Fail(const std::string& what) { out_ += what + "\n"; }
  void Send() {
    if (!out_.empty()) (void)!::write(fd_, out_.data(), out_.size());
    ::close(fd_);
  }

 private:
  void Line(const char* what, long r, const char* want) {
    std::ostringstream s;
    s << what << ": returned " << r << " (" << (r == -1 ? std::strerror(errno) : "no error")
      << "), " << want << "\n";
    out_ += s.str();
  }
  int fd_;
  std::string out_;
};

// Drops to nobody when root (so that attacker and victim share a uid, as
// executors of different namespaces do today).
void BecomeNobodyIfRoot() {
  if (::geteuid() != 0) return;
  if (::setgroups(0, nullptr) != 0 || ::setresgid(kNobody, kNobody, kNobody) != 0 ||
      ::setresuid(kNobody, kNobody, kNobody) != 0) {
    ::_exit(90);
  }
}

// A child that waits, as nobody when root: the victim. Returned once it
// has dropped to nobody (else the kernel, not the filter, would refuse).
pid_t StartVictim() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    BecomeNobodyIfRoot();
    for (;;) ::pause();
  }
  if (::geteuid() == 0) {
    const std::string want = "Uid:\t" + std::to_string(kNobody) + "\t";
    for (int i = 0; i < 5000; ++i) {
      std::ifstream f("/proc/" + std::to_string(pid) + "/status");
      std::string status((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (status.find(want) != std::string::npos) break;
      ::usleep(1000);
    }
  }
  return pid;
}

// The parent's half of InSandbox and InPolicy: what child `pid` reported
// on `fd` (closed here), and how it ended when that was not exit 0.
std::string Collect(pid_t pid, int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, n);
  ::close(fd);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    out += "sandboxed child ended with status " + std::to_string(status) + "\n";
  }
  return out;
}

// Runs `body(report)` in a child that first installs the filter (`full`:
// the whole sandbox, as a worker applies it, without Landlock's files), and
// returns the child's findings, or how it ended when that was not exit 0.
template <typename F>
std::string InSandbox(bool full, F body) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    // Its own process group: group-wide calls would reach only itself.
    ::setpgid(0, 0);
    Policy p;
    p.require_landlock = false;
    if (full) {
      BecomeNobodyIfRoot();
      if (!Apply(p).ok()) ::_exit(91);
    } else if (!ApplySystemCallFilter(p).ok()) {
      ::_exit(92);
    }
    Report report(fds[1]);
    body(report);
    report.Send();
    ::_exit(0);
  }
  ::close(fds[1]);
  return Collect(pid, fds[0]);
}

void EndVictim(pid_t victim) {
  ::kill(victim, SIGKILL);
  ::waitpid(victim, nullptr, 0);
}

// What another process can change of a process: its limits, nice value,
// CPU affinity and scheduling policy.
struct Observed {
  std::string limits;  // /proc/<pid>/limits
  int nice = 0;        // /proc/<pid>/stat, field 19
  cpu_set_t affinity{};
  int policy = -1;
  bool operator==(const Observed& o) const {
    return limits == o.limits && nice == o.nice && CPU_EQUAL(&affinity, &o.affinity) &&
           policy == o.policy;
  }
};

Observed Observe(pid_t pid) {
  Observed o;
  std::ifstream l("/proc/" + std::to_string(pid) + "/limits");
  o.limits.assign(std::istreambuf_iterator<char>(l), std::istreambuf_iterator<char>());
  std::ifstream s("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(s)), std::istreambuf_iterator<char>());
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 19 && rest >> field; ++i) {
    if (i == 19) o.nice = std::stoi(field);
  }
  ::sched_getaffinity(pid, sizeof o.affinity, &o.affinity);
  o.policy = ::sched_getscheduler(pid);
  return o;
}

std::string Describe(const Observed& o) {
  return "nice " + std::to_string(o.nice) + ", policy " + std::to_string(o.policy) + ", " +
         std::to_string(CPU_COUNT(&o.affinity)) + " CPUs, limits:\n" + o.limits;
}

// Every call of the issue aimed at `target`, which is not the caller.
void AttackProcess(Report& r, pid_t target) {
  rlimit old{}, one{1, 1};
  r.Refused("prlimit64(other, RLIMIT_CPU, NULL, &old)",
            ::syscall(SYS_prlimit64, target, RLIMIT_CPU, nullptr, &old));
  r.Refused("prlimit64(other, RLIMIT_CPU, {1,1})",
            ::syscall(SYS_prlimit64, target, RLIMIT_CPU, &one, nullptr));
  rlimit fsize{4096, 4096}, nofile{32, 32};
  r.Refused("prlimit64(other, RLIMIT_FSIZE, 4096)",
            ::syscall(SYS_prlimit64, target, RLIMIT_FSIZE, &fsize, nullptr));
  r.Refused("prlimit64(other, RLIMIT_NOFILE, 32)",
            ::syscall(SYS_prlimit64, target, RLIMIT_NOFILE, &nofile, nullptr));
  r.Refused("setpriority(PRIO_PROCESS, other, 19)", ::setpriority(PRIO_PROCESS, target, 19));
  cpu_set_t one_cpu;
  CPU_ZERO(&one_cpu);
  CPU_SET(0, &one_cpu);
  r.Refused("sched_setaffinity(other)", ::sched_setaffinity(target, sizeof one_cpu, &one_cpu));
  sched_param param{};
  r.Refused("sched_setscheduler(other, SCHED_IDLE)",
            ::sched_setscheduler(target, SCHED_IDLE, &param));
  r.Refused("sched_setparam(other)", ::sched_setparam(target, &param));
  SchedAttr attr{};
  attr.size = sizeof attr;
  attr.sched_policy = SCHED_IDLE;
  r.Refused("sched_setattr(other)", ::syscall(SYS_sched_setattr, target, &attr, 0));
  r.Refused("ioprio_set(IOPRIO_WHO_PROCESS, other)",
            ::syscall(SYS_ioprio_set, kIoprioWhoProcess, target, kIoprioBe4));
  unsigned long mask = 1;
  r.Refused("migrate_pages(other)", ::syscall(SYS_migrate_pages, target, 2, &mask, &mask));
  r.Refused("move_pages(other)", ::syscall(SYS_move_pages, target, 0, nullptr, nullptr, nullptr, 0));
  void* head = nullptr;
  size_t len = 0;
  r.Refused("get_robust_list(other)", ::syscall(SYS_get_robust_list, target, &head, &len));
  r.Refused("kill(other, 0)", ::kill(target, 0));
  r.Refused("tkill(other, 0)", ::syscall(SYS_tkill, target, 0));
  r.Refused("tgkill(other, other, 0)", ::syscall(SYS_tgkill, target, target, 0));
  siginfo_t info{};
  info.si_code = SI_QUEUE;
  info.si_pid = ::getpid();
  info.si_uid = ::getuid();
  r.Refused("rt_sigqueueinfo(other, 0)", ::syscall(SYS_rt_sigqueueinfo, target, 0, &info));
  r.Refused("rt_tgsigqueueinfo(other, other, 0)",
            ::syscall(SYS_rt_tgsigqueueinfo, target, target, 0, &info));
  r.Refused("ptrace(PTRACE_PEEKDATA, other)", ::ptrace(PTRACE_PEEKDATA, target, nullptr, nullptr));
  char byte = 0;
  iovec local{&byte, 1}, remote{&byte, 1};
  r.Refused("process_vm_readv(other)", ::syscall(SYS_process_vm_readv, target, &local, 1, &remote, 1, 0));
  r.Refused("process_vm_writev(other)",
            ::syscall(SYS_process_vm_writev, target, &local, 1, &remote, 1, 0));
  r.Refused("pidfd_open(other)", ::syscall(SYS_pidfd_open, target, 0));
  r.Refused("kcmp(other, self)", ::syscall(SYS_kcmp, target, ::getpid(), KCMP_VM, 0, 0));
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) {
    r.Fail("pipe failed");
    return;
  }
  r.Refused("fcntl(F_SETOWN, other)", ::fcntl(pipe_fds[0], F_SETOWN, target));
  int owner = target;
  r.Refused("ioctl(FIOSETOWN, other)", ::ioctl(pipe_fds[0], FIOSETOWN, &owner));
  r.Refused("ioctl(SIOCSPGRP, other)", ::ioctl(pipe_fds[0], SIOCSPGRP, &owner));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

// The calls that are refused whoever they name.
void AttackAnyone(Report& r) {
  r.Refused("setpriority(PRIO_PGRP, 0)", ::setpriority(PRIO_PGRP, 0, 19));
  r.Refused("setpriority(PRIO_PGRP, none)", ::setpriority(PRIO_PGRP, kNoSuchId, 19));
  r.Refused("setpriority(PRIO_USER, none)", ::setpriority(PRIO_USER, kNoSuchId, 19));
  r.Refused("ioprio_set(IOPRIO_WHO_PGRP, 0)",
            ::syscall(SYS_ioprio_set, kIoprioWhoPgrp, 0, kIoprioBe4));
  r.Refused("ioprio_set(IOPRIO_WHO_USER, none)",
            ::syscall(SYS_ioprio_set, kIoprioWhoUser, kNoSuchId, kIoprioBe4));
  r.Refused("pidfd_send_signal(-1)", ::syscall(SYS_pidfd_send_signal, -1, 0, nullptr, 0));
  r.Refused("pidfd_getfd(-1)", ::syscall(SYS_pidfd_getfd, -1, 0, 0));
  r.Refused("process_madvise(-1)", ::syscall(SYS_process_madvise, -1, nullptr, 0, 0, 0));
  r.Refused("process_mrelease(-1)", ::syscall(SYS_process_mrelease, -1, 0));
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) {
    r.Fail("pipe failed");
    return;
  }
  r.Refused("fcntl(F_SETOWN, -own group)", ::fcntl(pipe_fds[0], F_SETOWN, -::getpgrp()));
  f_owner_ex ex{F_OWNER_TID, static_cast<pid_t>(::gettid())};
  r.Refused("fcntl(F_SETOWN_EX)", ::fcntl(pipe_fds[0], F_SETOWN_EX, &ex));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
}

TEST(SandboxFilter, CallsAimedAtAnotherProcessFailWithEperm) {
  const pid_t victim = StartVictim();
  const Observed before = Observe(victim);
  const pid_t test = ::getpid();
  const Observed test_before = Observe(test);
  const std::string out = InSandbox(false, [&](Report& r) {
    AttackProcess(r, victim);
    // The parent (as the daemon is an executor's parent).
    AttackProcess(r, ::getppid());
    AttackAnyone(r);
  });
  EXPECT_EQ(out, "");
  const Observed after = Observe(victim);
  EXPECT_TRUE(after == before) << "before: " << Describe(before) << "after: " << Describe(after);
  EXPECT_TRUE(Observe(test) == test_before);
  EndVictim(victim);
}

// The reproduction, under the whole sandbox as a worker applies it:
// a victim of the same uid keeps its RLIMIT_CPU, nice value, affinity and
// scheduling policy, and is alive.
TEST(SandboxFilter, SameUidVictimKeepsItsLimitsNiceAffinityAndPolicy) {
  const pid_t victim = StartVictim();
  const Observed before = Observe(victim);
  const std::string out = InSandbox(true, [&](Report& r) {
    rlimit one{1, 1};
    sched_param param{};
    cpu_set_t one_cpu;
    CPU_ZERO(&one_cpu);
    CPU_SET(0, &one_cpu);
    r.Refused("prlimit64(victim, RLIMIT_CPU, {1,1})",
              ::syscall(SYS_prlimit64, victim, RLIMIT_CPU, &one, nullptr));
    r.Refused("setpriority(victim, 19)", ::setpriority(PRIO_PROCESS, victim, 19));
    r.Refused("sched_setaffinity(victim)", ::sched_setaffinity(victim, sizeof one_cpu, &one_cpu));
    r.Refused("sched_setscheduler(victim, SCHED_IDLE)",
              ::sched_setscheduler(victim, SCHED_IDLE, &param));
    r.Refused("kill(victim, SIGKILL)", ::kill(victim, SIGKILL));
    AttackProcess(r, victim);
  });
  EXPECT_EQ(out, "");
  const Observed after = Observe(victim);
  EXPECT_TRUE(after == before) << "before: " << Describe(before) << "after: " << Describe(after);
  EXPECT_EQ(::waitpid(victim, nullptr, WNOHANG), 0) << "the victim died";
  EndVictim(victim);
}

void* ThreadTargetsItself(void* arg) {
  Report& r = *static_cast<Report*>(arg);
  cpu_set_t set;
  r.Works("thread: sched_getaffinity(0)", ::sched_getaffinity(0, sizeof set, &set));
  r.Works("thread: sched_setaffinity(0)", ::sched_setaffinity(0, sizeof set, &set));
  r.Works("thread: setpriority(PRIO_PROCESS, 0, 12)", ::setpriority(PRIO_PROCESS, 0, 12));
  sched_param param{};
  r.Works("thread: sched_setscheduler(0, SCHED_BATCH)",
          ::sched_setscheduler(0, SCHED_BATCH, &param));
  // The documented limit: a later thread's own tid is refused (seccomp
  // cannot tell it from another process's pid); 0 is how it names itself.
  r.Refused("thread: sched_setaffinity(own tid)", ::sched_setaffinity(::gettid(), sizeof set, &set));
  return nullptr;
}

int g_signals = 0;
void OnSignal(int) { ++g_signals; }

TEST(SandboxFilter, CallsAimedAtItselfStillWork) {
  const pid_t victim = StartVictim();
  const std::string out = InSandbox(true, [&](Report& r) {
    const pid_t self = ::getpid();
    rlimit lim{};
    r.Works("getrlimit(RLIMIT_CPU)", ::getrlimit(RLIMIT_CPU, &lim));
    r.Works("prlimit64(0, RLIMIT_CPU, NULL, &old)",
            ::syscall(SYS_prlimit64, 0, RLIMIT_CPU, nullptr, &lim));
    r.Works("prlimit64(self, RLIMIT_CPU, NULL, &old)",
            ::syscall(SYS_prlimit64, self, RLIMIT_CPU, nullptr, &lim));
    rlimit files{};
    ::getrlimit(RLIMIT_NOFILE, &files);
    files.rlim_cur = files.rlim_cur > 64 ? 64 : files.rlim_cur;
    r.Works("setrlimit(RLIMIT_NOFILE, lower)", ::setrlimit(RLIMIT_NOFILE, &files));
    r.Works("setpriority(PRIO_PROCESS, 0, 5)", ::setpriority(PRIO_PROCESS, 0, 5));
    r.Works("setpriority(PRIO_PROCESS, self, 6)", ::setpriority(PRIO_PROCESS, self, 6));
    errno = 0;
    const int prio = ::getpriority(PRIO_PROCESS, victim);
    r.Works("getpriority(other)", prio == -1 && errno != 0 ? -1 : 0);
    cpu_set_t set;
    r.Works("sched_getaffinity(other)", ::sched_getaffinity(victim, sizeof set, &set));
    r.Works("sched_getaffinity(0)", ::sched_getaffinity(0, sizeof set, &set));
    r.Works("sched_setaffinity(0)", ::sched_setaffinity(0, sizeof set, &set));
    r.Works("sched_setaffinity(self)", ::sched_setaffinity(self, sizeof set, &set));
    sched_param param{};
    r.Works("sched_setscheduler(0, SCHED_BATCH)", ::sched_setscheduler(0, SCHED_BATCH, &param));
    r.Works("sched_setparam(self)", ::sched_setparam(self, &param));
    SchedAttr attr{};
    attr.size = sizeof attr;
    attr.sched_policy = SCHED_OTHER;
    attr.sched_nice = 10;  // (no higher priority: that needs privilege)
    r.Works("sched_setattr(0)", ::syscall(SYS_sched_setattr, 0, &attr, 0));
    r.Works("ioprio_set(IOPRIO_WHO_PROCESS, 0)",
            ::syscall(SYS_ioprio_set, kIoprioWhoProcess, 0, kIoprioBe4));
    r.Works("ioprio_set(IOPRIO_WHO_PROCESS, self)",
            ::syscall(SYS_ioprio_set, kIoprioWhoProcess, self, kIoprioBe4));
    void* head = nullptr;
    size_t len = 0;
    r.Works("get_robust_list(0)", ::syscall(SYS_get_robust_list, 0, &head, &len));
    // Signals to itself: raise (tgkill), sigqueue (rt_sigqueueinfo).
    ::signal(SIGUSR1, OnSignal);
    r.Works("raise(SIGUSR1)", ::raise(SIGUSR1));
    r.Works("sigqueue(self, SIGUSR1)", ::sigqueue(self, SIGUSR1, sigval{}));
    if (g_signals != 2) r.Fail("SIGUSR1 arrived " + std::to_string(g_signals) + " times, not 2");
    int pipe_fds[2];
    r.Works("pipe", ::pipe(pipe_fds));
    r.Works("fcntl(F_SETOWN, self)", ::fcntl(pipe_fds[0], F_SETOWN, self));
    r.Works("fcntl(F_SETOWN, 0)", ::fcntl(pipe_fds[0], F_SETOWN, 0));
    r.Works("fcntl(F_GETFL)", ::fcntl(pipe_fds[0], F_GETFL));
    int avail = 0;
    r.Works("ioctl(FIONREAD)", ::ioctl(pipe_fds[0], FIONREAD, &avail));
    // Threads start, and name themselves by 0.
    pthread_t t;
    const int rc = ::pthread_create(&t, nullptr, ThreadTargetsItself, &r);
    if (rc != 0) {
      r.Fail(std::string("pthread_create: ") + std::strerror(rc));
    } else {
      ::pthread_join(t, nullptr);
    }
  });
  EXPECT_EQ(out, "");
  EndVictim(victim);
}

TEST(SandboxFilter, AbortStillEndsTheProcessWithSigabrt) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    Policy p;
    p.require_landlock = false;
    BecomeNobodyIfRoot();
    if (!Apply(p).ok()) ::_exit(91);
    std::abort();
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGABRT);
}

// ---- keep_read_search: the compile workers' uid ---------------------------------------------

// A uid and gid no process has, for the compile uid of these tests.
constexpr uid_t kCompileUid = 0x7fffffe0;

// A directory of root's, 0700, holding a file of root's, 0600, with `text`.
std::string PrivateDir(const std::string& parent, const std::string& name,
                       const std::string& text) {
  const std::string dir = parent + "/" + name;
  if (::mkdir(dir.c_str(), 0700) != 0) return "";
  std::ofstream(dir + "/h") << text;
  ::chmod((dir + "/h").c_str(), 0600);
  return dir;
}

// Runs `body(report)` in a child that applies `p` (Landlock included);
// returns the child's findings, or how it ended when that was not exit 0.
template <typename F>
std::string InPolicy(const Policy& p, F body) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    Report report(fds[1]);
    if (absl::Status s = Apply(p); !s.ok()) {
      report.Fail("Apply: " + s.ToString());
    } else {
      body(report);
    }
    report.Send();
    ::_exit(0);
  }
  ::close(fds[1]);
  return Collect(pid, fds[0]);
}

// The content of `path`, or "" when it cannot be opened (errno says why).
std::string Slurp(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, n);
  ::close(fd);
  return out;
}

// The hex value of `field` ("CapEff") in /proc/self/status.
std::string StatusField(const std::string& status, const std::string& field) {
  const size_t at = status.find(field + ":\t");
  if (at == std::string::npos) return "";
  const size_t start = at + field.size() + 2;
  return status.substr(start, status.find('\n', start) - start);
}

class KeepReadSearch : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "switching to another uid needs root";
    if (LandlockAbi() <= 0) GTEST_SKIP() << "this kernel has no Landlock";
    char tmpl[] = "/tmp/opjit-sandbox-caps-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr) << std::strerror(errno);
    root_ = tmpl;  // 0700, root's
    allowed_ = PrivateDir(root_, "allowed", "allowed header");
    denied_ = PrivateDir(root_, "denied", "denied header");
    ASSERT_FALSE(allowed_.empty());
    ASSERT_FALSE(denied_.empty());
  }
  void TearDown() override {
    if (!root_.empty()) std::filesystem::remove_all(root_);
  }
  Policy CompilePolicy() const {
    Policy p;
    p.read_only_paths = {allowed_, "/proc/self/status"};
    p.uid = kCompileUid;
    p.gid = kCompileUid;
    p.keep_read_search = true;
    return p;
  }
  std::string root_, allowed_, denied_;
};

// As a compile worker: another uid, and only CAP_DAC_READ_SEARCH, which
// reads a 0700 directory of root's that Landlock allows and nothing that
// Landlock does not; the file-handle calls are refused.
TEST_F(KeepReadSearch, ReadsOnlyTheListedPrivateDirsAsAnotherUidWithOneCapability) {
  const std::string allowed = allowed_, denied = denied_;
  const std::string out = InPolicy(CompilePolicy(), [&](Report& r) {
    uid_t ru, eu, su;
    gid_t rg, eg, sg;
    ::getresuid(&ru, &eu, &su);
    ::getresgid(&rg, &eg, &sg);
    if (ru != kCompileUid || eu != kCompileUid || su != kCompileUid) r.Fail("uid not switched");
    if (rg != kCompileUid || eg != kCompileUid || sg != kCompileUid) r.Fail("gid not switched");
    gid_t groups[8];
    if (::getgroups(8, groups) != 0) r.Fail("supplementary groups left");
    // The listed 0700 directory of root's: listed, and its 0600 file read.
    if (Slurp(allowed + "/h") != "allowed header") {
      r.Fail(std::string("cannot read the allowed 0700 dir's file: ") + std::strerror(errno));
    }
    if (DIR* d = ::opendir(allowed.c_str())) {
      ::closedir(d);
    } else {
      r.Fail(std::string("cannot list the allowed 0700 dir: ") + std::strerror(errno));
    }
    // Not listed: Landlock refuses, capability or not.
    errno = 0;
    if (!Slurp(denied + "/h").empty() || errno != EACCES) {
      r.Fail(std::string("the unlisted dir's file: ") + std::strerror(errno));
    }
    if (!Slurp("/etc/os-release").empty() || errno != EACCES) r.Fail("read /etc/os-release");
    // One capability: effective and permitted; none inheritable, ambient
    // or in the bounding set but it.
    const std::string status = Slurp("/proc/self/status");
    const std::string one = "0000000000000004";  // 1 << CAP_DAC_READ_SEARCH
    if (StatusField(status, "CapEff") != one) r.Fail("CapEff " + StatusField(status, "CapEff"));
    if (StatusField(status, "CapPrm") != one) r.Fail("CapPrm " + StatusField(status, "CapPrm"));
    if (StatusField(status, "CapBnd") != one) r.Fail("CapBnd " + StatusField(status, "CapBnd"));
    if (StatusField(status, "CapInh") != "0000000000000000") r.Fail("CapInh");
    if (StatusField(status, "CapAmb") != "0000000000000000") r.Fail("CapAmb");
    if (StatusField(status, "NoNewPrivs") != "1") r.Fail("NoNewPrivs");
    // Nothing regained: not root, not another capability.
    r.Refused("setuid(0)", ::setuid(0));
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
    data[0].effective = data[0].permitted = (1u << CAP_DAC_READ_SEARCH) | (1u << CAP_SYS_ADMIN);
    r.Refused("capset CAP_SYS_ADMIN", ::syscall(SYS_capset, &header, data));
    // The classic escape with this capability: a file by its handle.
    struct {
      file_handle h;
      unsigned char bytes[MAX_HANDLE_SZ];
    } fh{};
    fh.h.handle_bytes = MAX_HANDLE_SZ;
    int mount_id = 0;
    r.Refused("name_to_handle_at",
              ::syscall(SYS_name_to_handle_at, AT_FDCWD, allowed.c_str(), &fh.h, &mount_id, 0));
    const int dir = ::open(allowed.c_str(), O_PATH | O_CLOEXEC);
    r.Refused("open_by_handle_at", ::syscall(SYS_open_by_handle_at, dir, &fh.h, O_RDONLY));
    if (dir >= 0) ::close(dir);
  });
  EXPECT_EQ(out, "");
}

// The same switch without keep_read_search: no capability at all, so the
// 0700 directory is shut to it even though Landlock lists it (what the
// option is for).
TEST_F(KeepReadSearch, WithoutItTheUidReadsNoPrivateDir) {
  Policy p = CompilePolicy();
  p.keep_read_search = false;
  const std::string allowed = allowed_;
  const std::string out = InPolicy(p, [&](Report& r) {
    if (::geteuid() != kCompileUid) r.Fail("uid not switched");
    errno = 0;
    if (!Slurp(allowed + "/h").empty() || errno != EACCES) {
      r.Fail(std::string("read the 0700 dir without the capability: ") + std::strerror(errno));
    }
    const std::string status = Slurp("/proc/self/status");
    if (StatusField(status, "CapEff") != "0000000000000000") {
      r.Fail("CapEff " + StatusField(status, "CapEff"));
    }
  });
  EXPECT_EQ(out, "");
}

// A root without CAP_DAC_READ_SEARCH in its permitted set (a container's
// root): the switch still happens, and nothing is kept.
TEST_F(KeepReadSearch, ARootWithoutTheCapabilityKeepsNone) {
  const std::string allowed = allowed_;
  const Policy p = CompilePolicy();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    Report r(fds[1]);
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
    if (::syscall(SYS_capget, &header, data) != 0) r.Fail("capget");
    data[CAP_TO_INDEX(CAP_DAC_READ_SEARCH)].effective &= ~CAP_TO_MASK(CAP_DAC_READ_SEARCH);
    data[CAP_TO_INDEX(CAP_DAC_READ_SEARCH)].permitted &= ~CAP_TO_MASK(CAP_DAC_READ_SEARCH);
    if (::syscall(SYS_capset, &header, data) != 0) r.Fail("capset without CAP_DAC_READ_SEARCH");
    if (absl::Status s = Apply(p); !s.ok()) {
      r.Fail("Apply: " + s.ToString());
    } else {
      if (::geteuid() != kCompileUid) r.Fail("uid not switched");
      const std::string status = Slurp("/proc/self/status");
      if (StatusField(status, "CapEff") != "0000000000000000" ||
          StatusField(status, "CapPrm") != "0000000000000000") {
        r.Fail("capabilities left: " + StatusField(status, "CapPrm"));
      }
      errno = 0;
      if (!Slurp(allowed + "/h").empty() || errno != EACCES) r.Fail("read the 0700 dir");
    }
    r.Send();
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(out, "");
}

}  // namespace
}  // namespace opjit::sandbox

// server/common/subprocess: what a child gets (descriptors, environment,
// process group, signals), how it is reaped and described, and the restart
// sweep of a daemon's leftovers. Children are /bin/sh and coreutils.
#include "server/common/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/common/paths.h"
#include "tests/unit/testing/procfs.h"
#include "server/common/subordinate_ids.h"

namespace opjit::subprocess {
namespace {

using Clock = std::chrono::steady_clock;

// Runs `path` `args` with `fds` (stdout is a pipe read here) and returns
// what it printed; reaps it.
std::string RunProgram(const std::string& path, std::vector<std::string> args,
                std::vector<FdMapping> fds = {}, std::vector<std::string> env = {},
                bool own_group = true, Exit* exit_out = nullptr) {
  int out[2];
  EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
  fds.push_back({1, out[1]});
  SpawnOptions o;
  o.path = path;
  o.args = std::move(args);
  o.env = std::move(env);
  o.fds = std::move(fds);
  o.own_process_group = own_group;
  absl::StatusOr<pid_t> pid = Spawn(o);
  ::close(out[1]);
  EXPECT_TRUE(pid.ok()) << pid.status();
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  if (pid.ok()) {
    absl::StatusOr<Exit> e = Wait(*pid);
    EXPECT_TRUE(e.ok()) << e.status();
    if (e.ok() && exit_out != nullptr) *exit_out = *e;
  }
  return text;
}

// The same with a /bin/sh script.
std::string RunSh(const std::string& script, std::vector<FdMapping> fds = {},
                  std::vector<std::string> env = {}, bool own_group = true,
                  Exit* exit_out = nullptr) {
  return RunProgram("/bin/sh", {"-c", script}, std::move(fds), std::move(env), own_group, exit_out);
}

// Field `index` (1-based, as in proc(5)) of /proc/<pid>/stat.
std::string StatField(pid_t pid, int index) {
  const std::string stat = opjit::testing::ReadProcFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= index; ++i) rest >> field;
  return field;
}

// Gone, or a zombie nobody reaped yet: either way it runs no more.
bool Dead(pid_t pid) {
  const std::string state = StatField(pid, 3);
  return state.empty() || state == "Z" || state == "X";
}

TEST(SubprocessTest, ChildGetsExactlyTheMappedDescriptors) {
  // Two files, each opened where the other must end up in the child: the
  // map must not overwrite one with the other.
  char a_path[] = "/tmp/opjit-subprocess-a-XXXXXX";
  char b_path[] = "/tmp/opjit-subprocess-b-XXXXXX";
  const int a = ::mkstemp(a_path);
  const int b = ::mkstemp(b_path);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  ASSERT_EQ(::write(a, "from-a", 6), 6);
  ASSERT_EQ(::write(b, "from-b", 6), 6);
  // (dash reads only one-digit descriptors in redirections.)
  ASSERT_EQ(::dup2(a, 7), 7);
  ASSERT_EQ(::dup2(b, 8), 8);
  ::lseek(7, 0, SEEK_SET);
  ::lseek(8, 0, SEEK_SET);
  // A descriptor without CLOEXEC that is not in the map: it must not leak.
  const int leak = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(leak, 0);
  const std::string out = RunSh(
      absl::StrCat("cat <&8; echo; cat <&7; echo; "
                   "for f in 3 4 5 6 9 ", leak, "; do [ -e /proc/$$/fd/$f ] && echo open $f; done; "
                   "readlink /proc/$$/fd/0; readlink /proc/$$/fd/2"),
      {{7, 8}, {8, 7}});
  EXPECT_EQ(out, "from-a\nfrom-b\n/dev/null\n/dev/null\n");
  ::close(leak);
  ::close(7);
  ::close(8);
  ::close(a);
  ::close(b);
  ::unlink(a_path);
  ::unlink(b_path);
}

// A child in a PID namespace of its own is its process 1, sees no parent,
// and an abort() as process 1 (kInitAbortExit, see ActAsInit) is reported
// as death by SIGABRT; the same exit code elsewhere stays an exit code.
TEST(SubprocessTest, NewPidNamespaceChildIsProcessOne) {
  if (!PidNamespaces()) GTEST_SKIP() << "PID namespaces need root";
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  SpawnOptions o;
  o.path = "/bin/sh";
  o.args = {"-c", "echo $$ $PPID; exit 134"};
  o.fds = {{1, out[1]}};
  o.new_pid_namespace = true;
  absl::StatusOr<pid_t> pid = Spawn(o);
  ::close(out[1]);
  ASSERT_TRUE(pid.ok()) << pid.status();
  char buf[64] = {};
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof(buf) - 1)) < 0 && errno == EINTR) {
  }
  ::close(out[0]);
  EXPECT_EQ(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0), "1 0\n");
  absl::StatusOr<Exit> e = Wait(*pid);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->signal(), SIGABRT) << e->Describe();
  EXPECT_EQ(e->Describe(), "was killed by SIGABRT (signal 6)");

  Exit plain;
  RunSh("exit 134", {}, {}, true, &plain);
  EXPECT_TRUE(plain.exited());
  EXPECT_EQ(plain.code(), kInitAbortExit);
}

// Output of `script` run by /bin/sh as uid 0 of a user namespace whose
// ids stand for `uid`/`gid`; `*e` how it ended.
std::string RunInUserNamespace(const std::string& script, uint32_t uid, uint32_t gid, Exit* e) {
  int out[2];
  EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
  SpawnOptions o;
  o.path = "/bin/sh";
  o.args = {"-c", script};
  o.fds = {{1, out[1]}, {2, kDevNull}};
  o.user_namespace = SpawnOptions::UserNamespace{uid, gid};
  absl::StatusOr<pid_t> pid = Spawn(o);
  ::close(out[1]);
  EXPECT_TRUE(pid.ok()) << pid.status();
  std::string text;
  char buf[256];
  for (;;) {
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  if (pid.ok()) {
    absl::StatusOr<Exit> done = Wait(*pid);
    EXPECT_TRUE(done.ok()) << done.status();
    if (done.ok()) *e = *done;
  }
  return text;
}

// A daemon without root starts its helpers as uid 0 of a user namespace of
// their own, and process 1 of a PID namespace that one owns: its own ids
// mapped (or, as root, any), no supplementary group, an abort() reported as
// SIGABRT, and only the descriptors it was given.
TEST(SubprocessTest, UserNamespaceChildIsRootOfItsOwnNamespacesOnly) {
  if (!UserNamespaces()) GTEST_SKIP() << "this kernel refuses user namespaces here";
  const bool root = ::geteuid() == 0;
  // As root any id can be mapped directly; otherwise only our own (other
  // ids go through newuidmap, which the integration tests cover).
  const uint32_t uid = root ? 1879113001u : ::geteuid();
  const uint32_t gid = root ? 1879113002u : ::getegid();
  Exit e;
  const std::string said = RunInUserNamespace(
      "echo $$ $PPID; id -u; id -g; id -G; tr -s ' ' < /proc/self/uid_map; "
      "tr -s ' ' < /proc/self/gid_map; ls /proc/self/fd | sort -n | tr '\\n' ' '; echo; exit 134",
      uid, gid, &e);
  EXPECT_EQ(said, absl::StrCat("1 0\n0\n0\n0\n 0 ", uid, " 1\n 0 ", gid, " 1\n0 1 2 3 \n"));
  EXPECT_EQ(e.signal(), SIGABRT) << e.Describe();

  // What the host sees: the mapped ids.
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  SpawnOptions o;
  o.path = "/bin/sh";
  o.args = {"-c", "read line"};
  o.fds = {{0, out[0]}};
  o.user_namespace = SpawnOptions::UserNamespace{uid, gid};
  absl::StatusOr<pid_t> pid = Spawn(o);
  ::close(out[0]);
  ASSERT_TRUE(pid.ok()) << pid.status();
  std::string status;
  for (int i = 0; i < 200 && status.find("Uid:") == std::string::npos; ++i) {
    status = ReadSmallFile(absl::StrCat("/proc/", *pid, "/status"));
  }
  EXPECT_NE(status.find(absl::StrCat("Uid:\t", uid, "\t", uid, "\t", uid, "\t", uid)),
            std::string::npos)
      << status;
  EXPECT_NE(status.find(absl::StrCat("Gid:\t", gid, "\t", gid, "\t", gid, "\t", gid)),
            std::string::npos)
      << status;
  ::close(out[1]);  // its read ends
  absl::StatusOr<Exit> done = Wait(*pid);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(done->exited());
}

TEST(SubprocessTest, UserNamespaceSpawnFailuresSayWhy) {
  if (!UserNamespaces()) GTEST_SKIP() << "this kernel refuses user namespaces here";
  SpawnOptions o;
  o.path = "/nonexistent/program";
  o.user_namespace = SpawnOptions::UserNamespace{static_cast<uint32_t>(::geteuid()),
                                                 static_cast<uint32_t>(::getegid())};
  absl::StatusOr<pid_t> missing = Spawn(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(missing.status().message().find("exec: No such file"), std::string::npos)
      << missing.status();
  EXPECT_EQ(missing.status().message().find("nonexistent"), std::string::npos);
  if (::geteuid() != 0) {
    // Someone else's id, without subordinate ids for it: newuidmap refuses.
    o.path = "/bin/true";
    o.user_namespace->uid = ::geteuid() + 1;
    absl::StatusOr<pid_t> refused = Spawn(o);
    EXPECT_FALSE(refused.ok());
  }
}

TEST(SubprocessTest, BadDescriptorMapsAreRefused) {
  SpawnOptions o;
  o.path = "/bin/true";
  o.fds = {{3, 1}, {3, 2}};
  EXPECT_EQ(Spawn(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.fds = {{3, 999}};  // not open
  EXPECT_EQ(Spawn(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.fds = {};
  o.path = "/nonexistent/program";
  absl::StatusOr<pid_t> missing = Spawn(o);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(missing.status().message().find("/nonexistent"), std::string::npos)
      << "no host path in the message: " << missing.status();
}

TEST(SubprocessTest, EnvironmentIsOnlyWhatWasPassed) {
  ::setenv("OPJIT_SUBPROCESS_TEST_SECRET", "leaked", 1);
  EXPECT_EQ(RunProgram("/usr/bin/env", {}, {}, {"A=1", "B=two words"}), "A=1\nB=two words\n");
  EXPECT_EQ(RunProgram("/usr/bin/env", {}), "");
  const std::vector<std::string> passed = FromEnvironment({"OPJIT_SUBPROCESS_TEST_SECRET", "OPJIT_UNSET_X"});
  EXPECT_EQ(passed, std::vector<std::string>{"OPJIT_SUBPROCESS_TEST_SECRET=leaked"});
  ::unsetenv("OPJIT_SUBPROCESS_TEST_SECRET");
  const std::vector<std::string> helper = HelperEnvironment();
  ASSERT_FALSE(helper.empty());
  EXPECT_EQ(helper[0], "PATH=/usr/bin:/bin");
}

TEST(SubprocessTest, OwnProcessGroupAndDefaultSignals) {
  // An ignored signal in this process must not stay ignored in the child.
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGUSR2, &ignore, &old), 0);
  const std::string out = RunSh(
      "echo $$; cut -d' ' -f5 /proc/self/stat; exec grep -E '^Sig(Ign|Blk):' /proc/self/status",
      {}, {"PATH=/usr/bin:/bin"});
  ::sigaction(SIGUSR2, &old, nullptr);
  std::istringstream in(out);
  std::string pid, pgid, line;
  in >> pid >> pgid;
  EXPECT_EQ(pid, pgid) << out;
  const uint64_t usr2_bit = 1ull << (SIGUSR2 - 1);
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const uint64_t mask = std::strtoull(line.substr(line.find(':') + 1).c_str(), nullptr, 16);
    if (line.rfind("SigBlk", 0) == 0) EXPECT_EQ(mask, 0u) << line;
    if (line.rfind("SigIgn", 0) == 0) EXPECT_EQ(mask & usr2_bit, 0u) << line;
  }
  // Without its own group it stays in ours.
  const std::string shared = RunSh("cut -d' ' -f5 /proc/$$/stat", {}, {}, /*own_group=*/false);
  EXPECT_EQ(shared, absl::StrCat(::getpgrp(), "\n"));
}

TEST(SubprocessTest, WaitReturnsTheCodeAndRusage) {
  Exit e;
  // Touch ~32 MiB so the peak RSS is clearly the child's own.
  RunSh("x=$(head -c 33554432 /dev/zero | tr '\\0' a | wc -c); exit 7", {}, {"PATH=/usr/bin:/bin"},
        true, &e);
  EXPECT_TRUE(e.exited());
  EXPECT_EQ(e.code(), 7);
  EXPECT_EQ(e.signal(), 0);
  EXPECT_FALSE(e.killed);
  EXPECT_GT(e.peak_rss_bytes(), 512u << 10);
  EXPECT_EQ(e.Describe(), "exited with status 7");
}

TEST(SubprocessTest, DescribesSignalsAndCores) {
  Exit e;
  RunSh("ulimit -c 0; kill -SEGV $$", {}, {"PATH=/usr/bin:/bin"}, true, &e);
  EXPECT_FALSE(e.exited());
  EXPECT_EQ(e.code(), -1);
  EXPECT_EQ(e.signal(), SIGSEGV);
  EXPECT_EQ(e.Describe(), "was killed by SIGSEGV (signal 11)");
  EXPECT_EQ(DescribeExit(SIGKILL), "was killed by SIGKILL (signal 9)");
  EXPECT_EQ(DescribeExit(SIGABRT | 0x80), "was killed by SIGABRT (signal 6) and dumped core");
  EXPECT_EQ(DescribeExit(3 << 8), "exited with status 3");
  EXPECT_EQ(SignalName(SIGTERM), "SIGTERM");
}

TEST(SubprocessTest, ReapGivesGraceThenKills) {
  SpawnOptions o;
  o.path = "/bin/sleep";
  o.args = {"30"};
  absl::StatusOr<pid_t> pid = Spawn(o);
  ASSERT_TRUE(pid.ok()) << pid.status();
  absl::StatusOr<std::optional<Exit>> early = WaitFor(*pid, absl::Milliseconds(50));
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_FALSE(early->has_value());
  const auto start = Clock::now();
  absl::StatusOr<Exit> e = Reap(*pid, absl::Milliseconds(100));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->killed);
  EXPECT_EQ(e->signal(), SIGKILL);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  // Reaped: a second wait finds no such child.
  EXPECT_FALSE(Wait(*pid).ok());

  // One that ends within its grace keeps its own status.
  o.path = "/bin/sh";
  o.args = {"-c", "sleep 0.05; exit 4"};
  o.env = {"PATH=/usr/bin:/bin"};
  pid = Spawn(o);
  ASSERT_TRUE(pid.ok()) << pid.status();
  e = Reap(*pid, absl::Seconds(30));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_FALSE(e->killed);
  EXPECT_EQ(e->code(), 4);
}

TEST(SubprocessTest, ReapCanEndTheWholeGroup) {
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  SpawnOptions o;
  o.path = "/bin/sh";
  o.args = {"-c", "sleep 30 & echo $!; wait"};
  o.env = {"PATH=/usr/bin:/bin"};
  o.fds = {{1, out[1]}};
  absl::StatusOr<pid_t> pid = Spawn(o);
  ::close(out[1]);
  ASSERT_TRUE(pid.ok()) << pid.status();
  char buf[32] = {0};
  ASSERT_GT(::read(out[0], buf, sizeof(buf) - 1), 0);
  ::close(out[0]);
  const pid_t grandchild = static_cast<pid_t>(std::atoi(buf));
  ASSERT_GT(grandchild, 0);
  absl::StatusOr<Exit> e = Reap(*pid, absl::ZeroDuration(), /*kill_group=*/true);
  ASSERT_TRUE(e.ok()) << e.status();
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (!Dead(grandchild) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(Dead(grandchild)) << "the group's other member survived";
}

TEST(SubprocessTest, TaggedHelpersCarryTheInstanceFirst) {
  SetInstanceTag("t3st/../x y");  // only the safe characters stay
  EXPECT_EQ(InstanceTag(), "t3stxy");
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  SpawnOptions o;
  o.path = "/bin/echo";
  o.args = {"hello"};
  o.fds = {{1, out[1]}};
  o.tag_instance = true;
  absl::StatusOr<pid_t> pid = Spawn(o);
  ::close(out[1]);
  ASSERT_TRUE(pid.ok()) << pid.status();
  char buf[128] = {0};
  ASSERT_GT(::read(out[0], buf, sizeof(buf) - 1), 0);
  ::close(out[0]);
  ASSERT_TRUE(Wait(*pid).ok());
  EXPECT_EQ(std::string(buf), "--instance t3stxy hello\n");
  SetInstanceTag("");
}

// A stand-in for a helper a killed daemon left behind: a shell named
// `program` with "--instance <tag>" on its command line, blocked reading
// `hold` (it exits when that pipe closes). With `orphan`, it is
// re-parented away from this process (double fork), as after the daemon's
// death. Returns its pid.
pid_t FakeHelper(const std::string& program, const std::string& tag, int hold, bool orphan) {
  int report[2];
  if (::pipe(report) != 0) return -1;
  const pid_t first = ::fork();
  if (first == 0) {
    const pid_t second = orphan ? ::fork() : 0;
    if (second == 0) {
      ::dup2(hold, 0);
      const pid_t me = ::getpid();
      if (::write(report[1], &me, sizeof(me)) != sizeof(me)) ::_exit(1);
      ::close(report[0]);
      ::close(report[1]);
      const char* argv[] = {program.c_str(), "-c", "read x", "--instance", tag.c_str(), nullptr};
      ::execv("/bin/sh", const_cast<char**>(argv));
      ::_exit(127);
    }
    ::_exit(0);
  }
  ::close(report[1]);
  pid_t pid = -1;
  if (::read(report[0], &pid, sizeof(pid)) != sizeof(pid)) pid = -1;
  ::close(report[0]);
  if (orphan) ::waitpid(first, nullptr, 0);
  return pid;
}

TEST(SubprocessTest, EndLeftoversKillsOnlyOrphansOfThisInstance) {
  const std::string program = "opjit-subprocess-test-fake";
  const std::string mine = absl::StrCat("mine", ::getpid());
  const std::string other = absl::StrCat("other", ::getpid());
  int hold[2];
  // CLOEXEC: only the fakes' stdin (dup2 clears the flag) holds the read
  // end, and only this process the write end.
  ASSERT_EQ(::pipe2(hold, O_CLOEXEC), 0);
  const pid_t orphan_mine = FakeHelper(program, mine, hold[0], /*orphan=*/true);
  const pid_t orphan_other = FakeHelper(program, other, hold[0], /*orphan=*/true);
  const pid_t child_mine = FakeHelper(program, mine, hold[0], /*orphan=*/false);
  ::close(hold[0]);
  ASSERT_GT(orphan_mine, 0);
  ASSERT_GT(orphan_other, 0);
  ASSERT_GT(child_mine, 0);
  // Wait until all three run as the fake program (after their exec).
  const auto until = Clock::now() + std::chrono::seconds(10);
  auto execed = [&](pid_t p) {
    const std::string c = opjit::testing::ReadProcFile("/proc/" + std::to_string(p) + "/cmdline");
    return c.rfind(program + '\0', 0) == 0;
  };
  while (!(execed(orphan_mine) && execed(orphan_other) && execed(child_mine)) &&
         Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_NE(StatField(orphan_mine, 4), absl::StrCat(::getpid()));

  EXPECT_EQ(EndLeftovers(mine, {"opjit-exec-worker", program}), 1);
  const auto dead_by = Clock::now() + std::chrono::seconds(10);
  while (!Dead(orphan_mine) && Clock::now() < dead_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(Dead(orphan_mine)) << "the leftover of this instance survived";
  EXPECT_FALSE(Dead(orphan_other)) << "another instance's helper was killed";
  EXPECT_FALSE(Dead(child_mine)) << "this process's own child was killed";
  // Names that are not helpers are never touched.
  EXPECT_EQ(EndLeftovers(other, {"opjit-exec-worker"}), 0);
  EXPECT_EQ(EndLeftovers("", {program}), 0);

  ::close(hold[1]);  // the others read EOF and exit
  int status = 0;
  EXPECT_EQ(::waitpid(child_mine, &status, 0), child_mine);
}

// /etc/subuid's format: by name or uid, first match, comments and bad
// lines skipped; a malformed matching line or one past the id space: none.
TEST(SubordinateIdsTest, FindsTheUsersFirstRange) {
  using subordinate::Find;
  const std::string text =
      "# comment\nalice:100000:65536\n  opjit:1879048192:65536  \n1001:300000:10\n"
      "opjit:5:5\nbroken line\n";
  auto r = Find(text, "opjit", 999);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->first, 1879048192u);
  EXPECT_EQ(r->count, 65536u);
  r = Find(text, "bob", 1001);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->first, 300000u);
  EXPECT_FALSE(Find(text, "bob", 1002).has_value());
  EXPECT_FALSE(Find(text, "", 1002).has_value());
  EXPECT_FALSE(Find("carol:x:10\n", "carol", 1).has_value());
  EXPECT_FALSE(Find("carol:10:0\n", "carol", 1).has_value());
  EXPECT_FALSE(Find("carol:4294967000:1000\n", "carol", 1).has_value());
}

}  // namespace
}  // namespace opjit::subprocess

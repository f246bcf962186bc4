// ProcessRunner through its seams (process_runner.h): ProcessRunnerOptions::spawn
// records what the runner asks of each executor process (program, flags,
// environment, descriptors, namespaces, ids) and still starts the real
// opjit-exec-worker, or makes a start fail, or hands back a worker that dies
// at once; ProcessRunnerOptions::clock is a FakeClock, so idle workers are
// stopped by stepping time, never by sleeping.
//
// The kernel is a placeholder with an empty object: every call starts (or
// reuses) a worker, which answers that it cannot load it. That is enough to
// drive the pools, and needs no compiler. Runs unprivileged and as root: a
// uid range is only recorded, and the worker started without the uid change
// where this process cannot give it.
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/opjit/wire/fast_channel.h"
#include "server/common/clock.h"
#include "server/common/error_info.h"
#include "server/common/subprocess.h"
#include "server/compiler/kernel_compiler.h"
#include "server/runner/process_runner.h"
#include "server/tensor/region.h"

namespace opjit::runner {
namespace {

using subprocess::SpawnOptions;

const char kWorker[] = OPJIT_BINARY_DIR "/bin/opjit-exec-worker";

// The value after `flag` in `args`; nullopt without it.
std::optional<std::string> Flag(const std::vector<std::string>& args, const std::string& flag) {
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == flag) return args[i + 1];
  }
  return std::nullopt;
}

// Starts the real worker for `o`. Without root, a worker cannot switch to
// the uid a range gave it: it keeps this process's (the recorded options
// still name the range's).
absl::StatusOr<pid_t> RealSpawn(SpawnOptions o) {
  if (::geteuid() != 0 && !o.user_namespace) {
    for (size_t i = 0; i + 1 < o.args.size(); ++i) {
      if (o.args[i] == "--uid" || o.args[i] == "--gid") o.args[i + 1] = "-1";
    }
  }
  return subprocess::Spawn(o);
}

// Whether `pid` is gone or a zombie (dead, not yet reaped).
bool Dead(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return true;
  const size_t close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z' ||
         line[close + 2] == 'X';
}

// Waits (bounded) until `pid` has died.
bool AwaitDeath(pid_t pid) {
  for (int i = 0; i < 2000; ++i) {
    if (Dead(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// The spawn seam: records every SpawnOptions and pid, and starts the real
// worker unless told otherwise. `hold` makes starts wait until Release().
class Recorder {
 public:
  enum class Mode { kReal, kFail, kDieAtOnce };

  ExecutorSpawn Fn() {
    return [this](const SpawnOptions& o) { return Spawn(o); };
  }
  void SetMode(Mode m) {
    std::lock_guard<std::mutex> lock(mu_);
    mode_ = m;
  }
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = false;
    cv_.notify_all();
  }
  // Waits (bounded) until `n` starts wait in Hold().
  bool AwaitWaiting(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return waiting_ >= n; });
  }
  std::vector<SpawnOptions> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }
  std::vector<pid_t> pids() {
    std::lock_guard<std::mutex> lock(mu_);
    return pids_;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(seen_.size());
  }
  int most_at_once() {
    std::lock_guard<std::mutex> lock(mu_);
    return most_at_once_;
  }

 private:
  absl::StatusOr<pid_t> Spawn(const SpawnOptions& o) {
    Mode mode;
    {
      std::unique_lock<std::mutex> lock(mu_);
      seen_.push_back(o);
      mode = mode_;
      ++waiting_;
      most_at_once_ = std::max(most_at_once_, waiting_);
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::seconds(30), [&] { return !held_; });
      --waiting_;
    }
    if (mode == Mode::kFail) {
      // A real failed start: the program is not there.
      SpawnOptions missing = o;
      missing.path = o.path + ".missing";
      return subprocess::Spawn(missing);
    }
    absl::StatusOr<pid_t> pid = RealSpawn(o);
    if (pid.ok()) {
      if (mode == Mode::kDieAtOnce) ::kill(*pid, SIGKILL);
      std::lock_guard<std::mutex> lock(mu_);
      pids_.push_back(*pid);
    }
    return pid;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  Mode mode_ = Mode::kReal;
  bool held_ = false;
  int waiting_ = 0, most_at_once_ = 0;
  std::vector<SpawnOptions> seen_;
  std::vector<pid_t> pids_;
};

class ProcessRunnerSeamTest : public ::testing::Test {
 protected:
  ProcessRunnerOptions Options() {
    ProcessRunnerOptions o;
    o.worker_path = kWorker;
    o.spawn = recorder_.Fn();
    o.clock = &clock_;
    o.namespace_memory_bytes = 0;  // no cgroup: nothing of the host's touched
    o.workers_per_namespace = 1;
    o.idle_ms = 1000;
    return o;
  }
  std::unique_ptr<ProcessRunner> Make(const ProcessRunnerOptions& o) {
    auto r = ProcessRunner::Create(o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }
  // An instance of a placeholder kernel in `ns`.
  std::shared_ptr<KernelInstance> Instance(ProcessRunner& runner, const std::string& ns) {
    // A CPU kernel with an empty artifact: no object file.
    auto k = std::make_shared<compiler::CompiledKernel>();
    k->cache_key = std::string(64, 'a');
    InstanceSpec spec;
    spec.ns = ns;
    spec.label = ns + "/placeholder v1";
    spec.kernel = std::move(k);
    spec.entry = "Kernel";
    spec.inputs = {{"float32", {4}}};
    auto inst = runner.Instance(spec);
    EXPECT_TRUE(inst.ok()) << inst.status();
    return inst.ok() ? *inst : nullptr;
  }
  // One call that needs a worker: the worker's answer, or the runner's when
  // it had none.
  static absl::Status Touch(KernelInstance& inst) { return inst.InferShape().status(); }
  // Whether `s` came from a started worker (it could not load the
  // placeholder), not from the runner failing to start one.
  static bool FromWorker(const absl::Status& s) {
    return !s.ok() && !absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s) &&
           !absl::IsAborted(s);
  }

  FakeClock clock_;
  Recorder recorder_;
};

TEST_F(ProcessRunnerSeamTest, AWorkerGetsOnlyWhatTheRunnerListsAndRunsTheRealExecutor) {
  ::setenv("OPJIT_SEAM_TEST_SECRET", "daemon-only", 1);
  ProcessRunnerOptions o = Options();
  o.memory_bytes = 3ull << 30;
  o.scratch_bytes = 5ull << 20;
  o.threads_per_executor = 77;
  o.arena_bytes = 8ull << 20;
  auto runner = Make(o);
  ASSERT_NE(runner, nullptr);
  EXPECT_EQ(recorder_.calls(), 0);  // Create starts nothing
  auto inst = Instance(*runner, "tenant-a");
  ASSERT_NE(inst, nullptr);
  const absl::Status s = Touch(*inst);
  EXPECT_TRUE(FromWorker(s)) << s;
  ASSERT_EQ(recorder_.calls(), 1);
  const SpawnOptions got = recorder_.seen()[0];
  EXPECT_EQ(got.path, kWorker);
  EXPECT_EQ(Flag(got.args, "--namespace"), "tenant-a");
  EXPECT_EQ(Flag(got.args, "--memory-bytes"), std::to_string(3ull << 30));
  EXPECT_EQ(Flag(got.args, "--scratch-bytes"), std::to_string(5ull << 20));
  EXPECT_EQ(Flag(got.args, "--arena-bytes"), std::to_string(8ull << 20));
  EXPECT_EQ(Flag(got.args, "--max-threads"), "77");
  EXPECT_EQ(Flag(got.args, "--parent-pid"), std::to_string(::getpid()));
  // No uid range: no per-uid process cap, unless a user namespace counts
  // its own.
  if (!got.user_namespace) {
    EXPECT_EQ(Flag(got.args, "--max-processes"), "0");
    EXPECT_EQ(Flag(got.args, "--uid"), "-1");
  }
  // Nothing of this process's environment but what the runner lists.
  for (const std::string& e : got.env) {
    EXPECT_EQ(e.find("OPJIT_SEAM_TEST_SECRET"), std::string::npos) << e;
    const std::string name = e.substr(0, e.find('='));
    EXPECT_TRUE(name == "PATH" || name == "TMPDIR" || name == "OPJIT_CUDA_DRIVER" ||
                name == kNoZeroFillEnv)
        << e;
  }
  EXPECT_NE(std::find(got.env.begin(), got.env.end(), "PATH=/usr/bin:/bin"), got.env.end());
  // Exactly stderr, the control socket and the arena.
  std::set<int> child_fds;
  for (const auto& m : got.fds) child_fds.insert(m.child_fd);
  EXPECT_EQ(child_fds, (std::set<int>{2, 3, 4}));
  EXPECT_TRUE(got.own_process_group);
  EXPECT_TRUE(got.tag_instance);
  // Namespaces as the host allows them, never both kinds.
  const bool isolated = subprocess::PrivateNamespaces();
  EXPECT_EQ(Flag(got.args, "--isolate"), isolated ? "1" : "0");
  if (got.user_namespace) {
    EXPECT_NE(::geteuid(), 0u);
    EXPECT_EQ(Flag(got.args, "--userns"), "1");
  } else {
    EXPECT_EQ(got.new_pid_namespace, isolated && subprocess::PidNamespaces());
  }
  ::unsetenv("OPJIT_SEAM_TEST_SECRET");
}

TEST_F(ProcessRunnerSeamTest, EachNamespaceTakesAUidOfItsOwnAndKeepsIt) {
  ProcessRunnerOptions o = Options();
  o.private_namespaces = false;  // ids on the command line, not a user namespace
  // A range nobody uses; only as root do workers switch to it.
  o.uid_first = 2100000000u + static_cast<uint32_t>(::getpid() % 100000) * 4;
  o.uid_last = o.uid_first + 1;
  o.gid_first = o.uid_first + 2;
  auto runner = Make(o);
  ASSERT_NE(runner, nullptr);
  auto a = Instance(*runner, "ns-a");
  auto b = Instance(*runner, "ns-b");
  auto c = Instance(*runner, "ns-c");
  ASSERT_TRUE(a && b && c);
  EXPECT_TRUE(FromWorker(Touch(*a)));
  EXPECT_TRUE(FromWorker(Touch(*b)));
  ASSERT_EQ(recorder_.calls(), 2);
  const auto seen = recorder_.seen();
  EXPECT_EQ(Flag(seen[0].args, "--uid"), std::to_string(o.uid_first));
  EXPECT_EQ(Flag(seen[0].args, "--gid"), std::to_string(o.gid_first));
  EXPECT_EQ(Flag(seen[1].args, "--uid"), std::to_string(o.uid_first + 1));
  EXPECT_EQ(Flag(seen[1].args, "--gid"), std::to_string(o.gid_first + 1));
  // With a uid of its own, RLIMIT_NPROC caps the whole namespace.
  EXPECT_EQ(Flag(seen[0].args, "--max-processes"), std::to_string(o.threads_per_namespace));
  // The range is used up: a third namespace is refused before any start.
  const absl::Status third = Touch(*c);
  EXPECT_TRUE(absl::IsResourceExhausted(third)) << third;
  EXPECT_EQ(GetReason(third)->reason, reason::kWorkerUnavailable);
  EXPECT_EQ(recorder_.calls(), 2);
  // ns-a's worker, stopped when idle, comes back with the same uid (never
  // given to another namespace while the runner lives).
  clock_.Advance(std::chrono::milliseconds(o.idle_ms + 1));
  runner->Maintain();
  EXPECT_EQ(runner->Stats().workers_live, 0u);
  EXPECT_TRUE(FromWorker(Touch(*a)));
  ASSERT_EQ(recorder_.calls(), 3);
  EXPECT_EQ(Flag(recorder_.seen()[2].args, "--uid"), std::to_string(o.uid_first));
}

// The daemon claims each namespace's uid host-wide (ProcessRunnerOptions::
// claim_uid): a namespace runs as the uid its claim gave, asked once; a
// refused claim refuses the namespace, before any start, with its code.
TEST_F(ProcessRunnerSeamTest, ANamespaceRunsAsTheUidItsClaimGaveAndARefusalRefusesIt) {
  ProcessRunnerOptions o = Options();
  o.private_namespaces = false;  // ids on the command line, not a user namespace
  o.uid_first = 2100000000u + static_cast<uint32_t>(::getpid() % 100000) * 4;
  o.uid_last = o.uid_first + 3;
  std::vector<std::pair<uint32_t, uint32_t>> asked;
  o.claim_uid = [&](uint32_t first, uint32_t last) -> absl::StatusOr<uint32_t> {
    asked.emplace_back(first, last);
    if (asked.size() == 1) return last;  // others hold the lower ones
    return absl::ResourceExhaustedError("every uid is taken by other opjitd servers on this host");
  };
  auto runner = Make(o);
  ASSERT_NE(runner, nullptr);
  auto a = Instance(*runner, "ns-a");
  auto b = Instance(*runner, "ns-b");
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(FromWorker(Touch(*a)));
  EXPECT_TRUE(FromWorker(Touch(*a)));
  ASSERT_EQ(recorder_.calls(), 1);
  EXPECT_EQ(Flag(recorder_.seen()[0].args, "--uid"), std::to_string(o.uid_last));
  const absl::Status refused = Touch(*b);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_NE(refused.message().find("other opjitd servers"), std::string::npos) << refused;
  EXPECT_EQ(GetReason(refused)->reason, reason::kWorkerUnavailable);
  EXPECT_EQ(recorder_.calls(), 1);
  ASSERT_EQ(asked.size(), 2u);  // once per namespace
  EXPECT_EQ(asked[0], std::make_pair(o.uid_first, o.uid_last));
}

TEST_F(ProcessRunnerSeamTest, AFailedStartAnswersUnavailableWithoutPathsAndFreesItsPlace) {
  auto runner = Make(Options());  // one worker per namespace
  ASSERT_NE(runner, nullptr);
  auto inst = Instance(*runner, "ns-fail");
  ASSERT_NE(inst, nullptr);
  recorder_.SetMode(Recorder::Mode::kFail);
  const absl::Status s = Touch(*inst);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_EQ(std::string(s.message()).find('/'), std::string::npos) << s;
  EXPECT_EQ(runner->Stats().workers_live, 0u);
  EXPECT_EQ(runner->Stats().workers_started, 0u);
  // The failed start gave its place back: the next call starts a worker
  // (with the pool's one place leaked it would wait for the deadline).
  recorder_.SetMode(Recorder::Mode::kReal);
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  EXPECT_EQ(recorder_.calls(), 2);
  EXPECT_EQ(runner->Stats().workers_live, 1u);
}

TEST_F(ProcessRunnerSeamTest, AWorkerThatDiesAtStartFailsOnlyThatCallAndIsReaped) {
  auto runner = Make(Options());
  ASSERT_NE(runner, nullptr);
  auto inst = Instance(*runner, "ns-die");
  ASSERT_NE(inst, nullptr);
  recorder_.SetMode(Recorder::Mode::kDieAtOnce);
  const absl::Status s = Touch(*inst);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_EQ(std::string(s.message()).find('/'), std::string::npos) << s;
  ASSERT_EQ(recorder_.pids().size(), 1u);
  const pid_t dead = recorder_.pids()[0];
  // Reaped by the runner: no longer our child.
  EXPECT_EQ(::waitpid(dead, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
  EXPECT_EQ(runner->Stats().workers_live, 0u);
  // Nothing is quarantined for it: the next call starts a fresh worker.
  recorder_.SetMode(Recorder::Mode::kReal);
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  EXPECT_EQ(recorder_.calls(), 2);  // the second call reused it
  EXPECT_EQ(runner->Stats().workers_live, 1u);
}

// An idle worker killed from outside (an operator, the OOM killer) is found
// dead when the next call takes it, before anything is sent: that call runs
// in a fresh worker, and no crash is counted (nor charged to its kernel).
TEST_F(ProcessRunnerSeamTest, AnIdleWorkerKilledFromOutsideIsReplacedAndTheNextCallRuns) {
  ProcessRunnerOptions o = Options();
  o.quarantine_after = 1;  // one charge would quarantine the kernel
  auto runner = Make(o);
  ASSERT_NE(runner, nullptr);
  auto inst = Instance(*runner, "ns-kill");
  ASSERT_NE(inst, nullptr);
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  for (int round = 0; round < 2; ++round) {
    ASSERT_EQ(recorder_.pids().size(), static_cast<size_t>(round + 1));
    const pid_t pid = recorder_.pids().back();
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    ASSERT_TRUE(AwaitDeath(pid));
    EXPECT_TRUE(FromWorker(Touch(*inst)));
    EXPECT_EQ(recorder_.calls(), round + 2);  // a fresh worker
    EXPECT_EQ(runner->Stats().worker_crashes, 0u);
    EXPECT_EQ(runner->Stats().quarantined, 0u);
    EXPECT_EQ(runner->Stats().workers_live, 1u);
  }
}

TEST_F(ProcessRunnerSeamTest, ANamespaceStartsAtMostWorkersPerNamespaceAndOthersWait) {
  ProcessRunnerOptions o = Options();
  o.workers_per_namespace = 2;
  auto runner = Make(o);
  ASSERT_NE(runner, nullptr);
  auto inst = Instance(*runner, "ns-bound");
  ASSERT_NE(inst, nullptr);
  // Three calls at once while starts are held: two start workers, the third
  // waits in the pool and then takes one of theirs.
  recorder_.Hold();
  std::vector<absl::Status> got(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) threads.emplace_back([&, i] { got[i] = Touch(*inst); });
  ASSERT_TRUE(recorder_.AwaitWaiting(2));
  recorder_.Release();
  for (auto& t : threads) t.join();
  for (const auto& s : got) EXPECT_TRUE(FromWorker(s)) << s;
  EXPECT_EQ(recorder_.calls(), 2);
  EXPECT_EQ(recorder_.most_at_once(), 2);
  EXPECT_EQ(runner->Stats().workers_live, 2u);
  // Another namespace has a pool of its own.
  auto other = Instance(*runner, "ns-other");
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(FromWorker(Touch(*other)));
  EXPECT_EQ(recorder_.calls(), 3);
  EXPECT_EQ(Flag(recorder_.seen()[2].args, "--namespace"), "ns-other");
  EXPECT_EQ(runner->Stats().workers_live, 3u);
}

TEST_F(ProcessRunnerSeamTest, MaintainStopsWorkersIdleLongerThanIdleMsOnTheInjectedClock) {
  auto runner = Make(Options());  // idle_ms = 1000
  ASSERT_NE(runner, nullptr);
  auto inst = Instance(*runner, "ns-idle");
  ASSERT_NE(inst, nullptr);
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  ASSERT_EQ(recorder_.pids().size(), 1u);
  const pid_t pid = recorder_.pids()[0];
  clock_.Advance(std::chrono::milliseconds(1000));
  runner->Maintain();  // exactly idle_ms: stays
  EXPECT_EQ(runner->Stats().workers_live, 1u);
  EXPECT_FALSE(Dead(pid));
  clock_.Advance(std::chrono::milliseconds(1));
  runner->Maintain();
  EXPECT_EQ(runner->Stats().workers_live, 0u);
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);  // stopped and reaped
  // The next call starts a new one; using it resets its idle time.
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  EXPECT_EQ(recorder_.calls(), 2);
  clock_.Advance(std::chrono::milliseconds(600));
  EXPECT_TRUE(FromWorker(Touch(*inst)));
  clock_.Advance(std::chrono::milliseconds(600));
  runner->Maintain();
  EXPECT_EQ(runner->Stats().workers_live, 1u);
  EXPECT_EQ(recorder_.calls(), 2);
}

TEST_F(ProcessRunnerSeamTest, AFastChannelsExecutorGetsItsRingAndItsNamespacesUid) {
  ProcessRunnerOptions o = Options();
  o.private_namespaces = false;
  o.uid_first = 2100000000u + static_cast<uint32_t>(::getpid() % 100000) * 4;
  o.uid_last = o.uid_first + 1;
  auto runner = Make(o);
  ASSERT_NE(runner, nullptr);
  auto inst = Instance(*runner, "ns-a");
  ASSERT_NE(inst, nullptr);
  EXPECT_TRUE(FromWorker(Touch(*inst)));  // ns-a takes uid_first
  auto ring = tensor::Region::CreateShm(absl::StrCat("/opjit-seamtest-", ::getpid(), "-ring"),
                                        fast::kChannelBytes, tensor::RegionInfo{});
  ASSERT_TRUE(ring.ok()) << ring.status();
  ChannelSpec spec;
  spec.ns = "ns-a";
  spec.label = "ns-a/channel";
  spec.memory = std::shared_ptr<const tensor::Region>(*std::move(ring));
  spec.resolve_handle = [](uint64_t) -> absl::StatusOr<HandleBinding> {
    return absl::NotFoundError("no handles here");
  };
  spec.resolve_region = [](uint64_t) -> absl::StatusOr<std::shared_ptr<const tensor::Region>> {
    return absl::NotFoundError("no regions here");
  };
  auto channel = runner->OpenChannel(spec);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_EQ(recorder_.calls(), 2);
  const SpawnOptions got = recorder_.seen()[1];
  EXPECT_EQ(Flag(got.args, "--namespace"), "ns-a");
  EXPECT_EQ(Flag(got.args, "--uid"), std::to_string(o.uid_first));  // the namespace's own
  EXPECT_EQ(Flag(got.args, "--channel-bytes"), std::to_string(fast::kChannelBytes));
  std::map<int, int> fds;
  for (const auto& m : got.fds) fds[m.child_fd] = m.parent_fd;
  EXPECT_EQ(fds.size(), 4u);  // stderr, socket, arena, and the ring on 5
  EXPECT_EQ(fds[5], spec.memory->fd());
  EXPECT_EQ((*channel)->pid(), recorder_.pids()[1]);
  EXPECT_TRUE((*channel)->alive());
  EXPECT_EQ(runner->Stats().workers_live, 2u);
  (*channel)->Close();
  EXPECT_FALSE((*channel)->alive());
  EXPECT_EQ(runner->Stats().workers_live, 1u);
  EXPECT_EQ(::waitpid(recorder_.pids()[1], nullptr, WNOHANG), -1);  // reaped
  // A channel whose executor cannot start is refused, naming no path.
  recorder_.SetMode(Recorder::Mode::kFail);
  auto refused = runner->OpenChannel(spec);
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
  EXPECT_EQ(std::string(refused.status().message()).find('/'), std::string::npos);
  EXPECT_EQ(runner->Stats().workers_live, 1u);
}

}  // namespace
}  // namespace opjit::runner

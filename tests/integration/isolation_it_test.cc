// Process isolation end to end: the real opjitd with its default
// [exec] isolation = "process", real clients, and kernels that misbehave.
// Each test is a row of the failure table in the README's threat model:
// whatever the kernel does, the daemon stays up, the registry stays intact,
// other clients' calls, regions and backward contexts are unharmed, and only
// the guilty call fails, with a status a client can act on.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <cmath>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "client/cpp/shm_region.h"
#include "server/common/error_info.h"
#include "tests/integration/daemon_harness.h"
#include "tests/unit/testing/procfs.h"

namespace opjit::testing {
namespace {

using ::testing::HasSubstr;
using client::InlineTensor;
using client::ShmTensor;
using Clock = std::chrono::steady_clock;

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

// The children of `pid` whose command is the executor, with their CPU time
// (utime + stime, in clock ticks). The health monitor's short-lived
// "opjit-exec-worker --probe" children are not executors and are left out.
std::map<pid_t, long> ExecWorkers(pid_t daemon) {
  std::map<pid_t, long> out;
  for (const ProcInfo& p : ListProcesses()) {
    if (p.comm != "opjit-exec-work" || p.ppid != daemon) continue;
    if (p.cmdline.find("--probe") != std::string::npos) continue;
    out[p.pid] = p.cpu_ticks;
  }
  return out;
}

// A kernel with one float32 input x[8] and one output y[8].
constexpr char kHeader[] = R"(
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include "custom_aot_extra.h"
)";

class IsolationIT : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon(""); }

  void StartDaemon(const std::string& exec_config) {
    c_.reset();
    daemon_.reset();
    std::vector<std::string> args;
    if (!exec_config.empty()) {
      const std::string cfg = tmp_.path() + "/exec.toml";
      std::ofstream(cfg) << "[exec]\n" << exec_config;
      args = {"--config", cfg};
    }
    daemon_ = std::make_unique<Daemon>(tmp_.path() + "/state", args);
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
    c_ = daemon_->NewClient();
  }

  // Registers `name` in `ns` with `body` as the kernel's body (it sees x, y,
  // n) and, optionally, an Init. Returns the registration's status.
  absl::Status RegisterKernel(const std::string& ns, const std::string& name,
                              const std::string& body, const std::string& init = "") {
    std::string src = kHeader;
    if (!init.empty()) {
      src += "extern \"C\" int KInit(int*, int64_t**, const char**, AotExtra* extra) {\n" + init +
             "\nreturn 0; }\n";
    }
    src += "extern \"C\" int K(int, void** params, int*, int64_t** shapes, const char**, void*, "
           "void* extra) {\n  float* x = static_cast<float*>(params[0]);\n"
           "  float* y = static_cast<float*>(params[1]);\n  const int64_t n = shapes[0][0];\n"
           "  (void)x; (void)y; (void)n;\n" +
           body + "\n  return 0;\n}\n";
    v1::OpDef op = FloatUnaryOp(name, "K", src);
    op.set_namespace_(ns);
    return c_->Register(op).status();
  }

  v1::ForwardRequest Call(const std::string& ns, const std::string& op,
                          std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8}) {
    v1::ForwardRequest req;
    req.set_namespace_(ns);
    req.set_op(op);
    *req.add_inputs()->add_tensors() = InlineTensor("float32", {int64_t(x.size())}, Bytes(x));
    return req;
  }

  // The daemon answers, and still has every op it had.
  void ExpectHealthy(size_t ops) {
    ASSERT_TRUE(daemon_->running());
    auto info = c_->Info();
    ASSERT_TRUE(info.ok()) << info.status() << daemon_->Log();
    auto list = c_->List("");
    ASSERT_TRUE(list.ok()) << list.status();
    EXPECT_EQ(list->size(), ops);
  }

  TempDir tmp_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> c_;
};

constexpr char kCopy[] = "for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i];";

TEST_F(IsolationIT, CrashesFailOnlyTheirCallAndInitRunsAgain) {
  // Init counts the instances made in its process; the kernel reports it.
  v1::OpDef op;
  {
    const std::string src = std::string(kHeader) + R"(
static int g_inits = 0;
extern "C" int KInit(int*, int64_t**, const char**, AotExtra*) { ++g_inits; return 0; }
extern "C" int K(int, void** params, int*, int64_t** shapes, const char**, void*, void* extra) {
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < shapes[0][0]; ++i) y[i] = g_inits;
  return 0;
}
)";
    op.set_name("counter");
    op.add_inputs()->set_name("x");
    op.add_outputs()->set_name("y");
    op.add_dtype_formats()->add_dtypes("float32");
    op.mutable_dtype_formats(0)->add_dtypes("float32");
    auto* impl = op.add_implementations();
    impl->set_target("CPU");
    impl->set_entry("K");
    impl->set_source(src);
    ASSERT_TRUE(c_->Register(op).ok());
  }
  ASSERT_TRUE(RegisterKernel("default", "segv", "*static_cast<volatile int*>(nullptr) = 1;").ok());
  ASSERT_TRUE(RegisterKernel("default", "abort", "abort();").ok());
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  // State that must survive: a region with data, and a backward context.
  auto region = c_->CreateRegion("", "keep", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  auto map = client::ShmMapping::Open(region->shm_key(), region->byte_size());
  ASSERT_TRUE(map.ok());
  std::memcpy((*map)->data(), "precious", 8);
  auto tanh = client::LoadOpSpec(SourceDir() + "/kernels/examples/tanh_grad.json");
  ASSERT_TRUE(tanh.ok());
  ASSERT_TRUE(c_->Register(*tanh).ok());
  tanh = client::LoadOpSpec(SourceDir() + "/kernels/examples/tanh.json");
  ASSERT_TRUE(c_->Register(*tanh).ok());
  auto fwd_req = Call("default", "tanh", {0.5f, -0.5f});
  fwd_req.add_requires_grad(true);
  auto fwd = c_->Forward(fwd_req);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_FALSE(fwd->context_id().empty());

  auto first = c_->Forward(Call("default", "counter"));
  ASSERT_TRUE(first.ok()) << first.status() << daemon_->Log();
  EXPECT_EQ(Floats(first->outputs(0).inline_data())[0], 1.0f);

  auto segv = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(segv.status().code(), absl::StatusCode::kAborted) << segv.status();
  EXPECT_THAT(std::string(segv.status().message()), HasSubstr("default/segv"));
  EXPECT_THAT(std::string(segv.status().message()), HasSubstr("SIGSEGV"));
  ExpectHealthy(6);

  auto abrt = c_->Forward(Call("default", "abort"));
  EXPECT_EQ(abrt.status().code(), absl::StatusCode::kAborted) << abrt.status();
  EXPECT_THAT(std::string(abrt.status().message()), HasSubstr("SIGABRT"));
  ExpectHealthy(6);

  // A fresh process: Init ran again there, once.
  auto again = c_->Forward(Call("default", "counter"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Floats(again->outputs(0).inline_data())[0], 1.0f);
  auto good = c_->Forward(Call("default", "double"));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(Floats(good->outputs(0).inline_data())[7], 16.0f);

  EXPECT_EQ(std::memcmp((*map)->data(), "precious", 8), 0);
  v1::BackwardRequest bwd;
  bwd.set_context_id(fwd->context_id());
  *bwd.add_grad_outputs() = InlineTensor("float32", {2}, Bytes({1, 1}));
  auto grads = c_->Backward(bwd);
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_NEAR(Floats(grads->grad_inputs(0).tensors(0).inline_data())[0], 1 - std::tanh(0.5f) * std::tanh(0.5f),
              1e-5);
  EXPECT_THAT(daemon_->Log(), HasSubstr("default/segv"));
}

TEST_F(IsolationIT, OtherNamespacesCallsCompleteWhileOneCrashes) {
  ASSERT_TRUE(RegisterKernel("bob", "double", kCopy).ok());
  ASSERT_TRUE(RegisterKernel("eve", "segv", "*static_cast<volatile int*>(nullptr) = 1;").ok());
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, bad{0};
  std::thread bob([&] {
    auto c = daemon_->NewClient();
    while (!stop) {
      auto r = c->Forward(Call("bob", "double", {1, 2, 3, 4, 5, 6, 7, float(ok.load())}));
      if (r.ok() && Floats(r->outputs(0).inline_data())[7] == 2.0f * ok.load()) {
        ok++;
      } else {
        bad++;
      }
    }
  });
  for (int i = 0; i < 3; ++i) {  // the default quarantine_after is 3
    auto r = c_->Forward(Call("eve", "segv"));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  }
  while (ok.load() < 50 && bad.load() == 0) std::this_thread::yield();
  stop = true;
  bob.join();
  EXPECT_EQ(bad.load(), 0);
  ExpectHealthy(2);
}

TEST_F(IsolationIT, RepeatedCrashesQuarantineTheKernelUntilItIsRegisteredAgain) {
  StartDaemon("quarantine_after = 2\n");
  ASSERT_TRUE(RegisterKernel("default", "segv", "*static_cast<volatile int*>(nullptr) = 1;").ok());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(c_->Forward(Call("default", "segv")).status().code(), absl::StatusCode::kAborted);
  }
  auto q = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(q.status().code(), absl::StatusCode::kFailedPrecondition) << q.status();
  EXPECT_THAT(std::string(q.status().message()), HasSubstr("quarantined"));
  // Fixed and registered again: a new version runs.
  ASSERT_TRUE(RegisterKernel("default", "segv", kCopy).ok());
  auto fixed = c_->Forward(Call("default", "segv"));
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(Floats(fixed->outputs(0).inline_data())[1], 4.0f);
}

TEST_F(IsolationIT, SpinningKernelIsKilledAtTheDeadlineAndTheCpuIsFreed) {
  StartDaemon("kernel_timeout_ms = 20000\n");
  ASSERT_TRUE(RegisterKernel("default", "spin", "for (volatile long i = 0;; ++i) {}").ok());
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  auto fast = client::Client::Connect(
      {.address = daemon_->address(), .timeout = std::chrono::milliseconds(1500)});
  ASSERT_TRUE(fast.ok());
  // Warm the worker pool so the deadline measures the kernel.
  ASSERT_TRUE(c_->Forward(Call("default", "double")).ok());
  const auto t0 = Clock::now();
  auto r = (*fast)->Forward(Call("default", "spin"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  // The spinning worker is gone: the executors together burn (almost) no CPU.
  std::map<pid_t, long> before = ExecWorkers(daemon_->pid());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::map<pid_t, long> after = ExecWorkers(daemon_->pid());
  long burnt = 0;
  for (const auto& [pid, ticks] : after) burnt += ticks - (before.count(pid) ? before[pid] : 0);
  const long hz = sysconf(_SC_CLK_TCK);
  EXPECT_LT(burnt, hz / 5) << "executors used " << burnt << " ticks in 0.5 s";
  auto next = c_->Forward(Call("default", "double"));
  ASSERT_TRUE(next.ok()) << next.status();
  ExpectHealthy(2);

  // Without a client deadline, the server's kernel time limit stops it.
  StartDaemon("kernel_timeout_ms = 300\n");
  auto limited = c_->Forward(Call("default", "spin"));
  EXPECT_EQ(limited.status().code(), absl::StatusCode::kDeadlineExceeded) << limited.status();
  EXPECT_THAT(std::string(limited.status().message()), HasSubstr("time limit"));
}

TEST_F(IsolationIT, MemoryBombHitsTheLimit) {
#ifdef OPJIT_SANITIZED
  GTEST_SKIP() << "sanitizer build: memory rlimits are off (ASan's shadow memory cannot live "
                  "under RLIMIT_AS/RLIMIT_DATA), so there is no limit to hit";
#endif
  StartDaemon("worker_memory_mb = 512\n");
  ASSERT_TRUE(RegisterKernel("default", "bomb",
                             "std::vector<std::vector<char>> hog;\n"
                             "for (;;) hog.emplace_back(64 << 20, 1);")
                  .ok());
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  auto r = c_->Forward(Call("default", "bomb"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  auto next = c_->Forward(Call("default", "double"));
  ASSERT_TRUE(next.ok()) << next.status();
  ExpectHealthy(2);
}

TEST_F(IsolationIT, ExecutorKilledFromOutsideIsNotCalledAMemoryProblem) {
  ASSERT_TRUE(RegisterKernel("default", "spin", "for (volatile long i = 0;; ++i) {}").ok());
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  absl::StatusOr<v1::ForwardResponse> r;
  // The kill must land inside the kernel, not in the executor's start (slow
  // under the sanitizers): that is a start failure (UNAVAILABLE), so wait
  // longer and try again.
  for (int wait_ms : {200, 1000, 3000}) {
    std::thread call([&] { r = c_->Forward(Call("default", "spin")); });
    std::map<pid_t, long> workers;
    for (int i = 0; i < 200 && workers.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      workers = ExecWorkers(daemon_->pid());
    }
    ASSERT_EQ(workers.size(), 1u);
    std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
    ASSERT_EQ(::kill(workers.begin()->first, SIGKILL), 0);
    call.join();
    if (r.status().code() != absl::StatusCode::kUnavailable) break;
  }
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("from outside opjitd"));
  auto next = c_->Forward(Call("default", "double"));
  ASSERT_TRUE(next.ok()) << next.status();
  ExpectHealthy(2);
}

// An executor killed from outside while idle (between calls) is nobody's
// crash: the next call finds it dead before sending anything, runs in a
// fresh executor and succeeds, and nothing counts towards a quarantine
// (three rounds: as many as quarantine_after).
TEST_F(IsolationIT, IdleExecutorKilledFromOutsideCostsNoCallAndNoCrash) {
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  for (int round = 0; round < 3; ++round) {
    auto r = c_->Forward(Call("default", "double"));
    ASSERT_TRUE(r.ok()) << r.status() << daemon_->Log();
    std::map<pid_t, long> workers = ExecWorkers(daemon_->pid());
    ASSERT_FALSE(workers.empty());
    for (const auto& [pid, ticks] : workers) ASSERT_EQ(::kill(pid, SIGKILL), 0);
    // Dead (a zombie until the daemon reaps it) before the next call.
    for (const auto& [pid, ticks] : workers) {
      for (int i = 0; i < 500; ++i) {
        const std::string stat = ReadProcFile("/proc/" + std::to_string(pid) + "/stat");
        const size_t close = stat.rfind(')');
        if (close == std::string::npos || stat.compare(close + 2, 1, "Z") == 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    auto next = c_->Forward(Call("default", "double"));
    ASSERT_TRUE(next.ok()) << next.status() << daemon_->Log();
    EXPECT_EQ(Floats(next->outputs(0).inline_data())[1], 4.0f);
  }
  EXPECT_THAT(daemon_->Log(), HasSubstr("before a call reached it"));
  EXPECT_THAT(daemon_->Log(), ::testing::Not(HasSubstr("quarantined")));
  ExpectHealthy(1);
}

TEST_F(IsolationIT, KernelsCannotReadFilesStartProcessesOpenSocketsOrSignal) {
  const std::string marker = tmp_.path() + "/pwned";
  ASSERT_TRUE(RegisterKernel("default", "escape",
                             "FILE* f = fopen(\"/etc/passwd\", \"r\");\n"
                             "char buf[16] = {0};\n"
                             "if (f) { fread(buf, 1, 15, f); fclose(f); }\n"
                             "y[0] = f == nullptr;\n"
                             "memcpy(&y[4], buf, 16);\n"
                             "y[1] = system(\"touch " + marker + "\") != 0;\n"
                             "y[2] = socket(AF_INET, SOCK_STREAM, 0) < 0;\n"
                             "y[3] = kill(getppid(), SIGKILL) != 0;\n")
                  .ok());
  auto r = c_->Forward(Call("default", "escape"));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string out = r->outputs(0).inline_data();
  const std::vector<float> y = Floats(out);
  EXPECT_EQ(y[0], 1.0f) << "fopen(/etc/passwd) succeeded";
  EXPECT_EQ(out.find("root"), std::string::npos);
  EXPECT_EQ(y[1], 1.0f) << "system() succeeded";
  EXPECT_FALSE(std::filesystem::exists(marker));
  EXPECT_EQ(y[2], 1.0f) << "socket() succeeded";
  EXPECT_EQ(y[3], 1.0f) << "kill(daemon) succeeded";
  ExpectHealthy(1);
}

TEST_F(IsolationIT, ShrunkRegionFailsOnlyThatCall) {
  ASSERT_TRUE(RegisterKernel("default", "sum", "float s = 0; for (int64_t i = 0; i < n; i += 1024) s += x[i]; y[0] = s;").ok());
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  const uint64_t bytes = 4 << 20;
  auto key = client::ShmMapping::RandomKey("opjit-it-shrink");
  ASSERT_TRUE(key.ok());
  auto mine = client::ShmMapping::Create(*key, bytes);
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_TRUE(c_->RegisterRegion("", "mine", *key, 0, bytes).ok());
  const int64_t n = bytes / 4;
  v1::ForwardRequest req;
  req.set_op("sum");
  *req.add_inputs()->add_tensors() = ShmTensor("float32", {n}, "mine", 0);
  auto ok = c_->Forward(req);
  ASSERT_TRUE(ok.ok()) << ok.status();
  // The client shrinks the object under the daemon's feet.
  int fd = shm_open(key->c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  auto r = c_->Forward(req);
  EXPECT_FALSE(r.ok());
  // The client's memory is at fault, not the kernel (fair quarantine).
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("region \"mine\""));
  auto next = c_->Forward(Call("default", "double"));
  ASSERT_TRUE(next.ok()) << next.status();
  ExpectHealthy(2);
}

TEST_F(IsolationIT, WorkspacesAreZeroFilledAndNamespacesGetTheirOwnProcesses) {
  // The kernel reports a byte of its workspace, then dirties it.
  const std::string body =
      "unsigned char* ws = static_cast<unsigned char*>(params[2]);\n"
      "y[0] = ws[100]; memset(ws, 0xAB, 4096);\n"
      "y[1] = static_cast<float>(getpid());";
  const std::string init =
      "extra->SetWorkSpace({4096});";
  ASSERT_TRUE(RegisterKernel("alice", "ws", body, init).ok());
  ASSERT_TRUE(RegisterKernel("bob", "ws", body, init).ok());
  float alice_pid = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = c_->Forward(Call("alice", "ws"));
    ASSERT_TRUE(r.ok()) << r.status() << daemon_->Log();
    EXPECT_EQ(Floats(r->outputs(0).inline_data())[0], 0.0f) << "call " << i;
    alice_pid = Floats(r->outputs(0).inline_data())[1];
  }
  auto b = c_->Forward(Call("bob", "ws"));
  ASSERT_TRUE(b.ok()) << b.status();
  const float bob_pid = Floats(b->outputs(0).inline_data())[1];
  if (::geteuid() == 0) {
    // A root daemon starts each executor as process 1 of a PID namespace
    // of its own.
    EXPECT_EQ(alice_pid, 1.0f);
    EXPECT_EQ(bob_pid, 1.0f);
  } else {
    EXPECT_NE(alice_pid, bob_pid);
    EXPECT_NE(alice_pid, static_cast<float>(daemon_->pid()));
    EXPECT_NE(bob_pid, static_cast<float>(daemon_->pid()));
  }
}

// The processes whose parent is `pid` ({pid: command}), less the health
// monitor's short-lived "--probe" runs.
std::map<pid_t, std::string> ChildrenOf(pid_t parent) {
  std::map<pid_t, std::string> out;
  for (const ProcInfo& p : ListProcesses()) {
    if (p.ppid != parent || p.cmdline.find("--probe") != std::string::npos) continue;
    out[p.pid] = p.comm;
  }
  return out;
}

// Gone, or a zombie (its new parent has not reaped it yet): it runs no more.
bool Ended(pid_t pid) {
  const std::string stat = ReadProcFile("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return true;
  const char state = stat[close + 2];
  return state == 'Z' || state == 'X';
}

TEST_F(IsolationIT, NoChildOutlivesTheDaemonKilledWithSigkill) {
  // A pool executor (an inline call), a fast-channel executor (which never
  // reads the daemon's socket, and runs under another uid when the daemon
  // is root) and the compile worker.
  ASSERT_TRUE(RegisterKernel("default", "double", kCopy).ok());
  auto r = c_->Forward(Call("default", "double"));
  ASSERT_TRUE(r.ok()) << r.status() << daemon_->Log();
  auto channel = c_->OpenChannel("");
  ASSERT_TRUE(channel.ok()) << channel.status() << daemon_->Log();
  // A compile worker serves one namespace and may be retired after its
  // compile: keep one busy with a compile of several seconds (3000 template
  // instances, each optimised), killed with the daemon under it.
  struct Joined {
    std::thread t;
    ~Joined() {
      if (t.joinable()) t.join();
    }
  } slow_compile{std::thread([client = daemon_->NewClient()] {
    v1::CompileRequest req;
    req.set_source(absl::StrCat(
        "#include <cstdint>\n#include <utility>\n"
        "template <int N> __attribute__((noinline)) float Step(float x) {\n"
        "  for (int i = 0; i < 4 + N % 5; ++i) x = x * 1.0001f + static_cast<float>(N % 7);\n"
        "  return x;\n}\n"
        "template <int... I> float All(float x, std::integer_sequence<int, I...>) {\n"
        "  float r[] = {Step<I>(x)...}; float s = ", ::getpid(), ";\n"
        "  for (float v : r) s += v;\n  return s;\n}\n"
        "extern \"C\" float Heavy(float x) {\n"
        "  return All(x, std::make_integer_sequence<int, 3000>{});\n}\n"));
    req.set_entry("Heavy");
    (void)client->Compile(req);  // fails once the daemon is killed
  })};
  std::map<pid_t, std::string> children;
  int executors = 0, compilers = 0;
  for (const auto until = Clock::now() + std::chrono::seconds(30); Clock::now() < until;) {
    children = ChildrenOf(daemon_->pid());
    executors = compilers = 0;
    for (const auto& [pid, comm] : children) {
      executors += comm == "opjit-exec-work";
      compilers += comm == "opjit-compile-w";
    }
    if (executors >= 2 && compilers >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(executors, 2) << "a pool executor and a channel executor";
  ASSERT_GE(compilers, 1);

  daemon_->Kill9();
  const auto killed = Clock::now();
  // Within about a second; 5 s allows for a loaded machine.
  std::map<pid_t, std::string> alive = children;
  while (!alive.empty() && Clock::now() < killed + std::chrono::seconds(5)) {
    for (auto it = alive.begin(); it != alive.end();) {
      it = Ended(it->first) ? alive.erase(it) : std::next(it);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killed).count();
  for (const auto& [pid, comm] : alive) {
    ADD_FAILURE() << comm << " " << pid << " outlived the daemon by " << ms << " ms";
    ::kill(pid, SIGKILL);  // leave nothing behind either way
  }
  RecordProperty("children_gone_after_ms", static_cast<int>(ms));
  std::cout << children.size() << " children of the killed daemon gone after " << ms << " ms\n";
  slow_compile.t.join();
  c_.reset();
  daemon_.reset();
}

// ---- fair quarantine (issue 27) -------------------------------------------

std::string ReasonOf(const absl::Status& s) {
  auto r = GetReason(s);
  return r ? r->reason : "";
}

// A client that truncates a region its calls name makes the kernel fault
// (SIGBUS) on the missing pages: that is the client's fault. Every such call
// gets FAILED_PRECONDITION, REGION_TOO_SMALL naming the region, on the pool
// and on a fast channel, and the kernel is never quarantined.
TEST_F(IsolationIT, ShrunkRegionNeverCountsAgainstTheKernel) {
  ASSERT_TRUE(RegisterKernel("default", "sum", "float s = 0; for (int64_t i = 0; i < n; i += 1024) s += x[i]; y[0] = s;").ok());
  const uint64_t bytes = 4 << 20;
  auto key = client::ShmMapping::RandomKey("opjit-it-quarantine");
  ASSERT_TRUE(key.ok());
  auto mine = client::ShmMapping::Create(*key, bytes);
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto pool = client::Client::Connect({.address = daemon_->address(), .fast = "off"});
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_TRUE(c_->RegisterRegion("", "mine", *key, 0, bytes).ok());
  ASSERT_TRUE((*pool)->RegisterRegion("", "theirs", *key, 0, bytes).ok());
  const int64_t n = bytes / 4;
  auto request = [&](const std::string& region) {
    v1::ForwardRequest req;
    req.set_op("sum");
    *req.add_inputs()->add_tensors() = ShmTensor("float32", {n}, region, 0);
    return req;
  };
  ASSERT_TRUE(c_->Forward(request("mine")).ok());
  ASSERT_TRUE((*pool)->Forward(request("theirs")).ok());
  int fd = shm_open(key->c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  // Five calls each way, more than quarantine_after (3) in a row.
  using Way = std::pair<client::Client*, std::string>;  // fast path (auto), and gRPC
  for (int i = 0; i < 5; ++i) {
    for (auto [caller, region] : {Way{c_.get(), "mine"}, Way{pool->get(), "theirs"}}) {
      auto r = caller->Forward(request(region));
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
          << region << " call " << i << ": " << r.status();
      EXPECT_EQ(ReasonOf(r.status()), "REGION_TOO_SMALL") << r.status();
      EXPECT_THAT(std::string(r.status().message()),
                  HasSubstr(absl::StrCat("region \"", region, "\"")));
      EXPECT_THAT(std::string(r.status().message()), ::testing::Not(HasSubstr(*key)));
    }
  }
  // Whole again: the kernel runs, on both paths; it was never quarantined.
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  close(fd);
  auto again = c_->Forward(request("mine"));
  EXPECT_TRUE(again.ok()) << again.status();
  auto again_pool = (*pool)->Forward(request("theirs"));
  EXPECT_TRUE(again_pool.ok()) << again_pool.status();
  ExpectHealthy(1);
}

// MindSpore's add_with_attr.cc pattern: a kernel returns correct numbers but
// corrupts the executor it shares with others (here it overwrites libc's
// `stdout`); the next, healthy kernel in that executor dies. The call runs
// again in a fresh executor, succeeds there, and nobody is blamed: after
// more rounds than quarantine_after, the healthy kernel still runs. A
// kernel that crashes on its own is still quarantined (it crashes in the
// fresh executor too).
TEST_F(IsolationIT, NeighboursCorruptionNeverQuarantinesAHealthyKernel) {
  StartDaemon("workers = 1\n");  // one executor: the two kernels share it
  ASSERT_TRUE(RegisterKernel("default", "corrupt",
                             "stdout = reinterpret_cast<FILE*>(16);\n" + std::string(kCopy))
                  .ok());
  ASSERT_TRUE(RegisterKernel("default", "healthy",
                             "std::fputc('.', stdout);\n" + std::string(kCopy)).ok());
  ASSERT_TRUE(RegisterKernel("default", "segv", "*static_cast<volatile int*>(nullptr) = 1;").ok());
  for (int round = 0; round < 5; ++round) {
    auto bad = c_->Forward(Call("default", "corrupt"));
    ASSERT_TRUE(bad.ok()) << bad.status();
    EXPECT_EQ(Floats(bad->outputs(0).inline_data())[2], 6.0f);
    auto good = c_->Forward(Call("default", "healthy", {1, 2, 3, 4, 5, 6, 7, float(round)}));
    ASSERT_TRUE(good.ok()) << "round " << round << ": " << good.status() << daemon_->Log();
    EXPECT_EQ(Floats(good->outputs(0).inline_data())[7], 2.0f * round);
  }
  // The healthy kernel did die in the shared executor each round: the
  // daemon ran it again rather than never having crashed.
  const std::string log = daemon_->Log();
  size_t retried = 0;
  for (size_t at = log.find("counted against no kernel"); at != std::string::npos;
       at = log.find("counted against no kernel", at + 1)) {
    ++retried;
  }
  EXPECT_EQ(retried, 5u) << log;

  // A kernel that crashes by itself: each call dies in the shared executor,
  // then in a fresh one, and counts once; the default quarantine_after is 3.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c_->Forward(Call("default", "healthy")).ok());
    auto r = c_->Forward(Call("default", "segv"));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
    EXPECT_EQ(ReasonOf(r.status()), "KERNEL_CRASHED") << r.status();
  }
  auto q = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(q.status().code(), absl::StatusCode::kFailedPrecondition) << q.status();
  EXPECT_EQ(ReasonOf(q.status()), "KERNEL_QUARANTINED") << q.status();
  auto still = c_->Forward(Call("default", "healthy"));
  EXPECT_TRUE(still.ok()) << still.status();
  ExpectHealthy(3);
}

// A call on op `op` over the fast path of `c`: x = the 8 floats at offset 0
// of region `in`, y at offset 4096 of region `out`.
v1::ForwardRequest FastCall(const std::string& op, const std::string& in, const std::string& out,
                            int64_t n = 8) {
  v1::ForwardRequest req;
  req.set_op(op);
  *req.add_inputs()->add_tensors() = ShmTensor("float32", {n}, in, 0);
  req.add_outputs()->mutable_shm()->set_region(out);
  req.mutable_outputs(0)->mutable_shm()->set_offset(4096);
  return req;
}

size_t Occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The add_with_attr.cc pattern on a fast channel. The daemon cannot run a
// fast call again in a fresh executor (the client drives the ring), so a
// crash counts against the running kernel only when no other kernel ran in
// that channel's executor since it started. "corrupt" returns correct
// numbers but breaks its executor (it overwrites libc's `stdout`, as
// add_with_attr's N*N floats in an N-byte workspace break the heap); the
// healthy kernel called next on the same channel dies. The daemon hands its
// call back as not run, and the client runs it again on a new channel (a
// fresh executor), where it succeeds (issue 40, item 5); after more rounds
// than quarantine_after (3) it still runs. A kernel that crashes alone in a
// fresh channel is still quarantined.
TEST_F(IsolationIT, FastChannelCrashCountsOnlyAgainstAKernelThatRanAlone) {
  ASSERT_TRUE(RegisterKernel("default", "corrupt",
                             "stdout = reinterpret_cast<FILE*>(16);\n" + std::string(kCopy))
                  .ok());
  ASSERT_TRUE(RegisterKernel("default", "healthy",
                             "std::fputc('.', stdout);\n" + std::string(kCopy)).ok());
  ASSERT_TRUE(RegisterKernel("default", "segv", "*static_cast<volatile int*>(nullptr) = 1;").ok());
  // fast = "on": a call that qualifies never falls back to gRPC (where the
  // pool would run it again in a fresh executor).
  auto fast = client::Client::Connect({.address = daemon_->address(), .fast = "on"});
  ASSERT_TRUE(fast.ok()) << fast.status();
  auto info = (*fast)->CreateRegion("", "buf", 1 << 16);
  ASSERT_TRUE(info.ok()) << info.status();
  auto map = client::ShmMapping::Open(info->shm_key(), info->byte_size());
  ASSERT_TRUE(map.ok()) << map.status();
  float* base = reinterpret_cast<float*>((*map)->data());
  for (int i = 0; i < 8; ++i) base[i] = static_cast<float>(i + 1);
  float* y = base + 1024;
  const std::string not_counted = "not counted towards the kernel's quarantine";

  for (int round = 0; round < 5; ++round) {
    // Each round on a fresh channel: the last one closed with its executor.
    y[2] = 0;
    auto bad = (*fast)->Forward(FastCall("corrupt", "buf", "buf"));
    ASSERT_TRUE(bad.ok()) << "round " << round << ": " << bad.status() << daemon_->Log();
    EXPECT_EQ(y[2], 6.0f);
    y[2] = 0;
    auto good = (*fast)->Forward(FastCall("healthy", "buf", "buf"));
    EXPECT_TRUE(good.ok()) << "round " << round << ": " << good.status() << daemon_->Log();
    EXPECT_EQ(y[2], 6.0f);
  }
  EXPECT_EQ(Occurrences(daemon_->Log(), "the crash is not counted against the running kernel"), 5u)
      << daemon_->Log();
  EXPECT_EQ(Occurrences(daemon_->Log(), "the call goes back to its client to run again"), 5u)
      << daemon_->Log();
  // Never quarantined: alone on a fresh channel, and on the pool, it runs.
  y[7] = 0;
  auto alone = (*fast)->Forward(FastCall("healthy", "buf", "buf"));
  ASSERT_TRUE(alone.ok()) << alone.status() << daemon_->Log();
  EXPECT_EQ(y[7], 16.0f);
  auto pooled = c_->Forward(Call("default", "healthy"));
  EXPECT_TRUE(pooled.ok()) << pooled.status();

  // A kernel that crashes by itself: a client of its own, so each call runs
  // first in a fresh channel (the crash closes it), and counts.
  auto own = client::Client::Connect({.address = daemon_->address(), .fast = "on"});
  ASSERT_TRUE(own.ok()) << own.status();
  for (int i = 0; i < 3; ++i) {
    auto r = (*own)->Forward(FastCall("segv", "buf", "buf"));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
    EXPECT_EQ(ReasonOf(r.status()), "KERNEL_CRASHED") << r.status();
    EXPECT_THAT(std::string(r.status().message()), ::testing::Not(HasSubstr(not_counted)));
  }
  auto q = (*own)->Forward(FastCall("segv", "buf", "buf"));
  EXPECT_EQ(q.status().code(), absl::StatusCode::kFailedPrecondition) << q.status();
  EXPECT_EQ(ReasonOf(q.status()), "KERNEL_QUARANTINED") << q.status();
  auto still = (*fast)->Forward(FastCall("healthy", "buf", "buf"));
  EXPECT_TRUE(still.ok()) << still.status();
  ExpectHealthy(3);
}

// A client that truncates a region its fast calls name (ShrunkRegionNever-
// CountsAgainstTheKernel's calls have no output placement, so they all go
// over gRPC):
// the channel's executor takes SIGBUS, every such call gets
// FAILED_PRECONDITION, REGION_TOO_SMALL naming the region, and after more
// calls than quarantine_after the kernel still runs.
TEST_F(IsolationIT, ShrunkRegionOnAFastChannelNeverCountsAgainstTheKernel) {
  ASSERT_TRUE(RegisterKernel("default", "sum",
                             "float s = 0;\n"
                             "for (int64_t i = 0; i < n; i += 1024) s += x[i];\n"
                             "y[0] = s;")
                  .ok());
  const uint64_t bytes = 4 << 20;
  const int64_t n = bytes / 4;
  auto key = client::ShmMapping::RandomKey("opjit-it-fastshrink");
  ASSERT_TRUE(key.ok());
  auto mine = client::ShmMapping::Create(*key, bytes);
  ASSERT_TRUE(mine.ok()) << mine.status();
  auto fast = client::Client::Connect({.address = daemon_->address(), .fast = "on"});
  ASSERT_TRUE(fast.ok()) << fast.status();
  ASSERT_TRUE((*fast)->RegisterRegion("", "mine", *key, 0, bytes).ok());
  // The output's region stays whole (n floats of y at offset 4096).
  ASSERT_TRUE((*fast)->CreateRegion("", "out", bytes + 4096).ok());
  auto ok = (*fast)->Forward(FastCall("sum", "mine", "out", n));
  ASSERT_TRUE(ok.ok()) << ok.status() << daemon_->Log();
  int fd = shm_open(key->c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  for (int i = 0; i < 5; ++i) {
    auto r = (*fast)->Forward(FastCall("sum", "mine", "out", n));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
        << "call " << i << ": " << r.status();
    EXPECT_EQ(ReasonOf(r.status()), "REGION_TOO_SMALL") << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("region \"mine\""));
    EXPECT_THAT(std::string(r.status().message()), ::testing::Not(HasSubstr(*key)));
  }
  // Each of them ended a fast channel's executor (the pool logs another line).
  EXPECT_EQ(Occurrences(daemon_->Log(), "faulted on a shrunk region of its client"), 5u)
      << daemon_->Log();
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  close(fd);
  auto again = (*fast)->Forward(FastCall("sum", "mine", "out", n));
  EXPECT_TRUE(again.ok()) << again.status();
  ExpectHealthy(1);
}

// Registering the op again, even with the identical definition (the same
// version), lifts its quarantine; so does an admin's ClearQuarantine
// (`opjit unquarantine`), which a user principal may not call.
TEST_F(IsolationIT, ReRegisteringOrAnAdminLiftsAQuarantine) {
  constexpr char kUserToken[] = "tok-quarantine-user-0123456789";
  StartDaemon(
      "quarantine_after = 2\n"
      "[[principal]]\nname = \"user\"\nrole = \"user\"\nnamespaces = [\"default\"]\n"
      "token_sha256 = [\"fc4a60ac9922df6ebe83f74fdb44d86d0c373f9c4dc8892003489d97eed1229f\"]\n");
  const std::string segv = "*static_cast<volatile int*>(nullptr) = 1;";
  ASSERT_TRUE(RegisterKernel("default", "segv", segv).ok()) << daemon_->Log();
  auto quarantine = [&] {
    for (int i = 0; i < 2; ++i) {
      auto r = c_->Forward(Call("default", "segv"));
      EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
    }
    auto q = c_->Forward(Call("default", "segv"));
    EXPECT_EQ(ReasonOf(q.status()), "KERNEL_QUARANTINED") << q.status();
  };
  quarantine();
  auto described = c_->Get("default", "segv");
  ASSERT_TRUE(described.ok()) << described.status();
  const int64_t version = described->version();

  // The identical definition again: the same version, and no quarantine.
  ASSERT_TRUE(RegisterKernel("default", "segv", segv).ok());
  auto same = c_->Get("default", "segv");
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->version(), version);
  auto lifted = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(lifted.status().code(), absl::StatusCode::kAborted) << lifted.status();
  EXPECT_EQ(ReasonOf(lifted.status()), "KERNEL_CRASHED") << lifted.status();

  // Quarantined again; a user may not lift it (nor can it be lifted by a
  // principal at all through anything but registering).
  auto q = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(q.status().code(), absl::StatusCode::kAborted) << q.status();
  auto q2 = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(ReasonOf(q2.status()), "KERNEL_QUARANTINED") << q2.status();
  auto user = client::Client::Connect({.address = daemon_->address(), .token = kUserToken});
  ASSERT_TRUE(user.ok()) << user.status();
  auto refused = (*user)->ClearQuarantine("default", "segv");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  auto still = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(ReasonOf(still.status()), "KERNEL_QUARANTINED") << still.status();

  // The admin (root on the unix socket) lifts it with the CLI.
  ProcessResult cli = daemon_->Cli({"unquarantine", "default/segv"});
  EXPECT_EQ(cli.exit_code, 0) << cli.out << cli.err;
  EXPECT_THAT(cli.out, HasSubstr("lifted the quarantine of 1 kernel(s)"));
  auto after = c_->Forward(Call("default", "segv"));
  EXPECT_EQ(ReasonOf(after.status()), "KERNEL_CRASHED") << after.status();
  // An op that does not exist is NOT_FOUND.
  auto missing = c_->ClearQuarantine("default", "no-such-op");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  ExpectHealthy(1);
}

}  // namespace
}  // namespace opjit::testing

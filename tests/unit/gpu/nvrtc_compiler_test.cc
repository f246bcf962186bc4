#include "server/gpu/nvrtc_compiler.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

#include "server/gpu/cubin.h"
#include "tests/unit/gpu/test_util.h"
#include "tests/unit/testing/procfs.h"

namespace opjit::gpu {
namespace {

constexpr char kAdd[] = R"(
extern "C" __global__ void add(float* a, const float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] += b[i];
}
)";

// Every compile in these tests runs in the sandbox, as the daemon's do.
constexpr char kSandbox[] = OPJIT_BINARY_DIR "/bin/opjit-gpu-sandbox";

// [compiler] uid's default: a root daemon's sandboxes run as it.
constexpr int64_t kCompileUid = 1879113728;

NvrtcOptions Options() {
  NvrtcOptions o;
  o.cuda_root = OPJIT_TEST_CUDA_ROOT;
  o.worker_path = kSandbox;
  // As root, as a root daemon runs them: as the compile uid, with
  // CAP_DAC_READ_SEARCH alone.
  o.sandbox_uid = ::geteuid() == 0 ? kCompileUid : -1;
  return o;
}

class NvrtcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<NvrtcCompiler>> c = NvrtcCompiler::Create(Options());
    ASSERT_TRUE(c.ok()) << c.status();
    compiler_ = std::move(*c);
  }
  std::unique_ptr<NvrtcCompiler> compiler_;
};

TEST_F(NvrtcTest, VersionAndToolchainId) {
  EXPECT_EQ(compiler_->Version().rfind("nvrtc 13.", 0), 0u) << compiler_->Version();
  const std::string& id = compiler_->ToolchainId();
  EXPECT_NE(id.find(compiler_->Version()), std::string::npos) << id;
  EXPECT_NE(id.find("sm_80,sm_90"), std::string::npos) << id;
  EXPECT_NE(id.find(OPJIT_TEST_CUDA_ROOT), std::string::npos) << id;
  // Stable: a second compiler says the same.
  auto again = NvrtcCompiler::Create(Options());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->ToolchainId(), id);
  const std::vector<int>& archs = compiler_->SupportedArchs();
  EXPECT_NE(std::find(archs.begin(), archs.end(), 90), archs.end());
}

TEST_F(NvrtcTest, CompilesCubinsForSm80AndSm90) {
  GpuCompileRequest req;
  req.source = kAdd;
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->cubins.size(), 2u);
  ASSERT_TRUE(out->cubins.count("sm_80"));
  ASSERT_TRUE(out->cubins.count("sm_90"));
  EXPECT_TRUE(CheckCubin(out->cubins["sm_80"], 80).ok()) << CheckCubin(out->cubins["sm_80"], 80);
  EXPECT_TRUE(CheckCubin(out->cubins["sm_90"], 90).ok()) << CheckCubin(out->cubins["sm_90"], 90);
  // And not the other way round.
  EXPECT_FALSE(CheckCubin(out->cubins["sm_80"], 90).ok());
  absl::StatusOr<CubinInfo> info = InspectCubin(out->cubins["sm_90"]);
  ASSERT_TRUE(info.ok());
  std::printf(
      "[          ] sm_90 cubin: %zu bytes, EI_OSABI 0x%x, ABI version %d, e_flags 0x%08x\n",
      out->cubins["sm_90"].size(), info->os_abi, info->abi_version, info->e_flags);
  EXPECT_EQ(out->ptx_arch, "compute_80");
  EXPECT_NE(out->ptx.find(".target sm_80"), std::string::npos);
  EXPECT_NE(out->ptx.find(".entry add("), std::string::npos);
  EXPECT_GT(out->compile_ms, 0);
}

// The e_flags rule of CheckCubin holds for every arch this NVRTC targets.
TEST_F(NvrtcTest, CheckCubinMatchesEverySupportedArch) {
  GpuCompileRequest req;
  req.source = kAdd;
  for (int sm : compiler_->SupportedArchs()) {
    req.archs = {"sm_" + std::to_string(sm)};
    absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
    ASSERT_TRUE(out.ok()) << sm << ": " << out.status();
    const std::string& cubin = out->cubins[req.archs[0]];
    EXPECT_TRUE(CheckCubin(cubin, sm).ok()) << CheckCubin(cubin, sm);
  }
}

TEST_F(NvrtcTest, PtxIsAcceptedByPtxas) {
  GpuCompileRequest req;
  req.source = kAdd;
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  testing::TempDir dir;
  const std::string ptx = dir.path() + "/k.ptx";
  testing::WriteFile(ptx, out->ptx);
  // compute_80 PTX assembled for a newer GPU: the forward-compatible path.
  testing::CommandResult r =
      testing::RunCommand({std::string(OPJIT_TEST_CUDA_ROOT) + "/bin/ptxas", "-arch=sm_90", "-o",
                           dir.path() + "/k.cubin", ptx});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(CheckCubin(testing::ReadFile(dir.path() + "/k.cubin"), 90).ok());
}

TEST_F(NvrtcTest, ArchSpecificTargetGetsGenericPtx) {
  GpuCompileRequest req;
  req.source = kAdd;
  req.archs = {"sm_90a"};
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(CheckCubin(out->cubins["sm_90a"], 90).ok());
  EXPECT_EQ(out->ptx_arch, "compute_90");
  EXPECT_NE(out->ptx.find(".target sm_90\n"), std::string::npos) << out->ptx.substr(0, 200);
}

TEST_F(NvrtcTest, Fp16HeaderCompiles) {
  GpuCompileRequest req;
  req.source = R"(
#include <cuda_fp16.h>
extern "C" __global__ void hadd(__half* a, const __half* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] = __hadd(a[i], b[i]);
}
)";
  req.archs = {"sm_90"};
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(CheckCubin(out->cubins["sm_90"], 90).ok());
}

TEST_F(NvrtcTest, NameExpressionsGiveLoweredNames) {
  GpuCompileRequest req;
  req.source = R"(
template <typename T>
__global__ void axpy(T a, const T* x, T* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
)";
  req.name_expressions = {"axpy<float>", "axpy<double>"};
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->lowered_names.size(), 2u);
  EXPECT_EQ(out->lowered_names["axpy<float>"], "_Z4axpyIfEvT_PKS0_PS0_i");
  EXPECT_EQ(out->lowered_names["axpy<double>"], "_Z4axpyIdEvT_PKS0_PS0_i");
  // The mangled names are the entry points in the PTX (and the CUBINs).
  EXPECT_NE(out->ptx.find(".entry _Z4axpyIfEvT_PKS0_PS0_i("), std::string::npos);
  EXPECT_NE(out->cubins["sm_90"].find("_Z4axpyIdEvT_PKS0_PS0_i"), std::string::npos);
}

TEST_F(NvrtcTest, BadNameExpressionIsInvalidArgument) {
  GpuCompileRequest req;
  req.source = kAdd;
  req.name_expressions = {"nosuch<float>"};
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
}

TEST_F(NvrtcTest, SyntaxErrorIsInvalidArgumentWithTheErrorLine) {
  GpuCompileRequest req;
  req.source = "extern \"C\" __global__ void k(float* a) {\n  a[0] = 1.0f\n}\n";
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(out.status().message());
  EXPECT_EQ(msg.rfind("compile failed:\n", 0), 0u) << msg;
  EXPECT_NE(msg.find("kernel.cu(3): error"), std::string::npos) << msg;
}

TEST_F(NvrtcTest, FileNameAppearsInDiagnostics) {
  GpuCompileRequest req;
  req.source = "__global__ void k() { undeclared(); }\n";
  req.file_name = "my_op.cu";
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(std::string(out.status().message()).find("my_op.cu(1): error"), std::string::npos)
      << out.status();
}

TEST_F(NvrtcTest, WarningsComeBackOnSuccess) {
  GpuCompileRequest req;
  req.source =
      "extern \"C\" __global__ void k(float* a) {\n  int unused = 3;\n  a[0] = 1.0f;\n}\n"
      "#warning opjit test warning\n";
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  std::printf("[          ] diagnostics: %s\n",
              out->diagnostics.empty() ? "(none)" : out->diagnostics.c_str());
  if (!out->diagnostics.empty()) {
    EXPECT_NE(out->diagnostics.find("kernel.cu(2): warning"), std::string::npos)
        << out->diagnostics;
    EXPECT_NE(out->diagnostics.find("opjit test warning"), std::string::npos) << out->diagnostics;
    // The same warning from both archs is reported once.
    EXPECT_EQ(out->diagnostics.find("[sm_"), std::string::npos) << out->diagnostics;
  }
}

TEST_F(NvrtcTest, UserOptionsAndStd) {
  GpuCompileRequest req;
  req.source = R"(
#if __cplusplus < 202002L
#error "not C++20"
#endif
#ifndef SCALE
#error "SCALE not defined"
#endif
extern "C" __global__ void k(float* a) { a[0] *= SCALE; }
)";
  req.options = {"-DSCALE=2.0f", "-std=c++20", "--use_fast_math"};
  req.archs = {"sm_90"};
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  EXPECT_TRUE(out.ok()) << out.status();
  // Without -std=, C++17 is the default.
  req.options = {"-DSCALE=2.0f"};
  out = compiler_->Compile(req);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(std::string(out.status().message()).find("not C++20"), std::string::npos)
      << out.status();
}

TEST_F(NvrtcTest, ConcurrentCompiles) {
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<GpuCompileOutput>> results(4, absl::UnknownError("not run"));
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      GpuCompileRequest req;
      req.source = std::string(kAdd) + "extern \"C\" __global__ void k" + std::to_string(t) + "() {}\n";
      req.archs = {"sm_90"};
      results[t] = compiler_->Compile(req);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    ASSERT_TRUE(results[t].ok()) << results[t].status();
    EXPECT_NE(results[t]->ptx.find(".entry k" + std::to_string(t)), std::string::npos);
  }
}

TEST_F(NvrtcTest, BadOptionIsInvalidArgument) {
  GpuCompileRequest req;
  req.source = kAdd;
  req.options = {"--no-such-option"};
  absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
}

TEST_F(NvrtcTest, BadArchsAreInvalidArgument) {
  GpuCompileRequest req;
  req.source = kAdd;
  for (const char* arch : {"sm_35", "compute_90", "sm_", "sm_90x", "gfx90a"}) {
    req.archs = {arch};
    absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
    ASSERT_FALSE(out.ok()) << arch;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << arch;
  }
  NvrtcOptions o = Options();
  o.archs = {"sm_20"};
  EXPECT_EQ(NvrtcCompiler::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// NVRTC reads includes itself; the sandbox's Landlock rules stop it outside
// the toolkit's and opjit's headers, and nothing of a host file is quoted.
TEST_F(NvrtcTest, HostFilesCannotBeIncluded) {
  const std::string passwd = testing::ReadFile("/etc/passwd");
  ASSERT_NE(passwd.find("root:"), std::string::npos);
  for (const char* path : {"/etc/shadow", "/etc/passwd", "/proc/self/environ", "/etc/hostname"}) {
    GpuCompileRequest req;
    req.source = std::string("#include \"") + path + "\"\n" + kAdd;
    absl::StatusOr<GpuCompileOutput> out = compiler_->Compile(req);
    ASSERT_FALSE(out.ok()) << path << " was included";
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    const std::string msg(out.status().message());
    EXPECT_EQ(msg.find("root:"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("PATH="), std::string::npos) << msg;
  }
}

// A preprocessor bomb: ~8^9 tokens. The sandbox's time or memory limit stops
// it, and the next compile works.
TEST(NvrtcSandboxTest, BombIsStoppedByTheLimits) {
#ifdef OPJIT_SANITIZED
  GTEST_SKIP() << "sanitizer build: memory rlimits are off (ASan's shadow memory cannot live "
                  "under RLIMIT_AS/RLIMIT_DATA), so there is no limit to hit";
#endif
  // The limits must stop the bomb, and the same compiler must then compile a
  // small kernel. Both have to hold on a busy machine (ctest -j2 beside a
  // build): the wall-clock limit is long enough for the small compile under
  // load (about 1 s idle here), and the bomb, which would need far more than
  // that, hits either limit first.
  NvrtcOptions o = Options();
  o.timeout_ms = 15000;
  o.memory_limit_bytes = 1ull << 30;
  auto c = NvrtcCompiler::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::string bomb = "#define X0 1+1+1+1+1+1+1+1\n";
  for (int i = 1; i <= 9; ++i) {
    bomb += "#define X" + std::to_string(i) + " ";
    for (int k = 0; k < 8; ++k) bomb += (k ? "+X" : "X") + std::to_string(i - 1);
    bomb += "\n";
  }
  bomb += "__device__ int v = X9;\n";
  GpuCompileRequest req;
  req.source = bomb;
  req.archs = {"sm_90"};
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<GpuCompileOutput> out = (*c)->Compile(req);
  ASSERT_FALSE(out.ok());
  EXPECT_TRUE(out.status().code() == absl::StatusCode::kDeadlineExceeded ||
              out.status().code() == absl::StatusCode::kResourceExhausted)
      << out.status();
  // Stopped at the limit, not after the bomb ran its course (minutes):
  // the sandbox is killed at once, so only the machine's load adds to this.
  EXPECT_LT(std::chrono::steady_clock::now() - t0,
            std::chrono::milliseconds(o.timeout_ms) + std::chrono::seconds(30));
  GpuCompileRequest ok;
  ok.source = kAdd;
  ok.archs = {"sm_90"};
  absl::StatusOr<GpuCompileOutput> after = (*c)->Compile(ok);
  EXPECT_TRUE(after.ok()) << after.status();
}

// As root: the sandbox runs as the compile uid with CAP_DAC_READ_SEARCH
// alone, and NVRTC still reads an include dir of root's kept 0700 (as
// operators keep theirs), which Landlock lists.
TEST(NvrtcSandboxTest, RunsAsTheCompileUidAndReadsAPrivateIncludeDir) {
  if (::geteuid() != 0) GTEST_SKIP() << "the sandbox switches uid only when the daemon is root";
  char tmpl[] = "/tmp/opjit-nvrtc-inc-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);  // 0700, root's
  const std::string dir = tmpl;
  std::ofstream(dir + "/private_scale.cuh") << "#pragma once\n#define PRIVATE_SCALE 3.0f\n";
  ::chmod((dir + "/private_scale.cuh").c_str(), 0600);
  NvrtcOptions o = Options();
  o.extra_include_dirs = {dir};
  auto c = NvrtcCompiler::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  GpuCompileRequest req;
  req.source = std::string("#include <private_scale.cuh>\n") +
               "extern \"C\" __global__ void scale(float* a) { a[threadIdx.x] *= PRIVATE_SCALE; }\n";
  req.archs = {"sm_90"};
  absl::StatusOr<GpuCompileOutput> out = (*c)->Compile(req);
  EXPECT_TRUE(out.ok()) << out.status();
  // The workers (the one that compiled, the spare started for the next
  // compile) wait for requests past their sandbox: what they run as.
  std::string status;
  for (int i = 0; i < 1000 && status.empty(); ++i) {
    for (const opjit::testing::ProcInfo& p : opjit::testing::ListProcesses()) {
      if (p.comm != "opjit-gpu-sandb" || p.ppid != ::getpid()) continue;  // its parent
      if (p.status.find("Uid:\t0\t") == std::string::npos) status = p.status;
    }
    if (status.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const std::string id = std::to_string(kCompileUid);
  EXPECT_NE(status.find("Uid:\t" + id + "\t" + id + "\t" + id + "\t" + id + "\n"),
            std::string::npos)
      << status;
  EXPECT_NE(status.find("Gid:\t" + id + "\t"), std::string::npos) << status;
  for (const char* field : {"CapEff", "CapPrm", "CapBnd"}) {
    EXPECT_NE(status.find(std::string(field) + ":\t0000000000000004\n"), std::string::npos)
        << field << " in " << status;
  }
  c->reset();
  std::filesystem::remove_all(dir);
}

// --- The worker pool ------------------------------------------------------

// A compiler whose pool has `workers` workers, recycled after `recycle`.
std::unique_ptr<NvrtcCompiler> Pool(int workers, int recycle = 256, int timeout_ms = 30000) {
  NvrtcOptions o = Options();
  o.workers = workers;
  o.recycle_after_compiles = recycle;
  o.timeout_ms = timeout_ms;
  auto c = NvrtcCompiler::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// kAdd with a distinct tail: every compile is a new source.
GpuCompileRequest AddRequest(int n, const std::string& tenant = "", const std::string& head = "") {
  GpuCompileRequest req;
  req.source = head + kAdd + "// " + std::to_string(n) + "\n";
  req.archs = {"sm_90"};
  req.tenant = tenant;
  return req;
}

int CompiledBy(const NvrtcCompiler& c, const GpuCompileRequest& req) {
  absl::StatusOr<GpuCompileOutput> out = c.Compile(req);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? out->worker_pid : -1;
}

TEST(NvrtcPoolTest, ManyCompilesReuseOneWorker) {
  auto c = Pool(1);
  ASSERT_NE(c, nullptr);
  const int first = CompiledBy(*c, AddRequest(0));
  EXPECT_GT(first, 0);
  for (int i = 1; i < 6; ++i) EXPECT_EQ(CompiledBy(*c, AddRequest(i)), first) << i;
  const NvrtcStats s = c->GetStats();
  EXPECT_EQ(s.spawns, 1u);
  EXPECT_EQ(s.compiles, 6u);
  EXPECT_EQ(s.recycled + s.crashes + s.timeouts, 0u);
}

TEST(NvrtcPoolTest, AWorkerServesOneNamespace) {
  // One slot: each switch of namespace ends the idle worker and starts one.
  auto one = Pool(1);
  ASSERT_NE(one, nullptr);
  const int a = CompiledBy(*one, AddRequest(0, "a"));
  const int b = CompiledBy(*one, AddRequest(1, "b"));
  const int a2 = CompiledBy(*one, AddRequest(2, "a"));
  EXPECT_NE(a, b);
  EXPECT_NE(a2, b);
  EXPECT_NE(a2, a);  // the first one was ended for "b"
  EXPECT_EQ(one->GetStats().tenant_switches, 2u);
  // Two slots: each namespace keeps its own.
  auto two = Pool(2);
  ASSERT_NE(two, nullptr);
  const int x = CompiledBy(*two, AddRequest(0, "x"));
  const int y = CompiledBy(*two, AddRequest(1, "y"));
  EXPECT_NE(x, y);
  EXPECT_EQ(CompiledBy(*two, AddRequest(2, "x")), x);
  EXPECT_EQ(CompiledBy(*two, AddRequest(3, "y")), y);
  EXPECT_EQ(two->GetStats().tenant_switches, 0u);
}

TEST(NvrtcPoolTest, RecyclesAfterNCompiles) {
  auto c = Pool(1, /*recycle=*/2);
  ASSERT_NE(c, nullptr);
  const int first = CompiledBy(*c, AddRequest(0));
  EXPECT_EQ(CompiledBy(*c, AddRequest(1)), first);
  const int next = CompiledBy(*c, AddRequest(2));
  EXPECT_NE(next, first);
  EXPECT_EQ(::kill(first, 0), -1);  // ended
  EXPECT_EQ(c->GetStats().recycled, 1u);
  EXPECT_EQ(c->GetStats().spawns, 2u);
}

// In-memory headers h1..hN, each including the one below twice: 2^N
// includes, seconds of NVRTC's time at N = 24 (and memory that grows with
// them: the limit may come first on a fast machine).
GpuCompileRequest IncludeTree(int levels) {
  GpuCompileRequest req;
  req.headers.emplace_back("h0.h", "\n");
  for (int k = 1; k <= levels; ++k) {
    const std::string below = "#include \"h" + std::to_string(k - 1) + ".h\"\n";
    req.headers.emplace_back("h" + std::to_string(k) + ".h", below + below);
  }
  req.source = "#include \"h" + std::to_string(levels) + ".h\"\n" + kAdd;
  req.archs = {"sm_90"};
  return req;
}

TEST(NvrtcPoolTest, ACompilePastTheLimitKillsItsWorker) {
  auto c = Pool(1, 256, /*timeout_ms=*/1000);
  ASSERT_NE(c, nullptr);
  const int before = CompiledBy(*c, AddRequest(0));
  absl::StatusOr<GpuCompileOutput> out = c->Compile(IncludeTree(24));
  ASSERT_FALSE(out.ok());
  EXPECT_TRUE(out.status().code() == absl::StatusCode::kDeadlineExceeded ||
              out.status().code() == absl::StatusCode::kResourceExhausted)
      << out.status();
  if (absl::IsDeadlineExceeded(out.status())) {
    EXPECT_NE(std::string(out.status().message()).find("ran past 1000 ms"), std::string::npos);
    EXPECT_EQ(c->GetStats().timeouts, 1u);
  }
  // That worker is gone: the next compile gets a new one, and works.
  EXPECT_EQ(::kill(before, 0), -1);
  const int after = CompiledBy(*c, AddRequest(1));
  EXPECT_GT(after, 0);
  EXPECT_NE(after, before);
}

TEST(NvrtcPoolTest, ConcurrentCompilesOfTwoNamespaces) {
  auto c = Pool(2);
  ASSERT_NE(c, nullptr);
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<GpuCompileOutput>> results(6, absl::UnknownError("not run"));
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] { results[t] = c->Compile(AddRequest(t, t % 2 ? "odd" : "even")); });
  }
  for (auto& th : threads) th.join();
  std::set<int> pids[2];
  for (int t = 0; t < 6; ++t) {
    ASSERT_TRUE(results[t].ok()) << results[t].status();
    pids[t % 2].insert(results[t]->worker_pid);
  }
  // No worker compiled for both.
  for (int pid : pids[0]) EXPECT_EQ(pids[1].count(pid), 0u) << pid;
}

constexpr char kPrelude[] = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n";

// NVRTC in this process: no worker, no PCH.
const NvrtcCompiler& InProcess() {
  static const std::unique_ptr<NvrtcCompiler> c = [] {
    NvrtcOptions o = Options();
    o.worker_path.clear();
    return *NvrtcCompiler::Create(o);
  }();
  return *c;
}

TEST(NvrtcPoolTest, ALeadingIncludeBlockIsPrecompiled) {
  auto c = Pool(1);
  ASSERT_NE(c, nullptr);
  GpuCompileRequest req = AddRequest(0, "", kPrelude);
  req.archs = {"sm_80", "sm_90"};
  absl::StatusOr<GpuCompileOutput> first = c->Compile(req);
  ASSERT_TRUE(first.ok()) << first.status();
  if (first->pch_created == 0 && first->pch_used == 0) {
    GTEST_SKIP() << "no PCHs here (no private namespaces, or NVRTC before 12.8)";
  }
  EXPECT_EQ(first->pch_created, 2);  // one per arch
  req.source = std::string(kPrelude) + kAdd + "// another body\n";
  absl::StatusOr<GpuCompileOutput> second = c->Compile(req);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->pch_used, 2);
  EXPECT_EQ(second->pch_created, 0);
  // The same bytes as a compile without PCH, and no word of it in the log.
  absl::StatusOr<GpuCompileOutput> ref = InProcess().Compile(req);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(second->cubins, ref->cubins);
  EXPECT_EQ(second->ptx, ref->ptx);
  EXPECT_EQ(second->diagnostics, ref->diagnostics);
  EXPECT_EQ(c->GetStats().pch_used, static_cast<uint64_t>(first->pch_used + second->pch_used));
  EXPECT_EQ(c->GetStats().pch_created, 2u);
  std::printf("[          ] prelude compile, sm_80+sm_90: %.1f ms creating its PCHs, %.1f ms "
              "with them, %.1f ms in process without\n",
              first->compile_ms, second->compile_ms, ref->compile_ms);
}

// An error in a source after a PCH'd block reads as it does without PCHs.
TEST(NvrtcPoolTest, DiagnosticsAreTheSameWithAPch) {
  auto c = Pool(1);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->Compile(AddRequest(0, "", kPrelude)).ok());
  GpuCompileRequest bad = AddRequest(1, "", kPrelude);
  bad.source += "__global__ void k(float* a) { a[0] = undeclared; }\n";
  absl::StatusOr<GpuCompileOutput> out = c->Compile(bad);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(out.status().message());
  EXPECT_NE(msg.find("kernel.cu(9): error: identifier \"undeclared\" is undefined"),
            std::string::npos)
      << msg;
  absl::StatusOr<GpuCompileOutput> ref = InProcess().Compile(bad);
  EXPECT_EQ(out.status().code(), ref.status().code());
  EXPECT_EQ(out.status().message(), ref.status().message());
  for (const char* word : {"precompiled", "PCH", "/dev/shm"}) {
    EXPECT_EQ(msg.find(word), std::string::npos) << word << " in " << msg;
  }
}

// Two archs of one compile run on two workers of its namespace at once when
// a second one is idle (here: the one started ahead): the same output as
// one NVRTC compiling both, warnings and lowered names included. Another
// namespace's worker is never the second.
TEST(NvrtcPoolTest, TwoArchsRunOnTwoWorkersAtOnce) {
  auto c = Pool(2);
  ASSERT_NE(c, nullptr);
  GpuCompileRequest req;
  req.source = std::string("#warning opjit split test\n") + kAdd +
               "template <typename T> __global__ void twice(T* a) { a[0] *= 2; }\n";
  req.name_expressions = {"twice<float>"};
  req.tenant = "a";
  absl::StatusOr<GpuCompileOutput> out;
  for (int i = 0; i < 100 && c->GetStats().split_compiles == 0; ++i) {
    req.source += "//\n";
    out = c->Compile(req);
    ASSERT_TRUE(out.ok()) << out.status();
    if (c->GetStats().split_compiles == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the spare starts
    }
  }
  ASSERT_EQ(c->GetStats().split_compiles, 1u);
  absl::StatusOr<GpuCompileOutput> ref = InProcess().Compile(req);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(out->cubins, ref->cubins);
  EXPECT_EQ(out->ptx, ref->ptx);
  EXPECT_EQ(out->ptx_arch, ref->ptx_arch);
  EXPECT_EQ(out->lowered_names, ref->lowered_names);
  EXPECT_EQ(out->diagnostics, ref->diagnostics);
  EXPECT_NE(out->diagnostics.find("opjit split test"), std::string::npos) << out->diagnostics;
  // An error in the source: the same error.
  GpuCompileRequest bad = req;
  bad.source += "__global__ void k(float* a) { a[0] = undeclared; }\n";
  absl::StatusOr<GpuCompileOutput> failed = c->Compile(bad);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().message(), InProcess().Compile(bad).status().message());
  // Namespace "a" holds both workers now: "b" gets a fresh one (ending one
  // of them), and no second one.
  const uint64_t splits = c->GetStats().split_compiles;
  req.tenant = "b";
  absl::StatusOr<GpuCompileOutput> b = c->Compile(req);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(b->worker_pid, out->worker_pid);
  EXPECT_EQ(c->GetStats().split_compiles, splits);
  EXPECT_EQ(c->GetStats().tenant_switches, 1u);
}

// NVRTC does not check a PCH's headers: the worker drops its PCHs when a
// header of the include dirs changes, so an edit is compiled.
TEST(NvrtcPoolTest, AnEditedHeaderIsNotServedFromAnOldPch) {
  testing::TempDir dir;
  ::chmod(dir.path().c_str(), 0755);
  testing::WriteFile(dir.path() + "/scale.cuh", "#define SCALE 11111\n");
  NvrtcOptions o = Options();
  o.workers = 1;
  o.extra_include_dirs = {dir.path()};
  auto c = NvrtcCompiler::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  GpuCompileRequest req;
  req.source = "#include <scale.cuh>\nextern \"C\" __global__ void k(int* a) { a[0] = SCALE; }\n";
  req.archs = {"sm_90"};
  for (int value : {11111, 22222, 33333}) {
    testing::WriteFile(dir.path() + "/scale.cuh", "#define SCALE " + std::to_string(value) + "\n");
    req.source += "//\n";
    absl::StatusOr<GpuCompileOutput> out = (*c)->Compile(req);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_NE(out->ptx.find(std::to_string(value)), std::string::npos) << value;
    // Unchanged: the PCH is used.
    req.source += "//\n";
    out = (*c)->Compile(req);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_NE(out->ptx.find(std::to_string(value)), std::string::npos) << value;
  }
}

// In-memory headers never meet a PCH (NVRTC would take one of another
// content of the same name for theirs).
TEST(NvrtcPoolTest, InMemoryHeadersAreCompiledEveryTime) {
  auto c = Pool(1);
  ASSERT_NE(c, nullptr);
  GpuCompileRequest req;
  req.source = "#include \"helper.h\"\nextern \"C\" __global__ void k(int* a) { a[0] = V; }\n";
  req.archs = {"sm_90"};
  for (const char* value : {"11111", "22222", "11111"}) {
    req.headers = {{"helper.h", std::string("#define V ") + value + "\n"}};
    req.source += "//\n";
    absl::StatusOr<GpuCompileOutput> out = c->Compile(req);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_NE(out->ptx.find(value), std::string::npos) << value;
    EXPECT_EQ(out->pch_used + out->pch_created, 0);
  }
}

TEST(NvrtcCreateTest, MissingLibraryIsUnavailable) {
  NvrtcOptions o = Options();
  o.nvrtc_path = "/nonexistent/libnvrtc.so";
  absl::StatusOr<std::unique_ptr<NvrtcCompiler>> c = NvrtcCompiler::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("NVRTC (libnvrtc.so) could not be loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find("install the CUDA toolkit"), std::string::npos) << msg;
}

TEST(NvrtcCreateTest, LibraryWithoutNvrtcIsUnavailable) {
  NvrtcOptions o = Options();
  o.nvrtc_path = "libm.so.6";
  absl::StatusOr<std::unique_ptr<NvrtcCompiler>> c = NvrtcCompiler::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(c.status().message()).find("nvrtcCompileProgram"), std::string::npos)
      << c.status();
}

// Each ctest case runs in a fresh process with a fresh pool: the first
// compile goes to a worker that NVRTC's initialisation (and the loading of
// libnvrtc-builtins) warmed up before it said hello.
TEST(NvrtcTimingTest, ColdCompileToSm90) {
  const auto t0 = std::chrono::steady_clock::now();
  auto c = NvrtcCompiler::Create(Options());
  ASSERT_TRUE(c.ok()) << c.status();
  const auto t1 = std::chrono::steady_clock::now();
  GpuCompileRequest req;
  req.source = kAdd;
  req.archs = {"sm_90"};
  auto cold = (*c)->Compile(req);
  ASSERT_TRUE(cold.ok()) << cold.status();
  auto warm = (*c)->Compile(req);
  ASSERT_TRUE(warm.ok()) << warm.status();
  req.source = std::string("#include <cuda_fp16.h>\n") + kAdd;
  auto fp16 = (*c)->Compile(req);
  ASSERT_TRUE(fp16.ok()) << fp16.status();
  req.source = kAdd;
  req.archs = {"sm_80", "sm_90"};
  auto both = (*c)->Compile(req);
  ASSERT_TRUE(both.ok()) << both.status();
  std::printf(
      "[          ] NVRTC: dlopen+Create %.1f ms; small kernel -> sm_90 CUBIN: first %.1f ms, "
      "second %.1f ms; "
      "with cuda_fp16.h %.1f ms; sm_80+sm_90+PTX %.1f ms\n",
      std::chrono::duration<double, std::milli>(t1 - t0).count(), cold->compile_ms,
      warm->compile_ms, fp16->compile_ms, both->compile_ms);
}

}  // namespace
}  // namespace opjit::gpu

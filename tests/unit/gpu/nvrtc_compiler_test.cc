#include "server/gpu/nvrtc_compiler.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
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
  // The spare sandbox, started for the next compile, waits for its request
  // past its sandbox: what it runs as.
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

// Each ctest case runs in a fresh process, so this is a cold NVRTC: the first
// compile pays for loading libnvrtc-builtins and initialising the front end.
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
      "[          ] NVRTC: dlopen+Create %.1f ms; small kernel -> sm_90 CUBIN: cold %.1f ms, warm "
      "%.1f ms; "
      "with cuda_fp16.h %.1f ms; sm_80+sm_90+PTX %.1f ms\n",
      std::chrono::duration<double, std::milli>(t1 - t0).count(), cold->compile_ms,
      warm->compile_ms, fp16->compile_ms, both->compile_ms);
}

}  // namespace
}  // namespace opjit::gpu

#include "server/gpu/nvcc_compiler.h"

#include <elf.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "tests/unit/gpu/test_util.h"
#include "tests/unit/testing/procfs.h"

namespace opjit::gpu {
namespace {

// A MindSpore aot GPU kernel: a __global__ kernel and an exported host
// launcher that uses <<<...>>> on the stream it is given.
constexpr char kAotAdd[] = R"(
#include <cstdint>
#include <cuda_runtime.h>
#include "custom_aot_extra.h"

__global__ void VectorAddKernel(const float* a, const float* b, float* c, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

extern "C" int CustomAdd(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                         void* stream, void* extra) {
  if (nparam != 3) return 1;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const int block = 256;
  const int64_t grid = (n + block - 1) / block;
  if (grid > 0) {
    VectorAddKernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
        static_cast<float*>(params[2]), n);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}
)";

NvccRequest Request(const std::string& source) {
  NvccRequest r;
  r.source = source;
  r.cuda_root = OPJIT_TEST_CUDA_ROOT;
  r.kernel_include_dir = OPJIT_TEST_KERNEL_INCLUDE_DIR;
  r.archs = {"sm_80"};
  // As the daemon runs it: confined by opjit-gpu-sandbox.
  r.sandbox_path = OPJIT_BINARY_DIR "/bin/opjit-gpu-sandbox";
  return r;
}

bool Exports(const std::vector<testing::ElfSymbol>& syms, const std::string& name) {
  return std::any_of(syms.begin(), syms.end(), [&](const testing::ElfSymbol& s) {
    return s.name == name && s.defined && s.function;
  });
}

TEST(NvccTest, AotKernelBuildsASharedObjectExportingItsEntry) {
  absl::StatusOr<NvccOutput> out = CompileAotSharedObject(Request(kAotAdd));
  ASSERT_TRUE(out.ok()) << out.status();
  std::printf("[          ] nvcc aot .so: %zu bytes in %.0f ms\n", out->shared_object.size(),
              out->compile_ms);
  int type = 0;
  std::vector<testing::ElfSymbol> syms = testing::DynamicSymbols(out->shared_object, &type);
  EXPECT_EQ(type, ET_DYN);
  EXPECT_TRUE(Exports(syms, "CustomAdd"));
  // The kernel stub is C++-mangled, the entry is not.
  EXPECT_FALSE(Exports(syms, "VectorAddKernel"));
}

TEST(NvccTest, SeveralArchsAndUserOptions) {
  NvccRequest r = Request(std::string("#ifndef OPJIT_FLAG\n#error no flag\n#endif\n") + kAotAdd);
  r.archs = {"sm_90", "sm_80"};
  r.options = {"-DOPJIT_FLAG=1", "--use_fast_math"};
  absl::StatusOr<NvccOutput> out = CompileAotSharedObject(r);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(Exports(testing::DynamicSymbols(out->shared_object), "CustomAdd"));
}

TEST(NvccTest, SyntaxErrorGivesDiagnostics) {
  NvccRequest r = Request("extern \"C\" int F(int n) {\n  return n +;\n}\n");
  r.file_name = "bad_op.cu";
  absl::StatusOr<NvccOutput> out = CompileAotSharedObject(r);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(out.status().message());
  EXPECT_EQ(msg.rfind("compile failed:\n", 0), 0u) << msg;
  EXPECT_NE(msg.find("bad_op.cu(2): error"), std::string::npos) << msg;
  // No temp-dir paths leak to the client.
  EXPECT_EQ(msg.find("opjit-nvcc-"), std::string::npos) << msg;
}

TEST(NvccTest, TimeoutKillsNvcc) {
  NvccRequest r = Request(kAotAdd);
  r.timeout_ms = 50;
  absl::StatusOr<NvccOutput> out = CompileAotSharedObject(r);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDeadlineExceeded) << out.status();
}

TEST(NvccTest, BadArchAndMissingNvcc) {
  NvccRequest r = Request(kAotAdd);
  r.archs = {"compute_80"};
  EXPECT_EQ(CompileAotSharedObject(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.archs = {};
  EXPECT_EQ(CompileAotSharedObject(r).status().code(), absl::StatusCode::kInvalidArgument);
  r = Request(kAotAdd);
  r.cuda_root = "/nonexistent";
  absl::StatusOr<NvccOutput> out = CompileAotSharedObject(r);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
}

// nvcc and the host compiler it runs read only the system's and opjit's
// headers; host files neither compile in nor show up in the diagnostics.
TEST(NvccTest, HostFilesCannotBeIncludedOrEmbedded) {
  const std::string passwd = testing::ReadFile("/etc/passwd");
  ASSERT_NE(passwd.find("root:"), std::string::npos);
  for (const std::string& src :
       {std::string("#include \"/etc/shadow\"\n"), std::string("#include \"/etc/passwd\"\n"),
        std::string("#include \"/proc/self/environ\"\n"),
        std::string("asm(\".incbin \\\"/etc/passwd\\\"\");\n")}) {
    absl::StatusOr<NvccOutput> out = CompileAotSharedObject(Request(src + "int unused;\n"));
    const std::string text =
        out.ok() ? out->shared_object + out->diagnostics : std::string(out.status().message());
    EXPECT_FALSE(out.ok()) << src;
    EXPECT_EQ(text.find("root:"), std::string::npos) << src << " leaked /etc/passwd";
    EXPECT_EQ(text.find("PATH="), std::string::npos) << src << " leaked an environment";
  }
}

TEST(NvccTest, ToolchainId) {
  absl::StatusOr<std::string> id = NvccToolchainId(OPJIT_TEST_CUDA_ROOT);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(id->find("release 13."), std::string::npos) << *id;
  EXPECT_NE(id->find("host="), std::string::npos) << *id;
  EXPECT_EQ(NvccToolchainId("/nonexistent").status().code(), absl::StatusCode::kUnavailable);
}

// /proc/<pid>/status fields ("Uid", "NSpid") of every process whose command
// line mentions `needle`.
std::vector<std::map<std::string, std::string>> ProcessesMentioning(const std::string& needle) {
  std::vector<std::map<std::string, std::string>> out;
  for (const opjit::testing::ProcInfo& p : opjit::testing::ListProcesses()) {
    if (p.cmdline.find(needle) == std::string::npos || p.status.empty()) continue;
    out.push_back({{"Uid", p.StatusField("Uid")}, {"NSpid", p.StatusField("NSpid")}});
  }
  return out;
}

// On a root daemon nvcc runs as the compile uid, never root, as process 1 of
// a PID namespace of its own (its tools below it), and still reads a 0700
// include directory of root's (CAP_DAC_READ_SEARCH, ambient across its
// execs, within Landlock).
TEST(NvccTest, SandboxedNvccRunsAsTheCompileUidInNamespacesOfItsOwn) {
  if (::geteuid() != 0) GTEST_SKIP() << "the compile uid is a root daemon's";
  char top[] = "/tmp/opjit-nvcc-private-XXXXXX";
  ASSERT_NE(::mkdtemp(top), nullptr);  // 0700, root's
  const std::string inc = std::string(top) + "/include";
  ASSERT_EQ(::mkdir(inc.c_str(), 0700), 0);
  {
    std::ofstream h(inc + "/nvcc_private.h");
    h << "#pragma once\n#define NVCC_PRIVATE_SCALE 3.0f\n";
  }
  ::chmod((inc + "/nvcc_private.h").c_str(), 0600);
  // Its temp dirs, found by this name. Searchable by anyone, as /tmp is:
  // gcc checks its TMPDIR with access(), which counts no capability.
  char tmp[] = "/tmp/opjit-nvcc-tmp-XXXXXX";
  ASSERT_NE(::mkdtemp(tmp), nullptr);
  ::chmod(tmp, 0711);
  NvccRequest r = Request(std::string("#include <nvcc_private.h>\n") + kAotAdd);
  r.extra_include_dirs = {inc};
  r.tmp_dir = tmp;
  r.compile_uid = 1879113728;
  absl::StatusOr<NvccOutput> out;
  std::atomic<bool> done{false};
  std::thread compile([&] {
    out = CompileAotSharedObject(r);
    done = true;
  });
  std::set<std::string> uids, nspids;
  while (!done) {
    for (const auto& p : ProcessesMentioning(tmp)) {
      uids.insert(p.count("Uid") ? p.at("Uid") : "?");
      nspids.insert(p.count("NSpid") ? p.at("NSpid") : "?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  compile.join();
  std::filesystem::remove_all(top);
  std::filesystem::remove_all(tmp);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_FALSE(uids.empty()) << "no process of the compile was seen";
  for (const std::string& u : uids) {
    // The sandbox itself may be seen before it switches; what runs nvcc's
    // work never keeps root.
    EXPECT_TRUE(u == "1879113728\t1879113728\t1879113728\t1879113728" || u.rfind("0\t", 0) == 0)
        << u;
  }
  EXPECT_TRUE(uids.count("1879113728\t1879113728\t1879113728\t1879113728")) << "nvcc never ran "
                                                                                "as the compile uid";
  // Every one is in a PID namespace below the host's ("<host pid>\t<pid>").
  for (const std::string& n : nspids) EXPECT_NE(n.find('\t'), std::string::npos) << n;
}

}  // namespace
}  // namespace opjit::gpu

#include "server/gpu/nvcc_compiler.h"

#include <elf.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "tests/unit/gpu/test_util.h"

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

}  // namespace
}  // namespace opjit::gpu

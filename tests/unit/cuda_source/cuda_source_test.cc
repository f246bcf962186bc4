// The host-code detector that sends a .cu file to nvcc instead of NVRTC
// (server/compiler/cuda_source.h).
#include "server/compiler/cuda_source.h"

#include <chrono>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

namespace opjit::compiler {
namespace {

using Kind = HostCodeSite::Kind;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// MindSpore's aot form: a kernel and an extern "C" launcher.
constexpr char kMindSporeAot[] = R"(#include <cstdint>
#include "custom_aot_extra.h"
__global__ void AddKernel(const float* x, const float* y, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

extern "C" int CustomAdd(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* extra) {
  AddKernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(params[0]), static_cast<const float*>(params[1]),
      static_cast<float*>(params[2]), 1);
  return 0;
}
)";

// Spaces as long as `text`.
std::string B(const std::string& text) { return std::string(text.size(), ' '); }

TEST(StripCommentsAndLiterals, KeepsLengthAndLines) {
  const std::string src = "int a; // c1 <<<\n/* c2\n <<< */ int b;\n";
  const std::string out = StripCommentsAndLiterals(src);
  ASSERT_EQ(out.size(), src.size());
  EXPECT_EQ(out, "int a; " + B("// c1 <<<") + "\n" + B("/* c2") + "\n" + B(" <<< */") + " int b;\n");
}

TEST(StripCommentsAndLiterals, StringsAndChars) {
  EXPECT_EQ(StripCommentsAndLiterals(R"(f("a<<<b\"c", '"', '\'');)"),
            "f(" + B(R"("a<<<b\"c")") + ", " + B(R"('"')") + ", " + B(R"('\'')") + ");");
  // Encoding prefixes go with their literal.
  EXPECT_EQ(StripCommentsAndLiterals(R"(x = u8"k<<<" L'a' U"z";)"),
            "x = " + B(R"(u8"k<<<")") + " " + B("L'a'") + " " + B(R"(U"z")") + ";");
  // An identifier before a quote is not a prefix.
  EXPECT_EQ(StripCommentsAndLiterals(R"(extern"C" int f();)"), "extern    int f();");
}

TEST(StripCommentsAndLiterals, RawStrings) {
  const std::string src = "auto s = R\"x(a )\" <<< \n b)x\"; int k;";
  const std::string out = StripCommentsAndLiterals(src);
  EXPECT_EQ(out.find("<<<"), std::string::npos) << out;
  EXPECT_NE(out.find("int k;"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_EQ(out.find('R'), std::string::npos) << out;  // the prefix too
}

TEST(StripCommentsAndLiterals, DigitSeparatorsAreNotCharLiterals) {
  EXPECT_EQ(StripCommentsAndLiterals("int n = 1'000'000; char c = 'x';"),
            "int n = 1'000'000; char c =    ;");
  EXPECT_EQ(StripCommentsAndLiterals("auto h = 0xFF'FF; k<<<1,1>>>();"),
            "auto h = 0xFF'FF; k<<<1,1>>>();");
}

TEST(StripCommentsAndLiterals, CommentMarkersInsideLiteralsAndViceVersa) {
  EXPECT_EQ(StripCommentsAndLiterals(R"(s = "// not a comment"; t;)"),
            "s = " + B(R"("// not a comment")") + "; t;");
  EXPECT_EQ(StripCommentsAndLiterals("/* \"quote */ x; // 'q\ny"),
            B("/* \"quote */") + " x; " + B("// 'q") + "\ny");
  // A line comment continued by a backslash.
  EXPECT_EQ(StripCommentsAndLiterals("// a \\\nb\nc"), B("// a \\") + "\n \nc");
  // Unterminated: a string stops at the end of its line, a comment at the end.
  EXPECT_EQ(StripCommentsAndLiterals("\"abc\nd /* e"), "    \nd     ");
}

TEST(FindHostCode, MindSporeAotFileHasHostCode) {
  auto site = FindHostCode(kMindSporeAot);
  ASSERT_TRUE(site.has_value());
  // The extern "C" function comes first (line 8), before its launch (line 10).
  EXPECT_EQ(site->kind, Kind::kHostFunction);
  EXPECT_EQ(site->function, "CustomAdd");
  EXPECT_EQ(site->line, 8);
  EXPECT_EQ(site->Describe(), "the extern \"C\" host function CustomAdd (line 8)");
}

TEST(FindHostCode, TheRepositorysExamples) {
  const std::string dir = std::string(OPJIT_SOURCE_DIR) + "/kernels/examples/";
  const std::string aot = ReadFile(dir + "add_aot.cu");
  ASSERT_FALSE(aot.empty());
  auto site = FindHostCode(aot);
  ASSERT_TRUE(site.has_value());
  EXPECT_EQ(site->function, "CustomAddGpu");
  const std::string nvrtc = ReadFile(dir + "scale_add.cu");
  ASSERT_FALSE(nvrtc.empty());
  EXPECT_FALSE(FindHostCode(nvrtc).has_value());
}

TEST(FindHostCode, LaunchAlone) {
  auto site = FindHostCode("__global__ void k(float*);\nvoid go(float* p) {\n  k<<<1, 32>>>(p);\n}\n");
  ASSERT_TRUE(site.has_value());
  EXPECT_EQ(site->kind, Kind::kKernelLaunch);
  EXPECT_EQ(site->function, "k");
  EXPECT_EQ(site->line, 3);
  EXPECT_EQ(site->Describe(), "a <<<...>>> kernel launch of k (line 3)");
}

TEST(FindHostCode, TemplateAndSpacedLaunches) {
  auto t = FindHostCode("void f() { Scale<float, 4> <<< g, b >>>(x); }");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->kind, Kind::kKernelLaunch);
  EXPECT_EQ(t->function, "Scale");
  auto nested = FindHostCode("void f() { K<A<int>><<<1,1>>>(); }");
  ASSERT_TRUE(nested.has_value());
  EXPECT_EQ(nested->function, "K");
  auto ptr = FindHostCode("void f() { (*table[0])<<<1,1>>>(); }");
  ASSERT_TRUE(ptr.has_value());
  EXPECT_EQ(ptr->function, "");
}

TEST(FindHostCode, LaunchInAMacroCounts) {
  auto site = FindHostCode("#define LAUNCH(k, n) k<<<(n + 255) / 256, 256>>>()\n");
  ASSERT_TRUE(site.has_value());
  EXPECT_EQ(site->kind, Kind::kKernelLaunch);
}

TEST(FindHostCode, PureDeviceCode) {
  EXPECT_FALSE(FindHostCode(R"(
extern "C" __global__ void saxpy(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
template <typename T> __device__ T sq(T v) { return v * v; }
__global__ void shift(int* x) { x[0] = x[1] << 2; x[2] = x[3] >> 1; }
)").has_value());
}

TEST(FindHostCode, ExternCDeviceAndHostDeviceFunctionsAreDeviceCode) {
  EXPECT_FALSE(FindHostCode("extern \"C\" __device__ float twice(float x) { return 2 * x; }").has_value());
  EXPECT_FALSE(
      FindHostCode("extern \"C\" __host__ __device__ float twice(float x) { return 2 * x; }").has_value());
  EXPECT_FALSE(FindHostCode("extern \"C\" __global__ void __launch_bounds__(256) k(float* x) { x[0] = 1; }")
                   .has_value());
  auto host = FindHostCode("extern \"C\" __host__ int entry(int n) { return n; }");
  ASSERT_TRUE(host.has_value());
  EXPECT_EQ(host->function, "entry");
}

TEST(FindHostCode, DeclarationsAndVariablesAreNot) {
  EXPECT_FALSE(FindHostCode("extern \"C\" int CustomAdd(int nparam, void** params);\n").has_value());
  EXPECT_FALSE(FindHostCode("extern \"C\" int table[] = {1, 2, 3};\n").has_value());
  EXPECT_FALSE(FindHostCode("extern \"C\" int (*hook)(int) = nullptr;\n").has_value());
  EXPECT_FALSE(FindHostCode("extern \"C\" struct Pair { int a, b; } pair;\n").has_value());
  // C++ linkage is not C linkage.
  EXPECT_FALSE(FindHostCode("extern \"C++\" int f(int n) { return n; }").has_value());
  // A plain extern variable.
  EXPECT_FALSE(FindHostCode("extern __device__ int counter;").has_value());
}

TEST(FindHostCode, ExternCBlocks) {
  const char* src = R"(#ifdef __cplusplus
extern "C" {
#endif
__global__ void k(float* x) { x[0] = 1; }
int helper_decl(int);
struct S { int v; };
int Launcher(int nparam, void** params) {
  return nparam;
}
#ifdef __cplusplus
}
#endif
)";
  auto site = FindHostCode(src);
  ASSERT_TRUE(site.has_value());
  EXPECT_EQ(site->kind, Kind::kHostFunction);
  EXPECT_EQ(site->function, "Launcher");
  EXPECT_EQ(site->line, 7);
  EXPECT_FALSE(FindHostCode("extern \"C\" {\n__global__ void k(float* x) { x[0] = 1; }\n"
                            "__device__ int d() { return 1; }\n}\n")
                   .has_value());
}

TEST(FindHostCode, CommentsAndStringsDoNotCount) {
  EXPECT_FALSE(FindHostCode(R"(
// launch it with k<<<grid, block>>>(x) from the host:
/* extern "C" int Launch(int n) { return n; } */
__device__ const char* kDoc = "k<<<1,1>>>() and extern \"C\" int f() {}";
__global__ void k(float* x) { x[0] = '<'; }
)").has_value());
}

TEST(FindHostCode, NotLaunches) {
  // operator<< <T> and shifts of numbers are not launches; an unmatched <<< is not either.
  EXPECT_FALSE(FindHostCode("template <> Out& operator<<<float>(Out& o, float v);").has_value());
  EXPECT_FALSE(FindHostCode("__device__ int f() { return 1 <<<2; }").has_value());
  EXPECT_FALSE(FindHostCode("__device__ int f(int a) { return a <<< 2; }").has_value());
}

TEST(FindHostCode, DefaultDeviceMakesUnannotatedFunctionsDeviceCode) {
  const char* fn = "extern \"C\" int entry(int n) { return n; }";
  EXPECT_TRUE(FindHostCode(fn).has_value());
  EXPECT_FALSE(FindHostCode(fn, /*default_device=*/true).has_value());
  // A launch is host code either way.
  EXPECT_TRUE(FindHostCode(kMindSporeAot, /*default_device=*/true).has_value());
  EXPECT_EQ(FindHostCode(kMindSporeAot, true)->kind, Kind::kKernelLaunch);
  EXPECT_EQ(FindHostCode(kMindSporeAot, true)->line, 10);
  EXPECT_TRUE(HasDefaultDeviceOption({"-DX=1", "-default-device"}));
  EXPECT_TRUE(HasDefaultDeviceOption({"--device-as-default-execution-space"}));
  EXPECT_FALSE(HasDefaultDeviceOption({"-DX=1", "--use_fast_math"}));
}

TEST(FindHostCode, EmptyAndDegenerateInputs) {
  EXPECT_FALSE(FindHostCode("").has_value());
  EXPECT_FALSE(FindHostCode("extern").has_value());
  EXPECT_FALSE(FindHostCode("extern \"C\"").has_value());
  EXPECT_FALSE(FindHostCode("extern \"C\" {").has_value());
  EXPECT_FALSE(FindHostCode("<<<").has_value());
  EXPECT_FALSE(FindHostCode("\"unterminated <<< >>>").has_value());
  EXPECT_FALSE(FindHostCode("/* unterminated k<<<1,1>>>()").has_value());
  // Unbalanced braces do not hang or crash.
  auto site = FindHostCode("extern \"C\" int f() { {");
  ASSERT_TRUE(site.has_value());
  EXPECT_EQ(site->function, "f");
}

// The detector runs in the daemon on every GPU compile request: text built to
// make a naive scanner quadratic takes linear time.
TEST(FindHostCode, LinearOnPathologicalText) {
  auto repeat = [](const std::string& unit, size_t times) {
    std::string out;
    out.reserve(unit.size() * times);
    for (size_t k = 0; k < times; ++k) out += unit;
    return out;
  };
  const std::vector<std::string> inputs = {
      repeat("1'", 500000),                  // digit separators
      repeat("R\"", 500000),                 // raw-string openers without (
      repeat("1<<<", 250000) + ">>>",       // launches that are not
      repeat("a.b<<<", 150000) + ">>>",
      repeat("extern \"C\" {", 80000),
      repeat("extern \"C\" int f(", 80000),
      repeat("/*", 500000),
  };
  const auto start = std::chrono::steady_clock::now();
  for (const auto& in : inputs) (void)FindHostCode(in);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 5.0);
}

}  // namespace
}  // namespace opjit::compiler

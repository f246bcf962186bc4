// Tests of opjit::loader: linking objects, symbol resolution, static
// constructors/destructors, exceptions, libraries.
#include "server/loader/loader.h"

#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/loader/test_kernels.h"

namespace opjit::loader {
namespace {

using ::opjit::testing::CompileKernel;
using ::testing::HasSubstr;

std::unique_ptr<JitLoader> MakeLoader(std::vector<std::string> allowed = {}) {
  JitLoaderOptions options;
  options.allowed_libraries = std::move(allowed);
  auto loader = JitLoader::Create(options);
  EXPECT_TRUE(loader.ok()) << loader.status();
  return loader.ok() ? std::move(*loader) : nullptr;
}

TEST(DetectHostTargetTest, DescribesTheHost) {
  HostTarget t = DetectHostTarget();
  EXPECT_FALSE(t.triple.empty());
  EXPECT_FALSE(t.cpu.empty());
#if defined(__x86_64__)
  EXPECT_THAT(t.triple, HasSubstr("x86_64"));
  EXPECT_THAT(t.features, HasSubstr("+sse2"));
#endif
  // Only enabled features, sorted and unique. LLVM's own names may contain
  // dashes ("+amx-bf16", "+avx512-vp2intersect"), so a feature is judged by
  // its leading sign alone: "+" enabled, "-" disabled.
  std::vector<std::string> parts;
  for (size_t pos = 0; pos <= t.features.size();) {
    size_t comma = std::min(t.features.find(',', pos), t.features.size());
    parts.push_back(t.features.substr(pos, comma - pos));
    pos = comma + 1;
  }
  for (const std::string& f : parts) {
    ASSERT_GE(f.size(), 2u) << "empty feature in '" << t.features << "'";
    EXPECT_EQ(f[0], '+') << "a disabled or unsigned feature: " << f;
  }
  EXPECT_TRUE(std::is_sorted(parts.begin(), parts.end()));
  EXPECT_EQ(std::adjacent_find(parts.begin(), parts.end()), parts.end()) << "duplicates";
  std::printf("host: %s %s (%zu features)\n", t.triple.c_str(), t.cpu.c_str(), parts.size());
}

constexpr char kMathKernel[] = R"(
#include <cmath>
extern "C" float SwishTanh(float x) { return std::tanh(x) * std::exp(x); }
extern "C" { int g_counter = 42; }
static int Hidden() { return 1; }
extern "C" __attribute__((visibility("hidden"))) int HiddenGlobal() { return Hidden(); }
)";

TEST(JitLoaderTest, LoadsAndResolvesLibm) {
  auto loader = MakeLoader();
  std::string obj = CompileKernel(kMathKernel);
  auto kernel = loader->Load(obj, "math", {});
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  auto fn = (*kernel)->FindAs<float (*)(float)>("SwishTanh");
  ASSERT_NE(fn, nullptr);
  EXPECT_FLOAT_EQ(fn(0.5f), std::tanh(0.5f) * std::exp(0.5f));
  int* counter = (*kernel)->FindAs<int*>("g_counter");
  ASSERT_NE(counter, nullptr);
  EXPECT_EQ(*counter, 42);
  EXPECT_EQ((*kernel)->Find("NoSuchSymbol"), nullptr);
  EXPECT_EQ((*kernel)->defined_symbols(), (std::vector<std::string>{"SwishTanh", "g_counter"}));
  EXPECT_EQ((*kernel)->code_bytes(), obj.size());
  EXPECT_EQ((*kernel)->name(), "math");
  EXPECT_EQ(loader->GetStats().live, 1u);
}

TEST(JitLoaderTest, LoadTime) {
  auto loader = MakeLoader();
  std::string obj = CompileKernel(kMathKernel);
  std::vector<double> ms;
  for (int i = 0; i < 30; ++i) {
    auto start = std::chrono::steady_clock::now();
    auto kernel = loader->Load(obj, "timed", {});
    ASSERT_TRUE(kernel.ok()) << kernel.status();
    void* fn = (*kernel)->Find("SwishTanh");
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
    ASSERT_NE(fn, nullptr);
  }
  std::sort(ms.begin(), ms.end());
  // Printed, not asserted: the machines are busy.
  std::printf("object (%zu bytes) -> Load -> Find: median %.3f ms, min %.3f ms, max %.3f ms\n",
              obj.size(), ms[ms.size() / 2], ms.front(), ms.back());
  EXPECT_EQ(loader->GetStats().loaded, 30u);
  EXPECT_EQ(loader->GetStats().live, 0u);
}

TEST(JitLoaderTest, SameSymbolInTwoKernels) {
  auto loader = MakeLoader();
  auto a = loader->Load(CompileKernel(R"(extern "C" int Value() { return 1; })"), "a", {});
  auto b = loader->Load(CompileKernel(R"(extern "C" int Value() { return 2; })"), "a", {});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*a)->FindAs<int (*)()>("Value")(), 1);
  EXPECT_EQ((*b)->FindAs<int (*)()>("Value")(), 2);
  a->reset();
  EXPECT_EQ((*b)->FindAs<int (*)()>("Value")(), 2);
  auto stats = loader->GetStats();
  EXPECT_EQ(stats.loaded, 2u);
  EXPECT_EQ(stats.unloaded, 1u);
  EXPECT_EQ(stats.live, 1u);
}

TEST(JitLoaderTest, ExceptionPropagatesToCaller) {
  auto loader = MakeLoader();
  auto kernel = loader->Load(CompileKernel(R"(
#include <stdexcept>
extern "C" int Thrower(int x) {
  if (x > 0) throw std::runtime_error("from kernel");
  return x;
}
)"),
                             "thrower", {});
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  auto fn = (*kernel)->FindAs<int (*)(int)>("Thrower");
  ASSERT_NE(fn, nullptr);
  EXPECT_EQ(fn(0), 0);
  try {
    fn(1);
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "from kernel");
  }
}

// Static objects: the destructor of a function-local static registered with
// __cxa_atexit(&__dso_handle) and a plain atexit() both run at unload, last
// registered first, then __opjit_run_dtors. A namespace-scope static puts an
// .init_array into the object too (not run: the compile worker lowers
// constructors into __opjit_run_ctors).
constexpr char kStaticsKernel[] = R"(
#include <cstdlib>
extern "C" { int* g_sink = nullptr; int g_ctors_ran = 0; }
static void Record(int digit) { if (g_sink) *g_sink = *g_sink * 10 + digit; }
struct Guard { ~Guard() { Record(1); } };
static Guard& GetGuard() { static Guard g; return g; }
static void AtExit() { Record(3); }
struct Global { Global() {} ~Global() { Record(9); } };
static Global global;
extern "C" void __opjit_run_ctors() {
  GetGuard();
  std::atexit(&AtExit);
  ++g_ctors_ran;
}
extern "C" void __opjit_run_dtors() { Record(2); }
)";

TEST(JitLoaderTest, StaticConstructorsAndDestructors) {
  auto loader = MakeLoader();
  auto kernel = loader->Load(CompileKernel(kStaticsKernel), "statics", {});
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  EXPECT_EQ(*(*kernel)->FindAs<int*>("g_ctors_ran"), 1);
  int sink = 0;
  *(*kernel)->FindAs<int**>("g_sink") = &sink;
  kernel->reset();
  EXPECT_EQ(sink, 312);
  EXPECT_EQ(loader->GetStats().unloaded, 1u);
}

TEST(JitLoaderTest, TwoKernelsKeepTheirOwnAtexits) {
  auto loader = MakeLoader();
  std::string obj = CompileKernel(kStaticsKernel);
  auto a = loader->Load(obj, "a", {});
  auto b = loader->Load(obj, "b", {});
  ASSERT_TRUE(a.ok() && b.ok());
  int sink_a = 0, sink_b = 0;
  *(*a)->FindAs<int**>("g_sink") = &sink_a;
  *(*b)->FindAs<int**>("g_sink") = &sink_b;
  a->reset();
  EXPECT_EQ(sink_a, 312);
  EXPECT_EQ(sink_b, 0);
  b->reset();
  EXPECT_EQ(sink_b, 312);
}

TEST(JitLoaderTest, ThrowingStaticInitialisationFailsTheLoad) {
  auto loader = MakeLoader();
  auto kernel = loader->Load(CompileKernel(R"(
#include <stdexcept>
extern "C" void __opjit_run_ctors() { throw std::runtime_error("bad init"); }
)"),
                             "badinit", {});
  ASSERT_FALSE(kernel.ok());
  EXPECT_EQ(kernel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(kernel.status().message()), HasSubstr("bad init"));
  EXPECT_EQ(loader->GetStats().live, 0u);
}

TEST(JitLoaderTest, UndefinedSymbolReportedAtLoad) {
  auto loader = MakeLoader({"libm.so.6"});
  auto kernel = loader->Load(CompileKernel(R"(
extern "C" int opjit_no_such_function(int);
extern "C" int Caller(int x) { return opjit_no_such_function(x) + 1; }
)"),
                             "undef", {"libm.so.6"});
  ASSERT_FALSE(kernel.ok());
  EXPECT_EQ(kernel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(kernel.status().message()),
              HasSubstr("undefined symbol 'opjit_no_such_function' (not in the process or the "
                        "allowed libraries: libm.so.6)"));
  EXPECT_EQ(loader->GetStats().loaded, 0u);
}

TEST(JitLoaderTest, LibraryNotOnTheAllowListIsRefused) {
  auto loader = MakeLoader({"libm.so.6"});
  auto kernel =
      loader->Load(CompileKernel(R"(extern "C" int F() { return 0; })"), "denied", {"libz.so.1"});
  ASSERT_FALSE(kernel.ok());
  EXPECT_EQ(kernel.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(kernel.status().message()), HasSubstr("'libz.so.1'"));
  EXPECT_THAT(std::string(kernel.status().message()), HasSubstr("allowed: libm.so.6"));
}

TEST(JitLoaderTest, AllowedLibraryResolves) {
  auto loader = MakeLoader({"libm.so.6"});
  auto kernel = loader->Load(CompileKernel(R"(
#include <math.h>
extern "C" double Cbrt(double x) { return cbrt(x); }
)"),
                             "cbrt", {"libm.so.6"});
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  EXPECT_DOUBLE_EQ((*kernel)->FindAs<double (*)(double)>("Cbrt")(27.0), 3.0);
}

// A library the test process does not have: resolvable only when named.
TEST(JitLoaderTest, SymbolOnlyInANamedLibrary) {
  const char* kLib = "libbz2.so.1.0";
  if (dlsym(RTLD_DEFAULT, "BZ2_bzlibVersion") != nullptr) GTEST_SKIP() << "bz2 already loaded";
  void* probe = dlopen(kLib, RTLD_NOW | RTLD_LOCAL);
  if (probe == nullptr) GTEST_SKIP() << kLib << " not installed";
  dlclose(probe);
  auto loader = MakeLoader({kLib});
  std::string obj = CompileKernel(R"(
extern "C" const char* BZ2_bzlibVersion(void);
extern "C" const char* Version() { return BZ2_bzlibVersion(); }
)");
  auto without = loader->Load(obj, "bz", {});
  ASSERT_FALSE(without.ok());
  EXPECT_THAT(std::string(without.status().message()), HasSubstr("'BZ2_bzlibVersion'"));
  auto with = loader->Load(obj, "bz", {kLib});
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_NE((*with)->FindAs<const char* (*)()>("Version")(), nullptr);
  // RTLD_LOCAL: the library does not leak into the global scope.
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "BZ2_bzlibVersion"), nullptr);
}

TEST(JitLoaderTest, MissingAllowedLibraryIsAPreconditionError) {
  auto loader = MakeLoader({"libopjit_does_not_exist.so.7"});
  auto kernel = loader->Load(CompileKernel(R"(extern "C" int F() { return 0; })"), "x",
                             {"libopjit_does_not_exist.so.7"});
  ASSERT_FALSE(kernel.ok());
  EXPECT_EQ(kernel.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(JitLoaderTest, GarbageIsRejected) {
  auto loader = MakeLoader();
  auto kernel = loader->Load("definitely not an ELF object", "garbage", {});
  ASSERT_FALSE(kernel.ok());
  EXPECT_EQ(kernel.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JitLoaderTest, CKernel) {
  auto loader = MakeLoader();
  auto kernel = loader->Load(CompileKernel(R"(
#include <math.h>
#include <stdint.h>
#include "custom_aot_extra.h"
int CustomSqrt(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
               void* stream, void* extra) {
  (void)nparam; (void)dtypes; (void)stream; (void)extra;
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = (const float*)params[0];
  float* y = (float*)params[1];
  for (int64_t i = 0; i < n; ++i) y[i] = sqrtf(x[i]);
  return 0;
}
)",
                                           "c"),
                             "csqrt", {});
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  auto fn = (*kernel)->FindAs<int (*)(int, void**, int*, int64_t**, const char**, void*, void*)>(
      "CustomSqrt");
  ASSERT_NE(fn, nullptr);
  float x[3] = {1, 4, 9}, y[3] = {};
  void* params[2] = {x, y};
  int ndims[2] = {1, 1};
  int64_t shape[1] = {3};
  int64_t* shapes[2] = {shape, shape};
  const char* dtypes[2] = {"float32", "float32"};
  EXPECT_EQ(fn(2, params, ndims, shapes, dtypes, nullptr, nullptr), 0);
  EXPECT_FLOAT_EQ(y[2], 3.0f);
}

TEST(JitLoaderTest, ConcurrentLoads) {
  auto loader = MakeLoader();
  std::string obj = CompileKernel(kMathKernel);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        auto kernel = loader->Load(obj, "concurrent", {});
        if (kernel.ok() && (*kernel)->FindAs<float (*)(float)>("SwishTanh")(0.0f) == 0.0f) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 40);
  EXPECT_EQ(loader->GetStats().live, 0u);
}

TEST(JitLoaderTest, KernelOutlivesTheLoader) {
  auto loader = MakeLoader();
  auto kernel = loader->Load(CompileKernel(kMathKernel), "orphan", {});
  ASSERT_TRUE(kernel.ok());
  loader.reset();
  EXPECT_FLOAT_EQ((*kernel)->FindAs<float (*)(float)>("SwishTanh")(0.0f), 0.0f);
}

}  // namespace
}  // namespace opjit::loader

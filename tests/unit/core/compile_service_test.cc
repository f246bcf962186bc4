// The compile use case and the compile quota of registrations, with a real
// compiler and quota manager, no gRPC: what the quota refuses never reaches
// the compiler, compile seconds are charged and cache hits are not.
#include "server/core/compile_service.h"

#include <unistd.h>

#include <filesystem>
#include <future>

#include "gtest/gtest.h"
#include "server/access/quotas.h"
#include "server/common/error_info.h"
#include "server/core/defaults.h"
#include "server/core/op_service.h"
#include "server/registry/registry.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::core {
namespace {

namespace fs = std::filesystem;

constexpr char kSource[] = "extern \"C\" int Seven() { return 7; }\n";

compiler::CompileJob Job(const std::string& ns, const std::string& source = kSource) {
  compiler::CompileJob job;
  job.source = source;
  job.entry = "Seven";
  job.ns = ns;
  return job;
}

registry::OpDef Def(const std::string& ns, const std::string& name) {
  registry::OpDef d = opjit::testing::FloatOp(
      name, {"x"}, {"y"},
      "#include <cstdint>\n"
      "extern \"C\" int Copy(int, void** p, int*, int64_t** s, const char**, void*, void*) {\n"
      "  for (int64_t i = 0; i < s[0][0]; ++i) static_cast<float*>(p[1])[i] = "
      "static_cast<float*>(p[0])[i];\n"
      "  return 0;\n"
      "}\n",
      "Copy");
  d.ns = ns;
  return d;
}

void ExpectQuota(const absl::Status& s, const std::string& quota) {
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  auto why = GetReason(s);
  ASSERT_TRUE(why.has_value()) << s;
  EXPECT_EQ(why->reason, reason::kQuotaExceeded);
  EXPECT_NE(s.message().find(quota), std::string::npos) << s;
}

class CompileServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "opjit-compile-service-test-XXXXXX").string();
    dir_ = ::mkdtemp(tmpl.data());
    compiler::KernelCompilerOptions o;
    o.cache_dir = dir_ + "/cache";
    o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
    o.kernel_include_dir = OPJIT_SOURCE_DIR "/kernels/include";
    auto kc = compiler::KernelCompiler::Create(o);
    ASSERT_TRUE(kc.ok()) << kc.status();
    compiler_ = *std::move(kc);
  }
  void TearDown() override {
    compiler_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  absl::StatusOr<compiler::CompileOutcome> Compile(const CompileService& service,
                                                   compiler::CompileJob job) {
    std::promise<absl::StatusOr<compiler::CompileOutcome>> p;
    service.CompileAsync(std::move(job), 1, [&p](absl::StatusOr<compiler::CompileOutcome> r) {
      p.set_value(std::move(r));
    });
    return p.get_future().get();
  }

  std::string dir_;
  std::unique_ptr<compiler::KernelCompiler> compiler_;
};

TEST_F(CompileServiceTest, CompilesWithoutQuotas) {
  CompileService service(compiler_.get(), nullptr);
  auto r = Compile(service, Job("default"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, compiler::CacheTier::kNone);
  EXPECT_EQ(compiler_->Stats().compiles, 1u);
}

TEST_F(CompileServiceTest, ACompileTheQuotaRefusesNeverReachesTheCompiler) {
  access::QuotaManager quotas({.concurrent_compiles = 1});
  CompileService service(compiler_.get(), &quotas);
  auto held = quotas.BeginCompile("busy");  // the namespace's only slot
  ASSERT_TRUE(held.ok());
  auto r = Compile(service, Job("busy"));
  ExpectQuota(r.status(), "concurrent_compiles");
  EXPECT_EQ(compiler_->Stats().compiles, 0u);
  EXPECT_EQ(compiler_->Stats().memory_misses, 0u);
  // Other namespaces have slots of their own.
  EXPECT_TRUE(Compile(service, Job("other")).ok());
  // The slot a compile held is given back before its answer.
  EXPECT_TRUE(Compile(service, Job("other")).ok());
}

TEST_F(CompileServiceTest, InvalidRequestsAreRefusedBeforeTheQuota) {
  access::QuotaManager quotas({.concurrent_compiles = 1});
  CompileService service(compiler_.get(), &quotas);
  auto held = quotas.BeginCompile("busy");
  ASSERT_TRUE(held.ok());
  auto empty = Compile(service, Job("busy", ""));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument) << empty.status();
  EXPECT_EQ(empty.status().message(), "source: empty; send the kernel's text");
  compiler::CompileJob job = Job("busy");
  job.options = {"-fplugin=evil.so"};
  auto option = Compile(service, job);
  EXPECT_EQ(option.status().code(), absl::StatusCode::kInvalidArgument) << option.status();
  EXPECT_NE(option.status().message().find("compile_options"), std::string::npos)
      << option.status();
  EXPECT_EQ(compiler_->Stats().memory_misses, 0u);
}

TEST_F(CompileServiceTest, CompileSecondsAreChargedAndCacheHitsAreFree) {
  // Any compile exhausts this budget; a charge of nothing does not.
  access::QuotaManager quotas({.compile_seconds_per_minute = 1e-9});
  CompileService service(compiler_.get(), &quotas);
  auto first = Compile(service, Job("a"));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->cache_hit, compiler::CacheTier::kNone);
  ASSERT_GT(first->kernel->compile_ms, 0);
  ExpectQuota(Compile(service, Job("a")).status(), "compile_seconds_per_minute");
  // The same source in another namespace is a cache hit: charged nothing
  // (not its wall time), so the namespace keeps its budget.
  for (int i = 0; i < 3; ++i) {
    auto hit = Compile(service, Job("b"));
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(hit->cache_hit, compiler::CacheTier::kMemory);
  }
  EXPECT_EQ(compiler_->Stats().compiles, 1u);
}

TEST_F(CompileServiceTest, RegistrationsTakeTheSameQuota) {
  auto reg = registry::Registry::Create({.db_path = dir_ + "/registry.db"});
  ASSERT_TRUE(reg.ok()) << reg.status();
  access::QuotaManager quotas({.concurrent_compiles = 1, .compile_seconds_per_minute = 1e-9});
  OpService ops(reg->get(), compiler_.get(), &quotas);
  auto Register = [&](registry::OpDef def) {
    std::promise<absl::StatusOr<RegisterOutcome>> p;
    ops.RegisterAsync(std::move(def), 1,
                      [&p](absl::StatusOr<RegisterOutcome> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  };
  {
    // No slot: refused before the definition is even validated.
    auto held = quotas.BeginCompile("a");
    ASSERT_TRUE(held.ok());
    registry::OpDef bad = Def("a", "copy");
    bad.dtype_formats.clear();
    ExpectQuota(Register(bad).status(), "concurrent_compiles");
    EXPECT_EQ(compiler_->Stats().memory_misses, 0u);
    (*held)->Charge(0);  // else its wall time would spend the budget
  }
  auto first = Register(Def("a", "copy"));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->compiled.size(), 1u);
  EXPECT_EQ(first->compiled[0].second.cache_hit, compiler::CacheTier::kNone);
  // Charged its compile seconds: the budget is spent.
  ExpectQuota(Register(Def("a", "copy2")).status(), "compile_seconds_per_minute");
  EXPECT_FALSE((*reg)->Get("a", "copy2", 0).ok());
  // A registration that hits the cache costs nothing.
  for (const char* name : {"copy", "copy3"}) {
    auto hit = Register(Def("b", name));
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(hit->compiled[0].second.cache_hit, compiler::CacheTier::kMemory);
  }
  // A bare compile and a registration share the namespace's budget.
  CompileService service(compiler_.get(), &quotas);
  ExpectQuota(Compile(service, Job("a")).status(), "compile_seconds_per_minute");
}

TEST(DefaultsTest, TargetAndLanguage) {
  EXPECT_EQ(*TargetOrDefault(""), registry::Target::kCpu);
  EXPECT_EQ(*TargetOrDefault("cpu"), registry::Target::kCpu);
  EXPECT_EQ(*TargetOrDefault("GPU"), registry::Target::kGpu);
  auto bad = TargetOrDefault("TPU");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "target: unknown \"TPU\" (expected CPU or GPU)");
  EXPECT_EQ(LanguageOrDefault("", registry::Target::kCpu), "c++");
  EXPECT_EQ(LanguageOrDefault("", registry::Target::kGpu), "cuda");
  EXPECT_EQ(LanguageOrDefault("c", registry::Target::kCpu), "c");
}

}  // namespace
}  // namespace opjit::core

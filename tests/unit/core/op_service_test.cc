#include "server/core/op_service.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "gtest/gtest.h"
#include "tests/unit/testing/core_stack.h"

namespace opjit::core {
namespace {

namespace fs = std::filesystem;

constexpr char kSource[] = R"(
#include <cstdint>
extern "C" int Twice(int, void** p, int*, int64_t** s, const char**, void*, void*) {
  for (int64_t i = 0; i < s[0][0]; ++i) static_cast<float*>(p[1])[i] = 2 * static_cast<float*>(p[0])[i];
  return 0;
}
)";

registry::OpDef Def(const std::string& name, const std::string& source = kSource,
                    const std::string& entry = "Twice") {
  registry::OpDef d = opjit::testing::FloatOp(name, {"x"}, {"y"}, source, entry);
  d.ns = "default";
  return d;
}

class OpServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "opjit-core-test-XXXXXX").string();
    dir_ = ::mkdtemp(tmpl.data());
    auto reg = registry::Registry::Create({.db_path = dir_ + "/registry.db"});
    ASSERT_TRUE(reg.ok()) << reg.status();
    registry_ = *std::move(reg);
    compiler::KernelCompilerOptions o;
    o.cache_dir = dir_ + "/cache";
    o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
    o.kernel_include_dir = OPJIT_SOURCE_DIR "/kernels/include";
    auto kc = compiler::KernelCompiler::Create(o);
    ASSERT_TRUE(kc.ok()) << kc.status();
    compiler_ = *std::move(kc);
    service_ = std::make_unique<OpService>(registry_.get(), compiler_.get());
  }
  void TearDown() override {
    service_.reset();
    compiler_.reset();
    registry_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  absl::StatusOr<RegisterOutcome> Register(registry::OpDef def) {
    std::promise<absl::StatusOr<RegisterOutcome>> p;
    service_->RegisterAsync(std::move(def), 1,
                            [&p](absl::StatusOr<RegisterOutcome> r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  }

  std::string dir_;
  std::unique_ptr<registry::Registry> registry_;
  std::unique_ptr<compiler::KernelCompiler> compiler_;
  std::unique_ptr<OpService> service_;
};

TEST_F(OpServiceTest, RegistersCompiledOpsAndIsIdempotent) {
  auto r = Register(Def("twice"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->result.created);
  EXPECT_EQ(r->result.record.version, 1);
  ASSERT_EQ(r->compiled.size(), 1u);
  EXPECT_EQ(r->compiled[0].first, registry::Target::kCpu);
  EXPECT_EQ(r->compiled[0].second.cache_hit, compiler::CacheTier::kNone);
  EXPECT_TRUE(registry_->Get("default", "twice", 0).ok());

  auto again = Register(Def("twice"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->result.created);
  EXPECT_EQ(again->result.record.version, 1);
  EXPECT_EQ(again->compiled[0].second.cache_hit, compiler::CacheTier::kMemory);

  // A renamed copy of the same source hits the cache: the key ignores the name.
  auto renamed = Register(Def("twice_too"));
  ASSERT_TRUE(renamed.ok()) << renamed.status();
  EXPECT_EQ(renamed->compiled[0].second.cache_hit, compiler::CacheTier::kMemory);
  EXPECT_EQ(compiler_->Stats().compiles, 1u);
}

TEST_F(OpServiceTest, CompileErrorsStoreNothing) {
  auto r = Register(Def("broken", "extern \"C\" int Twice( { return 0; }"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("op \"default/broken\" CPU implementation: compile failed"),
            std::string::npos)
      << r.status();
  EXPECT_FALSE(registry_->Get("default", "broken", 0).ok());
}

TEST_F(OpServiceTest, MissingEntryAndUndefinedSymbolsAreRefused) {
  auto r = Register(Def("noentry", kSource, "Thrice"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("\"Thrice\""), std::string::npos) << r.status();
  auto u = Register(Def("undefined",
                        "extern \"C\" int nowhere_to_be_found(int);\n"
                        "extern \"C\" int Twice(int n, void**, int*, long**, const char**, void*, "
                        "void*) { return nowhere_to_be_found(n); }\n"));
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.status().message().find("nowhere_to_be_found"), std::string::npos) << u.status();
  EXPECT_FALSE(registry_->Get("default", "undefined", 0).ok());
}

TEST_F(OpServiceTest, InvalidSpecsAreRefusedBeforeAnyCompile) {
  registry::OpDef d = Def("bad");
  d.dtype_formats[0].io.pop_back();  // one pair short
  auto r = Register(d);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(compiler_->Stats().compiles, 0u);
  EXPECT_EQ(compiler_->Stats().memory_misses, 0u);
}

TEST_F(OpServiceTest, ConcurrentRegistrationsStoreOneVersion) {
  std::vector<std::thread> threads;
  std::atomic<int> ok{0}, created{0};
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&] {
      auto r = Register(Def("shared"));
      if (r.ok()) {
        ++ok;
        created += r->result.created;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 6);
  EXPECT_EQ(created.load(), 1);
  EXPECT_EQ(registry_->Get("default", "shared", 0)->version, 1);
  EXPECT_EQ(compiler_->Stats().compiles, 1u);
}

// GPU compilers do not report the headers they read; the key covers every
// header they may read, so editing one misses (and the old key still hits).
TEST(GpuCacheKeyTest, EditedHeaderMisses) {
  std::string tmpl = (fs::temp_directory_path() / "opjit-gpukey-XXXXXX").string();
  const std::string dir = ::mkdtemp(tmpl.data());
  fs::create_directories(dir + "/inc");
  std::ofstream(dir + "/inc/scale.h") << "#define SCALE 2.0f\n";
  compiler::KernelCompilerOptions o;
  o.cache_dir = dir + "/cache";
  o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
  o.kernel_include_dir = dir + "/inc";
  o.gpu_archs = {"sm_90"};
  o.header_recheck_ms = 0;  // see an edit at once
  auto kc = compiler::KernelCompiler::Create(o);
  ASSERT_TRUE(kc.ok()) << kc.status();
  compiler::CompileJob job;
  job.target = registry::Target::kGpu;
  job.language = "cuda";
  job.source = "#include \"scale.h\"\nextern \"C\" __global__ void k(float* x) { x[0] *= SCALE; }\n";
  job.name_expressions = {"k"};
  auto first = (*kc)->Compile(job);
  ASSERT_TRUE(first.ok()) << first.status();
  auto hit = (*kc)->Compile(job);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->cache_hit, compiler::CacheTier::kMemory);
  EXPECT_EQ(hit->kernel->cache_key, first->kernel->cache_key);
  // A different size, so the digest memo sees the change at once.
  std::ofstream(dir + "/inc/scale.h") << "#define SCALE 3.0f /* edited */\n";
  auto edited = (*kc)->Compile(job);
  ASSERT_TRUE(edited.ok()) << edited.status();
  EXPECT_EQ(edited->cache_hit, compiler::CacheTier::kNone);
  EXPECT_NE(edited->kernel->cache_key, first->kernel->cache_key);
  kc->reset();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace opjit::core

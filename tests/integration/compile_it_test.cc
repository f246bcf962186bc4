// The CPU compile path end to end: the real opjitd (with its sandboxed compile
// workers, the ORC loader and the cache), driven by the CLI and the C++ client.
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "tests/integration/daemon_harness.h"

namespace opjit::testing {
namespace {

namespace fs = std::filesystem;

v1::CompileRequest Request(const std::string& source, const std::string& entry = "") {
  v1::CompileRequest r;
  r.set_source(source);
  r.set_entry(entry);
  return r;
}

constexpr char kKernel[] = R"(
#include <cmath>
#include "custom_aot_extra.h"
extern "C" int CustomTanh(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::tanh(x[i]);
  return 0;
}
)";

class CompileIT : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tmp_.path() + "/opjitd.toml";
    std::ofstream(config_) << "[compiler]\n"
                              "timeout_ms = 3000\n"
                              "allowed_libraries = [\"libm.so.6\"]\n";
  }
  std::unique_ptr<Daemon> StartDaemon() {
    auto d = std::make_unique<Daemon>(state_, std::vector<std::string>{"--config", config_});
    EXPECT_TRUE(d->Start()) << d->Log();
    return d;
  }

  TempDir tmp_;
  std::string state_ = tmp_.path() + "/state";
  std::string config_;
};

TEST_F(CompileIT, CliCompilesAnAotKernelAndChecksTheEntry) {
  auto d = StartDaemon();
  const std::string file = SourceDir() + "/kernels/examples/leaky_relu.cc";
  auto ok = d->Cli({"compile", file, "--entry", "CustomLeakyRelu", "--json"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err << d->Log();
  EXPECT_NE(ok.out.find("\"cache_key\": \""), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("CustomLeakyRelu"), std::string::npos) << ok.out;

  auto missing = d->Cli({"compile", file, "--entry", "LeakyRelu"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("entry symbol \"LeakyRelu\" is not defined"), std::string::npos)
      << missing.err;
  EXPECT_NE(missing.err.find("it defines: CustomLeakyRelu"), std::string::npos) << missing.err;
}

TEST_F(CompileIT, DiagnosticsOnErrorAndWarningsOnSuccess) {
  auto d = StartDaemon();
  auto c = d->NewClient();
  auto bad = c->Compile(Request("int f() {\n  return 1\n}\n"));
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("kernel.cc:2:11: error:"), std::string::npos)
      << bad.status();
  EXPECT_NE(bad.status().message().find("^"), std::string::npos) << bad.status();

  auto warn = c->Compile(Request("extern \"C\" int f() { return 1.5; }\n"));
  ASSERT_TRUE(warn.ok()) << warn.status();
  EXPECT_NE(warn->diagnostics().find("warning:"), std::string::npos) << warn->diagnostics();

  // Nothing of it reached the daemon's stderr.
  EXPECT_EQ(d->Log().find("return 1\n"), std::string::npos);
}

TEST_F(CompileIT, ForbiddenIncludesLeakNothing) {
  auto d = StartDaemon();
  auto c = d->NewClient();
  for (const std::string inc : {"\"/etc/passwd\"", "\"../../../../../../etc/hostname\"",
                                "</proc/self/environ>"}) {
    auto r = c->Compile(Request("#include " + inc + "\nint x;\n"));
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << inc;
    EXPECT_NE(r.status().message().find("not found"), std::string::npos) << r.status();
    EXPECT_EQ(r.status().message().find("root:"), std::string::npos) << r.status();
    EXPECT_EQ(r.status().message().find("PATH="), std::string::npos) << r.status();
  }
}

TEST_F(CompileIT, CompilerCrashAndTimeoutFailOnlyThatRequest) {
  auto d = StartDaemon();
  auto c = d->NewClient();
  auto crash = c->Compile(Request("#pragma clang __debug crash\nint x;\n"));
  ASSERT_EQ(crash.status().code(), absl::StatusCode::kInvalidArgument) << crash.status();
  EXPECT_NE(crash.status().message().find("crashed"), std::string::npos) << crash.status();

  // ~10^8 tokens of empty declarations: far past the 3 s limit.
  auto slow = c->Compile(Request(
      "#define A ;;;;;;;;;;\n#define B A A A A A A A A A A\n#define C B B B B B B B B B B\n"
      "#define D C C C C C C C C C C\n#define E D D D D D D D D D D\n"
      "#define F E E E E E E E E E E\n#define G F F F F F F F F F F\n"
      "#define H G G G G G G G G G G\nH H H H H H H H H H\n"));
  ASSERT_EQ(slow.status().code(), absl::StatusCode::kDeadlineExceeded) << slow.status();

  // The daemon and its workers keep serving.
  auto ok = c->Compile(Request(kKernel, "CustomTanh"));
  EXPECT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(c->Info().ok());
}

TEST_F(CompileIT, CacheHitsInMemoryAndOnDiskAfterRestart) {
  std::string key;
  {
    auto d = StartDaemon();
    auto c = d->NewClient();
    auto cold = c->Compile(Request(kKernel, "CustomTanh"));
    ASSERT_TRUE(cold.ok()) << cold.status();
    EXPECT_EQ(cold->cache_hit(), "");
    EXPECT_GT(cold->compile_ms(), 0);
    key = cold->cache_key();
    auto warm = c->Compile(Request(kKernel, "CustomTanh"));
    ASSERT_TRUE(warm.ok());
    EXPECT_EQ(warm->cache_hit(), "memory");
    EXPECT_EQ(warm->cache_key(), key);
    auto stats = c->CacheStats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->compiles(), 1u);
    EXPECT_GE(stats->memory_hits(), 1u);
  }
  auto d = StartDaemon();
  auto c = d->NewClient();
  auto disk = c->Compile(Request(kKernel, "CustomTanh"));
  ASSERT_TRUE(disk.ok()) << disk.status();
  EXPECT_EQ(disk->cache_hit(), "disk");
  EXPECT_EQ(disk->cache_key(), key);
  EXPECT_EQ(c->CacheStats()->compiles(), 0u);

  auto cleared = d->Cli({"cache", "clear"});
  ASSERT_EQ(cleared.exit_code, 0) << cleared.err;
  auto again = c->Compile(Request(kKernel, "CustomTanh"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->cache_hit(), "");
}

TEST_F(CompileIT, CorruptCacheFileIsRecompiledAndReplaced) {
  {
    auto d = StartDaemon();
    ASSERT_TRUE(d->NewClient()->Compile(Request(kKernel, "CustomTanh")).ok());
  }
  int corrupted = 0;
  for (const auto& e : fs::recursive_directory_iterator(state_ + "/cache/obj")) {
    if (!e.is_regular_file()) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(e.path()) / 2));
    f.put('\x5a');
    ++corrupted;
  }
  ASSERT_EQ(corrupted, 1);
  {
    auto d = StartDaemon();
    auto c = d->NewClient();
    auto r = c->Compile(Request(kKernel, "CustomTanh"));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->cache_hit(), "");  // recompiled
    EXPECT_EQ(c->CacheStats()->disk_corrupt(), 1u);
  }
  auto d = StartDaemon();
  auto r = d->NewClient()->Compile(Request(kKernel, "CustomTanh"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit(), "disk");  // the replacement is good
}

TEST_F(CompileIT, ConcurrentIdenticalRequestsCompileOnce) {
  auto d = StartDaemon();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  std::atomic<bool> go{false};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      auto c = d->NewClient();
      while (!go.load()) std::this_thread::yield();
      if (c->Compile(Request(kKernel, "CustomTanh")).ok()) ok.fetch_add(1);
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  auto stats = d->NewClient()->CacheStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->compiles(), 1u);
  EXPECT_EQ(stats->single_flight_joins() + stats->memory_hits(), 7u);
}

TEST_F(CompileIT, RegisterCompilesTheCpuImplementation) {
  auto d = StartDaemon();
  auto c = d->NewClient();
  auto spec = client::LoadOpSpec(SourceDir() + "/kernels/examples/leaky_relu.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto r = c->Register(*spec);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->compiled_size(), 1);
  EXPECT_FALSE(r->compiled(0).cache_key().empty());

  v1::OpDef broken = *spec;
  broken.set_name("broken");
  broken.mutable_implementations(0)->set_source("extern \"C\" int CustomLeakyRelu( {");
  auto b = c->Register(broken);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("error:"), std::string::npos) << b.status();
  EXPECT_EQ(c->Get("", "broken").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CompileIT, OneKeyPerSourceAndDiagnosticsNameTheUsersFile) {
  auto d = StartDaemon();
  auto c = d->NewClient();
  const std::string file = SourceDir() + "/kernels/examples/leaky_relu.cc";
  auto compiled = d->Cli({"compile", file, "--entry", "CustomLeakyRelu", "--json"});
  ASSERT_EQ(compiled.exit_code, 0) << compiled.err << d->Log();
  // Registration of the same source (read from source_file by the client)
  // finds what `opjit compile` put in the cache.
  auto spec = client::LoadOpSpec(SourceDir() + "/kernels/examples/leaky_relu.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->implementations(0).source_file(), "leaky_relu.cc");
  auto r = c->Register(*spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->compiled(0).cache_hit(), "memory");
  EXPECT_NE(compiled.out.find(r->compiled(0).cache_key()), std::string::npos) << compiled.out;

  // Errors name the user's file, at registration and in a bare compile.
  v1::OpDef broken = *spec;
  broken.set_name("broken");
  broken.mutable_implementations(0)->set_source("\nextern \"C\" int CustomLeakyRelu( {");
  auto b = c->Register(broken);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("leaky_relu.cc:2:"), std::string::npos) << b.status();
  EXPECT_EQ(b.status().message().find("kernel.cc"), std::string::npos) << b.status();
  v1::CompileRequest req = Request("int f() {\n  return 1\n}\n");
  req.set_file_name("/home/someone/my_add.cc");
  auto bad = c->Compile(req);
  EXPECT_NE(bad.status().message().find("my_add.cc:2:11: error:"), std::string::npos)
      << bad.status();
  EXPECT_EQ(bad.status().message().find("/home/someone"), std::string::npos) << bad.status();
  // The failure is in the daemon's log with its reason, the source is not.
  EXPECT_NE(d->Log().find("compile failed (INVALID_ARGUMENT, COMPILE_FAILED)"), std::string::npos)
      << d->Log();
  EXPECT_EQ(d->Log().find("return 1\n"), std::string::npos);
}

TEST_F(CompileIT, MultiFileSpecsThroughTheCliAndTheClient) {
  // kernels/examples/multi_file/poly.json: "files": ["poly_coeffs.h",
  // {"path": "detail/eval.h"}, "poly_eval.cc"], read beside the spec.
  const std::string dir = SourceDir() + "/kernels/examples/multi_file";
  auto spec = client::LoadOpSpec(dir + "/poly.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const auto& impl = spec->implementations(0);
  ASSERT_EQ(impl.files_size(), 3);
  EXPECT_EQ(impl.files(0).name(), "poly_coeffs.h");
  EXPECT_EQ(impl.files(1).name(), "detail/eval.h");
  EXPECT_EQ(impl.files(2).name(), "poly_eval.cc");
  for (const auto& f : impl.files()) {
    EXPECT_FALSE(f.content().empty()) << f.name();
    EXPECT_TRUE(f.path().empty()) << f.name();  // the server never sees a path
  }
  // Inline content, and a path out of the spec's directory (its base name).
  auto inline_spec = client::ParseOpSpec(
      R"({"name": "p", "implementations": [{"source": "x", "files": [
          {"name": "a.h", "content": "//"}, "../multi_file/detail/eval.h",
          {"path": "poly_coeffs.h", "name": "coeffs/c.h"}]}]})",
      dir);
  ASSERT_TRUE(inline_spec.ok()) << inline_spec.status();
  EXPECT_EQ(inline_spec->implementations(0).files(0).content(), "//");
  EXPECT_EQ(inline_spec->implementations(0).files(1).name(), "eval.h");
  EXPECT_EQ(inline_spec->implementations(0).files(2).name(), "coeffs/c.h");
  auto missing = client::ParseOpSpec(
      R"({"name": "p", "implementations": [{"source": "x", "files": ["nothere.h"]}]})", dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("implementations[0].files[0].path"),
            std::string::npos)
      << missing.status();

  // `opjit register spec.json` sends them; the registry keeps name and content.
  auto d = StartDaemon();
  auto reg = d->Cli({"register", dir + "/poly.json"});
  ASSERT_EQ(reg.exit_code, 0) << reg.err << d->Log();
  auto c = d->NewClient();
  auto rec = c->Get("", "poly");
  ASSERT_TRUE(rec.ok()) << rec.status();
  ASSERT_EQ(rec->op().implementations(0).files_size(), 3);
  EXPECT_EQ(rec->op().implementations(0).files(1).name(), "detail/eval.h");
  EXPECT_EQ(rec->op().implementations(0).files(1).content(), impl.files(1).content());
}

TEST_F(CompileIT, LibrariesMustBeOnTheAllowList) {
  auto d = StartDaemon();
  auto c = d->NewClient();
  auto req = Request(
      "extern \"C\" double cbrt(double);\nextern \"C\" double F(double x) { return cbrt(x); }\n",
      "F");
  req.add_libraries("libm.so.6");
  auto ok = c->Compile(req);
  EXPECT_TRUE(ok.ok()) << ok.status();
  req.set_libraries(0, "libz.so.1");
  auto denied = c->Compile(req);
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
  EXPECT_NE(denied.status().message().find("libm.so.6"), std::string::npos) << denied.status();
}

}  // namespace
}  // namespace opjit::testing

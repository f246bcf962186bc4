// Multi-file kernels (issue 29 item 6): an implementation's extra files
// (registry::SourceFile) seen by the compile in memory, for that compile
// only; part of the content hash and of the cache key; their limits.
// Compiles through the real CPU backend (opjit-compile-worker) with the
// example kernels/examples/multi_file (poly.cc + poly_coeffs.h +
// detail/eval.h + poly_eval.cc, a second translation unit).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/common/error_info.h"
#include "server/compiler/cache_key.h"
#include "server/compiler/kernel_compiler.h"
#include "server/registry/canonical.h"
#include "server/registry/validate.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::compiler {
namespace {

using cache::testing::TempDir;
using registry::SourceFile;

constexpr char kExample[] = OPJIT_SOURCE_DIR "/kernels/examples/multi_file/";

std::string ReadExample(const std::string& name) {
  std::ifstream in(std::string(kExample) + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_FALSE(ss.str().empty()) << name;
  return ss.str();
}

// The example's files, as poly.json lists them.
std::vector<SourceFile> PolyFiles(const std::string& coeffs) {
  return {{"poly_coeffs.h", coeffs},
          {"detail/eval.h", ReadExample("detail/eval.h")},
          {"poly_eval.cc", ReadExample("poly_eval.cc")}};
}

CompileJob PolyJob(const std::string& coeffs) {
  CompileJob job;
  job.source = ReadExample("poly.cc");
  job.files = PolyFiles(coeffs);
  job.entry = "Poly";
  job.ns = "default";
  return job;
}

class MultiFileCompileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KernelCompilerOptions o;
    o.cache_dir = dir_.Sub("cache");
    o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
    o.kernel_include_dir = OPJIT_SOURCE_DIR "/kernels/include";
    o.workers = 1;  // one worker: every compile below runs in the same process
    o.long_workers = 0;
    auto kc = KernelCompiler::Create(o);
    ASSERT_TRUE(kc.ok()) << kc.status();
    kc_ = *std::move(kc);
  }

  TempDir dir_;
  std::unique_ptr<KernelCompiler> kc_;
};

bool Defines(const CompileOutcome& out, const std::string& needle) {
  const auto& syms = out.kernel->cpu_object()->entry_points;
  return std::any_of(syms.begin(), syms.end(),
                     [&](const std::string& s) { return s.find(needle) != std::string::npos; });
}

TEST_F(MultiFileCompileTest, HeadersAndASecondUnitMakeOneObject) {
  auto out = kc_->Compile(PolyJob(ReadExample("poly_coeffs.h")));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->cache_hit, CacheTier::kNone);
  EXPECT_TRUE(Defines(*out, "Poly"));
  // poly_example::Eval comes from poly_eval.cc, linked into the same object.
  EXPECT_TRUE(Defines(*out, "poly_example4Eval")) << "the second translation unit is missing";
  // The same job again: the memory cache.
  auto again = kc_->Compile(PolyJob(ReadExample("poly_coeffs.h")));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->cache_hit, CacheTier::kMemory);
  EXPECT_EQ(again->kernel->cache_key, out->kernel->cache_key);
}

TEST_F(MultiFileCompileTest, AChangedHeaderIsAnotherKeyAndACompile) {
  const std::string coeffs = ReadExample("poly_coeffs.h");
  const std::string edited = absl::StrReplaceAll(coeffs, {{"kPolyC = 3.0f", "kPolyC = 4.0f"}});
  ASSERT_NE(coeffs, edited);
  EXPECT_NE(RequestKey(PolyJob(coeffs), "id", "roots"), RequestKey(PolyJob(edited), "id", "roots"));
  // A renamed file is another key too, and a one-file job's key ignores an
  // empty file list (the keys of kernels without files did not change).
  CompileJob renamed = PolyJob(coeffs);
  renamed.files[0].name = "coeffs.h";
  EXPECT_NE(RequestKey(PolyJob(coeffs), "id", "roots"), RequestKey(renamed, "id", "roots"));

  auto a = kc_->Compile(PolyJob(coeffs));
  ASSERT_TRUE(a.ok()) << a.status();
  const uint64_t compiles = kc_->Stats().compiles;
  auto b = kc_->Compile(PolyJob(edited));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->cache_hit, CacheTier::kNone);
  EXPECT_EQ(kc_->Stats().compiles, compiles + 1);
  EXPECT_NE(a->kernel->cache_key, b->kernel->cache_key);
  EXPECT_NE(a->kernel->cpu_object()->elf, b->kernel->cpu_object()->elf);
}

TEST_F(MultiFileCompileTest, AMissingHeaderIsAClearErrorWithoutHostPaths) {
  CompileJob job = PolyJob(ReadExample("poly_coeffs.h"));
  job.files.erase(job.files.begin());  // poly_coeffs.h
  auto out = kc_->Compile(job);
  ASSERT_FALSE(out.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(out.status())) << out.status();
  const std::string msg(out.status().message());
  EXPECT_TRUE(absl::StrContains(msg, "'poly_coeffs.h' file not found")) << msg;
  EXPECT_FALSE(absl::StrContains(msg, "/opjit-src")) << msg;
  EXPECT_FALSE(absl::StrContains(msg, dir_.path())) << msg;
  EXPECT_FALSE(absl::StrContains(msg, OPJIT_SOURCE_DIR)) << msg;
}

TEST_F(MultiFileCompileTest, AnErrorInAHeaderNamesItByItsName) {
  CompileJob job;
  job.source = "#include \"detail/bad.h\"\nextern \"C\" int K() { return Bad(); }\n";
  job.files = {{"detail/bad.h", "#pragma once\ninline int Bad() { return undefined_thing; }\n"}};
  auto out = kc_->Compile(job);
  ASSERT_FALSE(out.ok());
  const std::string msg(out.status().message());
  EXPECT_TRUE(absl::StrContains(msg, "detail/bad.h:2:")) << msg;
  EXPECT_FALSE(absl::StrContains(msg, "/opjit-src")) << msg;
}

TEST_F(MultiFileCompileTest, EachCompileSeesOnlyItsOwnFiles) {
  // Two ops with a header of the same name and different contents, compiled
  // one after the other in the same worker process.
  const std::string source = "#include \"helper.h\"\nextern \"C\" int HELPER_FN() { return 1; }\n";
  CompileJob alpha, beta, none;
  alpha.source = beta.source = none.source = source;
  alpha.files = {{"helper.h", "#define HELPER_FN AlphaFn\n"}};
  beta.files = {{"helper.h", "#define HELPER_FN BetaFn\n"}};
  auto a = kc_->Compile(alpha);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = kc_->Compile(beta);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(Defines(*a, "AlphaFn"));
  EXPECT_FALSE(Defines(*a, "BetaFn"));
  EXPECT_TRUE(Defines(*b, "BetaFn"));
  EXPECT_FALSE(Defines(*b, "AlphaFn"));
  // A compile without files does not see the others' header.
  auto n = kc_->Compile(none);
  ASSERT_FALSE(n.ok());
  EXPECT_TRUE(absl::StrContains(n.status().message(), "'helper.h' file not found"))
      << n.status();
}

TEST_F(MultiFileCompileTest, APreambleThatIncludesAFileIsKeyedByIt) {
  // The leading #include block is precompiled (a PCH per namespace): one
  // that includes a file of the kernel must not be reused with another
  // version of that file.
  const std::string source =
      "#include <cstdint>\n#include \"value.h\"\nextern \"C\" int64_t V() { return kValue; }\n";
  CompileJob one, two;
  one.source = two.source = source;
  one.files = {{"value.h", "constexpr int64_t kValue = 1;\n"}};
  two.files = {{"value.h", "constexpr int64_t kValue = 2;\n"}};  // same size
  auto a = kc_->Compile(one);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = kc_->Compile(two);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(a->kernel->cpu_object()->elf, b->kernel->cpu_object()->elf);
}

TEST_F(MultiFileCompileTest, AUnitThatRedefinesASymbolFailsToLink) {
  CompileJob job;
  job.source = "extern \"C\" int K() { return 1; }\n";
  job.files = {{"other.cc", "extern \"C\" int K() { return 2; }\n"}};
  auto out = kc_->Compile(job);
  ASSERT_FALSE(out.ok());
  EXPECT_TRUE(absl::StrContains(out.status().message(), "other.cc: error: cannot link"))
      << out.status();
}

TEST_F(MultiFileCompileTest, ACUnitBesideACxxSource) {
  CompileJob job;
  job.source = "extern \"C\" int Twice(int);\nextern \"C\" int K() { return Twice(21); }\n";
  job.files = {{"twice.c", "int Twice(int x) { return 2 * x; }\n"}};
  auto out = kc_->Compile(job);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(Defines(*out, "Twice"));
}

// ---- The registry's side: content hash and limits --------------------------

registry::OpDef PolyDef(const std::string& coeffs) {
  registry::OpDef def;
  def.name = "poly";
  def.inputs = {{0, "x", registry::ParamType::kRequired}};
  def.outputs = {{0, "y", registry::ParamType::kRequired}};
  def.dtype_formats = {{{{"float32", "DefaultFormat"}, {"float32", "DefaultFormat"}}}};
  registry::Implementation impl;
  impl.language = "c++";
  impl.source = ReadExample("poly.cc");
  impl.entry = "Poly";
  impl.files = PolyFiles(coeffs);
  def.implementations = {impl};
  return def;
}

TEST(MultiFileRegistryTest, FilesArePartOfTheContentHashAndRoundTrip) {
  const std::string coeffs = ReadExample("poly_coeffs.h");
  const registry::OpDef def = PolyDef(coeffs);
  ASSERT_TRUE(registry::ValidateOpDef(def).ok()) << registry::ValidateOpDef(def);
  const registry::OpDef edited =
      PolyDef(absl::StrReplaceAll(coeffs, {{"kPolyC = 3.0f", "kPolyC = 4.0f"}}));
  EXPECT_NE(registry::ContentHash(def), registry::ContentHash(edited));
  auto back = registry::FromJson(registry::ToJson(def));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, def);
  // Without files, the canonical form has no "files" key: hashes of ops
  // registered before files existed stay the same.
  registry::OpDef one_file = def;
  one_file.implementations[0].files.clear();
  EXPECT_EQ(registry::ToJson(one_file).find("\"files\""), std::string::npos);
}

// The refusal of `def` with files[k] changed by `edit`: INVALID_ARGUMENT,
// reason INVALID_SPEC, its message.
std::string Refusal(const std::function<void(registry::Implementation&)>& edit,
                    registry::Target target = registry::Target::kCpu) {
  registry::OpDef def = PolyDef("constexpr float kPolyA = 1, kPolyB = 2, kPolyC = 3, kPolyBias = 0;\n");
  registry::Implementation& impl = def.implementations[0];
  if (target == registry::Target::kGpu) {
    impl.target = target;
    impl.language = "cuda";
    impl.launch.grid = {"1"};
    impl.launch.block = {"1"};
    impl.launch.args = {"x", "y"};
  }
  edit(impl);
  absl::Status s = registry::ValidateOpDef(def);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  auto reason = GetReason(s);
  EXPECT_TRUE(reason.has_value() && reason->reason == reason::kInvalidSpec) << s;
  return std::string(s.message());
}

TEST(MultiFileRegistryTest, EachLimitIsRefusedClearly) {
  using registry::Implementation;
  // Count.
  std::string m = Refusal([](Implementation& i) {
    i.files.clear();
    for (size_t k = 0; k <= registry::kMaxFiles; ++k) i.files.push_back({absl::StrCat("h", k, ".h"), "//\n"});
  });
  EXPECT_TRUE(absl::StrContains(m, "implementations[0].files: has 65 files; the limit is 64")) << m;
  // Name length.
  m = Refusal([](Implementation& i) { i.files[0].name = std::string(256, 'a') + ".h"; });
  EXPECT_TRUE(absl::StrContains(m, "implementations[0].files[0].name")) << m;
  EXPECT_TRUE(absl::StrContains(m, "the limit is 255")) << m;
  // Empty, absolute, "..", ".", "//", backslash, NUL, control characters.
  m = Refusal([](Implementation& i) { i.files[1].name = ""; });
  EXPECT_TRUE(absl::StrContains(m, "files[1].name: must not be empty")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = "/etc/passwd"; });
  EXPECT_TRUE(absl::StrContains(m, "must be a relative path")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = "../helper.h"; });
  EXPECT_TRUE(absl::StrContains(m, "\"..\" path part")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = "detail/../../x.h"; });
  EXPECT_TRUE(absl::StrContains(m, "\"..\" path part")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = "./x.h"; });
  EXPECT_TRUE(absl::StrContains(m, "\".\" path part")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = "detail//x.h"; });
  EXPECT_TRUE(absl::StrContains(m, "empty path part")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = "detail\\x.h"; });
  EXPECT_TRUE(absl::StrContains(m, "not a backslash")) << m;
  m = Refusal([](Implementation& i) { i.files[1].name = std::string("x\0.h", 4); });
  EXPECT_TRUE(absl::StrContains(m, "must not contain NUL")) << m;
  EXPECT_EQ(m.find('\0'), std::string::npos);
  m = Refusal([](Implementation& i) { i.files[1].name = "x\n.h"; });
  EXPECT_TRUE(absl::StrContains(m, "control characters")) << m;
  // Unique names.
  m = Refusal([](Implementation& i) { i.files[2].name = i.files[0].name; });
  EXPECT_TRUE(absl::StrContains(m, "files[2].name: \"poly_coeffs.h\" is also files[0]")) << m;
  // Contents: UTF-8, and the source plus files within the source limit.
  m = Refusal([](Implementation& i) { i.files[0].content = "\xff\xfe"; });
  EXPECT_TRUE(absl::StrContains(m, "files[0].content")) << m;
  m = Refusal([](Implementation& i) {
    i.files[0].content = std::string(registry::kMaxSourceBytes - i.source.size(), ' ');
  });
  EXPECT_TRUE(absl::StrContains(m, "bytes together; the limit is 1048576")) << m;
  // GPU implementations take headers only.
  m = Refusal([](Implementation& i) { i.files = {{"more.cuh", "//\n"}, {"x.cu", "//\n"}}; },
              registry::Target::kGpu);
  EXPECT_TRUE(absl::StrContains(m, "files[1].name: \"x.cu\" is a translation unit")) << m;
  m = Refusal([](Implementation& i) { i.files = {{"x.cc", "//\n"}}; }, registry::Target::kGpu);
  EXPECT_TRUE(absl::StrContains(m, "GPU implementation takes headers only")) << m;
  // At the limits: accepted.
  registry::OpDef ok = PolyDef("//\n");
  ok.implementations[0].files.clear();
  for (size_t k = 0; k < registry::kMaxFiles; ++k) {
    ok.implementations[0].files.push_back({absl::StrCat("d/", std::string(200, 'n'), k, ".h"), "//\n"});
  }
  EXPECT_TRUE(registry::ValidateOpDef(ok).ok()) << registry::ValidateOpDef(ok);
}

}  // namespace
}  // namespace opjit::compiler

// A new compile backend is one file plus its registration (issue 28): a fake
// backend, written here as a backend author would, registered in a fresh
// KernelCompiler's BackendSet, gets the memory cache, the disk round trip
// through its Encode/Decode and single-flight with no other change, and its
// option allow-list is what KernelCompiler and the registry consult.
//
// The fake compiles the language "fake" and is registered under the GPU
// target (a new Target value would be a wire change; the BackendSet is what
// a backend plugs into). Nothing here starts a compile worker.
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/compiler/backend.h"
#include "server/compiler/kernel_compiler.h"
#include "server/compiler/toolchain_profile.h"
#include "server/registry/registry.h"
#include "server/registry/validate.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::compiler {
namespace {

using registry::Target;

// ---- the one file a backend author writes --------------------------------

// What the test sees of the fake: calls by kind, and a gate that holds
// compiles until opened (for single-flight).
struct FakeCounters {
  std::atomic<int> compiles{0}, decodes{0}, encodes{0}, option_checks{0};
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  int waiting = 0;  // compiles held at the gate

  void Close() {
    std::lock_guard<std::mutex> lock(mu);
    open = false;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
  void AwaitWaiting(int n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return waiting >= n; });
  }
};

constexpr char kFakeMagic[] = "FAKE1\n";

// "Compiles" the language "fake": the artifact is the source, upper-cased.
// Its allow-list: -fake-fast and -fake-level=<digit>.
class FakeBackend : public CompileBackend {
 public:
  explicit FakeBackend(std::shared_ptr<FakeCounters> counters) : c_(std::move(counters)) {}

  Target target() const override { return Target::kGpu; }
  std::vector<std::string> Languages() const override { return {"fake"}; }

  std::string OptionRefusal(const std::string& language, std::string_view option) const override {
    c_->option_checks.fetch_add(1);
    if (option == "-fake-fast") return "";
    if (option.size() == 13 && option.substr(0, 12) == "-fake-level=" && option[12] >= '0' &&
        option[12] <= '9') {
      return "";
    }
    return "the fake backend allows -fake-fast and -fake-level=<digit>";
  }

  absl::StatusOr<std::string> Identity(const CompileJob& job) override {
    if (job.language != "fake") return absl::InvalidArgumentError("not a fake language");
    return std::string("fake-toolchain-1");
  }

  absl::StatusOr<BackendOutput> Compile(const CompileJob& job) override {
    {
      std::unique_lock<std::mutex> lock(c_->mu);
      ++c_->waiting;
      c_->cv.notify_all();
      c_->cv.wait(lock, [&] { return c_->open; });
    }
    c_->compiles.fetch_add(1);
    BackendOutput out;
    out.kernel = std::make_shared<CompiledKernel>();
    out.kernel->target = Target::kGpu;
    // Plain bytes: a CpuObject's elf holds them (the artifact is not loaded).
    std::string& bytes = out.kernel->cpu_object()->elf;
    for (char ch : job.source) bytes += static_cast<char>(std::toupper(ch));
    out.kernel->diagnostics = "kernel.cc: note: compiled by the fake";
    return out;
  }

  absl::Status Check(const CompileJob& job, CompiledKernel* k) const override {
    if (k->cpu_object() == nullptr || k->cpu_object()->elf.empty()) {
      return absl::InvalidArgumentError("empty fake artifact");
    }
    return absl::OkStatus();
  }

  std::string DiskKind() const override { return "fake"; }

  std::string Encode(const CompiledKernel& k) const override {
    c_->encodes.fetch_add(1);
    return kFakeMagic + k.cpu_object()->elf;
  }

  absl::StatusOr<std::shared_ptr<CompiledKernel>> Decode(std::string_view blob) const override {
    c_->decodes.fetch_add(1);
    if (blob.substr(0, sizeof(kFakeMagic) - 1) != kFakeMagic) {
      return absl::DataLossError("malformed fake entry");
    }
    auto k = std::make_shared<CompiledKernel>();
    k->target = Target::kGpu;
    k->cpu_object()->elf = std::string(blob.substr(sizeof(kFakeMagic) - 1));
    return k;
  }

  std::string ToolchainId() const override { return "fake-toolchain-1"; }

 private:
  std::shared_ptr<FakeCounters> c_;
};

// ---- its registration, and the tests -------------------------------------

class BackendSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_.Sub("include"));
    counters_ = std::make_shared<FakeCounters>();
  }

  // A compiler whose only backend is the fake: the registration.
  std::unique_ptr<KernelCompiler> Make() {
    KernelCompilerOptions o;
    o.cache_dir = dir_.Sub("cache");
    o.kernel_include_dir = dir_.Sub("include");
    o.header_recheck_ms = 0;
    BackendSet backends;
    backends[Target::kGpu] = std::make_unique<FakeBackend>(counters_);
    auto kc = KernelCompiler::Create(o, std::move(backends));
    EXPECT_TRUE(kc.ok()) << kc.status();
    return kc.ok() ? *std::move(kc) : nullptr;
  }

  static CompileJob Job(std::string source = "add one") {
    CompileJob job;
    job.target = Target::kGpu;
    job.language = "fake";
    job.source = std::move(source);
    job.options = {"-fake-level=2"};
    return job;
  }

  cache::testing::TempDir dir_;
  std::shared_ptr<FakeCounters> counters_;
};

TEST_F(BackendSetTest, AFakeBackendGetsTheMemoryAndDiskCachesWithNoOtherChange) {
  {
    auto kc = Make();
    ASSERT_NE(kc, nullptr);
    EXPECT_EQ(kc->ToolchainId(), "fake-toolchain-1");
    auto first = kc->Compile(Job());
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->cache_hit, CacheTier::kNone);
    EXPECT_EQ(first->kernel->cpu_object()->elf, "ADD ONE");
    EXPECT_EQ(first->kernel->cache_key.size(), 64u);
    auto again = kc->Compile(Job());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->cache_hit, CacheTier::kMemory);
    EXPECT_EQ(again->kernel, first->kernel);
    EXPECT_EQ(counters_->compiles.load(), 1);
    EXPECT_EQ(counters_->encodes.load(), 1);
    // Another source is another key.
    auto other = kc->Compile(Job("sub one"));
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(other->cache_hit, CacheTier::kNone);
    EXPECT_EQ(counters_->compiles.load(), 2);
  }  // the compiler's pool finishes its disk writes before it goes
  auto kc = Make();
  ASSERT_NE(kc, nullptr);
  auto from_disk = kc->Compile(Job());
  ASSERT_TRUE(from_disk.ok()) << from_disk.status();
  EXPECT_EQ(from_disk->cache_hit, CacheTier::kDisk);
  EXPECT_EQ(from_disk->kernel->cpu_object()->elf, "ADD ONE");
  EXPECT_EQ(counters_->decodes.load(), 1);
  EXPECT_EQ(counters_->compiles.load(), 2);  // no compile for a disk hit
  EXPECT_EQ(kc->Stats().disk_hits, 2u);  // the manifest, then the fake's artifact
  EXPECT_EQ(kc->Compile(Job())->cache_hit, CacheTier::kMemory);
}

TEST_F(BackendSetTest, ConcurrentRequestsForOneKeyShareOneFakeCompile) {
  auto kc = Make();
  ASSERT_NE(kc, nullptr);
  counters_->Close();
  constexpr int kCallers = 6;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<absl::StatusOr<CompileOutcome>> results;
  for (int i = 0; i < kCallers; ++i) {
    kc->CompileAsync(Job(), [&](absl::StatusOr<CompileOutcome> r) {
      std::lock_guard<std::mutex> lock(mu);
      results.push_back(std::move(r));
      cv.notify_all();
    });
    if (i == 0) counters_->AwaitWaiting(1);  // the leader's compile is running
  }
  EXPECT_EQ(kc->Stats().single_flight_joins, static_cast<uint64_t>(kCallers - 1));
  counters_->Open();
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return results.size() == kCallers; });
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->kernel, results[0]->kernel);
  }
  EXPECT_EQ(counters_->compiles.load(), 1);
}

TEST_F(BackendSetTest, TheFakesAllowListIsConsultedByTheCompilerAndTheRegistry) {
  auto kc = Make();
  ASSERT_NE(kc, nullptr);
  CompileJob bad = Job();
  bad.options = {"-fake-fast", "-O2"};
  auto out = kc->Compile(bad);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(),
            "compile_options[1]: option \"-O2\" is refused: the fake backend allows -fake-fast "
            "and -fake-level=<digit>");
  EXPECT_EQ(counters_->compiles.load(), 0);
  EXPECT_GE(counters_->option_checks.load(), 2);

  // The registry asks the compiler's backends (KernelCompiler::Rules()).
  const registry::TargetRules& rules = kc->Rules();
  EXPECT_EQ(rules.Languages(Target::kGpu), std::vector<std::string>{"fake"});
  EXPECT_TRUE(registry::ValidateCompileOptions(Target::kGpu, "fake", {"-fake-fast"},
                                               "compile_options", rules)
                  .ok());
  absl::Status s = registry::ValidateCompileOptions(Target::kGpu, "fake", {"-O2"},
                                                    "compile_options", rules);
  EXPECT_TRUE(absl::StrContains(s.message(), "the fake backend allows")) << s;
  s = registry::ValidateCompileOptions(Target::kGpu, "cuda", {}, "compile_options", rules);
  EXPECT_EQ(s.message(), "language: \"cuda\" is not a GPU language (expected fake)");
  // The built-in rules know no "fake".
  EXPECT_FALSE(registry::ValidateCompileOptions(Target::kGpu, "fake", {}, "compile_options").ok());

  registry::OpDef def;
  def.ns = "t";
  def.name = "Fake";
  def.inputs = {{0, "x", registry::ParamType::kRequired}};
  def.outputs = {{0, "y", registry::ParamType::kRequired}};
  def.dtype_formats = {{{{"float32", ""}, {"float32", ""}}}};
  registry::Implementation impl;
  impl.target = Target::kGpu;
  impl.language = "fake";
  impl.entry = "Fake";
  impl.source = "add one";
  impl.compile_options = {"-fake-level=3"};
  def.implementations = {impl};
  EXPECT_TRUE(registry::ValidateOpDef(def, rules).ok()) << registry::ValidateOpDef(def, rules);
  {
    // The registry stores it by the fake's rules; by the built-in ones it
    // is not a GPU language.
    registry::Registry::Options ro;
    ro.db_path = dir_.Sub("ops.db");
    auto reg = registry::Registry::Create(ro);
    ASSERT_TRUE(reg.ok()) << reg.status();
    auto stored = (*reg)->Register(def, rules);
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_TRUE(stored->created);
    EXPECT_EQ((*reg)->Register(def).status().message(),
              "implementations[0].language: \"fake\" is not a GPU language (cuda)");
  }
  def.implementations[0].compile_options = {"-fake-level=x"};
  s = registry::ValidateOpDef(def, rules);
  EXPECT_TRUE(absl::StrContains(s.message(), "implementations[0].compile_options[0]: option "
                                             "\"-fake-level=x\" is refused: the fake backend"))
      << s;
  // No backend for CPU in this compiler: said so, not compiled as CPU.
  def.implementations[0].target = Target::kCpu;
  def.implementations[0].language = "c++";
  def.implementations[0].compile_options.clear();
  s = registry::ValidateOpDef(def, rules);
  EXPECT_EQ(s.message(), "implementations[0].target: no compile backend for target CPU");
}

TEST_F(BackendSetTest, AJobForATargetWithoutABackendIsRefusedNotCompiledForAnother) {
  auto kc = Make();
  ASSERT_NE(kc, nullptr);
  CompileJob job = Job();
  job.target = Target::kCpu;
  job.language = "c++";
  job.options.clear();
  auto out = kc->Compile(job);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "no compile backend for target CPU");
  EXPECT_EQ(counters_->compiles.load(), 0);
}

TEST_F(BackendSetTest, ABackendUnderAnotherTargetsKeyOrNoBackendIsRefusedAtCreate) {
  KernelCompilerOptions o;
  o.cache_dir = dir_.Sub("cache");
  o.kernel_include_dir = dir_.Sub("include");
  BackendSet misfiled;
  misfiled[Target::kCpu] = std::make_unique<FakeBackend>(counters_);
  EXPECT_EQ(KernelCompiler::Create(o, std::move(misfiled)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KernelCompiler::Create(o, BackendSet{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A library of an offered toolchain profile selects it for namespaces its
// policy names; the refusals say what to ask the operator for, with no host
// path (toolchain_profile.h).
TEST(SelectProfileTest, ALibraryOfAnOfferedProfileSelectsItWhereThePolicyAllows) {
  KernelCompilerOptions o;
  o.allowed_libraries = {"libm.so.6"};
  ToolchainProfile aten;
  aten.name = "aten";
  aten.include_dirs = {"/host/only/include"};
  aten.libraries = {"libtorch_cpu.so", "libc10.so"};
  aten.namespaces = {"team"};
  o.profiles = {aten};
  CompileJob job;
  job.ns = "team";
  job.libraries = {"libtorch_cpu.so", "libc10.so", "libm.so.6"};
  job.profile = "forged";
  ASSERT_TRUE(SelectProfile(o, &job).ok());
  EXPECT_EQ(job.profile, "aten");
  job.libraries = {"libm.so.6"};
  ASSERT_TRUE(SelectProfile(o, &job).ok());
  EXPECT_EQ(job.profile, "") << "a caller's value is not kept";

  job.ns = "other";
  job.libraries = {"libtorch_cpu.so"};
  absl::Status s = SelectProfile(o, &job);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "[toolchains.aten] namespaces")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "/host")) << s;
  // The operator's own allow-list still lets it link (the old hand config).
  o.allowed_libraries.push_back("libtorch_cpu.so");
  EXPECT_TRUE(SelectProfile(o, &job).ok());
  EXPECT_EQ(job.profile, "");

  // Not offered here: which profile, and what the operator enables.
  o.profiles.clear();
  job.libraries = {"libc10.so"};
  s = SelectProfile(o, &job);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "profiles = [\"aten\"]")) << s;
  job.libraries = {"libfoo.so"};
  EXPECT_EQ(SelectProfile(o, &job).code(), absl::StatusCode::kPermissionDenied);
}

TEST(SelectProfileTest, DetectsAtenUnderARootAndSaysWhatIsMissing) {
  cache::testing::TempDir root;
  auto touch = [&](const std::string& rel) {
    std::filesystem::create_directories(std::filesystem::path(root.path() + "/" + rel).parent_path());
    std::ofstream(root.path() + "/" + rel) << "x";
  };
  absl::StatusOr<ToolchainProfile> p = DetectProfile("aten", root.path());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "libtorch-dev")) << p.status();
  for (const char* f : {"usr/include/torch/extension.h",
                        "usr/include/torch/csrc/api/include/torch/all.h",
                        "usr/include/ATen/ATen.h", "usr/include/python3.9/Python.h",
                        "usr/include/python3.11/Python.h", "usr/include/pybind11/pybind11.h",
                        "usr/lib/libtorch_cpu.so", "usr/lib/libc10.so"}) {
    touch(f);
  }
  p = DetectProfile("aten", root.path());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->prefix_header, "torch/extension.h");
  EXPECT_EQ(p->libraries, (std::vector<std::string>{"libtorch_cpu.so", "libc10.so"}));
  ASSERT_EQ(p->include_dirs.size(), 2u);
  EXPECT_EQ(p->include_dirs[1], root.path() + "/usr/include/python3.11");
  EXPECT_EQ(DetectProfile("nope").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuiltinProfileNames(), std::vector<std::string>{"aten"})
      << "config.cc's check of compiler.profiles lists the same names";
}

}  // namespace
}  // namespace opjit::compiler

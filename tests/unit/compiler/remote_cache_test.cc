// KernelCompiler with the shared Redis tier: two "daemons" (two compilers with
// their own disk caches) share one redis-server.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/cache/remote_tier.h"
#include "server/compiler/kernel_compiler.h"
#include "tests/unit/cache/redis_server.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::compiler {
namespace {

using cache::RemoteTier;
using cache::testing::RedisServer;
using cache::testing::TempDir;
using Clock = std::chrono::steady_clock;

constexpr char kClusterKey[] = "shared-cluster-key-0123456789";

constexpr char kSource[] = R"(
#include <cstdint>
#include "shared.h"
extern "C" int Scale(int nparam, void** params, int* ndims, int64_t** shapes,
                     const char** dtypes, void* stream, void* extra) {
  float* x = static_cast<float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < shapes[0][0]; ++i) y[i] = x[i] * kScale;
  return 0;
}
)";

CompileJob Job() {
  CompileJob job;
  job.source = kSource;
  job.entry = "Scale";
  return job;
}

class RemoteCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cache::testing::HaveRedisServer()) {
      GTEST_SKIP() << "needs " << cache::testing::kRedisServer << " (Debian package redis-server)";
    }
    std::filesystem::create_directories(dir_.Sub("redis"));
    std::filesystem::create_directories(dir_.Sub("inc"));
    WriteHeader("constexpr float kScale = 2.0f;\n");
    redis_ = std::make_unique<RedisServer>(dir_.Sub("redis"));
    ASSERT_TRUE(redis_->Start());
  }

  void WriteHeader(const std::string& text) {
    cache::testing::WriteFile(dir_.Sub("inc/shared.h"), text);
  }

  // A compiler ("daemon") with its own disk cache <dir>/<name>.
  // `kernel_dir` and `extra_dir` default to the source tree's kernels/include
  // and <dir>/inc.
  std::unique_ptr<KernelCompiler> Make(const std::string& name, std::string key = kClusterKey,
                                       std::string url = "", std::string kernel_dir = "",
                                       std::string extra_dir = "") {
    KernelCompilerOptions o;
    o.cache_dir = dir_.Sub(name);
    o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
    o.kernel_include_dir = kernel_dir.empty() ? OPJIT_SOURCE_DIR "/kernels/include" : kernel_dir;
    o.extra_include_dirs = {extra_dir.empty() ? dir_.Sub("inc") : extra_dir};
    o.workers = 1;
    o.header_recheck_ms = 0;  // see header edits at once
    o.remote.url = url.empty() ? redis_->url() : url;
    o.remote.key = std::move(key);
    auto kc = KernelCompiler::Create(o);
    EXPECT_TRUE(kc.ok()) << kc.status();
    return kc.ok() ? *std::move(kc) : nullptr;
  }

  // Waits until `kc` has written `n` entries to Redis (puts run after the
  // compile answers).
  static void AwaitRemotePuts(KernelCompiler* kc, uint64_t n) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (kc->Stats().remote_puts < n && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(kc->Stats().remote_puts, n);
  }

  // The one manifest in Redis: its request key.
  std::string ManifestKey() const {
    auto keys = redis_->Keys("opjit:v1:manifest:*");
    EXPECT_EQ(keys.size(), 1u);
    return keys.empty() ? "" : keys[0].substr(std::string("opjit:v1:manifest:").size());
  }

  TempDir dir_;
  std::unique_ptr<RedisServer> redis_;
};

TEST_F(RemoteCacheTest, SecondDaemonGetsARemoteHitAndKeepsItOnDisk) {
  auto first = Make("a");
  ASSERT_NE(first, nullptr);
  auto compiled = first->Compile(Job());
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  EXPECT_EQ(compiled->cache_hit, CacheTier::kNone);
  AwaitRemotePuts(first.get(), 2);  // the object, then its manifest
  KernelCacheStats s1 = first->Stats();
  EXPECT_EQ(s1.compiles, 1u);
  EXPECT_EQ(s1.remote_misses, 1u);  // the manifest lookup before compiling
  EXPECT_EQ(s1.remote_hits, 0u);
  EXPECT_EQ(redis_->Keys("opjit:v1:obj:*").size(), 1u);
  EXPECT_EQ(redis_->Keys("opjit:v1:manifest:*").size(), 1u);

  auto second = Make("b");
  ASSERT_NE(second, nullptr);
  auto fetched = second->Compile(Job());
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->cache_hit, CacheTier::kRemote);
  EXPECT_EQ(fetched->kernel->cache_key, compiled->kernel->cache_key);
  EXPECT_EQ(fetched->kernel->cpu_object()->elf, compiled->kernel->cpu_object()->elf);
  EXPECT_EQ(fetched->kernel->cpu_object()->entry_points,
            compiled->kernel->cpu_object()->entry_points);
  KernelCacheStats s2 = second->Stats();
  EXPECT_EQ(s2.compiles, 0u);  // nothing compiled
  EXPECT_EQ(s2.remote_hits, 2u);  // manifest and object
  EXPECT_EQ(s2.remote_rejected, 0u);
  EXPECT_EQ(s2.remote_errors, 0u);
  std::cout << "[ measure  ] compile " << compiled->total_ms << " ms; remote hit "
            << fetched->total_ms << " ms (" << compiled->kernel->cpu_object()->elf.size()
            << " byte object)\n";
  RecordProperty("compile_ms", std::to_string(compiled->total_ms));
  RecordProperty("remote_hit_ms", std::to_string(fetched->total_ms));

  // Now in memory...
  auto again = second->Compile(Job());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->cache_hit, CacheTier::kMemory);
  EXPECT_EQ(second->Stats().remote_puts, 0u);  // a remote hit is not put back
  // ...and on disk: the same cache dir, with Redis gone, hits disk.
  second.reset();  // finishes its disk writes
  redis_->Kill();
  auto restarted = Make("b");
  ASSERT_NE(restarted, nullptr);
  auto from_disk = restarted->Compile(Job());
  ASSERT_TRUE(from_disk.ok()) << from_disk.status();
  EXPECT_EQ(from_disk->cache_hit, CacheTier::kDisk);
  EXPECT_EQ(from_disk->kernel->cpu_object()->elf, compiled->kernel->cpu_object()->elf);
  KernelCacheStats s3 = restarted->Stats();
  EXPECT_EQ(s3.compiles, 0u);
  EXPECT_EQ(s3.disk_hits, 2u);
  EXPECT_EQ(s3.remote_hits + s3.remote_misses, 0u);  // disk answered first
}

// Two daemons installed under different prefixes (opjit's kernel headers and
// the extra include dir at other paths, with the same contents) share keys
// and the tier; a third whose kernel header differs does not.
TEST_F(RemoteCacheTest, InstallPrefixesShareKeysHeaderContentSplitsThem) {
  namespace fs = std::filesystem;
  const auto copy_tree = [&](const std::string& from, const std::string& to) {
    fs::create_directories(to);
    fs::copy(from, to, fs::copy_options::recursive);
  };
  // A header that quotes its own path: the objects must not.
  cache::testing::WriteFile(dir_.Sub("inc/where.h"),
                            "inline const char* Where() { return __FILE__; }\n");
  copy_tree(OPJIT_SOURCE_DIR "/kernels/include", dir_.Sub("build/kernels/include"));
  copy_tree(OPJIT_SOURCE_DIR "/kernels/include", dir_.Sub("usr/share/opjit/include"));
  copy_tree(dir_.Sub("inc"), dir_.Sub("usr/include/extra"));
  copy_tree(OPJIT_SOURCE_DIR "/kernels/include", dir_.Sub("edited/include"));
  {
    std::ofstream out(dir_.Sub("edited/include/opjit/kernel.h"), std::ios::app);
    out << "// a local edit\n";
  }
  CompileJob job = Job();
  job.source = "#include <opjit/kernel.h>\n#include \"where.h\"\n" + job.source +
               "extern \"C\" const char* WhereIsIt() { return Where(); }\n";

  auto a = Make("a", kClusterKey, "", dir_.Sub("build/kernels/include"), dir_.Sub("inc"));
  auto b = Make("b", kClusterKey, "", dir_.Sub("usr/share/opjit/include"),
                dir_.Sub("usr/include/extra"));
  auto c = Make("c", kClusterKey, "", dir_.Sub("edited/include"), dir_.Sub("inc"));
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->IncludeIdentity(), b->IncludeIdentity());
  EXPECT_NE(a->IncludeIdentity(), c->IncludeIdentity());
  EXPECT_EQ(a->ToolchainId().find(dir_.path()), std::string::npos);
  auto compiled = a->Compile(job);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  AwaitRemotePuts(a.get(), 2);
  EXPECT_EQ(redis_->Keys("opjit:v1:manifest:*").size(), 1u);

  auto fetched = b->Compile(job);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->cache_hit, CacheTier::kRemote);
  EXPECT_EQ(fetched->kernel->cache_key, compiled->kernel->cache_key);
  EXPECT_EQ(fetched->kernel->cpu_object()->elf, compiled->kernel->cpu_object()->elf);
  EXPECT_EQ(b->Stats().compiles, 0u);
  EXPECT_EQ(redis_->Keys("opjit:v1:manifest:*").size(), 1u);  // one request key

  EXPECT_EQ(compiled->kernel->cpu_object()->elf.find(dir_.path()), std::string::npos);
  EXPECT_NE(compiled->kernel->cpu_object()->elf.find("include1/where.h"), std::string::npos);
  // Compiled at the other prefix (another cluster key: no tier), the same
  // bytes.
  auto alone = Make("d", "another-cluster-key-987654321", "",
                    dir_.Sub("usr/share/opjit/include"), dir_.Sub("usr/include/extra"));
  ASSERT_NE(alone, nullptr);
  auto own = alone->Compile(job);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->cache_hit, CacheTier::kNone);
  EXPECT_EQ(own->kernel->cache_key, compiled->kernel->cache_key);
  EXPECT_EQ(own->kernel->cpu_object()->elf, compiled->kernel->cpu_object()->elf);

  auto other = c->Compile(job);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->cache_hit, CacheTier::kNone);
  EXPECT_EQ(c->Stats().compiles, 1u);
  EXPECT_NE(other->kernel->cache_key, compiled->kernel->cache_key);
  std::cout << "[ measure  ] key at prefix a " << compiled->kernel->cache_key.substr(0, 16)
            << ", at prefix b " << fetched->kernel->cache_key.substr(0, 16) << " ("
            << CacheTierName(fetched->cache_hit) << " hit), edited header "
            << other->kernel->cache_key.substr(0, 16) << "\n";

  // A header edited while a daemon runs: the final key follows it.
  cache::testing::WriteFile(dir_.Sub("usr/include/extra/shared.h"),
                            "constexpr float kScale = 5.0f;\n");
  auto edited = b->Compile(job);
  ASSERT_TRUE(edited.ok()) << edited.status();
  EXPECT_EQ(edited->cache_hit, CacheTier::kNone);
  EXPECT_NE(edited->kernel->cache_key, compiled->kernel->cache_key);
  EXPECT_EQ(b->Stats().compiles, 1u);
}

TEST_F(RemoteCacheTest, AnotherClusterKeyRecompiles) {
  auto first = Make("a");
  ASSERT_NE(first, nullptr);
  ASSERT_TRUE(first->Compile(Job()).ok());
  AwaitRemotePuts(first.get(), 2);

  auto stranger = Make("b", "another-cluster-key-987654321");
  ASSERT_NE(stranger, nullptr);
  auto r = stranger->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kNone);
  KernelCacheStats s = stranger->Stats();
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.remote_hits, 0u);
  EXPECT_EQ(s.remote_rejected, 1u);  // the manifest; the object was never asked for
}

// A remote manifest is checked like a disk one: a header that changed since
// makes its dependency digests stale, so the kernel is compiled again.
TEST_F(RemoteCacheTest, ChangedHeaderIsNotServedFromTheRemoteTier) {
  auto first = Make("a");
  ASSERT_NE(first, nullptr);
  auto old_kernel = first->Compile(Job());
  ASSERT_TRUE(old_kernel.ok()) << old_kernel.status();
  AwaitRemotePuts(first.get(), 2);

  WriteHeader("constexpr float kScale = 3.0f;\n");
  auto second = Make("b");
  ASSERT_NE(second, nullptr);
  auto r = second->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kNone);
  EXPECT_EQ(second->Stats().compiles, 1u);
  EXPECT_NE(r->kernel->cache_key, old_kernel->kernel->cache_key);
  EXPECT_NE(r->kernel->cpu_object()->elf, old_kernel->kernel->cpu_object()->elf);
}

// Entries that authenticate (written with the cluster key) still get every
// check a disk entry gets: a manifest whose final key does not follow from
// its dependencies, or an artifact that does not decode, is not used.
TEST_F(RemoteCacheTest, AuthenticEntriesStillPassTheDiskChecks) {
  auto first = Make("a");
  ASSERT_NE(first, nullptr);
  auto compiled = first->Compile(Job());
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  AwaitRemotePuts(first.get(), 2);
  const std::string request_key = ManifestKey();
  const std::string final_key = compiled->kernel->cache_key;
  std::string manifest, object;
  ASSERT_TRUE(redis_->RawGet(RemoteTier::RedisKey("manifest", request_key), &manifest));
  ASSERT_TRUE(redis_->RawGet(RemoteTier::RedisKey("obj", final_key), &object));
  manifest = manifest.substr(48);
  object = object.substr(48);

  // 1. The manifest names another final key, under which the object sits.
  const std::string bogus(64, 'e');
  std::string forged = manifest;
  forged.replace(forged.find(final_key), final_key.size(), bogus);
  ASSERT_TRUE(redis_->RawSet(RemoteTier::RedisKey("manifest", request_key),
                             RemoteTier::Seal(kClusterKey, "manifest", request_key, forged)));
  ASSERT_TRUE(redis_->RawSet(RemoteTier::RedisKey("obj", bogus),
                             RemoteTier::Seal(kClusterKey, "obj", bogus, object)));
  auto b = Make("b");
  ASSERT_NE(b, nullptr);
  auto r = b->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kNone);
  EXPECT_EQ(b->Stats().compiles, 1u);
  EXPECT_EQ(r->kernel->cache_key, final_key);

  // 2. A correct manifest, but the object is not one.
  AwaitRemotePuts(b.get(), 2);  // b put the good manifest back
  ASSERT_TRUE(redis_->RawSet(RemoteTier::RedisKey("obj", final_key),
                             RemoteTier::Seal(kClusterKey, "obj", final_key, "not an object")));
  auto c = Make("c");
  ASSERT_NE(c, nullptr);
  r = c->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kNone);
  EXPECT_EQ(c->Stats().compiles, 1u);
  EXPECT_EQ(c->Stats().remote_hits, 2u);  // both authenticated; the object did not decode
}

TEST_F(RemoteCacheTest, ClearLeavesTheSharedTierAlone) {
  auto kc = Make("a");
  ASSERT_NE(kc, nullptr);
  ASSERT_TRUE(kc->Compile(Job()).ok());
  AwaitRemotePuts(kc.get(), 2);
  EXPECT_GE(kc->Clear(/*memory_only=*/false), 1u);
  EXPECT_EQ(redis_->Keys("opjit:v1:*").size(), 2u);
  auto r = kc->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kRemote);
  EXPECT_EQ(kc->Stats().compiles, 1u);
}

TEST_F(RemoteCacheTest, UnreachableRedisOnlyMeansCompiling) {
  auto kc = Make("a", kClusterKey,
                 "redis://127.0.0.1:" + std::to_string(cache::testing::FreePort()));
  ASSERT_NE(kc, nullptr);
  auto r = kc->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kNone);
  r = kc->Compile(Job());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cache_hit, CacheTier::kMemory);
  KernelCacheStats s = kc->Stats();
  EXPECT_EQ(s.compiles, 1u);
  EXPECT_EQ(s.remote_errors, 1u);  // then backing off: the puts were dropped
  EXPECT_EQ(s.remote_puts, 0u);
}

TEST(RemoteCacheOptionsTest, BadRemoteUrlIsInvalidArgument) {
  TempDir dir;
  KernelCompilerOptions o;
  o.cache_dir = dir.Sub("cache");
  o.worker_path = OPJIT_BINARY_DIR "/bin/opjit-compile-worker";
  o.kernel_include_dir = OPJIT_SOURCE_DIR "/kernels/include";
  o.workers = 1;
  o.remote.url = "memcached://cache:11211";
  o.remote.key = kClusterKey;
  auto kc = KernelCompiler::Create(o);
  EXPECT_TRUE(absl::IsInvalidArgument(kc.status())) << kc.status();
  o.remote.url = "redis://cache:6379";
  o.remote.key = "short";
  EXPECT_TRUE(absl::IsInvalidArgument(KernelCompiler::Create(o).status()));
}

}  // namespace
}  // namespace opjit::compiler

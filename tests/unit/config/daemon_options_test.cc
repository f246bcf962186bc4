// The config-to-options converters (server/daemon_options.h): each key
// reaches its subsystem's option, with the units and defaults the
// subsystems expect.
#include "server/daemon_options.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/common/uid_claims.h"
#include "server/config.h"

namespace opjit {
namespace {

// A config from a TOML body, checked.
DaemonConfig FromToml(const std::string& body) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            absl::StrCat("opjit-daemon-options-test-", ::getpid(), ".toml"))
                               .string();
  std::ofstream(path) << body;
  ConfigResult r = BuildConfig(path, {});
  std::filesystem::remove(path);
  EXPECT_TRUE(r.problems.empty()) << r.problems.front().ToString();
  return r.config;
}

TEST(DaemonOptionsTest, RegistryTakesTheBackendByNameAndThePassword) {
  DaemonConfig cfg = FromToml(
      "state_dir = \"/tmp/opjit-options-test\"\n[quota]\nops = 9\nversions_per_op = 4\n"
      "[registry]\nbackend = \"postgres\"\nurl = \"host=db\"\npoll_ms = 300\n");
  const registry::Registry::Options o = RegistryOptionsFromConfig(cfg, "s3cret");
  EXPECT_EQ(o.backend, "postgres");
  EXPECT_EQ(o.url, "host=db");
  EXPECT_EQ(o.password, "s3cret");
  EXPECT_EQ(o.poll_ms, 300);
  EXPECT_EQ(o.db_path, "/tmp/opjit-options-test/registry.db");
  EXPECT_EQ(o.max_ops_per_namespace, 9u);
  EXPECT_EQ(o.max_versions_per_op, 4u);
  EXPECT_EQ(RegistryOptionsFromConfig(FromToml(""), "").backend, "sqlite");
}

TEST(DaemonOptionsTest, CompilerAndCache) {
  DaemonConfig cfg = FromToml(
      "[compiler]\nworkers = 3\nmemory_limit_mb = 1000\nlong_workers = 1\n"
      "[cache]\nmemory_mb = 5\ndisk_mb = 7\n");
  compiler::KernelCompilerOptions o = CompilerOptionsFromConfig(cfg, "/h", "/inc", "key");
  EXPECT_EQ(o.worker_path, "/h/opjit-compile-worker");
  EXPECT_EQ(o.kernel_include_dir, "/inc");
  EXPECT_EQ(o.cache_dir, cfg.state_dir + "/cache");
  EXPECT_EQ(o.workers, 3);
  EXPECT_EQ(o.long_workers, 1);
  EXPECT_EQ(o.memory_limit_bytes, 1000ull << 20);
  EXPECT_EQ(o.recycle_memory_bytes, 500ull << 20);  // 0: half the limit
  EXPECT_EQ(o.memory_bytes, 5ull << 20);
  EXPECT_EQ(o.disk_bytes, 7ull << 20);
  EXPECT_TRUE(o.remote.url.empty());  // no cache.remote.url: the key is not used
  EXPECT_TRUE(o.remote.key.empty());
}

TEST(DaemonOptionsTest, ExecutionSharedMemoryAndAutograd) {
  DaemonConfig cfg = FromToml(
      "max_message_mb = 10\n[exec]\nthreads = 3\nqueue = 5\ninline_max_bytes = 99\n"
      "[shm]\nquota_mb = 6\nlease_ms = 700\n[quota]\ntotal_shm_mb = 12\ntotal_context_mb = 3\n"
      "[autograd]\ncontext_ttl_ms = 800\ncontext_mb = 2\n");
  const exec::ExecutorOptions e = ExecutorOptionsFromConfig(cfg);
  EXPECT_EQ(e.pool_threads, 3);
  EXPECT_EQ(e.max_queue, 5);
  EXPECT_EQ(e.inline_max_bytes, 99);
  EXPECT_EQ(e.max_inline_output_bytes, (10 << 20) - (1 << 20));
  const tensor::RegionManagerOptions r = RegionOptionsFromConfig(cfg);
  EXPECT_EQ(r.namespace_quota_bytes, 6ull << 20);
  EXPECT_EQ(r.total_quota_bytes, 12ull << 20);
  EXPECT_EQ(r.default_lease_ms, 700);
  EXPECT_EQ(r.instance_tag.size(), 12u);
  const autograd::AutogradOptions a = AutogradOptionsFromConfig(cfg);
  EXPECT_EQ(a.ttl_ms, 800);
  EXPECT_EQ(a.namespace_bytes, 2ull << 20);
  EXPECT_EQ(a.total_bytes, 3ull << 20);
  EXPECT_EQ(KernelHostOptionsFromConfig(cfg).scratch_dir, cfg.state_dir + "/cache/gpu-load");
}

// The shm every namespace together may hold is bounded well below /dev/shm by
// default, and no namespace's quota exceeds it.
TEST(DaemonOptionsTest, SharedMemoryQuotasAreBoundedByDevShm) {
  const tensor::RegionManagerOptions d = RegionOptionsFromConfig(FromToml(""));
  struct statvfs vfs;
  ASSERT_EQ(statvfs("/dev/shm", &vfs), 0);
  const uint64_t dev_shm = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  EXPECT_EQ(d.total_quota_bytes, dev_shm / 4);
  EXPECT_EQ(d.namespace_quota_bytes, std::min<uint64_t>(4096ull << 20, dev_shm / 4));
  const tensor::RegionManagerOptions over =
      RegionOptionsFromConfig(FromToml("[shm]\nquota_mb = 20\n[quota]\ntotal_shm_mb = 12\n"));
  EXPECT_EQ(over.namespace_quota_bytes, 12ull << 20);
  EXPECT_EQ(over.total_quota_bytes, 12ull << 20);
}

TEST(DaemonOptionsTest, FastChannelsAreOffWithoutChannels) {
  EXPECT_TRUE(ChannelOptionsFromConfig(FromToml("")).enabled);
  EXPECT_FALSE(ChannelOptionsFromConfig(FromToml("[fast]\nchannels = 0\n")).enabled);
  EXPECT_FALSE(ChannelOptionsFromConfig(FromToml("[fast]\nenabled = false\n")).enabled);
  const DaemonConfig cfg =
      FromToml("[fast]\nhandles = 17\ntotal_channels = 3\n[shm]\nlease_ms = 9\n");
  EXPECT_EQ(ChannelOptionsFromConfig(cfg).total, 3u);
  EXPECT_EQ(HandleOptionsFromConfig(cfg).max_per_namespace, 17u);
  EXPECT_EQ(HandleOptionsFromConfig(cfg).lease_ms, 9);
}

TEST(DaemonOptionsTest, AccessQuotasAndServer) {
  const DaemonConfig cfg = FromToml(
      "socket_mode = \"0600\"\nlisten = [\"unix:/tmp/x.sock\"]\n"
      "[quota]\nconcurrent_compiles = 2\ncompile_seconds_per_minute = 30\n"
      "calls_per_second = 100\nnamespaces = 5\n");
  const access::QuotaOptions q = QuotaOptionsFromConfig(cfg);
  EXPECT_EQ(q.concurrent_compiles, 2);
  EXPECT_EQ(q.compile_seconds_per_minute, 30);
  EXPECT_EQ(q.calls_per_second, 100);
  EXPECT_EQ(AccessOptionsFromConfig(cfg).max_namespaces, 5u);
  EXPECT_EQ(AccessOptionsFromConfig(cfg).daemon_uid, ::getuid());
  const rpc::GrpcServerOptions s = ServerOptionsFromConfig(cfg);
  EXPECT_EQ(s.listen, std::vector<std::string>{"unix:/tmp/x.sock"});
  EXPECT_EQ(s.socket_mode, 0600u);
  EXPECT_EQ(s.max_message_bytes, 320 << 20);
  EXPECT_TRUE(s.interceptors.empty());  // the Daemon adds its own
}

// Each namespace's uid is claimed in exec.uid_claim_dir: two daemons (two
// option sets here) with one config take two uids; a directory others may
// write refuses the start; a runner without a uid range claims nothing.
TEST(DaemonOptionsTest, ExecutorUidsAreClaimedInTheClaimDirectory) {
  char tmpl[] = "/tmp/opjit-options-claims-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string top = tmpl;
  DaemonConfig cfg = FromToml(absl::StrCat("[exec]\nuid_claim_dir = \"", top, "/claims\"\n"));
  SubordinateIds sub;  // a root daemon's: none; a non-root one's claims are opened here too
  if (::geteuid() != 0) sub.claims = *UidClaims::Open(cfg.uid_claim_dir);
  runner::ProcessRunnerOptions none;
  ASSERT_TRUE(ClaimUidsFromConfig(cfg, sub, &none).ok());
  EXPECT_FALSE(none.claim_uid);  // no range, nothing claimed
  runner::ProcessRunnerOptions a, b;
  a.uid_first = b.uid_first = 2000000300u;
  a.uid_last = b.uid_last = 2000000309u;
  ASSERT_TRUE(ClaimUidsFromConfig(cfg, sub, &a).ok());
  ASSERT_TRUE(a.claim_uid);
  EXPECT_EQ(*a.claim_uid(a.uid_first, a.uid_last), a.uid_first);
  if (::geteuid() == 0) {
    // Another daemon: another descriptor, so another uid.
    ASSERT_TRUE(ClaimUidsFromConfig(cfg, sub, &b).ok());
    EXPECT_EQ(*b.claim_uid(b.uid_first, b.uid_last), b.uid_first + 1);
    EXPECT_EQ(*a.claim_uid(a.uid_first, a.uid_last), a.uid_first + 2);
    // A directory others may write could have its lock file swapped.
    ASSERT_EQ(::chmod(cfg.uid_claim_dir.c_str(), 0777), 0);
    runner::ProcessRunnerOptions c = a;
    c.claim_uid = nullptr;
    const absl::Status refused = ClaimUidsFromConfig(cfg, sub, &c);
    EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
    EXPECT_NE(refused.message().find("uid_claim_dir"), std::string::npos) << refused;
  }
  std::filesystem::remove_all(top);
}

}  // namespace
}  // namespace opjit

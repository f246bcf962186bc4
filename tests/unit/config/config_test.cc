#include "server/config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace opjit {
namespace {

absl::StatusOr<DaemonConfig> Load(std::vector<std::string> args) {
  args.insert(args.begin(), "opjitd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return LoadConfig(static_cast<int>(argv.size()), argv.data());
}

std::string TomlFile(const std::string& body) {
  std::string path = (std::filesystem::temp_directory_path() /
                      ("opjit-config-test-" + std::to_string(::getpid()) + ".toml"))
                         .string();
  std::ofstream(path) << body;
  return path;
}

TEST(ConfigTest, DefaultsListenOnLoopbackAndTheLocalSocket) {
  auto cfg = Load({"--state-dir", "/tmp/opjit-config-test"});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_EQ(cfg->listen.size(), 2u);
  EXPECT_EQ(cfg->listen[0], "unix:/tmp/opjit-config-test/opjitd.sock");
  EXPECT_EQ(cfg->listen[1], "127.0.0.1:7878");
  EXPECT_FALSE(cfg->allow_insecure_tcp);
}

TEST(ConfigTest, NonLoopbackTcpIsRefusedWithoutAnExplicitOptIn) {
  for (const char* address : {"0.0.0.0:0", "0.0.0.0:7878", ":7878", "[::]:7878", "10.1.2.3:7878",
                              "gpu-box:7878", "127.evil.com:1"}) {
    auto cfg = Load({"--listen", address});
    ASSERT_FALSE(cfg.ok()) << address;
    EXPECT_EQ(cfg.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_TRUE(absl::StrContains(cfg.status().message(), "allow_insecure_tcp"))
        << cfg.status();
  }
  for (const char* address : {"127.0.0.1:0", "127.0.0.2:7878", "localhost:7878", "[::1]:7878",
                              "unix:/tmp/x.sock"}) {
    EXPECT_TRUE(Load({"--listen", address}).ok()) << address;
  }
  EXPECT_TRUE(Load({"--listen", "0.0.0.0:0", "--allow-insecure-tcp"}).ok());
  const std::string toml = TomlFile("allow_insecure_tcp = true\nlisten = [\"0.0.0.0:0\"]\n");
  EXPECT_TRUE(Load({"--config", toml}).ok());
  const std::string bad = TomlFile("allow_insecure_tcp = \"yes\"\n");
  auto refused = Load({"--config", bad});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  std::filesystem::remove(toml);
}

TEST(ConfigTest, CallsPerSecondIsBoundedOnlyOnASharedDaemonUnlessSet) {
  auto single = Load({"--state-dir", "/tmp/opjit-config-test"});
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->quota_calls_per_second, 0);  // no principals: no bound
  const std::string shared = TomlFile(
      "[[principal]]\nname = \"alice\"\nrole = \"user\"\nnamespaces = [\"alice\"]\n"
      "uids = [1001]\n");
  auto with_principals = Load({"--config", shared});
  ASSERT_TRUE(with_principals.ok()) << with_principals.status();
  EXPECT_EQ(with_principals->quota_calls_per_second, kSharedCallsPerSecond);
  const std::string set = TomlFile("[quota]\ncalls_per_second = 500\n");
  auto explicit_rate = Load({"--config", set});
  ASSERT_TRUE(explicit_rate.ok()) << explicit_rate.status();
  EXPECT_EQ(explicit_rate->quota_calls_per_second, 500);
  const std::string negative = TomlFile("[quota]\ncalls_per_second = -1\n");
  EXPECT_EQ(Load({"--config", negative}).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(negative);
}

TEST(ConfigTest, CompilerLaneAndRecyclingKeys) {
  const std::string toml = TomlFile(
      "[compiler]\nlong_after_ms = 250\nlong_workers = 1\nrecycle_after = 10\nslow_log_ms = 7000\n"
      "recycle_memory_mb = 900\nthreads = 0\nlong_timeout_ms = 90000\n");
  auto cfg = Load({"--config", toml});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->compile_long_after_ms, 250);
  EXPECT_EQ(cfg->compile_long_timeout_ms, 90000);
  EXPECT_EQ(cfg->compile_slow_log_ms, 7000);
  EXPECT_EQ(cfg->compile_long_workers, 1);
  EXPECT_EQ(cfg->compile_recycle_after, 10);
  EXPECT_EQ(cfg->compile_recycle_memory_mb, 900);
  const std::string bad = TomlFile("[compiler]\nlong_workers = -1\n");
  EXPECT_FALSE(Load({"--config", bad}).ok());
  std::filesystem::remove(toml);
}

// Toolchain profiles (server/compiler/toolchain_profile.h): "aten" offered
// by default where installed, a policy per profile, unknown names refused.
TEST(ConfigTest, ToolchainProfileKeys) {
  auto d = Load({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->compiler_profiles, std::vector<std::string>{"aten"});
  EXPECT_EQ(d->aten_namespaces, std::vector<std::string>{"*"});
  EXPECT_FALSE(d->aten_pch_at_start);
  const std::string toml = TomlFile(
      "[compiler]\nprofiles = []\n[toolchains.aten]\nnamespaces = [\"team\"]\n"
      "pch_at_start = true\n");
  auto cfg = Load({"--config", toml});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->compiler_profiles.empty());
  EXPECT_EQ(cfg->aten_namespaces, std::vector<std::string>{"team"});
  EXPECT_TRUE(cfg->aten_pch_at_start);
  std::filesystem::remove(toml);
  for (const char* bad : {"[compiler]\nprofiles = [\"cuda\"]\n",
                          "[toolchains.aten]\nnamespace = [\"x\"]\n",
                          "[toolchains.other]\nnamespaces = [\"x\"]\n"}) {
    const std::string path = TomlFile(bad);
    const ConfigResult r = BuildConfig(path, {});
    EXPECT_FALSE(r.problems.empty()) << bad;
    std::filesystem::remove(path);
  }
}

// A uid range per namespace by default, outside regular users, Debian's
// subordinate uids and systemd's container range; "" turns it off.
TEST(ConfigTest, ExecutorUidRangeAndThreadCaps) {
  auto d = Load({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->uid_range, "1879048192-1879113727");
  EXPECT_EQ(d->uid_first, 1879048192u);
  EXPECT_EQ(d->uid_last, 1879113727u);
  EXPECT_GT(d->uid_first, 600100000u);  // past Debian's SUB_UID_MAX and systemd's containers
  EXPECT_EQ(d->uid_claim_dir, "/run/opjit-uids");  // where every daemon of the host claims
  EXPECT_EQ(d->threads_per_executor, 256);
  EXPECT_EQ(d->threads_per_namespace, 1024);
  EXPECT_EQ(d->scratch_mb, 64);
  EXPECT_TRUE(d->exec_namespaces);
  EXPECT_EQ(d->namespace_memory_mb, 16384);
  const std::string toml = TomlFile(
      "[exec]\nuid_range = \"200000-200009\"\nthreads_per_executor = 64\n"
      "threads_per_namespace = 300\nscratch_mb = 8\nnamespaces = false\nnamespace_memory_mb = 0\n");
  auto cfg = Load({"--config", toml});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->uid_first, 200000u);
  EXPECT_EQ(cfg->uid_last, 200009u);
  EXPECT_EQ(cfg->threads_per_executor, 64);
  EXPECT_EQ(cfg->threads_per_namespace, 300);
  EXPECT_EQ(cfg->scratch_mb, 8);
  EXPECT_FALSE(cfg->exec_namespaces);
  EXPECT_EQ(cfg->namespace_memory_mb, 0);
  const std::string off = TomlFile("[exec]\nuid_range = \"\"\n");
  auto none = Load({"--config", off});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->uid_first, 0u);
  EXPECT_EQ(none->uid_last, 0u);
  std::filesystem::remove(toml);
  std::filesystem::remove(off);
}

// The compile uid: by default the uid right after the default executor
// range; any other outside exec.uid_range, not root's or nobody's.
TEST(ConfigTest, CompileUid) {
  auto d = Load({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->compile_uid, 1879113728);
  EXPECT_EQ(d->compile_uid, int64_t{d->uid_last} + 1);
  const std::string toml =
      TomlFile("[compiler]\nuid = 200010\n[exec]\nuid_range = \"200000-200009\"\n");
  auto cfg = Load({"--config", toml});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->compile_uid, 200010);
  // With no executor range, any uid but root's and nobody's.
  const std::string off =
      TomlFile("[compiler]\nuid = 1879048192\n[exec]\nuid_range = \"\"\n");
  auto none = Load({"--config", off});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->compile_uid, 1879048192);
  std::filesystem::remove(toml);
  std::filesystem::remove(off);
}

// --check-config: every problem, each with its file:line and key.
TEST(ConfigTest, BuildConfigReportsEveryProblemWithItsLineAndKey) {
  const std::string path = TomlFile(
      "log_level = \"loud\"\n"              // 1
      "bogus = 1\n"                         // 2
      "[quota]\n"                           // 3
      "calls_per_second = -3\n"             // 4
      "ops = \"many\"\n"                    // 5
      "[exec]\n"                            // 6
      "workers = 0\n"                       // 7
      "[[principal]]\n"                     // 8
      "name = \"bob\"\n"                    // 9
      "token_sha256 = [\"abc\"]\n"          // 10
      "namespaces = [\"bob\"]\n");          // 11
  const ConfigResult r = BuildConfig(path, {});
  std::vector<std::string> lines;
  for (const ConfigProblem& p : r.problems) lines.push_back(p.ToString());
  ASSERT_EQ(lines.size(), 6u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[0], path + ":1: log_level: expected trace, debug, info, warn, error, critical "
                             "or off, not \"loud\"");
  EXPECT_TRUE(absl::StartsWith(lines[1], path + ":2: bogus: unknown key")) << lines[1];
  EXPECT_EQ(lines[2], path + ":4: quota.calls_per_second: expected a non-negative number");
  EXPECT_EQ(lines[3], path + ":5: quota.ops: expected an integer");
  EXPECT_EQ(lines[4], path + ":7: exec.workers: expected an integer >= 1, not 0");
  EXPECT_TRUE(absl::StartsWith(lines[5], path + ":8: principal[0]: principal \"bob\": "
                                                "token_sha256 entries are 64"))
      << lines[5];
  // LoadConfig refuses the same file with the same lines.
  auto refused = Load({"--config", path});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(std::string(refused.status().message()), absl::StrJoin(lines, "\n"));
  std::filesystem::remove(path);
}

TEST(ConfigTest, SyntaxErrorsNameLineAndColumn) {
  const std::string path = TomlFile("log_level = \"info\"\ntoken_sha256: [\"x\"]\n");
  const ConfigResult r = BuildConfig(path, {});
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(r.problems[0].ToString(), path + ":2:13: ")) << r.problems[0].ToString();
  EXPECT_EQ(r.problems[0].line, 2);
  std::filesystem::remove(path);
}

TEST(ConfigTest, AFileThatCannotBeReadIsOneProblem) {
  const ConfigResult r = BuildConfig("/nonexistent/opjitd.toml", {});
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].ToString(),
            "/nonexistent/opjitd.toml: File could not be opened for reading");
}

TEST(ConfigTest, ProblemsFromFlagsNameTheFlag) {
  ConfigFlags flags;
  flags.log_level = "chatty";
  flags.isolation = "none";
  const ConfigResult r = BuildConfig("", flags);
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_TRUE(absl::StartsWith(r.problems[0].ToString(), "--log-level: log_level: "))
      << r.problems[0].ToString();
  EXPECT_TRUE(absl::StartsWith(r.problems[1].ToString(), "--isolation: exec.isolation: "))
      << r.problems[1].ToString();
}

TEST(ConfigTest, RangesAndCombinations) {
  struct Case {
    std::string toml, key;
  };
  for (const Case& c : std::vector<Case>{
           {"max_message_mb = 4096\n", "max_message_mb"},
           {"[health]\ninterval_ms = 10\n", "health.interval_ms"},
           {"[compiler]\ntimeout_ms = 3000000000\n", "compiler.timeout_ms"},
           {"[registry]\nbackend = \"mysql\"\n", "registry.backend"},
           {"[registry]\nbackend = \"postgres\"\n", "registry.url"},
           {"[cache.remote]\nurl = \"redis://x:1\"\n", "cache.remote.key_file"},
           {"[tls]\ncert = \"/nonexistent/c.pem\"\n", "tls.cert"},  // without a key
           {"[tls]\ncert = \"/nonexistent/c.pem\"\nkey = \"/nonexistent/k.pem\"\n", "tls.key"},
           {"socket_mode = \"999\"\n", "socket_mode"},
           {"[exec]\nworkers = 1.5\n", "exec.workers"},
           {"[exec]\nuid_range = \"5000\"\n", "exec.uid_range"},
           {"[exec]\nuid_claim_dir = \"run/opjit-uids\"\n", "exec.uid_claim_dir"},
           {"[exec]\nuid_claim_dir = \"\"\n", "exec.uid_claim_dir"},
           {"[exec]\nuid_range = \"2000-1000\"\n", "exec.uid_range"},
           {"[exec]\nuid_range = \"0-100\"\n", "exec.uid_range"},
           {"[exec]\nuid_range = \"60000-70000\"\n", "exec.uid_range"},  // holds nobody
           {"[exec]\nuid_range = \"1-4294967295\"\n", "exec.uid_range"},
           {"[exec]\nthreads_per_executor = 2\n", "exec.threads_per_executor"},
           {"[compiler]\nuid = 0\n", "compiler.uid"},                // root
           {"[compiler]\nuid = -5\n", "compiler.uid"},
           {"[compiler]\nuid = 4294967295\n", "compiler.uid"},       // (uid_t)-1
           {"[compiler]\nuid = 65534\n", "compiler.uid"},            // nobody
           {"[compiler]\nuid = \"compile\"\n", "compiler.uid"},
           {"[compiler]\nuid = 1879048192\n", "compiler.uid"},       // the default range's first
           {"[compiler]\nuid = 200005\n[exec]\nuid_range = \"200000-200009\"\n", "compiler.uid"},
           {"[exec]\nthreads_per_namespace = 0\n", "exec.threads_per_namespace"},
           {"exec = 3\n", "exec"},
           {"[[principal]]\nname = \"a\"\nrole = \"root\"\nuids = [5]\n", "principal[0].role"},
           {"[[principal]]\nname = \"a\"\nrole = \"admin\"\n", "principal[0]"},
           {"[[principal]]\nname = \"a\"\nrole = \"admin\"\nuids = [5]\n"
            "[[principal]]\nname = \"a\"\nrole = \"admin\"\nuids = [6]\n",
            "principal[1]"},
       }) {
    const std::string path = TomlFile(c.toml);
    const ConfigResult r = BuildConfig(path, {});
    std::vector<std::string> keys;
    for (const ConfigProblem& p : r.problems) keys.push_back(p.key);
    EXPECT_TRUE(std::find(keys.begin(), keys.end(), c.key) != keys.end())
        << c.toml << " -> [" << absl::StrJoin(keys, ", ") << "]";
    std::filesystem::remove(path);
  }
}

TEST(ConfigTest, TheShippedConfigsHaveNoProblem) {
  for (const char* rel : {"deploy/opjitd.toml", "deploy/container/opjitd.toml",
                          "deploy/k8s/insecure/opjitd.toml"}) {
    const std::string path = std::string(OPJIT_SOURCE_DIR) + "/" + rel;
    const ConfigResult r = BuildConfig(path, {});
    std::vector<std::string> lines;
    for (const ConfigProblem& p : r.problems) {
      // Files that exist only where the config is deployed are not this test's concern.
      if (p.message != "no such file") lines.push_back(p.ToString());
    }
    EXPECT_TRUE(lines.empty()) << absl::StrJoin(lines, "\n");
  }
}

TEST(ConfigTest, SettingsOfNamesEveryKeyButThePrincipals) {
  DaemonConfig a = BuildConfig("", {}).config, b = a;
  const auto before = SettingsOf(a);
  b.quota_calls_per_second = 7;
  b.exec_workers = 9;
  const auto after = SettingsOf(b);
  std::vector<std::string> changed;
  for (const auto& [k, v] : after) {
    if (before.at(k) != v) changed.push_back(k);
  }
  EXPECT_EQ(changed, (std::vector<std::string>{"exec.workers", "quota.calls_per_second"}));
  EXPECT_EQ(before.count("principal"), 0u);
  EXPECT_GT(before.size(), 60u);
}

}  // namespace
}  // namespace opjit

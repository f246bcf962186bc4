#include "server/config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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
      "[compiler]\nlong_after_ms = 250\nlong_workers = 1\nrecycle_after = 10\n"
      "recycle_memory_mb = 900\nthreads = 0\n");
  auto cfg = Load({"--config", toml});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->compile_long_after_ms, 250);
  EXPECT_EQ(cfg->compile_long_workers, 1);
  EXPECT_EQ(cfg->compile_recycle_after, 10);
  EXPECT_EQ(cfg->compile_recycle_memory_mb, 900);
  const std::string bad = TomlFile("[compiler]\nlong_workers = -1\n");
  EXPECT_FALSE(Load({"--config", bad}).ok());
  std::filesystem::remove(toml);
}

}  // namespace
}  // namespace opjit

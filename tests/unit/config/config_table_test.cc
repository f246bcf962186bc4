// The config as a table (config.cc Keys()): every key has a row with a type
// and a doc, --help-config lists them all, enums are parsed once at load
// and refuse values outside their set, unknown keys are refused.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/config.h"

namespace opjit {
namespace {

// A TOML file of its own (removed when the test ends).
class TomlFile {
 public:
  explicit TomlFile(const std::string& body)
      : path_((std::filesystem::temp_directory_path() /
               absl::StrCat("opjit-config-table-test-", ::getpid(), "-", next_++, ".toml"))
                  .string()) {
    std::ofstream(path_) << body;
  }
  ~TomlFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int next_ = 0;
  std::string path_;
};

std::vector<std::string> Lines(const ConfigResult& r) {
  std::vector<std::string> lines;
  for (const ConfigProblem& p : r.problems) lines.push_back(p.ToString());
  return lines;
}

TEST(ConfigTableTest, EveryKeyHasATypeADefaultAndADoc) {
  const std::vector<ConfigKeyInfo> keys = ConfigKeys();
  ASSERT_GT(keys.size(), 70u);
  std::set<std::string> seen;
  for (const ConfigKeyInfo& k : keys) {
    EXPECT_TRUE(seen.insert(k.key).second) << "listed twice: " << k.key;
    EXPECT_FALSE(k.type.empty()) << k.key;
    EXPECT_FALSE(k.default_value.empty()) << k.key;
    EXPECT_GE(k.doc.size(), 10u) << k.key << " has no doc";
  }
}

// SettingsOf (what a reload compares) is the table too: every key but the
// principals and the aliases, and nothing else.
TEST(ConfigTableTest, SettingsOfIsTheTableLessAliasesAndPrincipals) {
  std::set<std::string> expected;
  for (const ConfigKeyInfo& k : ConfigKeys()) {
    if (!k.alias && k.key != "principal") expected.insert(k.key);
  }
  std::set<std::string> settings;
  for (const auto& [key, value] : SettingsOf(DaemonConfig{})) settings.insert(key);
  EXPECT_EQ(settings, expected);
}

TEST(ConfigTableTest, HelpConfigListsEveryKeyWithTypeAndDefault) {
  const std::string help = ConfigHelp();
  for (const ConfigKeyInfo& k : ConfigKeys()) {
    EXPECT_TRUE(absl::StrContains(
        help, absl::StrCat("\n", k.key, "  ", k.type, "  (default ", k.default_value, ")\n")))
        << k.key;
  }
  EXPECT_TRUE(absl::StrContains(help, "\nexec.isolation  process | in-daemon  (default process)\n"))
      << help;
  EXPECT_TRUE(absl::StrContains(help, "\nexec.workers  integer >= 1  (default 2)\n"));
  // Every doc line fits 80 columns.
  for (absl::string_view line : absl::StrSplit(help, '\n')) {
    if (absl::StartsWith(line, "    ")) EXPECT_LE(line.size(), 80u) << line;
  }
  // The flag: LoadConfig answers it like --help (CANCELLED, the text).
  std::vector<std::string> args = {"opjitd", "--help-config"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  auto r = LoadConfig(static_cast<int>(argv.size()), argv.data());
  ASSERT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(std::string(r.status().message()), help);
  EXPECT_TRUE(absl::StrContains(Usage(), "--help-config"));
}

TEST(ConfigTableTest, EnumsAreParsedAtLoad) {
  const TomlFile file("[exec]\nisolation = \"in-daemon\"\n[registry]\nbackend = \"postgres\"\n"
                      "url = \"host=db\"\n");
  const ConfigResult r = BuildConfig(file.path(), {});
  ASSERT_TRUE(r.problems.empty()) << absl::StrJoin(Lines(r), "\n");
  EXPECT_EQ(r.config.isolation, Isolation::kInDaemon);
  EXPECT_EQ(r.config.registry_backend, RegistryBackend::kPostgres);
  EXPECT_EQ(SettingsOf(r.config).at("exec.isolation"), "in-daemon");
  EXPECT_EQ(SettingsOf(r.config).at("registry.backend"), "postgres");
  const ConfigResult d = BuildConfig("", {});
  EXPECT_EQ(d.config.isolation, Isolation::kProcess);
  EXPECT_EQ(d.config.registry_backend, RegistryBackend::kSqlite);
  ConfigFlags flags;
  flags.isolation = "in-daemon";
  EXPECT_EQ(BuildConfig(file.path(), flags).config.isolation, Isolation::kInDaemon);
  EXPECT_STREQ(IsolationName(Isolation::kInDaemon), "in-daemon");
  EXPECT_STREQ(RegistryBackendName(RegistryBackend::kSqlite), "sqlite");
}

TEST(ConfigTableTest, AnEnumValueOutsideItsSetIsRefusedNamingTheAllowedValues) {
  const TomlFile file("[exec]\n"                    // 1
                      "isolation = \"none\"\n"      // 2
                      "[registry]\n"                // 3
                      "backend = \"mysql\"\n"       // 4
                      "log_level = 3\n");           // 5: unknown in [registry]
  const std::vector<std::string> lines = Lines(BuildConfig(file.path(), {}));
  ASSERT_EQ(lines.size(), 3u) << absl::StrJoin(lines, "\n");
  EXPECT_EQ(lines[0], file.path() + ":2: exec.isolation: expected \"process\" or "
                                    "\"in-daemon\", not \"none\"");
  EXPECT_EQ(lines[1], file.path() + ":4: registry.backend: expected \"sqlite\" or "
                                    "\"postgres\", not \"mysql\"");
  EXPECT_TRUE(absl::StartsWith(lines[2], file.path() + ":5: registry.log_level: unknown key"));
  const TomlFile not_a_string("[exec]\nisolation = 1\n");
  EXPECT_EQ(Lines(BuildConfig(not_a_string.path(), {})),
            std::vector<std::string>{not_a_string.path() +
                                     ":2: exec.isolation: expected a string"});
  ConfigFlags flags;
  flags.isolation = "sandbox";
  EXPECT_EQ(Lines(BuildConfig("", flags)),
            std::vector<std::string>{
                "--isolation: exec.isolation: expected \"process\" or \"in-daemon\", not "
                "\"sandbox\""});
}

TEST(ConfigTableTest, UnknownKeysAreRefusedWithTheKeysKnownThere) {
  const TomlFile file("verbose = true\n"            // 1
                      "[shm]\n"                     // 2
                      "quota = 5\n"                 // 3
                      "[cache.remote]\n"            // 4
                      "host = \"x\"\n"              // 5
                      "[bogus]\n");                 // 6
  const std::vector<std::string> lines = Lines(BuildConfig(file.path(), {}));
  ASSERT_EQ(lines.size(), 4u) << absl::StrJoin(lines, "\n");
  EXPECT_TRUE(absl::StartsWith(lines[0], file.path() + ":1: verbose: unknown key (known here: "
                                                       "allow_insecure_tcp, autograd, cache, "))
      << lines[0];
  EXPECT_EQ(lines[1], file.path() + ":3: shm.quota: unknown key (known here: lease_ms, quota_mb)");
  EXPECT_EQ(lines[2], file.path() + ":5: cache.remote.host: unknown key (known here: key_file, "
                                    "max_mb, timeout_ms, ttl_s, url)");
  EXPECT_TRUE(absl::StartsWith(lines[3], file.path() + ":6: bogus: unknown key")) << lines[3];
  // [cache] knows its subsection.
  const TomlFile cache("[cache]\nsize = 1\n");
  const std::vector<std::string> c = Lines(BuildConfig(cache.path(), {}));
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0], cache.path() + ":2: cache.size: unknown key (known here: disk_mb, "
                                 "memory_entries, memory_mb, remote)");
  // A section that is not a table is one problem.
  const TomlFile scalar("cache = 3\n");
  EXPECT_EQ(Lines(BuildConfig(scalar.path(), {})),
            std::vector<std::string>{scalar.path() + ":1: cache: expected a table ([cache])"});
}

// An alias is read before the key it stands for: the latter wins.
TEST(ConfigTableTest, AliasesYieldToTheirKey) {
  const TomlFile both("[quota]\nexecutor_processes = 3\nshm_mb = 7\n[exec]\nworkers = 5\n");
  const ConfigResult r = BuildConfig(both.path(), {});
  ASSERT_TRUE(r.problems.empty()) << absl::StrJoin(Lines(r), "\n");
  EXPECT_EQ(r.config.exec_workers, 5);
  EXPECT_EQ(r.config.shm_quota_mb, 7);
}

}  // namespace
}  // namespace opjit

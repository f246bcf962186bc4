#include "server/registry/registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/registry/canonical.h"
#include "server/registry/sqlite_store.h"
#include "tests/unit/registry/test_util.h"

namespace opjit::registry {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using testing::ValidDef;

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetLogLevel("warn");
    path_ = dir_.File("registry.db");
    reg_ = Open();
  }

  std::unique_ptr<Registry> Open() {
    auto reg = Registry::Create({.db_path = path_});
    EXPECT_TRUE(reg.ok()) << reg.status();
    return reg.ok() ? std::move(*reg) : nullptr;
  }

  Registry::RegisterResult MustRegister(const OpDef& def) {
    auto r = reg_->Register(def);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : Registry::RegisterResult{};
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<Registry> reg_;
};

OpDef WithDoc(OpDef def, const std::string& doc) {
  def.doc = doc;
  return def;
}

TEST_F(RegistryTest, RegisterIsIdempotent) {
  auto first = MustRegister(ValidDef());
  EXPECT_TRUE(first.created);
  EXPECT_EQ(first.record.version, 1);
  EXPECT_EQ(first.record.content_hash, ContentHash(ValidDef()));
  EXPECT_GT(first.record.created_unix_ms, 0);
  auto again = MustRegister(ValidDef());
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.record.version, 1);
  EXPECT_EQ(again.record.created_unix_ms, first.record.created_unix_ms);
  EXPECT_EQ(reg_->Size(), 1u);
  EXPECT_EQ(reg_->List("", true).size(), 1u);
}

TEST_F(RegistryTest, InvalidDefIsRefusedAndNotStored) {
  OpDef def = ValidDef();
  def.inputs[0].name = "";
  auto r = reg_->Register(def);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("inputs[0].name"));
  EXPECT_EQ(reg_->Size(), 0u);
}

TEST_F(RegistryTest, VersioningAndPinnedGet) {
  OpDef v1 = ValidDef();
  OpDef v2 = WithDoc(ValidDef(), "second");
  EXPECT_EQ(MustRegister(v1).record.version, 1);
  auto r2 = MustRegister(v2);
  EXPECT_TRUE(r2.created);
  EXPECT_EQ(r2.record.version, 2);

  auto latest = reg_->Get("default", "leaky_relu", 0);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->version, 2);
  EXPECT_EQ(latest->def, v2);
  auto pinned = reg_->Get("default", "leaky_relu", 1);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pinned->def, v1);
  auto shared = reg_->GetShared("default", "leaky_relu", 1);
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ((*shared)->def, v1);

  // Only the latest is compared: going back to v1's definition is version 3.
  auto r3 = MustRegister(v1);
  EXPECT_TRUE(r3.created);
  EXPECT_EQ(r3.record.version, 3);
  EXPECT_EQ(r3.record.content_hash, ContentHash(v1));

  auto missing = reg_->Get("default", "leaky_relu", 7);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(),
            "op \"default/leaky_relu\" has no version 7 (versions: 1, 2, 3)");
  auto unknown = reg_->Get("default", "foo", 0);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(unknown.status().message(), "op \"default/foo\" not found");
  EXPECT_EQ(reg_->Get("other", "leaky_relu", 0).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, ListSortedByNamespaceNameVersion) {
  for (const char* ns : {"zeta", "alpha", "default"}) {
    for (const char* name : {"b", "a"}) {
      OpDef def = ValidDef(name);
      def.ns = ns;
      MustRegister(def);
      MustRegister(WithDoc(def, "v2"));
    }
  }
  auto all = reg_->List("", true);
  ASSERT_EQ(all.size(), 12u);
  std::vector<std::string> got;
  for (const auto& r : all) {
    got.push_back(r.def.ns + "/" + r.def.name + "@" + std::to_string(r.version));
  }
  EXPECT_EQ(got[0], "alpha/a@1");
  EXPECT_EQ(got[1], "alpha/a@2");
  EXPECT_EQ(got[2], "alpha/b@1");
  EXPECT_EQ(got[11], "zeta/b@2");
  EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));

  auto latest = reg_->List("default", false);
  ASSERT_EQ(latest.size(), 2u);
  EXPECT_EQ(latest[0].def.name, "a");
  EXPECT_EQ(latest[0].version, 2);
  EXPECT_EQ(latest[1].def.name, "b");
  EXPECT_EQ(reg_->List("default", true).size(), 4u);
  EXPECT_TRUE(reg_->List("nope", true).empty());
  EXPECT_EQ(reg_->Size(), 6u);
}

TEST_F(RegistryTest, DeleteVersionsAndAll) {
  MustRegister(ValidDef());
  MustRegister(WithDoc(ValidDef(), "2"));
  MustRegister(WithDoc(ValidDef(), "3"));

  auto one = reg_->Delete("default", "leaky_relu", 2);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, 1);
  EXPECT_EQ(reg_->Get("default", "leaky_relu", 2).status().message(),
            "op \"default/leaky_relu\" has no version 2 (versions: 1, 3)");
  auto again = reg_->Delete("default", "leaky_relu", 2);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);

  auto rest = reg_->Delete("default", "leaky_relu", 0);
  ASSERT_TRUE(rest.ok());
  EXPECT_EQ(*rest, 2);
  EXPECT_EQ(reg_->Size(), 0u);
  auto none = reg_->Delete("default", "leaky_relu", 0);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(none.status().message(), "op \"default/leaky_relu\" not found");

  // Version numbers are never reused, also across a restart.
  EXPECT_EQ(MustRegister(ValidDef()).record.version, 4);
  reg_.reset();
  reg_ = Open();
  ASSERT_NE(reg_, nullptr);
  ASSERT_TRUE(reg_->Delete("default", "leaky_relu", 0).ok());
  reg_.reset();
  reg_ = Open();
  EXPECT_EQ(MustRegister(ValidDef()).record.version, 5);
}

TEST_F(RegistryTest, PersistsAcrossReopen) {
  auto a1 = MustRegister(ValidDef("a"));
  auto a2 = MustRegister(WithDoc(ValidDef("a"), "2"));
  auto b1 = MustRegister(ValidDef("b"));
  ASSERT_TRUE(reg_->Delete("default", "a", 1).ok());
  reg_.reset();

  reg_ = Open();
  ASSERT_NE(reg_, nullptr);
  EXPECT_EQ(reg_->Size(), 2u);
  auto got = reg_->Get("default", "a", 0);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->version, 2);
  EXPECT_EQ(got->def, a2.record.def);
  EXPECT_EQ(got->content_hash, a2.record.content_hash);
  EXPECT_EQ(got->created_unix_ms, a2.record.created_unix_ms);
  EXPECT_EQ(reg_->Get("default", "a", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg_->Get("default", "b", 1)->def, b1.record.def);
  // Idempotence holds across restarts.
  auto again = MustRegister(WithDoc(ValidDef("a"), "2"));
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.record.version, 2);
}

// A dangling backward.op is registered, with a warning that lasts until the
// backward op exists (in the same namespace).
TEST_F(RegistryTest, DanglingBackwardOpIsAWarning) {
  OpDef fwd = ValidDef("square");
  fwd.backward.op = "square_grad";
  fwd.backward.inputs = {"dout"};  // ValidDef's one input and output: square_grad(dout) -> dx
  fwd.output_rules.push_back({});  // a rule: no output_rules warning
  auto r = reg_->Register(fwd);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->created);
  EXPECT_THAT(reg_->Warnings(r->record.def),
              ::testing::ElementsAre(
                  "backward.op: \"square_grad\" is not a registered op in namespace \"default\"; "
                  "the op is registered, but its backward fails until \"square_grad\" is "
                  "registered"));
  // The same name in another namespace does not count.
  OpDef other = ValidDef("square_grad");
  other.ns = "team";
  MustRegister(other);
  EXPECT_EQ(reg_->Warnings(fwd).size(), 1u);
  MustRegister(ValidDef("square_grad"));
  EXPECT_TRUE(reg_->Warnings(fwd).empty());
  // Deleting the backward op brings the warning back.
  ASSERT_TRUE(reg_->Delete("default", "square_grad", 0).ok());
  EXPECT_EQ(reg_->Warnings(fwd).size(), 1u);
  // No backward and a rule: nothing to warn about.
  OpDef plain = ValidDef("plain");
  plain.output_rules.push_back({});
  EXPECT_TRUE(reg_->Warnings(plain).empty());
  // No rule: the rule assumed is said (issue 29).
  EXPECT_THAT(reg_->Warnings(ValidDef("plain")),
              ::testing::ElementsAre(::testing::StartsWith(
                  "output_rules: none given, and the CPU kernel exports no \"")));
}

TEST_F(RegistryTest, QuotasOnOpsAndVersions) {
  Registry::Options options{.db_path = path_, .max_ops_per_namespace = 2, .max_versions_per_op = 2};
  reg_.reset();
  auto reg = Registry::Create(options);
  ASSERT_TRUE(reg.ok()) << reg.status();
  reg_ = std::move(*reg);
  MustRegister(ValidDef("a"));
  MustRegister(ValidDef("b"));
  auto third = reg_->Register(ValidDef("c"));
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  auto why = GetReason(third.status());
  ASSERT_TRUE(why.has_value());
  EXPECT_EQ(why->reason, reason::kQuotaExceeded);
  EXPECT_EQ(why->metadata["quota"], "ops");
  // Another namespace has its own count; a known op is not a new one.
  OpDef other = ValidDef("c");
  other.ns = "team";
  MustRegister(other);
  EXPECT_EQ(MustRegister(WithDoc(ValidDef("a"), "2")).record.version, 2);
  auto v3 = reg_->Register(WithDoc(ValidDef("a"), "3"));
  ASSERT_FALSE(v3.ok());
  EXPECT_EQ(GetReason(v3.status())->metadata["quota"], "versions");
  // Re-registering the latest is not a new version, so the quota does not apply.
  EXPECT_FALSE(MustRegister(WithDoc(ValidDef("a"), "2")).created);
  ASSERT_TRUE(reg_->Delete("default", "a", 1).ok());
  EXPECT_EQ(MustRegister(WithDoc(ValidDef("a"), "3")).record.version, 3);
  EXPECT_EQ(reg_->Size(), 3u);
}

TEST(RegistryCreateTest, Errors) {
  auto empty = Registry::Create({});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  auto unknown = Registry::Create({.db_path = "/nonexistent/r.db", .backend = "etcd"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("etcd"));
  TempDir dir;
  std::string path = dir.File("r.db");
  {
    std::ofstream f(path);
    for (int i = 0; i < 500; ++i) f << "garbage garbage garbage ";
  }
  auto bad = Registry::Create({.db_path = path});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path));
}

TEST_F(RegistryTest, ConcurrentRegisterAndRead) {
  constexpr int kWriters = 4;
  constexpr int kPerWriter = 10;
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      for (int i = 0; i < kPerWriter; ++i) {
        // Every writer also re-registers a shared op: exactly one creates it.
        OpDef shared = ValidDef("shared");
        auto s = reg_->Register(shared);
        auto r = reg_->Register(ValidDef("op_" + std::to_string(w) + "_" + std::to_string(i)));
        if (!s.ok() || !r.ok() || !r->created || r->record.version != 1) ++failures;
      }
    });
  }
  std::thread reader([&] {
    while (!done.load()) {
      for (const OpRecord& rec : reg_->List("", true)) {
        if (rec.content_hash != ContentHash(rec.def)) ++failures;
      }
      (void)reg_->Get("default", "shared", 0);
    }
  });
  for (auto& t : threads) t.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(reg_->Size(), static_cast<size_t>(kWriters * kPerWriter + 1));
  EXPECT_EQ(reg_->List("default", true).size(), static_cast<size_t>(kWriters * kPerWriter + 1));
}

// The definition the crash test's child registers as op `i`.
OpDef CrashDef(int i) {
  OpDef def = ValidDef("op_" + std::to_string(i));
  // A larger source makes each commit write several pages, so a kill is
  // likely to land in the middle of one.
  def.implementations[0].source += "// " + std::string(5000 + i, 'k') + "\n";
  return def;
}

bool WriteAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += n;
  }
  return true;
}

TEST(RegistryCrashTest, KillNineLosesNothingAcknowledged) {
  SetLogLevel("warn");
  TempDir dir;
  std::string path = dir.File("registry.db");
  constexpr int kKillAfter = 200;

  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: register ops until killed; acknowledge each after Register returns.
    close(fds[0]);
    signal(SIGPIPE, SIG_DFL);
    auto reg = Registry::Create({.db_path = path});
    if (!reg.ok()) {
      WriteAll(fds[1], "ERR " + reg.status().ToString() + "\n");
      _exit(2);
    }
    for (int i = 0; i < 100000; ++i) {
      auto r = (*reg)->Register(CrashDef(i));
      if (!r.ok()) {
        WriteAll(fds[1], "ERR " + r.status().ToString() + "\n");
        _exit(3);
      }
      if (!WriteAll(fds[1], std::to_string(i) + "\n")) _exit(4);
    }
    _exit(0);
  }

  close(fds[1]);
  std::vector<int> acked;
  std::string buf;
  bool killed = false;
  char chunk[4096];
  for (;;) {
    ssize_t n = read(fds[0], chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the child is gone
    buf.append(chunk, n);
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      ASSERT_EQ(line.rfind("ERR", 0), std::string::npos) << line;
      acked.push_back(std::stoi(line));
    }
    if (!killed && acked.size() >= kKillAfter) {
      ASSERT_EQ(kill(pid, SIGKILL), 0);
      killed = true;
    }
  }
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  ASSERT_GE(acked.size(), static_cast<size_t>(kKillAfter));

  // Every acknowledged op is there and intact; at most one more (committed
  // but not yet acknowledged when the kill landed).
  auto store = SqliteStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto records = (*store)->LoadAll();  // parses every row and checks its hash
  ASSERT_TRUE(records.ok()) << records.status();
  std::set<std::string> stored;
  for (const OpRecord& rec : *records) {
    EXPECT_EQ(rec.content_hash, ContentHash(rec.def));
    auto reparsed = FromJson(ToJson(rec.def));
    ASSERT_TRUE(reparsed.ok());
    stored.insert(rec.def.name);
  }
  for (int i : acked) {
    std::string name = "op_" + std::to_string(i);
    ASSERT_TRUE(stored.count(name)) << name << " was acknowledged but is missing";
  }
  EXPECT_LE(records->size(), acked.size() + 1);
  store->reset();

  auto reg = Registry::Create({.db_path = path});
  ASSERT_TRUE(reg.ok()) << reg.status();
  for (int i : acked) {
    auto rec = (*reg)->Get("default", "op_" + std::to_string(i), 0);
    ASSERT_TRUE(rec.ok()) << rec.status();
    EXPECT_EQ(rec->def, CrashDef(i));
    EXPECT_EQ(rec->version, 1);
  }
  // The registry still takes writes after the crash.
  auto more = (*reg)->Register(CrashDef(1000000));
  EXPECT_TRUE(more.ok()) << more.status();
}

}  // namespace
}  // namespace opjit::registry

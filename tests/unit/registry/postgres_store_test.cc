// The registry on a shared PostgreSQL database: several Registry instances
// (standing in for daemons) on one throwaway server (pg_fixture.h).
#include "server/registry/postgres_store.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iostream>
#include <latch>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/registry/canonical.h"
#include "server/registry/registry.h"
#include "spdlog/sinks/base_sink.h"
#include "tests/unit/registry/pg_fixture.h"
#include "tests/unit/registry/test_util.h"

namespace opjit::registry {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::PgTest;
using testing::ValidDef;
using Clock = std::chrono::steady_clock;

constexpr char kPassword[] = "pw-Secret-4711";

OpDef WithDoc(OpDef def, const std::string& doc) {
  def.doc = doc;
  return def;
}

OpDef InNs(OpDef def, const std::string& ns) {
  def.ns = ns;
  return def;
}

int64_t MsSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// Checks `cond` every millisecond until it holds; the milliseconds that took,
// or -1 when it still does not hold after `limit_ms`. (A change made by
// another daemon arrives asynchronously: there is nothing to wait on but the
// registry's own state.)
template <typename F>
int64_t MsUntil(F cond, int64_t limit_ms = 5000) {
  const Clock::time_point start = Clock::now();
  for (;;) {
    if (cond()) return MsSince(start);
    if (MsSince(start) > limit_ms) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string Reason(const absl::Status& s) {
  auto r = GetReason(s);
  return r ? r->reason : "";
}

// Captures what Logger("registry") writes while it lives. Create it before
// any thread that logs, and let those end before it does.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<Sink>()) {
    sink_->set_pattern("%v");
    Logger("registry")->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = Logger("registry")->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::string text() { return sink_->text(); }

 private:
  class Sink final : public spdlog::sinks::base_sink<std::mutex> {
   public:
    std::string text() {
      std::lock_guard<std::mutex> lock(mutex_);
      return text_;
    }

   protected:
    void sink_it_(const spdlog::details::log_msg& msg) override {
      text_.append(msg.payload.data(), msg.payload.size());
      text_ += '\n';
    }
    void flush_() override {}

   private:
    std::string text_;
  };
  std::shared_ptr<Sink> sink_;
};

// One stand-in daemon: a Registry with a counting change listener.
struct Daemon {
  std::unique_ptr<Registry> reg;
  std::shared_ptr<std::atomic<int>> changes = std::make_shared<std::atomic<int>>(0);
};

class PostgresRegistryTest : public PgTest {
 protected:
  void SetUp() override {
    PgTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    SetLogLevel("warn");
    url_ = NewDatabase();
    ASSERT_FALSE(url_.empty());
  }

  Registry::Options Options(int64_t poll_ms = 60000) const {
    Registry::Options o;
    o.backend = "postgres";
    o.url = url_;
    o.password = kPassword;  // trust auth ignores it; it must never show
    o.poll_ms = poll_ms;
    return o;
  }

  Daemon Open(const Registry::Options& options) {
    Daemon d;
    auto reg = Registry::Create(options);
    EXPECT_TRUE(reg.ok()) << reg.status();
    if (reg.ok()) {
      d.reg = std::move(*reg);
      d.reg->SetChangeListener([c = d.changes] { c->fetch_add(1); });
    }
    return d;
  }
  Daemon Open(int64_t poll_ms = 60000) { return Open(Options(poll_ms)); }

  static Registry::RegisterResult MustRegister(Registry& reg, const OpDef& def) {
    auto r = reg.Register(def);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : Registry::RegisterResult{};
  }

  static bool Has(const Registry& reg, const std::string& ns, const std::string& name,
                  int64_t version) {
    return reg.GetShared(ns, name, version).ok();
  }

  std::string Db() const { return url_.substr(url_.rfind('/') + 1); }
  // The rows of op `name` in the database.
  std::string CountRows(const std::string& name) {
    auto n = server()->Query(
        Db(), absl::StrCat("SELECT count(*) FROM opjit_op_versions WHERE name = '", name, "'"));
    EXPECT_TRUE(n.ok()) << n.status();
    return n.ok() ? *n : "?";
  }

  std::string url_;
};

TEST_F(PostgresRegistryTest, RegisterGetDeleteRoundTrip) {
  Daemon a = Open();
  ASSERT_NE(a.reg, nullptr);
  Registry& reg = *a.reg;

  auto first = MustRegister(reg, ValidDef());
  EXPECT_TRUE(first.created);
  EXPECT_EQ(first.record.version, 1);
  EXPECT_EQ(first.record.content_hash, ContentHash(ValidDef()));
  auto again = MustRegister(reg, ValidDef());  // idempotent
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.record.version, 1);
  EXPECT_EQ(again.record.created_unix_ms, first.record.created_unix_ms);
  EXPECT_EQ(again.record.def, ValidDef());

  auto second = MustRegister(reg, WithDoc(ValidDef(), "second"));
  EXPECT_TRUE(second.created);
  EXPECT_EQ(second.record.version, 2);
  EXPECT_EQ(reg.Get("default", "leaky_relu", 0)->def, WithDoc(ValidDef(), "second"));
  EXPECT_EQ(reg.Get("default", "leaky_relu", 1)->def, ValidDef());
  EXPECT_EQ(reg.List("", true).size(), 2u);

  auto one = reg.Delete("default", "leaky_relu", 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, 1);
  EXPECT_EQ(reg.Get("default", "leaky_relu", 1).status().message(),
            "op \"default/leaky_relu\" has no version 1 (versions: 2)");
  auto gone = reg.Delete("default", "leaky_relu", 1);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(), "op \"default/leaky_relu\" has no version 1 (versions: 2)");
  EXPECT_EQ(Reason(gone.status()), reason::kVersionNotFound);

  // Everything is in the database: a fresh daemon sees the same.
  a.reg.reset();
  Daemon b = Open();
  ASSERT_NE(b.reg, nullptr);
  auto latest = b.reg->Get("default", "leaky_relu", 0);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->version, 2);
  EXPECT_EQ(latest->created_unix_ms, second.record.created_unix_ms);
  EXPECT_EQ(latest->def, second.record.def);
  // Going back to version 1's definition is a new version: 3, not 1.
  EXPECT_EQ(MustRegister(*b.reg, ValidDef()).record.version, 3);
  auto all = b.reg->Delete("default", "leaky_relu", 0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, 2);
  EXPECT_EQ(b.reg->Size(), 0u);
  auto none = b.reg->Delete("default", "leaky_relu", 0);
  EXPECT_EQ(none.status().message(), "op \"default/leaky_relu\" not found");
  EXPECT_EQ(MustRegister(*b.reg, ValidDef()).record.version, 4);
}

// A registration through one daemon reaches another by NOTIFY (its poll
// interval is a minute, so nothing else could deliver it in time), the
// listener fires, generation() moves, and a daemon's own writes cause no
// reload.
TEST_F(PostgresRegistryTest, ChangesReachOtherDaemonsByNotify) {
  Daemon a = Open();
  Daemon b = Open();
  ASSERT_NE(a.reg, nullptr);
  ASSERT_NE(b.reg, nullptr);
  constexpr int kOps = 20;
  constexpr int64_t kBoundMs = 1000;
  std::vector<int64_t> latencies;
  for (int i = 0; i < kOps; ++i) {
    const std::string name = absl::StrCat("op_", i);
    const uint64_t gen_before = b.reg->generation();
    const int changes_before = b.changes->load();
    const Clock::time_point start = Clock::now();
    auto r = MustRegister(*a.reg, ValidDef(name));
    ASSERT_TRUE(r.created);
    int64_t ms = MsUntil([&] { return Has(*b.reg, "default", name, 1); });
    ASSERT_GE(ms, 0) << name << " never reached the other daemon";
    latencies.push_back(MsSince(start));
    // generation() moves, and the listener runs, right after the change is
    // visible to Get.
    EXPECT_GE(MsUntil([&] {
                return b.reg->generation() > gen_before && b.changes->load() > changes_before;
              }),
              0);
    EXPECT_EQ(b.reg->Get("default", name, 0)->def, ValidDef(name));
  }
  std::sort(latencies.begin(), latencies.end());
  std::cout << "register -> visible in the other daemon (NOTIFY): median " << latencies[kOps / 2]
            << " ms, max " << latencies.back() << " ms over " << kOps << " ops\n";
  RecordProperty("notify_median_ms", static_cast<int>(latencies[kOps / 2]));
  RecordProperty("notify_max_ms", static_cast<int>(latencies.back()));
  EXPECT_LT(latencies.back(), kBoundMs);
  EXPECT_EQ(b.reg->reloads(), static_cast<uint64_t>(kOps));

  // Deletes travel the same way.
  ASSERT_TRUE(a.reg->Delete("default", "op_0", 0).ok());
  EXPECT_GE(MsUntil([&] { return !Has(*b.reg, "default", "op_0", 0); }, kBoundMs), 0);

  // B writes; once A has reloaded for it, A has also read the notifications
  // of its own writes (they came first on the same connection): none of
  // those caused a reload, and each of its writes fired its listener once.
  ASSERT_TRUE(MustRegister(*b.reg, ValidDef("from_b")).created);
  ASSERT_GE(MsUntil([&] { return Has(*a.reg, "default", "from_b", 1); }, kBoundMs), 0);
  // The reload is counted, and the listener fired, just after the change
  // became visible.
  EXPECT_GE(
      MsUntil([&] { return a.reg->reloads() >= 1 && a.changes->load() >= kOps + 2; }, kBoundMs), 0);
  EXPECT_EQ(a.reg->reloads(), 1u);
  EXPECT_EQ(a.changes->load(), kOps + 1 + 1);  // its registrations, its delete, B's op
}

// A lost notification (simulated: a change committed with the generation
// bumped but no NOTIFY) is picked up by the poll within about poll_ms.
TEST_F(PostgresRegistryTest, PollCatchesAChangeWithoutNotify) {
  constexpr int64_t kPollMs = 200;
  Daemon a = Open(kPollMs);
  ASSERT_NE(a.reg, nullptr);
  OpDef def = ValidDef("sneaky");
  std::string json = ToJson(def);
  ASSERT_EQ(json.find("$j$"), std::string::npos);
  std::string db = url_.substr(url_.rfind('/') + 1);
  const Clock::time_point start = Clock::now();
  auto r = server()->Query(
      db, absl::StrCat("BEGIN; INSERT INTO opjit_op_versions VALUES ('default', 'sneaky', 1, '",
                       ContentHash(def), "', $j$", json,
                       "$j$, 1700000000000); INSERT INTO opjit_op_high_water VALUES ('default', "
                       "'sneaky', 1); UPDATE opjit_generation SET generation = generation + 1; "
                       "COMMIT"));
  ASSERT_TRUE(r.ok()) << r.status();
  int64_t ms = MsUntil([&] { return Has(*a.reg, "default", "sneaky", 1); });
  ASSERT_GE(ms, 0);
  std::cout << "change without NOTIFY visible after " << MsSince(start) << " ms (poll_ms "
            << kPollMs << ")\n";
  EXPECT_LE(MsSince(start), kPollMs + 500);
  EXPECT_EQ(a.reg->Get("default", "sneaky", 0)->def, def);
  EXPECT_EQ(a.reg->reloads(), 1u);
}

// Registrations of one op from many threads in three daemons: the same
// definition gets one version, different definitions get distinct versions
// that continue the high-water mark without gaps, and all daemons converge.
TEST_F(PostgresRegistryTest, ConcurrentRegistrationsAgreeAcrossDaemons) {
  std::vector<Daemon> daemons;
  for (int i = 0; i < 3; ++i) {
    daemons.push_back(Open());
    ASSERT_NE(daemons.back().reg, nullptr);
  }
  // Raise the high-water mark to 1 and leave no live version.
  ASSERT_EQ(MustRegister(*daemons[0].reg, WithDoc(ValidDef("contended"), "seed")).record.version,
            1);
  ASSERT_TRUE(daemons[0].reg->Delete("default", "contended", 0).ok());

  constexpr int kThreads = 12;
  std::latch go(kThreads);
  std::mutex mu;
  std::vector<Registry::RegisterResult> same, distinct;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Registry& reg = *daemons[t % daemons.size()].reg;
      go.arrive_and_wait();
      auto s = reg.Register(ValidDef("same"));
      auto d = reg.Register(WithDoc(ValidDef("contended"), absl::StrCat("thread ", t)));
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(s.ok()) << s.status();
      EXPECT_TRUE(d.ok()) << d.status();
      if (s.ok()) same.push_back(*s);
      if (d.ok()) distinct.push_back(*d);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(same.size(), static_cast<size_t>(kThreads));
  ASSERT_EQ(distinct.size(), static_cast<size_t>(kThreads));

  int created = 0;
  for (const auto& r : same) {
    EXPECT_EQ(r.record.version, 1);
    EXPECT_EQ(r.record.created_unix_ms, same[0].record.created_unix_ms);
    created += r.created;
  }
  EXPECT_EQ(created, 1);

  std::vector<int64_t> versions;
  for (const auto& r : distinct) {
    EXPECT_TRUE(r.created);
    versions.push_back(r.record.version);
  }
  std::sort(versions.begin(), versions.end());
  std::vector<int64_t> want(kThreads);
  std::iota(want.begin(), want.end(), 2);  // after the high-water mark 1
  EXPECT_EQ(versions, want);

  // Every daemon ends up with the same versions and definitions.
  for (Daemon& d : daemons) {
    EXPECT_GE(MsUntil([&] {
                return d.reg->List("default", true).size() == static_cast<size_t>(kThreads + 1);
              }),
              0);
    for (const auto& r : distinct) {
      auto got = d.reg->Get("default", "contended", r.record.version);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->def, r.record.def);
    }
    EXPECT_EQ(d.reg->List("default", true).size(), static_cast<size_t>(kThreads + 1));
  }
}

// Quotas hold across daemons, because the store checks them in the
// registering transaction, not against a daemon's possibly stale memory.
TEST_F(PostgresRegistryTest, QuotasAreEnforcedInTheTransaction) {
  Registry::Options options = Options();
  options.max_ops_per_namespace = 4;
  options.max_versions_per_op = 3;
  Daemon a = Open(options);
  Daemon b = Open(options);
  ASSERT_NE(a.reg, nullptr);
  ASSERT_NE(b.reg, nullptr);

  auto race = [&](auto make_def) {
    constexpr int kThreads = 8;
    std::latch go(kThreads);
    std::vector<absl::StatusOr<Registry::RegisterResult>> results(kThreads,
                                                                  absl::UnknownError("unset"));
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        Registry& reg = t % 2 ? *a.reg : *b.reg;
        go.arrive_and_wait();
        results[t] = reg.Register(make_def(t));
      });
    }
    for (auto& t : threads) t.join();
    return results;
  };

  // Eight new ops into a namespace that holds four.
  int ok = 0;
  for (const auto& r : race([](int t) { return InNs(ValidDef(absl::StrCat("op", t)), "q"); })) {
    if (r.ok()) {
      ++ok;
      continue;
    }
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    auto why = GetReason(r.status());
    ASSERT_TRUE(why.has_value());
    EXPECT_EQ(why->reason, reason::kQuotaExceeded);
    EXPECT_EQ(why->metadata["quota"], "ops");
    EXPECT_EQ(why->metadata["limit"], "4");
  }
  EXPECT_EQ(ok, 4);

  // Eight definitions of one op that may keep three versions.
  std::vector<int64_t> versions;
  for (const auto& r :
       race([](int t) { return InNs(WithDoc(ValidDef("v"), absl::StrCat("doc ", t)), "qv"); })) {
    if (r.ok()) {
      versions.push_back(r->record.version);
      continue;
    }
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_EQ(GetReason(r.status())->metadata["quota"], "versions");
  }
  std::sort(versions.begin(), versions.end());
  EXPECT_EQ(versions, (std::vector<int64_t>{1, 2, 3}));
  // Deleting one makes room again, through either daemon.
  ASSERT_TRUE(a.reg->Delete("qv", "v", 1).ok());
  auto more = b.reg->Register(InNs(WithDoc(ValidDef("v"), "after delete"), "qv"));
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(more->record.version, 4);
}

// A delete through one daemon and a registration through another: the
// version numbers of deleted versions never come back.
TEST_F(PostgresRegistryTest, DeleteThenRegisterNeverReusesAVersion) {
  Daemon a = Open();
  Daemon b = Open();
  ASSERT_NE(a.reg, nullptr);
  ASSERT_NE(b.reg, nullptr);
  EXPECT_EQ(MustRegister(*a.reg, ValidDef()).record.version, 1);
  EXPECT_EQ(MustRegister(*a.reg, WithDoc(ValidDef(), "2")).record.version, 2);
  // B deletes without waiting to have seen version 2: the store decides.
  auto del = b.reg->Delete("default", "leaky_relu", 2);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(*del, 1);
  // Version 1 (ValidDef) is the latest again; "2" differs from it: version 3.
  EXPECT_EQ(MustRegister(*a.reg, WithDoc(ValidDef(), "2")).record.version, 3);
  ASSERT_TRUE(b.reg->Delete("default", "leaky_relu", 0).ok());
  EXPECT_EQ(MustRegister(*a.reg, ValidDef()).record.version, 4);
  EXPECT_GE(MsUntil([&] { return Has(*b.reg, "default", "leaky_relu", 4); }), 0);
  EXPECT_FALSE(Has(*b.reg, "default", "leaky_relu", 1));
  EXPECT_FALSE(Has(*b.reg, "default", "leaky_relu", 3));
  auto missing = b.reg->Delete("default", "leaky_relu", 3);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "op \"default/leaky_relu\" has no version 3 (versions: 4)");
}

// The database goes away (killed) and comes back: writes fail fast with
// UNAVAILABLE/STORE_UNAVAILABLE, reads keep working, the probe fails; after
// the restart writes work again and changes flow between daemons again.
TEST_F(PostgresRegistryTest, DatabaseDownAndBack) {
  Daemon a = Open(/*poll_ms=*/300);
  Daemon b = Open(/*poll_ms=*/300);
  ASSERT_NE(a.reg, nullptr);
  ASSERT_NE(b.reg, nullptr);
  MustRegister(*a.reg, ValidDef("before"));
  ASSERT_TRUE(a.reg->ProbeStore().ok());
  ASSERT_GE(MsUntil([&] { return Has(*b.reg, "default", "before", 1); }), 0);

  ASSERT_TRUE(server()->Stop(/*immediate=*/true).ok());
  for (int i = 0; i < 3; ++i) {  // the first finds the old connection dead, the rest cannot connect
    const Clock::time_point start = Clock::now();
    auto r = a.reg->Register(ValidDef(absl::StrCat("during_", i)));
    const int64_t ms = MsSince(start);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_EQ(Reason(r.status()), reason::kStoreUnavailable);
    const std::string msg(r.status().message());
    EXPECT_THAT(msg, Not(HasSubstr(kPassword)));
    EXPECT_THAT(msg, Not(HasSubstr(absl::StrCat(server()->port()))));
    EXPECT_THAT(msg, Not(HasSubstr("postgresql://")));
    EXPECT_LT(ms, 1000) << "register " << i << " took " << ms << " ms";
    std::cout << "register while down " << i << ": " << ms << " ms\n";
  }
  auto del = b.reg->Delete("default", "before", 0);
  EXPECT_EQ(del.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(a.reg->ProbeStore().ok());
  // Reads are served from memory.
  auto got = a.reg->Get("default", "before", 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->def, ValidDef("before"));
  EXPECT_EQ(b.reg->List("", true).size(), 1u);

  ASSERT_TRUE(server()->Restart().ok());
  const Clock::time_point start = Clock::now();
  int64_t ms = MsUntil([&] { return a.reg->Register(ValidDef("after")).ok(); }, 10000);
  ASSERT_GE(ms, 0) << "writes did not work again after the restart";
  std::cout << "writes work again " << MsSince(start) << " ms after the restart\n";
  EXPECT_TRUE(a.reg->ProbeStore().ok());
  // B's sync connection came back too.
  EXPECT_GE(MsUntil([&] { return Has(*b.reg, "default", "after", 1); }, 5000), 0);
  ASSERT_TRUE(MustRegister(*b.reg, ValidDef("after_b")).created);
  EXPECT_GE(MsUntil([&] { return Has(*a.reg, "default", "after_b", 1); }, 5000), 0);
  EXPECT_FALSE(Has(*a.reg, "default", "during_0", 0));
}

// Three daemons starting at once on an empty database create the schema
// once between them; a schema from a newer opjit is refused; a tampered row
// is DATA_LOSS.
TEST_F(PostgresRegistryTest, SchemaCreationAndChecks) {
  std::vector<absl::StatusOr<std::unique_ptr<Registry>>> regs;
  for (int i = 0; i < 3; ++i) regs.emplace_back(absl::UnknownError("unset"));
  {
    std::latch go(3);
    std::vector<std::thread> threads;
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back([&, i] {
        go.arrive_and_wait();
        regs[i] = Registry::Create(Options());
      });
    }
    for (auto& t : threads) t.join();
  }
  for (auto& r : regs) ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE((*regs[0])->Register(ValidDef()).ok());
  regs.clear();

  std::string db = url_.substr(url_.rfind('/') + 1);
  ASSERT_TRUE(server()
                  ->Query(db,
                          "UPDATE opjit_op_versions SET def_json = "
                          "replace(def_json, 'alpha * x', 'beta * x')")
                  .ok());
  auto tampered = Registry::Create(Options());
  ASSERT_FALSE(tampered.ok());
  EXPECT_EQ(tampered.status().code(), absl::StatusCode::kDataLoss) << tampered.status();
  EXPECT_THAT(std::string(tampered.status().message()), HasSubstr("default/leaky_relu version 1"));

  ASSERT_TRUE(server()->Query(db, "UPDATE opjit_schema SET version = 99").ok());
  auto newer = Registry::Create(Options());
  ASSERT_FALSE(newer.ok());
  EXPECT_EQ(newer.status().code(), absl::StatusCode::kFailedPrecondition) << newer.status();
  EXPECT_THAT(std::string(newer.status().message()), HasSubstr("schema version 99"));
}

// The database hangs (every PostgreSQL process stopped with SIGSTOP: TCP is
// accepted and ACKed, nothing answers) under a daemon whose url bounds a call
// to 3 s and connecting to 1 s: a registration fails with UNAVAILABLE /
// STORE_UNAVAILABLE within the bound, the hang is logged while it lasts,
// and once the server runs again the registration never appears; the next
// one succeeds.
TEST_F(PostgresRegistryTest, FrozenServerWriteFailsFastAndNeverLands) {
  LogCapture log;
  Registry::Options options = Options();
  options.url = url_ + "?connect_timeout=1&options=-c%20statement_timeout%3D3000";
  Daemon a = Open(options);
  ASSERT_NE(a.reg, nullptr);
  ASSERT_TRUE(MustRegister(*a.reg, ValidDef("before")).created);  // a healthy write commits

  ASSERT_TRUE(server()->Freeze().ok());
  const char* names[] = {"frozen", "frozen_reconnect"};  // on the old connection, then connecting
  for (const char* name : names) {
    const Clock::time_point start = Clock::now();
    auto r = a.reg->Register(ValidDef(name));
    const int64_t ms = MsSince(start);
    std::cout << "register with the server frozen (" << name << "): " << ms << " ms\n";
    RecordProperty(absl::StrCat(name, "_ms"), static_cast<int>(ms));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    EXPECT_EQ(Reason(r.status()), reason::kStoreUnavailable);
    const std::string msg(r.status().message());
    EXPECT_THAT(msg, Not(HasSubstr(kPassword)));
    EXPECT_THAT(msg, Not(HasSubstr(absl::StrCat(server()->port()))));
    EXPECT_THAT(msg, Not(HasSubstr("postgresql://")));
    EXPECT_LT(ms, 15000) << name;
    // It waited for the server rather than failing on something else.
    EXPECT_GE(ms, 900) << name << ": " << r.status();
  }
  // Reads are served from memory meanwhile.
  EXPECT_TRUE(Has(*a.reg, "default", "before", 1));
  const std::string logged = log.text();
  EXPECT_THAT(logged, HasSubstr("PostgreSQL has not answered for"));
  EXPECT_THAT(logged, HasSubstr("(registering an op)"));
  EXPECT_THAT(logged, HasSubstr("(connecting)"));
  EXPECT_THAT(logged, Not(HasSubstr(kPassword)));

  ASSERT_TRUE(server()->Thaw().ok());
  std::this_thread::sleep_for(std::chrono::seconds(3));
  EXPECT_EQ(CountRows("frozen"), "0");
  EXPECT_EQ(CountRows("frozen_reconnect"), "0");
  const Clock::time_point start = Clock::now();
  ASSERT_GE(MsUntil([&] { return a.reg->Register(ValidDef("after")).ok(); }, 10000), 0)
      << "writes did not work again after the server resumed";
  std::cout << "writes work again " << MsSince(start) << " ms after the server resumed\n";
  // Nothing of the refused registration was left behind: version 1.
  EXPECT_EQ(MustRegister(*a.reg, ValidDef("frozen")).record.version, 1);
  EXPECT_EQ(CountRows("frozen"), "1");
}

// The worst moment: the server freezes after answering a write's last
// statement, and the COMMIT goes into its socket unanswered. The caller is
// told UNAVAILABLE (STORE_OUTCOME_UNKNOWN) within the bound; when the server runs again it executes
// that COMMIT, and the commit guard refuses it (its deadline has passed), so
// the write never lands. Without the guard the row would be there. The
// backends are resumed before the postmaster, so that the store's cancel
// request (held by the frozen postmaster) cannot be what stopped it.
TEST_F(PostgresRegistryTest, FrozenBeforeCommitNeverLandsLater) {
  SetLogLevel("info");
  LogCapture log;
  std::atomic<bool> freeze{false};
  absl::Status freeze_status;
  PostgresStore::Options options;
  options.url = url_;
  options.password = kPassword;
  options.timeout_ms = 3000;
  options.connect_timeout_ms = 1000;
  options.before_commit_for_test = [&] {
    if (freeze.exchange(false)) freeze_status = server()->Freeze();
  };
  auto opened = PostgresStore::Open(options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  PostgresStore& store = **opened;
  EXPECT_EQ(store.timeout_ms(), 3000);
  EXPECT_EQ(store.connect_timeout_ms(), 1000);
  auto write = [&](const std::string& name) {
    return store.RegisterVersion(ValidDef(name), ContentHash(ValidDef(name)), 1700000000000, {});
  };

  // Healthy: committed and acknowledged, guard and all.
  auto healthy = write("healthy");
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(healthy->created);
  EXPECT_EQ(CountRows("healthy"), "1");
  auto generation = server()->Query(Db(), "SELECT generation FROM opjit_generation");
  ASSERT_TRUE(generation.ok());

  freeze = true;
  const Clock::time_point start = Clock::now();
  auto late = write("late");
  const int64_t ms = MsSince(start);
  ASSERT_TRUE(freeze_status.ok()) << freeze_status;
  ASSERT_TRUE(server()->frozen());
  std::cout << "register with the server frozen before COMMIT: " << ms << " ms\n";
  RecordProperty("unanswered_commit_ms", static_cast<int>(ms));
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();
  // The COMMIT was sent: not "refused", the outcome is unknown.
  EXPECT_EQ(Reason(late.status()), PostgresStore::kOutcomeUnknownReason);
  EXPECT_LT(ms, 15000);
  EXPECT_THAT(log.text(), HasSubstr("PostgreSQL has not answered for"));

  ASSERT_TRUE(server()->Thaw(/*postmaster=*/false).ok());
  const int64_t refused = MsUntil(
      [&] {
        return server()->ServerLog().find("the commit deadline has passed") != std::string::npos;
      },
      10000);
  EXPECT_GE(refused, 0) << "the resumed server never ran the guard:\n" << server()->ServerLog();
  ASSERT_TRUE(server()->Thaw().ok());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_EQ(CountRows("late"), "0");
  EXPECT_EQ(server()->Query(Db(), "SELECT generation FROM opjit_generation").value_or("?"),
            *generation);

  // The store works again, and tells what became of the unanswered COMMIT.
  ASSERT_GE(MsUntil([&] { return write("after").ok(); }, 10000), 0);
  EXPECT_THAT(log.text(), HasSubstr("was rolled back"));
  EXPECT_THAT(log.text(), Not(HasSubstr("committed after all")));
  auto again = write("late");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->record.version, 1);
  opened->reset();
  SetLogLevel("warn");
}

// Timeouts given in the url are used, within bounds; a call holding the
// connection makes the next one wait at most the bound.
TEST_F(PostgresRegistryTest, UrlTimeoutsAreBounded) {
  struct Case {
    std::string query;
    int64_t timeout_ms;
    int64_t connect_ms;
  };
  const Case cases[] = {
      {"", 10000, 5000},
      {"?options=-c%20statement_timeout%3D2s%20-c%20lock_timeout%3D1h&connect_timeout=2", 2000,
       2000},
      {"?options=--statement-timeout%3D750", 750, 5000},
      {"?options=-c%20statement_timeout%3D0&connect_timeout=0", 60000, 30000},  // 0: no limit
      {"?options=-cstatement_timeout%3D5min&connect_timeout=600", 60000, 30000},
      {"?options=-c%20statement_timeout%3D5%20-c%20work_mem%3D8MB", 200, 5000},
  };
  for (const Case& c : cases) {
    PostgresStore::Options o;
    o.url = url_ + c.query;
    auto store = PostgresStore::Open(o);
    ASSERT_TRUE(store.ok()) << c.query << ": " << store.status();
    EXPECT_EQ((*store)->timeout_ms(), c.timeout_ms) << c.query;
    EXPECT_EQ((*store)->connect_timeout_ms(), c.connect_ms) << c.query;
    EXPECT_TRUE((*store)->Probe().ok()) << c.query;
  }
  PostgresStore::Options bad;
  bad.url = url_ + "?options=-c%20statement_timeout%3Dsoon";
  EXPECT_EQ(PostgresStore::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.url = url_ + "?keepalives_idle=often";
  EXPECT_EQ(PostgresStore::Open(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// Errors from options and from an unreachable server: no password, no URL.
TEST(PostgresRegistryCreateTest, ErrorsNeverQuoteSecrets) {
  SetLogLevel("off");
  Registry::Options o;
  o.backend = "postgres";
  auto empty = Registry::Create(o);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);

  o.url = "host=127.0.0.1 password='url-Secret-1 dbname=x";  // unterminated quote
  auto bad = Registry::Create(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), Not(HasSubstr("url-Secret-1")));

  // A port nobody listens on (bound here, never listened to).
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  o.url = absl::StrCat("postgresql://opjit:url-Secret-2@127.0.0.1:", ntohs(addr.sin_port), "/db");
  o.password = kPassword;
  const Clock::time_point start = Clock::now();
  auto down = Registry::Create(o);
  close(fd);
  ASSERT_FALSE(down.ok());
  EXPECT_LT(MsSince(start), 3000);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  EXPECT_EQ(Reason(down.status()), reason::kStoreUnavailable);
  const std::string msg(down.status().message());
  EXPECT_THAT(msg, Not(HasSubstr("url-Secret-2")));
  EXPECT_THAT(msg, Not(HasSubstr(kPassword)));
  EXPECT_THAT(msg, Not(HasSubstr("postgresql://")));

  o.backend = "mysql";
  EXPECT_EQ(Registry::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace opjit::registry

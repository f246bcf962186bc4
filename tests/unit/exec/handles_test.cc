// Prepared handles: ownership, staleness when the registry changes, the
// per-namespace limit, release and expiry.
#include "server/exec/handles.h"

#include <unistd.h>

#include <filesystem>

#include "gtest/gtest.h"
#include "server/common/error_info.h"
#include "server/registry/registry.h"

namespace opjit::exec {
namespace {

registry::OpDef Def(const std::string& name, const std::string& doc) {
  registry::OpDef d;
  d.name = name;
  d.doc = doc;
  d.inputs.push_back({0, "x", registry::ParamType::kRequired});
  d.outputs.push_back({0, "y", registry::ParamType::kRequired});
  registry::DtypeFormat df;
  df.io = {{"float32", "DefaultFormat"}, {"float32", "DefaultFormat"}};
  d.dtype_formats.push_back(df);
  registry::Implementation impl;
  impl.language = "c++";
  impl.source = "int f;";
  impl.entry = "F";
  d.implementations.push_back(impl);
  return d;
}

class HandlesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/handles_test_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    auto r = registry::Registry::Create({.db_path = dir_ + "/registry.db"});
    ASSERT_TRUE(r.ok()) << r.status();
    registry_ = *std::move(r);
    ASSERT_TRUE(registry_->Register(Def("sq", "v1")).ok());
  }
  // A prepared call of `op` at `version` (0: latest) as the registry has it now.
  std::pair<ForwardCall, PreparedCall> Prepared(const std::string& op, int64_t version) {
    ForwardCall call;
    call.ns = "default";
    call.op = op;
    call.version = version;
    PreparedCall p;
    auto rec = registry_->GetShared("default", op, version);
    EXPECT_TRUE(rec.ok()) << rec.status();
    p.record = *rec;
    return {call, p};
  }
  std::shared_ptr<const Handle> Add(HandleTable& t, const std::string& owner, int64_t version = 0) {
    auto [call, p] = Prepared("sq", version);
    auto h = t.Add("default", owner, call, p, true);
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : nullptr;
  }
  static void ExpectStale(const absl::StatusOr<std::shared_ptr<const Handle>>& got) {
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
    auto why = GetReason(got.status());
    ASSERT_TRUE(why.has_value());
    EXPECT_EQ(why->reason, reason::kStaleHandle);
  }
  void TearDown() override {
    registry_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::string dir_;
  std::unique_ptr<registry::Registry> registry_;
};

TEST_F(HandlesTest, OnlyTheOwnerInItsNamespaceFindsAHandle) {
  HandleTable t({}, registry_.get());
  auto h = Add(t, "alice/c1");
  ASSERT_NE(h, nullptr);
  EXPECT_NE(h->id, 0u);
  auto got = t.Get("default", "alice/c1", h->id);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->id, h->id);
  ExpectStale(t.Get("default", "alice/c2", h->id));
  ExpectStale(t.Get("default", "bob/c1", h->id));
  ExpectStale(t.Get("other", "alice/c1", h->id));
  ExpectStale(t.Get("default", "alice/c1", h->id + 100));
  EXPECT_EQ(t.size(), 1u);
}

TEST_F(HandlesTest, ANewVersionMakesLatestHandlesStaleButNotPinnedOnes) {
  HandleTable t({}, registry_.get());
  auto latest = Add(t, "a/c");
  auto pinned = Add(t, "a/c", 1);
  ASSERT_TRUE(registry_->Register(Def("sq", "v2")).ok());
  ExpectStale(t.Get("default", "a/c", latest->id));
  EXPECT_TRUE(t.Get("default", "a/c", pinned->id).ok());
  EXPECT_EQ(t.size(), 1u) << "a stale handle is dropped";
  ASSERT_TRUE(registry_->Delete("default", "sq", 1).ok());
  ExpectStale(t.Get("default", "a/c", pinned->id));
  EXPECT_EQ(t.size(), 0u);
}

TEST_F(HandlesTest, TheNamespaceLimitIsQuotaExceededUntilHandlesAreReleased) {
  HandleTable t({.max_per_namespace = 2}, registry_.get());
  auto h1 = Add(t, "a/c");
  Add(t, "b/c");
  auto [call, p] = Prepared("sq", 0);
  auto third = t.Add("default", "a/c", call, p, true);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetReason(third.status())->reason, reason::kQuotaExceeded);
  EXPECT_TRUE(t.Add("other", "a/c", call, p, true).ok()) << "the limit is per namespace";
  EXPECT_EQ(t.Release("default", "b/c", {h1->id}), 0) << "only the owner releases";
  EXPECT_EQ(t.Release("default", "a/c", {h1->id}), 1);
  EXPECT_TRUE(t.Add("default", "a/c", call, p, true).ok());
  EXPECT_EQ(t.Release("default", "a/c", {}), 1);
  EXPECT_EQ(t.Release("default", "b/c", {}), 1);
  EXPECT_EQ(t.size(), 1u);
}

TEST_F(HandlesTest, HandlesOfOwnersWithoutRegionsExpireUnlessRenewed) {
  FakeClock clock;
  HandleTable t({.lease_ms = 3000, .clock = &clock}, registry_.get());
  auto kept = Add(t, "with-regions/c");
  auto gone = Add(t, "idle/c");
  auto renewed = Add(t, "busy/c");
  clock.Advance(std::chrono::milliseconds(2000));
  t.Renew("default", "busy/c");
  EXPECT_EQ(t.Expire([](const std::string&, const std::string&) { return false; }), 0)
      << "nothing lapsed yet";
  clock.Advance(std::chrono::milliseconds(1000));  // idle: 3000 ms, its whole lease
  const int n = t.Expire([](const std::string&, const std::string& owner) {
    return owner == "with-regions/c";
  });
  EXPECT_EQ(n, 1);
  EXPECT_TRUE(t.Get("default", "with-regions/c", kept->id).ok());
  ExpectStale(t.Get("default", "idle/c", gone->id));
  EXPECT_TRUE(t.Get("default", "busy/c", renewed->id).ok());
}

}  // namespace
}  // namespace opjit::exec

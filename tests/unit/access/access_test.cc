#include "server/access/access.h"

#include <gtest/gtest.h>

#include "server/access/quotas.h"
#include "server/common/error_info.h"
#include "server/common/sha256.h"

namespace opjit::access {
namespace {

AccessOptions TwoUsers() {
  AccessOptions o;
  o.daemon_uid = 1000;
  o.max_namespaces = 5;
  o.principals.push_back({.name = "alice", .role = Role::kUser, .namespaces = {"alice"},
                          .token_sha256 = {Sha256Hex("ta")}, .uids = {2001}});
  o.principals.push_back({.name = "carol", .role = Role::kReader, .namespaces = {"alice"},
                          .token_sha256 = {Sha256Hex("tc")}, .gids = {3000}});
  o.principals.push_back({.name = "root", .role = Role::kAdmin, .token_sha256 = {Sha256Hex("tr")}});
  return o;
}

PeerInfo Tcp(std::optional<std::string> auth) {
  PeerInfo p;
  p.transport = PeerInfo::Transport::kTcp;
  p.loopback = true;
  p.authorization = std::move(auth);
  return p;
}

PeerInfo Unix(uid_t uid, gid_t gid) {
  PeerInfo p;
  p.transport = PeerInfo::Transport::kUnix;
  p.uid = uid;
  p.gid = gid;
  p.pid = 42;
  return p;
}

TEST(AccessTest, EmbeddedDefaultMakesLocalCallersAdmin) {
  auto ac = AccessControl::Create({});
  ASSERT_TRUE(ac.ok());
  EXPECT_FALSE((*ac)->enabled());
  auto p = (*ac)->Authenticate(Unix(5555, 5555));
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE((*p)->admin());
  EXPECT_TRUE((*ac)->Authenticate(Tcp(std::nullopt)).ok());
}

TEST(AccessTest, TokensMapToPrincipals) {
  auto ac = AccessControl::Create(TwoUsers());
  ASSERT_TRUE(ac.ok()) << ac.status();
  auto alice = (*ac)->Authenticate(Tcp("Bearer ta"));
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ((*alice)->name, "alice");
  EXPECT_EQ((*ac)->Authenticate(Tcp("bearer  tc")).value()->name, "carol");
  for (auto bad : {std::optional<std::string>(), std::optional<std::string>("Bearer nope"),
                   std::optional<std::string>("Basic ta")}) {
    auto s = (*ac)->Authenticate(Tcp(bad));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(GetReason(s.status())->reason, "UNAUTHENTICATED");
  }
}

TEST(AccessTest, UnixPeersMapByUidThenGidAndTheOwnerIsAdmin) {
  auto ac = AccessControl::Create(TwoUsers());
  ASSERT_TRUE(ac.ok());
  EXPECT_EQ((*ac)->Authenticate(Unix(2001, 9)).value()->name, "alice");
  EXPECT_EQ((*ac)->Authenticate(Unix(7, 3000)).value()->name, "carol");
  EXPECT_TRUE((*ac)->Authenticate(Unix(1000, 1000)).value()->admin());
  EXPECT_TRUE((*ac)->Authenticate(Unix(0, 0)).value()->admin());
  EXPECT_EQ((*ac)->Authenticate(Unix(4444, 4444)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AccessTest, NamespacesAndRoles) {
  auto ac = AccessControl::Create(TwoUsers());
  ASSERT_TRUE(ac.ok());
  auto alice = *(*ac)->Authenticate(Tcp("Bearer ta"));
  auto carol = *(*ac)->Authenticate(Tcp("Bearer tc"));
  auto root = *(*ac)->Authenticate(Tcp("Bearer tr"));
  EXPECT_TRUE((*ac)->Check(*alice, "alice", Action::kWrite).ok());
  auto other = (*ac)->Check(*alice, "bob", Action::kDescribe);
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetReason(other)->reason, "NAMESPACE_NOT_FOUND");
  EXPECT_TRUE((*ac)->Check(*carol, "alice", Action::kCall).ok());
  auto denied = (*ac)->Check(*carol, "alice", Action::kWrite);
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(GetReason(denied)->metadata.at("role"), "reader");
  EXPECT_EQ((*ac)->Check(*alice, "alice", Action::kAdmin).code(),
            absl::StatusCode::kPermissionDenied);
  // default + alice exist; the admin creates up to 5 in all.
  EXPECT_EQ((*ac)->namespace_count(), 2u);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*ac)->Check(*root, "n" + std::to_string(i), Action::kWrite).ok());
  auto cap = (*ac)->Check(*root, "n9", Action::kWrite);
  EXPECT_EQ(cap.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetReason(cap)->metadata.at("quota"), "namespaces");
  EXPECT_TRUE((*ac)->Check(*root, "n9", Action::kDescribe).ok());  // reading creates nothing
}

TEST(AccessTest, BadConfigIsRefused) {
  AccessOptions o = TwoUsers();
  o.principals[1].token_sha256 = o.principals[0].token_sha256;
  EXPECT_EQ(AccessControl::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = TwoUsers();
  o.principals[0].name = "a/b";
  EXPECT_EQ(AccessControl::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = TwoUsers();
  o.principals[0].token_sha256 = {"not-hex"};
  EXPECT_EQ(AccessControl::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = TwoUsers();
  o.principals[0].namespaces.clear();
  EXPECT_EQ(AccessControl::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AccessTest, AMetricsPrincipalScrapesAllAndMayDoNothingOverGrpc) {
  AccessOptions o = TwoUsers();
  o.principals.push_back({.name = "prometheus", .role = Role::kMetrics, .token_sha256 = {Sha256Hex("tm")}});
  auto ac = AccessControl::Create(o);
  ASSERT_TRUE(ac.ok()) << ac.status();
  auto scraper = (*ac)->Authenticate(Tcp("Bearer tm"));
  ASSERT_TRUE(scraper.ok()) << scraper.status();
  EXPECT_EQ(RoleName((*scraper)->role), std::string("metrics"));
  EXPECT_TRUE((*scraper)->scrapes_all());
  EXPECT_FALSE((*scraper)->admin());
  auto alice = *(*ac)->Authenticate(Tcp("Bearer ta"));
  EXPECT_FALSE(alice->scrapes_all());
  for (Action a : {Action::kDescribe, Action::kCall, Action::kWrite}) {
    absl::Status s = (*ac)->Check(**scraper, "alice", a);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << ActionName(a);
    EXPECT_EQ(GetReason(s)->reason, "NAMESPACE_NOT_FOUND");
  }
  EXPECT_EQ((*ac)->Check(**scraper, "", Action::kAdmin).code(), absl::StatusCode::kPermissionDenied);
  // It scrapes every namespace, so it names none.
  o.principals.back().namespaces = {"alice"};
  EXPECT_EQ(AccessControl::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRole("metrics"), Role::kMetrics);
}

// A reload (SIGHUP): the next call sees the new principals; a call already
// authenticated keeps its Principal.
TEST(AccessTest, SetPrincipalsSwapsTheTableForTheNextCall) {
  auto ac = AccessControl::Create(TwoUsers());
  ASSERT_TRUE(ac.ok()) << ac.status();
  auto alice = (*ac)->Authenticate(Tcp("Bearer ta"));
  ASSERT_TRUE(alice.ok());
  EXPECT_FALSE((*ac)->Authenticate(Tcp("Bearer tb")).ok());
  AccessOptions next = TwoUsers();
  next.principals.erase(next.principals.begin());  // alice goes
  next.principals.push_back({.name = "bob", .role = Role::kUser, .namespaces = {"bob"},
                             .token_sha256 = {Sha256Hex("tb")}, .uids = {2002}});
  ASSERT_TRUE((*ac)->SetPrincipals(next.principals).ok());
  auto bob = (*ac)->Authenticate(Tcp("Bearer tb"));
  ASSERT_TRUE(bob.ok()) << bob.status();
  EXPECT_EQ((*bob)->name, "bob");
  EXPECT_EQ((*ac)->Authenticate(Unix(2002, 2002)).value()->name, "bob");
  EXPECT_TRUE((*ac)->Check(**bob, "bob", Action::kWrite).ok());  // its namespace exists now
  EXPECT_EQ((*ac)->Authenticate(Tcp("Bearer ta")).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*ac)->Authenticate(Unix(2001, 2001)).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*alice)->name, "alice");  // what was authenticated before stays valid
  // Invalid principals change nothing.
  auto bad = next.principals;
  bad.push_back(bad.back());
  EXPECT_EQ((*ac)->SetPrincipals(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*ac)->Authenticate(Tcp("Bearer tb")).ok());
  // None <-> some needs a restart.
  EXPECT_EQ((*ac)->SetPrincipals({}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*ac)->enabled());
  auto open = AccessControl::Create({});
  ASSERT_TRUE(open.ok());
  EXPECT_EQ((*open)->SetPrincipals(next.principals).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE((*open)->enabled());
}

TEST(AccessTest, PrincipalProblemsListsEveryOne) {
  std::vector<PrincipalConfig> ps = TwoUsers().principals;
  ps.push_back({.name = "alice", .role = Role::kUser, .namespaces = {}, .token_sha256 = {"x"}});
  ps.push_back({.name = "bad name!", .role = Role::kAdmin, .uids = {2001}});
  const auto problems = PrincipalProblems(ps);
  ASSERT_EQ(problems.size(), 5u);
  EXPECT_EQ(problems[0].first, 3u);  // defined twice
  EXPECT_EQ(problems[1].first, 3u);  // no namespace
  EXPECT_EQ(problems[2].first, 3u);  // bad token hash
  EXPECT_EQ(problems[3].first, 4u);  // bad name
  EXPECT_EQ(problems[4].first, 4u);  // uid mapped twice
  for (const auto& [i, message] : problems) {
    EXPECT_EQ(message.find(Sha256Hex("ta")), std::string::npos);
  }
  EXPECT_TRUE(PrincipalProblems(TwoUsers().principals).empty());
}

TEST(AccessTest, SetMaxNamespacesBoundsTheNextCreation) {
  AccessOptions o;
  o.max_namespaces = 2;  // "default" and one more
  auto ac = AccessControl::Create(o);
  ASSERT_TRUE(ac.ok());
  auto admin = (*ac)->Authenticate(Unix(0, 0)).value();
  EXPECT_TRUE((*ac)->Check(*admin, "one", Action::kWrite).ok());
  EXPECT_EQ((*ac)->Check(*admin, "two", Action::kWrite).code(),
            absl::StatusCode::kResourceExhausted);
  (*ac)->SetMaxNamespaces(3);
  EXPECT_TRUE((*ac)->Check(*admin, "two", Action::kWrite).ok());
}

TEST(QuotaTest, ConcurrentCompilesAndCompileSeconds) {
  QuotaManager q({.concurrent_compiles = 1, .compile_seconds_per_minute = 2, .calls_per_second = 0});
  auto t1 = q.BeginCompile("a");
  ASSERT_TRUE(t1.ok());
  auto t2 = q.BeginCompile("a");
  EXPECT_EQ(GetReason(t2.status())->metadata.at("quota"), "concurrent_compiles");
  EXPECT_TRUE(q.BeginCompile("b").ok());  // another namespace
  (*t1)->Charge(3);
  t1->reset();
  auto t3 = q.BeginCompile("a");
  EXPECT_EQ(GetReason(t3.status())->metadata.at("quota"), "compile_seconds_per_minute");
  EXPECT_TRUE(q.AdmitCall("a").ok());  // calls unbounded here
}

TEST(QuotaTest, CallsPerSecondIsATokenBucket) {
  FakeClock clock;
  QuotaManager q({.concurrent_compiles = 0, .compile_seconds_per_minute = 0, .calls_per_second = 3},
                 &clock);
  int admitted = 0;
  for (int i = 0; i < 10; ++i) admitted += q.AdmitCall("a").ok();
  EXPECT_EQ(admitted, 3);
  auto s = q.AdmitCall("a");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("calls_per_second (3)"), absl::string_view::npos) << s;
  EXPECT_TRUE(q.AdmitCall("b").ok());
}

// The bucket refills at the rate, never past one second's worth.
TEST(QuotaTest, TheCallBucketRefillsWithTime) {
  FakeClock clock;
  QuotaManager q({.concurrent_compiles = 0, .compile_seconds_per_minute = 0, .calls_per_second = 4},
                 &clock);
  auto drain = [&q] {
    int n = 0;
    while (q.AdmitCall("a").ok() && n < 100) ++n;
    return n;
  };
  EXPECT_EQ(drain(), 4);
  clock.Advance(std::chrono::milliseconds(200));  // 0.8 of a token
  EXPECT_EQ(drain(), 0);
  clock.Advance(std::chrono::milliseconds(100));  // 1.2 tokens
  EXPECT_EQ(drain(), 1);
  clock.Advance(std::chrono::seconds(60));  // capped at one second's worth
  EXPECT_EQ(drain(), 4);
}

// Compile seconds count in a sliding 60 s window.
TEST(QuotaTest, CompileSecondsLeaveTheWindowAfterAMinute) {
  FakeClock clock;
  QuotaManager q({.concurrent_compiles = 0, .compile_seconds_per_minute = 2, .calls_per_second = 0},
                 &clock);
  {
    auto t = q.BeginCompile("a");
    ASSERT_TRUE(t.ok());
    clock.Advance(std::chrono::seconds(3));  // a 3 s compile, charged its wall time
  }
  auto refused = q.BeginCompile("a");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(GetReason(refused.status())->metadata.at("quota"), "compile_seconds_per_minute");
  EXPECT_NE(refused.status().message().find("3.0 s"), absl::string_view::npos)
      << refused.status();
  clock.Advance(std::chrono::seconds(59));
  EXPECT_FALSE(q.BeginCompile("a").ok()) << "59 s later the compile is still in the window";
  clock.Advance(std::chrono::seconds(2));
  EXPECT_TRUE(q.BeginCompile("a").ok()) << "61 s later it has left it";
}

// Credit for fast channels comes out of the same bucket as AdmitCall: a
// batch is granted whole while the bucket holds it, partly when it holds
// less, and refused with AdmitCall's own status when it holds less than one
// call. (The clock stands still, so no token comes back meanwhile.)
TEST(QuotaTest, AdmitCallsGrantsBatchesFromTheSameBucket) {
  FakeClock clock;
  QuotaManager q({.concurrent_compiles = 0, .compile_seconds_per_minute = 0, .calls_per_second = 10},
                 &clock);
  auto first = q.AdmitCalls("a", 4);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, 4u);
  EXPECT_TRUE(q.AdmitCall("a").ok());  // one more through the gRPC path
  auto rest = q.AdmitCalls("a", 64);   // 5 left of 10: a partial batch
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(*rest, 5u);
  auto refused = q.AdmitCalls("a", 64);
  ASSERT_FALSE(refused.ok());
  auto grpc = q.AdmitCall("a");  // the gRPC path shares the empty bucket
  ASSERT_FALSE(grpc.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetReason(refused.status())->reason, reason::kQuotaExceeded);
  EXPECT_EQ(GetReason(refused.status())->metadata.at("quota"), "calls_per_second");
  EXPECT_EQ(refused.status().message(), grpc.message()) << "the same answer on both paths";
  EXPECT_NE(refused.status().message().find("calls_per_second (10)"), absl::string_view::npos);
  // Another namespace has its own bucket; a zero batch takes nothing.
  auto b = q.AdmitCalls("b", 64);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, 10u);
  auto none = q.AdmitCalls("a", 0);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0u);
}

TEST(QuotaTest, AdmitCallsWithoutABoundGrantsEverything) {
  QuotaManager q({.concurrent_compiles = 0, .compile_seconds_per_minute = 0, .calls_per_second = 0});
  for (int i = 0; i < 3; ++i) {
    auto g = q.AdmitCalls("a", q.CallCreditBatch());
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(*g, q.CallCreditBatch());
  }
  EXPECT_EQ(q.CallCreditBatch(), 4096u);
}

// A channel's batch is ~20 ms of the namespace's rate, between 1 and 64.
TEST(QuotaTest, CallCreditBatchFollowsTheRate) {
  auto batch = [](double rate) {
    return QuotaManager({.concurrent_compiles = 0, .compile_seconds_per_minute = 0,
                         .calls_per_second = rate})
        .CallCreditBatch();
  };
  EXPECT_EQ(batch(10), 1u);
  EXPECT_EQ(batch(50), 1u);
  EXPECT_EQ(batch(1000), 20u);
  EXPECT_EQ(batch(20000), 64u);
  EXPECT_EQ(batch(1e9), 64u);
}

TEST(QuotaTest, SetOptionsAppliesToTheNextCall) {
  QuotaManager q({.concurrent_compiles = 1, .compile_seconds_per_minute = 0,
                  .calls_per_second = 0});
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(q.AdmitCall("a").ok());
  EXPECT_EQ(q.CallCreditBatch(), 4096u);
  q.SetOptions({.concurrent_compiles = 2, .compile_seconds_per_minute = 0, .calls_per_second = 3});
  EXPECT_EQ(q.options().calls_per_second, 3);
  EXPECT_EQ(q.CallCreditBatch(), 1u);
  int admitted = 0;
  for (int i = 0; i < 10; ++i) admitted += q.AdmitCall("a").ok();
  EXPECT_GE(admitted, 3);
  EXPECT_LE(admitted, 4);  // a refill of at most one in the loop's time
  auto t1 = q.BeginCompile("a");
  auto t2 = q.BeginCompile("a");
  EXPECT_TRUE(t1.ok() && t2.ok());
  // Lowered: a full bucket shrinks to the new second's worth at once.
  q.SetOptions({.concurrent_compiles = 2, .compile_seconds_per_minute = 0,
                .calls_per_second = 1000});
  q.SetOptions({.concurrent_compiles = 2, .compile_seconds_per_minute = 0, .calls_per_second = 2});
  EXPECT_LE(q.AdmitCalls("b", 100).value(), 2u);
  q.SetOptions({});  // defaults
  EXPECT_EQ(q.options().concurrent_compiles, 8);
}

}  // namespace
}  // namespace opjit::access

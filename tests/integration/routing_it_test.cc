// Several server addresses in the C++ client: address lists, rendezvous
// ranking (the same as the Python client's), failover past a dead address
// and a daemon killed mid-run, and affinity routing, against real opjitd
// daemons with their own state directories.
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "tests/integration/daemon_harness.h"

namespace opjit::testing {
namespace {

using client::Client;
using client::ClientOptions;
using client::InlineTensor;
using client::Routing;

TEST(RoutingAddresses, SplitTrimsNormalizesAndDropsEmptyItems) {
  EXPECT_EQ(client::SplitAddresses(" /a.sock, 127.0.0.1:7878,,unix:/b.sock ,"),
            (std::vector<std::string>{"unix:/a.sock", "127.0.0.1:7878", "unix:/b.sock"}));
  EXPECT_EQ(client::SplitAddresses("host:1"), (std::vector<std::string>{"host:1"}));
  EXPECT_TRUE(client::SplitAddresses(" , ").empty());
}

TEST(RoutingAddresses, ConnectTakesAListOrACommaString) {
  auto a = Client::Connect({.address = "/x.sock,127.0.0.1:1"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->addresses(), (std::vector<std::string>{"unix:/x.sock", "127.0.0.1:1"}));
  EXPECT_EQ((*a)->address(), "unix:/x.sock");
  auto b = Client::Connect({.addresses = {"127.0.0.1:2", "/y.sock"}});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->addresses(), (std::vector<std::string>{"127.0.0.1:2", "unix:/y.sock"}));
  auto none = Client::Connect({.address = " , "});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RoutingAddresses, RendezvousMatchesThePythonClientAndMovesFewOps) {
  // Values computed by opjit._routing.rendezvous_score.
  EXPECT_EQ(client::RendezvousScore("", "leaky_relu", "unix:/tmp/a.sock"), 8430931691908382791ull);
  EXPECT_EQ(client::RendezvousScore("default", "leaky_relu", "unix:/tmp/a.sock"),
            8430931691908382791ull);
  EXPECT_EQ(client::RendezvousScore("ns1", "op", "127.0.0.1:7878"), 7069246995912207172ull);

  const std::vector<std::string> three = {"h1:1", "h2:1", "h3:1"};
  std::vector<std::string> four = three;
  four.push_back("h4:1");
  std::map<std::string, int> firsts;
  int moved = 0;
  for (int i = 0; i < 400; ++i) {
    const std::string op = "op" + std::to_string(i);
    const std::string a = client::RendezvousOrder("ns", op, three).front();
    const std::string b = client::RendezvousOrder("ns", op, four).front();
    ++firsts[a];
    // Adding a daemon moves an op only onto the new daemon.
    if (a != b) {
      EXPECT_EQ(b, "h4:1") << op;
      ++moved;
    }
  }
  for (const auto& h : three) EXPECT_GT(firsts[h], 80) << h;  // ~133 each
  EXPECT_GT(moved, 50);   // ~100 of 400
  EXPECT_LT(moved, 160);
}

// An op whose kernel writes `mark` into every output element: which daemon
// ran a call shows in its result.
v1::OpDef MarkOp(const std::string& name, float mark) {
  return FloatUnaryOp(name, "Mark", absl::StrCat(R"(#include <cstdint>
extern "C" int Mark(int nparam, void** params, int* ndims, int64_t** shapes,
                    const char** dtypes, void* stream, void* extra) {
  int64_t n = 1;
  for (int i = 0; i < ndims[0]; ++i) n *= shapes[0][i];
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * 0.0f + static_cast<float>()",
                                 mark, R"();
  return 0;
}
)"));
}

class RoutingIT : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      daemons_.push_back(std::make_unique<Daemon>(absl::StrCat(tmp_.path(), "/d", i)));
      ASSERT_TRUE(daemons_.back()->Start()) << daemons_.back()->Log();
    }
  }
  // Registers op `name` on every daemon, daemon i's kernel writing i + 1.
  void RegisterEverywhere(const std::string& name) {
    for (size_t i = 0; i < daemons_.size(); ++i) {
      auto c = daemons_[i]->NewClient();
      auto r = c->Register(MarkOp(name, static_cast<float>(i + 1)));
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
  // Forwards `op` inline; returns the mark of the daemon that ran it (0 on error).
  static float Run(Client& c, const std::string& op, absl::Status* status = nullptr) {
    v1::ForwardRequest req;
    req.set_op(op);
    const float x[4] = {1, 2, 3, 4};
    *req.add_inputs()->add_tensors() =
        InlineTensor("float32", {4}, std::string(reinterpret_cast<const char*>(x), sizeof x));
    auto r = c.Forward(req);
    if (status != nullptr) *status = r.status();
    if (!r.ok() || r->outputs_size() != 1 || r->outputs(0).inline_data().size() != sizeof x) {
      return 0;
    }
    float y[4];
    std::memcpy(y, r->outputs(0).inline_data().data(), sizeof y);
    for (float v : y) {
      if (v != y[0]) return -1;
    }
    return y[0];
  }
  std::string Dead() const { return "unix:" + tmp_.path() + "/nobody.sock"; }

  TempDir tmp_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
};

TEST_F(RoutingIT, ADeadFirstAddressIsSkipped) {
  RegisterEverywhere("mark");
  auto c = Client::Connect({.timeout = std::chrono::seconds(60),
                            .addresses = {Dead(), daemons_[0]->address(), daemons_[1]->address()},
                            .health_timeout = std::chrono::milliseconds(500)});
  ASSERT_TRUE(c.ok()) << c.status();
  auto info = (*c)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ((*c)->current_address(), daemons_[0]->address());
  absl::Status s;
  EXPECT_EQ(Run(**c, "mark", &s), 1.0f) << s;
  // Calls on a daemon's state pin the first healthy one.
  auto region = (*c)->CreateRegion("", "r", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  auto listed = daemons_[0]->NewClient()->ListRegions("");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);

  // Every address dead: UNAVAILABLE naming them.
  auto none = Client::Connect({.addresses = {Dead(), "unix:" + tmp_.path() + "/nobody2.sock"},
                               .health_timeout = std::chrono::milliseconds(300)});
  ASSERT_TRUE(none.ok());
  auto info2 = (*none)->Info();
  EXPECT_EQ(info2.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(info2.status().message().find("nobody2.sock"), std::string::npos)
      << info2.status();
}

TEST_F(RoutingIT, FailsOverWhenTheCurrentDaemonIsKilled) {
  RegisterEverywhere("mark");
  auto c = Client::Connect({.address = absl::StrCat(daemons_[0]->address(), ",",
                                                    daemons_[1]->address()),
                            .timeout = std::chrono::seconds(60),
                            .health_timeout = std::chrono::milliseconds(500)});
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status s;
  EXPECT_EQ(Run(**c, "mark", &s), 1.0f) << s;
  daemons_[0]->Kill9();
  // The next idempotent calls succeed on the second daemon.
  EXPECT_EQ(Run(**c, "mark", &s), 2.0f) << s;
  EXPECT_EQ((*c)->current_address(), daemons_[1]->address());
  auto got = (*c)->Get("", "mark");
  ASSERT_TRUE(got.ok()) << got.status();
  // A registration goes to the daemon that answers now.
  auto r = (*c)->Register(MarkOp("mark2", 7.0f));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Run(**c, "mark2", &s), 7.0f) << s;
}

TEST_F(RoutingIT, ADaemonsOwnErrorIsNotRetriedElsewhere) {
  // The op exists on the second daemon only: NOT_FOUND from the first is
  // the answer (failover is for daemons that do not answer).
  auto c2 = daemons_[1]->NewClient();
  ASSERT_TRUE(c2->Register(MarkOp("only2", 2.0f)).ok());
  auto c = Client::Connect({.timeout = std::chrono::seconds(60),
                            .addresses = {daemons_[0]->address(), daemons_[1]->address()}});
  ASSERT_TRUE(c.ok());
  absl::Status s;
  EXPECT_EQ(Run(**c, "only2", &s), 0.0f);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

TEST_F(RoutingIT, AffinityRoutesEachOpToOneDaemonAndSpreadsOps) {
  std::vector<std::string> ops;
  for (int i = 0; i < 16; ++i) {
    ops.push_back("aff" + std::to_string(i));
    RegisterEverywhere(ops.back());
  }
  const std::vector<std::string> addrs = {daemons_[0]->address(), daemons_[1]->address()};
  auto c = Client::Connect({.timeout = std::chrono::seconds(60),
                            .addresses = addrs,
                            .routing = Routing::kAffinity});
  ASSERT_TRUE(c.ok());
  std::set<float> used;
  for (const auto& op : ops) {
    const std::string want = (*c)->PreferredAddresses("", op).front();
    const float mark = want == addrs[0] ? 1.0f : 2.0f;
    for (int k = 0; k < 3; ++k) {
      absl::Status s;
      EXPECT_EQ(Run(**c, op, &s), mark) << op << " " << s;
    }
    used.insert(mark);
  }
  EXPECT_EQ(used.size(), 2u) << "16 ops all ranked one daemon first";

  // The preferred daemon of an op dies: its calls fall through to the next.
  const std::string op = ops[0];
  const bool first = (*c)->PreferredAddresses("", op).front() == addrs[0];
  daemons_[first ? 0 : 1]->Kill9();
  absl::Status s;
  EXPECT_EQ(Run(**c, op, &s), first ? 2.0f : 1.0f) << s;
}

}  // namespace
}  // namespace opjit::testing

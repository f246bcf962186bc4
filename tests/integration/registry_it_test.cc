// The registry end to end: the real opjitd, driven by the opjit CLI and the
// C++ client library.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <fstream>
#include <map>
#include <filesystem>
#include <mutex>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "tests/integration/daemon_harness.h"

namespace opjit::testing {
namespace {

std::string LeakyReluSpec() { return SourceDir() + "/kernels/examples/leaky_relu.json"; }

// An op with no implementation source to compile: fast to register in bulk.
v1::OpDef SimpleOp(const std::string& name, const std::string& doc = "") {
  v1::OpDef op;
  op.set_name(name);
  op.set_doc(doc);
  auto* in = op.add_inputs();
  in->set_index(0);
  in->set_name("x");
  auto* out = op.add_outputs();
  out->set_index(0);
  out->set_name("y");
  auto* df = op.add_dtype_formats();
  df->add_dtypes("float32");
  df->add_dtypes("float32");
  auto* impl = op.add_implementations();
  impl->set_target("GPU");
  impl->set_language("cuda");
  impl->set_entry("k");
  impl->set_source("extern \"C\" __global__ void k(float* y, const float* x) {}");
  return op;
}

class RegistryIT : public ::testing::Test {
 protected:
  TempDir tmp_;
  std::string state_ = tmp_.path() + "/state";
};

TEST_F(RegistryIT, CliRegisterListDescribeDeleteAndRestart) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();

  auto reg = d.Cli({"register", LeakyReluSpec()});
  ASSERT_EQ(reg.exit_code, 0) << reg.err << d.Log();
  EXPECT_NE(reg.out.find("registered default/leaky_relu version 1"), std::string::npos) << reg.out;

  auto again = d.Cli({"register", LeakyReluSpec()});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("unchanged default/leaky_relu version 1"), std::string::npos)
      << again.out;

  auto ops = d.Cli({"ops", "--json"});
  ASSERT_EQ(ops.exit_code, 0) << ops.err;
  EXPECT_NE(ops.out.find("\"name\": \"leaky_relu\""), std::string::npos) << ops.out;

  auto desc = d.Cli({"describe", "leaky_relu"});
  ASSERT_EQ(desc.exit_code, 0) << desc.err;
  EXPECT_NE(desc.out.find("alpha"), std::string::npos) << desc.out;
  EXPECT_NE(desc.out.find("float16/DefaultFormat, float16/DefaultFormat"), std::string::npos)
      << desc.out;
  EXPECT_NE(desc.out.find("entry=CustomLeakyRelu"), std::string::npos) << desc.out;

  // The client library sees the same record, sources included.
  auto c = d.NewClient();
  auto rec = c->Get("", "leaky_relu");
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ(rec->version(), 1);
  EXPECT_NE(rec->op().implementations(0).source().find("CustomLeakyRelu"), std::string::npos);

  // Restart: the same registry comes back.
  ASSERT_EQ(d.Stop(), 0) << d.Log();
  Daemon d2(state_);
  ASSERT_TRUE(d2.Start()) << d2.Log();
  auto c2 = d2.NewClient();
  auto rec2 = c2->Get("", "leaky_relu");
  ASSERT_TRUE(rec2.ok()) << rec2.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*rec, *rec2));

  auto del = d2.Cli({"delete", "default/leaky_relu"});
  ASSERT_EQ(del.exit_code, 0) << del.err;
  EXPECT_NE(del.out.find("deleted 1 version(s)"), std::string::npos) << del.out;
  auto gone = d2.Cli({"describe", "leaky_relu"});
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_NE(gone.err.find("NOT_FOUND"), std::string::npos) << gone.err;
}

TEST_F(RegistryIT, VersionsAndPinnedGet) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  auto c = d.NewClient();
  auto v1 = c->Register(SimpleOp("scale", "first"));
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_TRUE(v1->created());
  auto v2 = c->Register(SimpleOp("scale", "second"));
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->record().version(), 2);
  auto same = c->Register(SimpleOp("scale", "second"));
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(same->created());
  EXPECT_EQ(same->record().version(), 2);

  EXPECT_EQ(c->Get("", "scale")->op().doc(), "second");
  EXPECT_EQ(c->Get("", "scale", 1)->op().doc(), "first");
  auto missing = c->Get("", "scale", 7);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  auto all = c->List("", /*all_versions=*/true);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 2u);
  auto pinned = d.Cli({"describe", "scale", "--version", "1", "--json"});
  ASSERT_EQ(pinned.exit_code, 0) << pinned.err;
  EXPECT_NE(pinned.out.find("\"doc\": \"first\""), std::string::npos) << pinned.out;

  // Namespaces keep same-named ops apart.
  v1::OpDef other = SimpleOp("scale", "team b");
  other.set_namespace_("team-b");
  ASSERT_TRUE(c->Register(other).ok());
  EXPECT_EQ(c->Get("team-b", "scale")->version(), 1);
  EXPECT_EQ(c->List("team-b")->size(), 1u);
}

TEST_F(RegistryIT, InvalidSpecsNameTheField) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  auto c = d.NewClient();

  v1::OpDef dup = SimpleOp("dup");
  dup.mutable_outputs(0)->set_name("x");
  auto r = c->Register(dup);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("outputs[0].name"), std::string::npos) << r.status();

  v1::OpDef arity = SimpleOp("arity");
  arity.mutable_dtype_formats(0)->add_dtypes("float32");
  r = c->Register(arity);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("dtype_formats[0]"), std::string::npos) << r.status();

  v1::OpDef dtype = SimpleOp("dtype");
  dtype.mutable_dtype_formats(0)->set_dtypes(0, "float33");
  r = c->Register(dtype);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("float33"), std::string::npos) << r.status();

  v1::OpDef def = SimpleOp("baddefault");
  auto* attr = def.add_attrs();
  attr->set_name("alpha");
  attr->set_value_type("float");
  attr->set_default_value("fast");
  r = c->Register(def);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("attrs[0].default_value"), std::string::npos) << r.status();

  v1::OpDef vt = SimpleOp("badtype");
  auto* attr2 = vt.add_attrs();
  attr2->set_name("alpha");
  attr2->set_value_type("double");
  r = c->Register(vt);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("attrs[0].value_type"), std::string::npos) << r.status();

  // The CLI reports the server's message and exits non-zero.
  const std::string spec = tmp_.path() + "/bad.json";
  {
    std::ofstream(spec) << R"({"name": "x", "inputs": [], "outputs": []})";
  }
  auto cli = d.Cli({"register", spec});
  EXPECT_EQ(cli.exit_code, 1);
  EXPECT_NE(cli.err.find("INVALID_ARGUMENT"), std::string::npos) << cli.err;
  {
    std::ofstream(spec) << R"({"name": "x", "inputz": []})";
  }
  cli = d.Cli({"register", spec});
  EXPECT_EQ(cli.exit_code, 1);
  EXPECT_NE(cli.err.find("inputz"), std::string::npos) << cli.err;

  // Nothing invalid was stored.
  EXPECT_TRUE(c->List()->empty());
}

// A backward.op that names no registered op is registered, with a warning in
// the RegisterOp response and in the record Get and List return, until that
// op is registered.
TEST_F(RegistryIT, DanglingBackwardOpIsAWarning) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  auto c = d.NewClient();
  const std::string want =
      "backward.op: \"fwd_grad\" is not a registered op in namespace \"default\"; the op is "
      "registered, but its backward fails until \"fwd_grad\" is registered";
  v1::OpDef fwd = SimpleOp("fwd");
  fwd.mutable_backward()->set_op("fwd_grad");
  fwd.mutable_backward()->add_inputs("dout");  // fwd_grad(dy) -> dx: SimpleOp's shape
  fwd.add_output_rules()->set_kind("same_as");  // a rule: no output_rules warning
  auto r = c->Register(fwd);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->created());
  ASSERT_EQ(r->warnings_size(), 1);
  EXPECT_EQ(r->warnings(0), want);
  ASSERT_EQ(r->record().warnings_size(), 1);
  auto got = c->Get("", "fwd");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->warnings_size(), 1);
  EXPECT_EQ(got->warnings(0), want);
  auto listed = c->List();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].warnings_size(), 1);

  v1::OpDef grad = SimpleOp("fwd_grad");
  grad.add_output_rules()->set_kind("same_as");
  auto g = c->Register(grad);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->warnings_size(), 0);
  EXPECT_EQ(c->Get("", "fwd")->warnings_size(), 0);
  auto again = c->Register(fwd);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->warnings_size(), 0);
}

TEST_F(RegistryIT, Kill9DuringRegistrationBurstLosesNothingAcknowledged) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  std::mutex mu;
  std::map<std::string, std::string> acked;  // name -> content hash
  std::atomic<bool> stop{false};
  std::atomic<int> count{0};
  std::atomic<int> alive{4};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      struct Exit {
        std::atomic<int>& alive;
        ~Exit() { alive.fetch_sub(1); }
      } on_exit{alive};
      auto c = d.NewClient();
      for (int i = 0; !stop.load(); ++i) {
        const std::string name = "op_" + std::to_string(t) + "_" + std::to_string(i);
        auto r = c->Register(SimpleOp(name, std::string(200 + i % 50, 'd')));
        if (!r.ok()) break;  // the daemon died
        std::lock_guard<std::mutex> lock(mu);
        acked[name] = r->record().content_hash();
        count.fetch_add(1);
      }
    });
  }
  while (count.load() < 150 && alive.load() > 0) std::this_thread::yield();
  ASSERT_GE(count.load(), 150) << d.Log();
  d.Kill9();
  stop = true;
  for (auto& t : threads) t.join();

  Daemon d2(state_);
  ASSERT_TRUE(d2.Start()) << d2.Log();
  auto c = d2.NewClient();
  auto all = c->List("", true);
  ASSERT_TRUE(all.ok());
  std::map<std::string, std::string> stored;
  for (const auto& r : *all) stored[r.op().name()] = r.content_hash();
  EXPECT_GE(stored.size(), acked.size());
  for (const auto& [name, hash] : acked) {
    ASSERT_TRUE(stored.count(name)) << name << " was acknowledged but is missing";
    EXPECT_EQ(stored[name], hash) << name;
    auto full = c->Get("", name);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_EQ(full->op().inputs(0).name(), "x");
  }
}

TEST_F(RegistryIT, SecondDaemonOnSameStateDirOrSocketIsRefused) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  auto second = RunProcess({BinDir() + "/opjitd", "--state-dir", state_, "--listen",
                            "unix:" + tmp_.path() + "/other.sock"});
  EXPECT_NE(second.exit_code, 0);
  EXPECT_NE(second.err.find("already serving state dir"), std::string::npos) << second.err;

  auto third = RunProcess({BinDir() + "/opjitd", "--state-dir", tmp_.path() + "/state2",
                           "--listen", d.address()});
  EXPECT_NE(third.exit_code, 0);
  EXPECT_NE(third.err.find("already listening"), std::string::npos) << third.err;
  // The first daemon is unharmed.
  EXPECT_TRUE(d.NewClient()->Info().ok());
}

TEST_F(RegistryIT, StaleSocketIsReplaced) {
  std::filesystem::create_directories(state_);
  const std::string path = state_ + "/opjitd.sock";
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(fd);  // leaves a socket file nobody listens on
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  EXPECT_NE(d.Log().find("replacing stale socket"), std::string::npos);
}

TEST_F(RegistryIT, InfoHealthAndTcp) {
  Daemon d(state_, {"--listen", "127.0.0.1:0"});
  ASSERT_TRUE(d.Start()) << d.Log();
  auto info = d.Cli({"info", "--json"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("\"triple\": \"x86_64"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("\"kernel_abi_version\": 1"), std::string::npos) << info.out;
  if (access("/dev/nvidia0", F_OK) != 0) {
    EXPECT_NE(info.out.find("\"available\": false"), std::string::npos) << info.out;
    EXPECT_NE(info.out.find("libcuda"), std::string::npos) << info.out;
  }

  // The OS-chosen TCP port is published in <state>/endpoints and serves too.
  std::ifstream endpoints(state_ + "/endpoints");
  std::string line, tcp;
  while (std::getline(endpoints, line)) {
    if (line.rfind("127.0.0.1:", 0) == 0) tcp = line;
  }
  ASSERT_FALSE(tcp.empty());
  auto c = client::Client::Connect({.address = tcp});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->Info().ok());

  // Standard grpc.health.v1 health check, called generically: an empty
  // HealthCheckRequest; SERVING is field 1 = 1, i.e. bytes 08 01.
  auto channel = grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;
  grpc::Status status;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = s;
                   done = true;
                   cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST_F(RegistryIT, SigtermShutsDownCleanly) {
  Daemon d(state_);
  ASSERT_TRUE(d.Start()) << d.Log();
  EXPECT_EQ(d.Stop(), 0);
  EXPECT_FALSE(std::filesystem::exists(state_ + "/opjitd.sock"));
  EXPECT_NE(d.Log().find("shutting down"), std::string::npos);
}

TEST(CliIT, UnreachableServerGivesAClearError) {
  TempDir tmp;
  auto r = RunProcess({BinDir() + "/opjit", "--server", "unix:" + tmp.path() + "/none.sock",
                       "--timeout", "2", "ops"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("is opjitd running"), std::string::npos) << r.err;
  auto usage = RunProcess({BinDir() + "/opjit", "frobnicate"});
  EXPECT_EQ(usage.exit_code, 2);
}

}  // namespace
}  // namespace opjit::testing

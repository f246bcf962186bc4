// Forward execution end to end: the real opjitd, tensors inline and in shared
// memory, driven by the C++ client and the CLI.
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "client/cpp/npy.h"
#include "client/cpp/shm_region.h"
#include "tests/integration/daemon_harness.h"

namespace opjit::testing {
namespace {

using client::InlineTensor;
using client::ShmTensor;
using client::TextAttr;

std::string Example(const std::string& name) {
  return SourceDir() + "/kernels/examples/" + name + ".json";
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

template <typename T>
std::vector<T> Values(const std::string& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

uint16_t Half(float f) {  // exact for the values used below
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  if (f == 0.0f) return sign;
  return static_cast<uint16_t>(sign | (exp << 10) | ((x & 0x7fffff) >> 13));
}

class ForwardIT : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(tmp_.path() + "/state");
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
    c_ = daemon_->NewClient();
  }
  void Register(const std::string& example) {
    auto spec = client::LoadOpSpec(Example(example));
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto r = c_->Register(*spec);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  void RegisterSource(const std::string& name, const std::string& entry, const std::string& src,
                      int inputs = 1) {
    v1::OpDef op;
    op.set_name(name);
    auto* df = op.add_dtype_formats();
    for (int i = 0; i < inputs; ++i) {
      auto* in = op.add_inputs();
      in->set_index(i);
      in->set_name("x" + std::to_string(i));
      df->add_dtypes("float32");
    }
    auto* out = op.add_outputs();
    out->set_name("y");
    df->add_dtypes("float32");
    auto* impl = op.add_implementations();
    impl->set_target("CPU");
    impl->set_source(src);
    impl->set_entry(entry);
    auto r = c_->Register(op);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  v1::ForwardRequest Call(const std::string& op) {
    v1::ForwardRequest req;
    req.set_op(op);
    return req;
  }

  TempDir tmp_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> c_;
};

TEST_F(ForwardIT, LeakyReluFloat32AndFloat16WithAlpha) {
  Register("leaky_relu");
  std::vector<float> x = {-2.0f, -0.5f, 0.0f, 1.5f};
  auto req = Call("leaky_relu");
  *req.add_inputs()->add_tensors() = InlineTensor("float32", {2, 2}, Bytes(x));
  (*req.mutable_attrs())["alpha"] = TextAttr("0.25");
  auto r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status() << daemon_->Log();
  ASSERT_EQ(r->outputs_size(), 1);
  EXPECT_EQ(r->outputs(0).dtype(), "float32");
  EXPECT_EQ(r->outputs(0).shape_size(), 2);
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{-0.5f, -0.125f, 0, 1.5f}));

  // The default alpha (0.01), a typed attr, and float16.
  req.mutable_attrs()->clear();
  r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(Values<float>(r->outputs(0).inline_data())[0], -0.02f);

  std::vector<uint16_t> h = {Half(-2.0f), Half(4.0f)};
  auto hreq = Call("leaky_relu");
  *hreq.add_inputs()->add_tensors() = InlineTensor("float16", {2}, Bytes(h));
  (*hreq.mutable_attrs())["alpha"].set_f(0.5);
  r = c_->Forward(hreq);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outputs(0).dtype(), "float16");
  EXPECT_EQ(Values<uint16_t>(r->outputs(0).inline_data()), (std::vector<uint16_t>{Half(-1.0f), Half(4.0f)}));
}

// Repeated calls of one shape reuse what the first call checked; a new or
// deleted version must still be seen by the very next call.
TEST_F(ForwardIT, RepeatedCallsFollowNewAndDeletedVersions) {
  Register("leaky_relu");
  std::vector<float> x = {-2.0f, 3.0f};
  auto req = Call("leaky_relu");
  *req.add_inputs()->add_tensors() = InlineTensor("float32", {2}, Bytes(x));
  for (int i = 0; i < 3; ++i) {
    auto r = c_->Forward(req);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->version(), 1);
    EXPECT_FLOAT_EQ(Values<float>(r->outputs(0).inline_data())[0], -0.02f);  // default 0.01
  }
  // Version 2: the same op with another default alpha.
  auto spec = client::LoadOpSpec(Example("leaky_relu"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->mutable_attrs(0)->set_default_value("0.5");
  auto reg = c_->Register(*spec);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version(), 2);
  EXPECT_FLOAT_EQ(Values<float>(r->outputs(0).inline_data())[0], -1.0f);
  // Pinned to version 1, then version 2 deleted: back to 1 as the latest.
  req.set_version(1);
  r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(Values<float>(r->outputs(0).inline_data())[0], -0.02f);
  req.set_version(0);
  auto del = c_->Delete("", "leaky_relu", 2);
  ASSERT_TRUE(del.ok()) << del.status();
  r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version(), 1);
  EXPECT_FLOAT_EQ(Values<float>(r->outputs(0).inline_data())[0], -0.02f);
  // Deleting the last version makes the next call NOT_FOUND.
  ASSERT_TRUE(c_->Delete("", "leaky_relu", 0).ok());
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
}

TEST_F(ForwardIT, SharedMemoryInputsAndOutputs) {
  Register("leaky_relu");
  auto info = c_->CreateRegion("", "buf", 1 << 20);
  ASSERT_TRUE(info.ok()) << info.status();
  auto map = client::ShmMapping::Open(info->shm_key(), info->byte_size());
  ASSERT_TRUE(map.ok()) << map.status();
  float* x = reinterpret_cast<float*>((*map)->data());
  for (int i = 0; i < 1024; ++i) x[i] = static_cast<float>(i - 512);

  // Zero copy: the output goes exactly where the caller says.
  auto req = Call("leaky_relu");
  *req.add_inputs()->add_tensors() = ShmTensor("float32", {1024}, "buf", 0);
  req.add_outputs()->mutable_shm()->set_region("buf");
  req.mutable_outputs(0)->mutable_shm()->set_offset(8192);
  auto r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outputs(0).shm().offset(), 8192u);
  const float* y = reinterpret_cast<const float*>((*map)->data() + 8192);
  EXPECT_FLOAT_EQ(y[0], -5.12f);
  EXPECT_FLOAT_EQ(y[1023], 511.0f);

  // The server picks the place.
  req.mutable_outputs(0)->mutable_alloc_in()->set_region("buf");
  req.mutable_outputs(0)->mutable_alloc_in()->set_offset(4096);
  r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(r->outputs(0).shm().offset(), 4096u);
  EXPECT_EQ(r->outputs(0).shm().offset() % 64, 0u);

  // An output over its own input is refused.
  req.mutable_outputs(0)->mutable_shm()->set_region("buf");
  req.mutable_outputs(0)->mutable_shm()->set_offset(64);
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("overlaps"), std::string::npos) << r.status();

  // Exactly its input, in a call that keeps its output bytes (zero-filling
  // would wipe the input): written in place, an in-place op (opjit.torch's
  // aliases). Without keep_output_bytes, or partly over it, still refused.
  req.mutable_outputs(0)->mutable_shm()->set_offset(0);
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  req.set_keep_output_bytes(true);
  r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outputs(0).shm().offset(), 0u);
  EXPECT_FLOAT_EQ(x[0], -5.12f);
  EXPECT_FLOAT_EQ(x[1023], 511.0f);
  req.mutable_outputs(0)->mutable_shm()->set_offset(64);
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
}

TEST_F(ForwardIT, BadOffsetsSizesAndDtypesAreRefusedBeforeAnyKernelRuns) {
  Register("leaky_relu");
  ASSERT_TRUE(c_->CreateRegion("", "small", 4096).ok());
  auto req = Call("leaky_relu");
  auto* t = req.add_inputs()->add_tensors();
  *t = ShmTensor("float32", {1024}, "small", 4);  // 4 + 4096 > 4096
  auto r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("inputs[0]"), std::string::npos) << r.status();

  *t = ShmTensor("float32", {4}, "small", 1ull << 62);
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();

  *t = ShmTensor("float32", {1ll << 61, 8}, "small", 0);  // byte size overflows
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();

  *t = ShmTensor("float32", {4}, "small", 2);  // misaligned
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();

  *t = ShmTensor("float32", {4}, "nope", 0);
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();

  *t = InlineTensor("float32", {4}, std::string(12, '\0'));  // 12 bytes for 16
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("needs 16"), std::string::npos) << r.status();

  *t = InlineTensor("float64", {2}, std::string(16, '\0'));
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("accepted combinations: (float32) -> (float32); (float16) -> (float16)"),
            std::string::npos)
      << r.status();

  *t = InlineTensor("float32", {1}, std::string(4, '\0'));
  (*req.mutable_attrs())["alpha"] = TextAttr("fast");
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("alpha"), std::string::npos) << r.status();
  req.mutable_attrs()->clear();
  (*req.mutable_attrs())["beta"] = TextAttr("1");
  r = c_->Forward(req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no attr \"beta\""), std::string::npos) << r.status();

  // Wrong input count.
  auto two = Call("leaky_relu");
  two.add_inputs()->add_tensors()->CopyFrom(InlineTensor("float32", {1}, std::string(4, '\0')));
  two.add_inputs();
  r = c_->Forward(two);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("takes 1 input(s)"), std::string::npos) << r.status();
}

TEST_F(ForwardIT, MultiOutputDynamicOptionalAndInferShape) {
  Register("arith3");
  Register("add_n");
  Register("scale_bias");
  Register("reduce_sum");

  auto req = Call("arith3");
  *req.add_inputs()->add_tensors() = InlineTensor("float32", {3}, Bytes(std::vector<float>{1, 2, 3}));
  *req.add_inputs()->add_tensors() = InlineTensor("float32", {3}, Bytes(std::vector<float>{4, 5, 6}));
  auto r = c_->Forward(req);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->outputs_size(), 3);
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(Values<float>(r->outputs(1).inline_data()), (std::vector<float>{4, 10, 18}));
  EXPECT_FLOAT_EQ(Values<float>(r->outputs(2).inline_data())[2], 0.5f);

  auto addn = Call("add_n");
  auto* group = addn.add_inputs();
  for (int k = 1; k <= 3; ++k) {
    *group->add_tensors() = InlineTensor("float32", {2}, Bytes(std::vector<float>{1.0f * k, 10.0f * k}));
  }
  r = c_->Forward(addn);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{6, 60}));

  auto sb = Call("scale_bias");
  *sb.add_inputs()->add_tensors() = InlineTensor("float32", {2}, Bytes(std::vector<float>{1, 2}));
  sb.add_inputs();  // b absent
  r = c_->Forward(sb);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{2, 4}));
  *sb.mutable_inputs(1)->add_tensors() = InlineTensor("float32", {2}, Bytes(std::vector<float>{10, 20}));
  r = c_->Forward(sb);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{12, 24}));

  std::vector<float> m = {1, 2, 3, 4, 5, 6};
  auto rs = Call("reduce_sum");
  *rs.add_inputs()->add_tensors() = InlineTensor("float32", {2, 3}, Bytes(m));
  (*rs.mutable_attrs())["axis"].set_i(1);
  r = c_->Forward(rs);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->outputs(0).shape_size(), 1);
  EXPECT_EQ(r->outputs(0).shape(0), 2);
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{6, 15}));
  (*rs.mutable_attrs())["axis"].set_i(-2);
  r = c_->Forward(rs);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Values<float>(r->outputs(0).inline_data()), (std::vector<float>{5, 7, 9}));
  rs.mutable_attrs()->clear();
  r = c_->Forward(rs);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("needs attr \"axis\""), std::string::npos) << r.status();
}

TEST_F(ForwardIT, KernelErrorsNameTheOpAndCode) {
  RegisterSource("fails", "Fails",
                 "#include <cstdint>\nextern \"C\" int Fails(int, void**, int*, int64_t**, const "
                 "char**, void*, void*) { return 7; }\n");
  auto req = Call("fails");
  *req.add_inputs()->add_tensors() = InlineTensor("float32", {1}, std::string(4, '\0'));
  auto r = c_->Forward(req);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("default/fails"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("7"), std::string::npos) << r.status();
  // The daemon is fine.
  EXPECT_TRUE(c_->Info().ok());
}

TEST_F(ForwardIT, UnregisteringARegionInUseNeverUnmapsUnderTheKernel) {
  // The kernel signals that it started by writing y[0] = 1, then waits until
  // the client sets x[1] != 0, then copies x to y.
  RegisterSource("waiter", "Waiter", R"(
#include <cstdint>
extern "C" int Waiter(int, void** params, int*, int64_t** shapes, const char**, void*, void*) {
  volatile float* x = static_cast<volatile float*>(params[0]);
  volatile float* y = static_cast<volatile float*>(params[1]);
  y[0] = 1.0f;
  for (long spins = 0; x[1] == 0.0f; ++spins) {
    if (spins > 40000000000L) return 9;  // a safety valve, never reached when the test runs
  }
  for (int64_t i = 0; i < shapes[0][0]; ++i) y[i] = x[i] + 100.0f;
  return 0;
}
)");
  auto info = c_->CreateRegion("", "busy", 1 << 20);
  ASSERT_TRUE(info.ok()) << info.status();
  auto map = client::ShmMapping::Open(info->shm_key(), info->byte_size());
  ASSERT_TRUE(map.ok());
  volatile float* x = reinterpret_cast<volatile float*>((*map)->data());
  volatile float* y = reinterpret_cast<volatile float*>((*map)->data() + 4096);
  for (int i = 0; i < 256; ++i) x[i] = 0.0f;
  y[0] = 0.0f;
  // 256 KiB of input would run inline; 1 KiB runs inline too, on a gRPC thread.
  auto req = Call("waiter");
  *req.add_inputs()->add_tensors() = ShmTensor("float32", {256}, "busy", 0);
  req.add_outputs()->mutable_shm()->set_region("busy");
  req.mutable_outputs(0)->mutable_shm()->set_offset(4096);
  absl::StatusOr<v1::ForwardResponse> result;
  std::thread call([&] { result = daemon_->NewClient()->Forward(req); });
  while (y[0] != 1.0f) std::this_thread::yield();  // the kernel is running
  ASSERT_TRUE(c_->UnregisterRegion("", "busy").ok());
  EXPECT_EQ(c_->ListRegions("")->size(), 0u);
  x[1] = 1.0f;  // let it finish
  call.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FLOAT_EQ(y[1], 101.0f);
  // The region is gone for new calls.
  auto again = c_->Forward(req);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();
}

TEST_F(ForwardIT, LeasesLapseAndClientsReleaseTheirRegions) {
  // Leases belong to a client (its client_id): one that stops renewing loses
  // its regions; another client's stay.
  auto brief = daemon_->NewClient();
  ASSERT_TRUE(brief->CreateRegion("", "short", 4096, /*lease_ms=*/50).ok());
  ASSERT_TRUE(c_->CreateRegion("", "long", 4096, /*lease_ms=*/600000).ok());
  // The daemon's reaper runs once a second.
  bool expired = false;
  for (int i = 0; i < 100 && !expired; ++i) {
    auto list = c_->ListRegions("");
    ASSERT_TRUE(list.ok());
    expired = list->size() == 1 && (*list)[0].name() == "long";
    if (!expired) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(expired);
  auto released = c_->ReleaseRegions("");
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 1);
  EXPECT_TRUE(c_->ListRegions("")->empty());
}

TEST_F(ForwardIT, QuotaIsResourceExhausted) {
  daemon_.reset();
  const std::string cfg = tmp_.path() + "/q.toml";
  std::ofstream(cfg) << "[shm]\nquota_mb = 1\n";
  daemon_ = std::make_unique<Daemon>(tmp_.path() + "/state2", std::vector<std::string>{"--config", cfg});
  ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  c_ = daemon_->NewClient();
  ASSERT_TRUE(c_->CreateRegion("", "a", 800 << 10).ok());
  auto r = c_->CreateRegion("", "b", 800 << 10);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

TEST_F(ForwardIT, EightConcurrentClients) {
  Register("leaky_relu");
  std::atomic<int> good{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto c = daemon_->NewClient();
      for (int i = 0; i < 40; ++i) {
        std::vector<float> x(64 + t, -1.0f * (t + 1));
        auto req = Call("leaky_relu");
        *req.add_inputs()->add_tensors() =
            InlineTensor("float32", {static_cast<int64_t>(x.size())}, Bytes(x));
        (*req.mutable_attrs())["alpha"].set_f(0.5);
        auto r = c->Forward(req);
        if (!r.ok()) return;
        auto y = Values<float>(r->outputs(0).inline_data());
        if (y.size() != x.size() || y[0] != -0.5f * (t + 1)) return;
      }
      good.fetch_add(1);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), 8) << daemon_->Log();
}

// With one pool thread and a queue of one: a slow kernel occupies the pool,
// a second big call waits in the queue, a third is refused, a small op still
// runs inline, and a queued call whose deadline passes never runs its kernel.
TEST_F(ForwardIT, SlowKernelsQueueDeadlinesAndBackpressure) {
  daemon_.reset();
  const std::string cfg = tmp_.path() + "/pool.toml";
  std::ofstream(cfg) << "[exec]\nthreads = 1\nqueue = 1\n";
  daemon_ = std::make_unique<Daemon>(tmp_.path() + "/state3",
                                     std::vector<std::string>{"--config", cfg});
  ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
  // The execution pool's queue is what this test checks: its clients stay on
  // gRPC (a fast channel has its own executor and never queues there).
  auto grpc_only = [&](std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    auto c = client::Client::Connect({.address = daemon_->address(), .timeout = timeout,
                                      .fast = "off"});
    EXPECT_TRUE(c.ok());
    return *std::move(c);
  };
  c_ = grpc_only();
  Register("leaky_relu");
  // runs[1] = 1 says "started"; the kernel then waits until the client sets
  // x[1] != 0, and counts its completed runs in x[2] (its input: outputs
  // start zeroed on every call, so they cannot count across calls).
  RegisterSource("gate", "Gate", R"(
#include <cstdint>
extern "C" int Gate(int, void** params, int*, int64_t**, const char**, void*, void*) {
  volatile float* x = static_cast<volatile float*>(params[0]);
  volatile float* runs = static_cast<volatile float*>(params[1]);
  runs[1] = 1.0f;
  for (long spins = 0; x[1] == 0.0f; ++spins) {
    if (spins > 40000000000L) return 9;  // a safety valve, never reached when the test runs
  }
  x[2] = x[2] + 1.0f;
  return 0;
}
)");
  const int64_t n = 1 << 17;  // 512 KiB of input: over the inline limit, so it runs on the pool
  auto info = c_->CreateRegion("", "gate", 4 << 20);
  ASSERT_TRUE(info.ok()) << info.status();
  auto map = client::ShmMapping::Open(info->shm_key(), info->byte_size());
  ASSERT_TRUE(map.ok());
  volatile float* x = reinterpret_cast<volatile float*>((*map)->data());
  volatile float* runs = reinterpret_cast<volatile float*>((*map)->data() + (2 << 20));
  x[1] = x[2] = 0.0f;
  runs[1] = 0.0f;
  auto gate = Call("gate");
  *gate.add_inputs()->add_tensors() = ShmTensor("float32", {n}, "gate", 0);
  gate.add_outputs()->mutable_shm()->set_region("gate");
  gate.mutable_outputs(0)->mutable_shm()->set_offset(2 << 20);
  auto queue_depth = [&] { return c_->Info()->exec_queued(); };

  absl::StatusOr<v1::ForwardResponse> first, queued;
  std::thread t1([&] { first = grpc_only()->Forward(gate); });
  while (runs[1] != 1.0f) std::this_thread::yield();  // the pool thread is busy
  const auto t2_start = std::chrono::steady_clock::now();
  std::thread t2([&] {
    queued = grpc_only(std::chrono::milliseconds(1000))->Forward(gate);
  });
  while (queue_depth() != 1) std::this_thread::yield();  // the second call waits

  auto third = c_->Forward(gate);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();

  // Small ops still run inline while the pool is stuck.
  auto small = Call("leaky_relu");
  *small.add_inputs()->add_tensors() = InlineTensor("float32", {2}, Bytes(std::vector<float>{-1, 1}));
  auto r = c_->Forward(small);
  EXPECT_TRUE(r.ok()) << r.status();

  t2.join();  // its 1 s deadline passes while it waits behind the first call
  EXPECT_EQ(queued.status().code(), absl::StatusCode::kDeadlineExceeded) << queued.status();
  // The server's copy of that deadline counts from when the call arrived,
  // a little after the client's: let it pass too before the pool moves on.
  std::this_thread::sleep_until(t2_start + std::chrono::milliseconds(1300));
  x[1] = 1.0f;  // release the first call
  t1.join();
  ASSERT_TRUE(first.ok()) << first.status();
  while (queue_depth() != 0) std::this_thread::yield();
  auto after = c_->Forward(gate);
  ASSERT_TRUE(after.ok()) << after.status();
  // The first call and this one ran; the expired one was dropped unrun.
  EXPECT_EQ(x[2], 2.0f) << "the expired call's kernel must not run";
}

TEST_F(ForwardIT, CliRunsNpyFiles) {
  Register("arith3");
  client::NpyArray x{"float32", {3}, Bytes(std::vector<float>{1, 2, 3})};
  client::NpyArray y{"float32", {3}, Bytes(std::vector<float>{2, 4, 6})};
  const std::string dir = tmp_.path();
  ASSERT_TRUE(client::WriteNpy(dir + "/x.npy", x).ok());
  ASSERT_TRUE(client::WriteNpy(dir + "/y.npy", y).ok());
  for (const std::string transport : {"shm", "inline"}) {
    auto run = daemon_->Cli({"run", "arith3", "--in", dir + "/x.npy", "--in", dir + "/y.npy",
                             "--out", dir + "/s.npy", "--out", dir + "/p.npy", "--transport",
                             transport});
    ASSERT_EQ(run.exit_code, 0) << run.err << daemon_->Log();
    auto p = client::ReadNpy(dir + "/p.npy");
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(Values<float>(p->data), (std::vector<float>{2, 8, 18})) << transport;
  }
  // A Fortran-ordered array is refused with a message saying what to do.
  {
    std::string bad = client::SerializeNpy(x);
    const auto pos = bad.find("'fortran_order': False");
    ASSERT_NE(pos, std::string::npos);
    bad.replace(pos, 22, "'fortran_order': True ");
    std::ofstream(dir + "/f.npy", std::ios::binary) << bad;
  }
  auto run = daemon_->Cli({"run", "arith3", "--in", dir + "/f.npy", "--in", dir + "/y.npy"});
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("Fortran"), std::string::npos) << run.err;
}

}  // namespace
}  // namespace opjit::testing

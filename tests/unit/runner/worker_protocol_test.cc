#include "server/runner/worker_protocol.h"

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "server/compiler/elf_symbols.h"
#include "server/compiler/kernel_compiler.h"

namespace opjit::runner {
namespace {

std::shared_ptr<compiler::CompiledKernel> Kernel() {
  auto k = std::make_shared<compiler::CompiledKernel>();
  k->cache_key = "abc123";
  k->object = std::string("\x7f" "ELF", 4) + std::string(100, 'x');
  k->libraries = {"libm.so.6"};
  k->defined_symbols = {"K", "KInit"};
  return k;
}

TEST(WireTest, KernelsAndInstancesRoundTrip) {
  auto k = Kernel();
  auto back = wire::DecodeKernel(wire::EncodeKernel(*k));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)->cache_key, k->cache_key);
  EXPECT_EQ((*back)->object, k->object);
  EXPECT_EQ((*back)->libraries, k->libraries);

  InstanceSpec spec;
  spec.ns = "alice";
  spec.label = "alice/op v2";
  spec.kernel = k;
  spec.entry = "K";
  spec.inputs = {{"float32", {2, 3}}, {"int64", {}}};
  spec.outputs = {{"float32", {2, 3}}};
  spec.attrs["alpha"] = 0.25;
  spec.attrs["axes"] = std::vector<int64_t>{0, -1};
  spec.attrs["name"] = std::string("x");
  std::map<std::string, std::shared_ptr<const compiler::CompiledKernel>> kernels = {
      {k->cache_key, k}};
  uint64_t id = 0;
  auto decoded = wire::DecodeInstance(wire::EncodeInstance(42, spec), &id, kernels);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(id, 42u);
  EXPECT_EQ(decoded->ns, "alice");
  EXPECT_EQ(decoded->inputs, spec.inputs);
  EXPECT_EQ(decoded->outputs, spec.outputs);
  EXPECT_EQ(decoded->attrs, spec.attrs);
  // Without the artifact the worker asks for it.
  EXPECT_TRUE(absl::IsNotFound(wire::DecodeInstance(wire::EncodeInstance(42, spec), &id, {}).status()));
}

// A target this build does not know is a protocol error, never a CPU kernel.
TEST(WireTest, AnUnknownTargetIsAnError) {
  std::string frame = wire::EncodeKernel(*Kernel());
  ASSERT_EQ(frame[0], static_cast<char>(registry::Target::kCpu));
  frame[0] = static_cast<char>(registry::Target::kGpu);
  EXPECT_EQ((*wire::DecodeKernel(frame))->target, registry::Target::kGpu);
  frame[0] = 7;
  auto back = wire::DecodeKernel(frame);
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(back.status().message(), "malformed kernel frame: unknown target 7");
}

// Truncations, bit flips and random bytes give errors, never a crash or a
// read past the input (ASan would say so).
TEST(WireTest, MalformedFramesAreErrors) {
  const std::string good = wire::EncodeKernel(*Kernel());
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(wire::DecodeKernel(good.substr(0, n)).ok()) << n;
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string bad = good;
    for (int k = 0; k < 4; ++k) bad[rng() % bad.size()] = static_cast<char>(rng());
    (void)wire::DecodeKernel(bad);  // any answer, but no crash
    std::string noise(rng() % 200, '\0');
    for (char& c : noise) c = static_cast<char>(rng());
    (void)wire::DecodeKernel(noise);
    uint64_t id;
    (void)wire::DecodeInstance(noise, &id, {});
  }
  wire::Reader r(std::string_view("\xff\xff\xff\xff\xff\xff\xff\x7f", 8));
  EXPECT_TRUE(r.Str().empty());  // a huge length prefix: refused, not allocated
  EXPECT_FALSE(r.ok());
}

// Frames from an executor are bounded before they are read (issue 26): a
// kernel writing a header that claims 1 GiB to fd 3 gets DATA_LOSS at once,
// not a 1 GiB buffer and a wait for bytes that never come.
TEST(WireTest, ExecutorFramesAreBoundedBeforeTheyAreRead) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const char huge[5] = {0, 0, 0, 0x40, 2};  // [len = 1 << 30][kDoorbell]
  ASSERT_EQ(::write(sv[0], huge, sizeof huge), 5);
  wire::Msg type;
  std::string payload;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = wire::RecvFrame(sv[1], &type, &payload, absl::Now() + absl::Seconds(30));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("executor channel"), std::string::npos) << s;
  EXPECT_EQ(payload.capacity(), std::string().capacity());
  ::close(sv[0]);
  ::close(sv[1]);

  // A kernel artifact is large one way only: the executor takes it, the
  // daemon would refuse the same frame from an executor.
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const std::string big(wire::kMaxFromExecutorBytes, 'k');
  std::thread writer([&] {
    EXPECT_TRUE(wire::SendFrame(sv[0], wire::Msg::kLoadKernel, big).ok());
    // Refused by the reader, which may close before all of it is sent.
    (void)wire::SendFrame(sv[0], wire::Msg::kReply, big);
  });
  int fd = -1;
  ASSERT_TRUE(wire::RecvFrame(sv[1], &type, &payload, absl::Now() + absl::Seconds(30), &fd,
                              wire::kToExecutor)
                  .ok());
  EXPECT_EQ(type, wire::Msg::kLoadKernel);
  EXPECT_EQ(payload, big);
  EXPECT_EQ(fd, -1);
  s = wire::RecvFrame(sv[1], &type, &payload, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  ::close(sv[1]);  // the writer may still be blocked on the refused frame
  writer.join();
  ::close(sv[0]);
}

TEST(ElfSymbolsTest, MalformedObjectsAreInvalidArgument) {
  EXPECT_EQ(compiler::ReadElfSymbols("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(compiler::ReadElfSymbols("not an elf file at all, but long enough to have a header...")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A header that points its section table far outside the buffer.
  std::string h(64, '\0');
  h[0] = 0x7f, h[1] = 'E', h[2] = 'L', h[3] = 'F', h[4] = 2, h[5] = 1, h[6] = 1;
  h[16] = 1;     // ET_REL
  h[18] = 62;    // EM_X86_64
  h[40] = 0x10;  // e_shoff = 0x10...
  h[47] = 0x7f;  // ... far away
  h[58] = 64;    // e_shentsize
  h[60] = 5;     // e_shnum
  EXPECT_EQ(compiler::ReadElfSymbols(h).status().code(), absl::StatusCode::kInvalidArgument);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 2000; ++i) {
    std::string b = h + std::string(rng() % 512, '\0');
    for (int k = 0; k < 6; ++k) b[rng() % b.size()] = static_cast<char>(rng());
    (void)compiler::ReadElfSymbols(b);  // never a crash
  }
}

}  // namespace
}  // namespace opjit::runner

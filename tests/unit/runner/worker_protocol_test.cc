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
  compiler::CpuObject* cpu = k->cpu_object();
  cpu->elf = std::string("\x7f" "ELF", 4) + std::string(100, 'x');
  cpu->libraries = {"libm.so.6"};
  cpu->defined_symbols = {"K", "KInit"};
  return k;
}

std::shared_ptr<compiler::CompiledKernel> GpuKernel() {
  auto k = std::make_shared<compiler::CompiledKernel>();
  k->target = registry::Target::kGpu;
  k->cache_key = "def456";
  compiler::GpuBinary& g = k->artifact.emplace<compiler::GpuBinary>();
  g.cubins = {{"sm_80", "cubin80"}, {"sm_90", "cubin90"}};
  g.ptx = "ptx";
  g.ptx_arch = "compute_80";
  g.lowered_names = {{"&saxpy<float>", "_Z5saxpyIfEvv"}};
  g.archs = {"sm_80", "sm_90"};
  return k;
}

TEST(WireTest, KernelsAndInstancesRoundTrip) {
  auto k = Kernel();
  auto back = wire::DecodeKernel(wire::EncodeKernel(*k));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)->cache_key, k->cache_key);
  ASSERT_NE((*back)->cpu_object(), nullptr);
  EXPECT_EQ((*back)->gpu(), nullptr);
  EXPECT_EQ((*back)->cpu_object()->elf, k->cpu_object()->elf);
  EXPECT_EQ((*back)->cpu_object()->libraries, k->cpu_object()->libraries);
  EXPECT_EQ((*back)->cpu_object()->defined_symbols, k->cpu_object()->defined_symbols);

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

// The kernel frame's layout, written out field by field: target, cache key,
// the CPU object's bytes, libraries and symbols (empty for a GPU binary), a
// flag, then the GPU binary's cubins, PTX, PTX arch, lowered names, shared
// object and archs. The sum type did not change a byte of it.
TEST(WireTest, TheKernelFrameKeepsItsLayout) {
  wire::Writer cpu;
  cpu.U8(static_cast<uint8_t>(registry::Target::kCpu));
  cpu.Str("abc123");
  cpu.Str(std::string("\x7f" "ELF", 4) + std::string(100, 'x'));
  cpu.Strs({"libm.so.6"});
  cpu.Strs({"K", "KInit"});
  cpu.U8(0);
  EXPECT_EQ(wire::EncodeKernel(*Kernel()), cpu.out());

  wire::Writer gpu;
  gpu.U8(static_cast<uint8_t>(registry::Target::kGpu));
  gpu.Str("def456");
  gpu.Str("");
  gpu.Strs({});
  gpu.Strs({});
  gpu.U8(1);
  gpu.Count(2);
  for (const char* s : {"sm_80", "cubin80", "sm_90", "cubin90"}) gpu.Str(s);
  gpu.Str("ptx");
  gpu.Str("compute_80");
  gpu.Count(1);
  gpu.Str("&saxpy<float>");
  gpu.Str("_Z5saxpyIfEvv");
  gpu.Str("");
  gpu.Strs({"sm_80", "sm_90"});
  EXPECT_EQ(wire::EncodeKernel(*GpuKernel()), gpu.out());

  auto back = wire::DecodeKernel(gpu.out());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)->cpu_object(), nullptr);
  ASSERT_NE((*back)->gpu(), nullptr);
  EXPECT_EQ((*back)->gpu()->cubins, GpuKernel()->gpu()->cubins);
  EXPECT_EQ((*back)->gpu()->lowered_names, GpuKernel()->gpu()->lowered_names);
  EXPECT_EQ((*back)->gpu()->archs, GpuKernel()->gpu()->archs);
  EXPECT_EQ((*back)->binary_bytes(), GpuKernel()->binary_bytes());
}

// A frame with both a CPU object and a GPU binary is malformed: a kernel is
// one or the other.
TEST(WireTest, AFrameWithBothArtifactsIsAnError) {
  wire::Writer both;
  both.U8(static_cast<uint8_t>(registry::Target::kGpu));
  both.Str("k");
  both.Str("elf");
  both.Strs({});
  both.Strs({});
  both.U8(1);
  both.Count(0);
  both.Str("ptx");
  both.Str("compute_80");
  both.Count(0);
  both.Str("");
  both.Strs({});
  ASSERT_TRUE(both.out().size() > 0);
  auto back = wire::DecodeKernel(both.out());
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss);
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

#include "server/runner/worker_protocol.h"

#include <random>

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

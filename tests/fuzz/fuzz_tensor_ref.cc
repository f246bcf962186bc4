// Tensor references resolved against shared-memory regions (every shm input
// and output of a call). Two regions map the same shm object, the second at
// an offset. Invariants: refusals are input errors; a resolved view lies
// inside its region's mapping, has exactly ByteSize(dtype, shape) bytes and
// is aligned to its element size; Overlaps is symmetric and sees overlaps
// across the two mappings by object offset.
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/tensor/region.h"
#include "server/tensor/tensor_ref.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using opjit::fuzz::IsInputError;
using opjit::tensor::Region;

constexpr uint64_t kObjectBytes = 1 << 16;
constexpr uint64_t kSecondOffset = 4096;

struct Regions {
  std::shared_ptr<const Region> whole, window;
};

const Regions& TheRegions() {
  static const Regions* r = [] {
    const std::string key = "/opjit-fuzz-tensor-ref-" + std::to_string(::getpid());
    opjit::tensor::RegionInfo info;
    info.ns = "default";
    info.name = "a";
    auto whole = Region::CreateShm(key, kObjectBytes, info);
    FUZZ_CHECK(whole.ok());
    info.name = "b";
    auto window = Region::MapExisting(key, kSecondOffset, kObjectBytes - kSecondOffset, info);
    FUZZ_CHECK(window.ok());
    // The mappings outlive the name: nothing is left in /dev/shm at exit.
    ::shm_unlink(key.c_str());
    return new Regions{std::shared_ptr<const Region>(std::move(*whole)),
                       std::shared_ptr<const Region>(std::move(*window))};
  }();
  return *r;
}

const char* const kDtypes[] = {"float32", "float64", "float16", "int8",  "int16",  "int32",
                               "int64",   "uint8",   "uint16",  "uint32", "uint64", "bool",
                               "complex64", "", "float32\0x"};

opjit::tensor::TensorRef Ref(FuzzedDataProvider& in, const std::string& region) {
  opjit::tensor::TensorRef ref;
  ref.region = in.ConsumeBool() ? region : in.ConsumeRandomLengthString(16);
  ref.offset = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint64_t>(0, kObjectBytes + 64)
                                : in.ConsumeIntegral<uint64_t>();
  ref.dtype = kDtypes[in.ConsumeIntegralInRange<size_t>(0, std::size(kDtypes) - 1)];
  const int rank = in.ConsumeIntegralInRange<int>(0, 40);
  for (int i = 0; i < rank; ++i) {
    ref.shape.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 300)
                                         : in.ConsumeIntegral<int64_t>());
  }
  return ref;
}

void CheckView(const opjit::tensor::TensorView& v, const Region& r,
               const opjit::tensor::TensorRef& ref) {
  auto nbytes = opjit::tensor::ByteSize(ref.dtype, ref.shape);
  FUZZ_CHECK(nbytes.ok());
  FUZZ_CHECK(v.nbytes == *nbytes);
  const auto* p = static_cast<const uint8_t*>(v.data);
  FUZZ_CHECK(p >= r.data());
  FUZZ_CHECK(static_cast<uint64_t>(p - r.data()) <= r.size());
  FUZZ_CHECK(v.nbytes <= r.size() - static_cast<uint64_t>(p - r.data()));
  auto elem = opjit::tensor::DtypeSize(ref.dtype);
  FUZZ_CHECK(elem.ok());
  FUZZ_CHECK(reinterpret_cast<uintptr_t>(p) % *elem == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Regions& regions = TheRegions();
  FuzzedDataProvider in(data, size);
  const auto a_ref = Ref(in, "a");
  const auto b_ref = Ref(in, "b");
  auto a = opjit::tensor::Resolve(regions.whole, a_ref, "inputs[0]");
  auto b = opjit::tensor::Resolve(regions.window, b_ref, "outputs[0]");
  if (!a.ok()) FUZZ_CHECK(IsInputError(a.status()));
  if (!b.ok()) FUZZ_CHECK(IsInputError(b.status()));
  if (a.ok()) CheckView(*a, *regions.whole, a_ref);
  if (b.ok()) CheckView(*b, *regions.window, b_ref);
  if (a.ok() && b.ok()) {
    const bool ab = opjit::tensor::Overlaps(*a, *b);
    FUZZ_CHECK(ab == opjit::tensor::Overlaps(*b, *a));
    // By object offsets: a at [a.offset, +n), b at [4096 + b.offset, +m).
    const uint64_t a0 = a_ref.offset, a1 = a0 + a->nbytes;
    const uint64_t b0 = kSecondOffset + b_ref.offset, b1 = b0 + b->nbytes;
    const bool expect = a->nbytes > 0 && b->nbytes > 0 && a0 < b1 && b0 < a1;
    FUZZ_CHECK(ab == expect);
  }
  return 0;
}

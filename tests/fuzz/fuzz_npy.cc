// .npy parsing (the CLI's and C++ client's tensors from files). Invariants:
// refusals are input errors; a parsed array is valid (dtype, shape, exactly
// the bytes its shape needs) and survives a serialize/parse round trip.
#include <cstdint>
#include <string_view>

#include "client/cpp/npy.h"
#include "tests/fuzz/fuzz_util.h"

using opjit::fuzz::IsInputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto a = opjit::client::ParseNpy(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!a.ok()) {
    FUZZ_CHECK(IsInputError(a.status()));
    return 0;
  }
  FUZZ_CHECK(opjit::client::ValidateNpyArray(*a).ok());
  auto b = opjit::client::ParseNpy(opjit::client::SerializeNpy(*a));
  FUZZ_CHECK(b.ok());
  FUZZ_CHECK(b->dtype == a->dtype);
  FUZZ_CHECK(b->shape == a->shape);
  FUZZ_CHECK(b->data == a->data);
  return 0;
}

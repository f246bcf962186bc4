// Attr text parsing (defaults in specs, text attrs on calls). Invariants:
// refusals are input errors; a parsed value has the type asked for, and its
// formatted text parses back to the same text (values round-trip).
#include <cstdint>
#include <string>

#include "server/registry/attr_value.h"
#include "tests/fuzz/fuzz_util.h"

using opjit::fuzz::IsInputError;
using opjit::registry::ValueType;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (1 << 16)) return 0;
  // Every value type, "all" (MindSpore's any kind) included.
  constexpr int kTypes = static_cast<int>(ValueType::kAll) + 1;
  const auto type = static_cast<ValueType>(data[0] % kTypes);
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  auto v = opjit::registry::ParseAttrValue(type, text);
  if (!v.ok()) {
    FUZZ_CHECK(IsInputError(v.status()));
    return 0;
  }
  // "all" keeps the kind the text has; the value then round-trips as that kind.
  const ValueType kind = opjit::registry::ValueTypeOf(*v);
  FUZZ_CHECK(type == ValueType::kAll ? kind != ValueType::kAll : kind == type);
  FUZZ_CHECK(opjit::registry::AttrValueMatches(type, *v));
  const std::string formatted = opjit::registry::FormatAttrValue(*v);
  auto again = opjit::registry::ParseAttrValue(kind, formatted);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(opjit::registry::FormatAttrValue(*again) == formatted);
  return 0;
}

#include "server/common/text.h"

#include "absl/strings/str_cat.h"

namespace opjit {

absl::string_view Utf8Prefix(absl::string_view s, size_t max) {
  if (s.size() <= max) return s;
  size_t n = max;
  // Step back over continuation bytes (10xxxxxx) to the start of the
  // character that straddles the cut, then drop that character.
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}

std::string Excerpt(absl::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  return absl::StrCat(Utf8Prefix(s, max), "...(", s.size(), " bytes)");
}

std::string HumanBytes(size_t n) {
  if (n < 1024) return absl::StrCat(n, n == 1 ? " byte" : " bytes");
  // One decimal, rounded down: "1.9 KiB" is never more than was there.
  const size_t unit = n < 1024 * 1024 ? 1024 : 1024 * 1024;
  const size_t tenths = n / unit * 10 + n % unit * 10 / unit;  // no overflow
  return absl::StrCat(tenths / 10, ".", tenths % 10, unit == 1024 ? " KiB" : " MiB");
}

}  // namespace opjit

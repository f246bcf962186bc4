#include "server/common/codec.h"

#include "absl/strings/str_cat.h"

namespace opjit::codec {

void Writer::U32(uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  Raw(b, sizeof b);
}

void Writer::U64(uint64_t v) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  Raw(b, sizeof b);
}

void Writer::F64(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  U64(bits);
}

bool Reader::Take(void* out, size_t n) {
  if (!ok_ || in_.size() < n) {
    ok_ = false;
    std::memset(out, 0, n);
    return false;
  }
  std::memcpy(out, in_.data(), n);
  in_.remove_prefix(n);
  return true;
}

uint8_t Reader::U8() {
  uint8_t v;
  Take(&v, 1);
  return v;
}

uint32_t Reader::U32() {
  unsigned char b[4];
  Take(b, sizeof b);
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{b[i]} << (8 * i);
  return v;
}

uint64_t Reader::U64() {
  unsigned char b[8];
  Take(b, sizeof b);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{b[i]} << (8 * i);
  return v;
}

double Reader::F64() {
  const uint64_t bits = U64();
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

uint32_t Reader::Count(size_t min_bytes) {
  const uint32_t n = U32();
  if (!ok_) return 0;
  if (min_bytes == 0) min_bytes = 1;
  if (n > in_.size() / min_bytes) {
    ok_ = false;
    return 0;
  }
  return n;
}

std::string_view Reader::StrView() {
  const uint32_t n = Count(1);
  if (!ok_) return {};
  std::string_view s = in_.substr(0, n);
  in_.remove_prefix(n);
  return s;
}

std::string Reader::Str() { return std::string(StrView()); }

std::vector<std::string> Reader::Strs() {
  // Each string takes at least its 4-byte length.
  std::vector<std::string> v(Count(4));
  for (auto& s : v) {
    s = Str();
    if (!ok_) return {};
  }
  return v;
}

absl::Status Reader::Finish(std::string_view what) const {
  if (done()) return absl::OkStatus();
  return Malformed(what, channel_);
}

absl::Status Malformed(std::string_view what, std::string_view channel) {
  // Debian's absl::string_view is not std::string_view.
  return absl::DataLossError(absl::StrCat("malformed ", absl::string_view(what.data(), what.size()),
                                          " on the ",
                                          absl::string_view(channel.data(), channel.size())));
}

}  // namespace opjit::codec

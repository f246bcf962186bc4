#include "server/common/text.h"

#include <gtest/gtest.h>

#include <string>

namespace opjit {
namespace {

// Whether `s` is well-formed UTF-8 (enough for the cuts below: sequence
// lengths and continuation bytes).
bool WellFormedUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

TEST(ExcerptTest, ShortTextIsKeptWhole) {
  EXPECT_EQ(Excerpt(""), "");
  EXPECT_EQ(Excerpt("float32"), "float32");
  const std::string exact(kExcerptBytes, 'x');
  EXPECT_EQ(Excerpt(exact), exact);
}

TEST(ExcerptTest, LongTextKeepsItsStartAndSaysHowLongItWas) {
  const std::string ns(100000, 'n');
  const std::string e = Excerpt(ns);
  EXPECT_EQ(e, std::string(kExcerptBytes, 'n') + "...(100000 bytes)");
  EXPECT_EQ(Excerpt(std::string(65, 'a'), 8), "aaaaaaaa...(65 bytes)");
}

TEST(ExcerptTest, NeverCutsInsideAUtf8Character) {
  // "é" is 2 bytes, "€" 3, "𝄞" 4: cut at every byte count.
  const std::string text = std::string("a\xC3\xA9\xE2\x82\xAC\xF0\x9D\x84\x9E") + "zzzz";
  for (size_t max = 0; max < text.size(); ++max) {
    const std::string e = Excerpt(text, max);
    EXPECT_TRUE(WellFormedUtf8(e)) << "max " << max;
    EXPECT_LE(Utf8Prefix(text, max).size(), max);
  }
  EXPECT_EQ(Utf8Prefix(text, 2), "a");
  EXPECT_EQ(Utf8Prefix(text, 3), "a\xC3\xA9");
  EXPECT_EQ(Utf8Prefix(text, 5), "a\xC3\xA9");
  EXPECT_EQ(Utf8Prefix(text, 9), "a\xC3\xA9\xE2\x82\xAC");
  EXPECT_EQ(Utf8Prefix(text, 10), "a\xC3\xA9\xE2\x82\xAC\xF0\x9D\x84\x9E");
}

TEST(HumanBytesTest, RoundsDownToATenth) {
  EXPECT_EQ(HumanBytes(0), "0 bytes");
  EXPECT_EQ(HumanBytes(1), "1 byte");
  EXPECT_EQ(HumanBytes(1023), "1023 bytes");
  EXPECT_EQ(HumanBytes(1024), "1.0 KiB");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(2047), "1.9 KiB");
  EXPECT_EQ(HumanBytes(1024 * 1024), "1.0 MiB");
  EXPECT_EQ(HumanBytes(size_t{5} << 30), "5120.0 MiB");
}

}  // namespace
}  // namespace opjit

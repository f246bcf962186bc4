// The fast channel's layout has one home, proto/opjit/wire/fast_channel.h.
// The Python client cannot include it, so client/python/opjit/_fast.py
// mirrors it by hand; these tests read that file and check every constant,
// offset and struct format in it against the header, so the two cannot
// drift apart silently.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "proto/opjit/wire/fast_channel.h"

namespace opjit::fast {
namespace {

std::string ReadMirror() {
  std::ifstream in(OPJIT_SOURCE_DIR "/client/python/opjit/_fast.py");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t b = item.find_first_not_of(' ');
    const size_t e = item.find_last_not_of(' ');
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

// The module-level integer constants: `NAME = 12` and `A, B = 1, 2` lines
// (a trailing comment is allowed).
std::map<std::string, uint64_t> Constants(const std::string& py) {
  std::map<std::string, uint64_t> out;
  const std::regex line(R"(^([A-Z][A-Z0-9_]*(?:, *[A-Z][A-Z0-9_]*)*) = ((?:0x[0-9A-Fa-f]+|[0-9_]+)(?:, *(?:0x[0-9A-Fa-f]+|[0-9_]+))*) *(?:#.*)?$)");
  std::istringstream in(py);
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (!std::regex_match(l, m, line)) continue;
    const auto names = SplitCommas(m[1]);
    const auto values = SplitCommas(m[2]);
    if (names.size() != values.size()) continue;
    for (size_t i = 0; i < names.size(); ++i) {
      std::string v = values[i];
      std::erase(v, '_');
      out[names[i]] = std::stoull(v, nullptr, 0);
    }
  }
  return out;
}

// The format of `NAME = struct.Struct("...")`, or "" when there is none.
std::string StructFormat(const std::string& py, const std::string& name) {
  std::smatch m;
  const std::regex re("\n" + name + R"re( = struct\.Struct\("([^"]*)"\))re");
  return std::regex_search(py, m, re) ? m[1].str() : "";
}

// A field as Python's struct sees it: offset and format character.
using Field = std::pair<size_t, char>;

// What a little-endian, unaligned ("<") struct format lays out from `base`.
std::vector<Field> Layout(const std::string& format, size_t base) {
  std::vector<Field> out;
  EXPECT_FALSE(format.empty());
  if (format.empty()) return out;
  EXPECT_EQ(format[0], '<') << "the mirror must use little-endian, unpadded formats";
  static const std::map<char, size_t> kSize = {{'i', 4}, {'I', 4}, {'q', 8}, {'Q', 8}, {'d', 8}};
  size_t at = base;
  for (char c : format.substr(1)) {
    auto it = kSize.find(c);
    EXPECT_NE(it, kSize.end()) << "format character " << c;
    if (it == kSize.end()) return out;
    out.push_back({at, c});
    at += it->second;
  }
  return out;
}

// The format character of a member type.
template <typename T>
constexpr char Code() {
  if constexpr (std::is_same_v<T, double>) return 'd';
  if constexpr (std::is_same_v<T, int32_t>) return 'i';
  if constexpr (std::is_same_v<T, uint32_t> || std::is_same_v<T, std::atomic<uint32_t>>) return 'I';
  if constexpr (std::is_same_v<T, int64_t>) return 'q';
  if constexpr (std::is_same_v<T, uint64_t>) return 'Q';
  return '?';
}
#define OPJIT_FIELD(type, member) \
  Field { offsetof(type, member), Code<decltype(type::member)>() }

TEST(FastLayoutMirror, TheMirrorIsReadable) {
  const std::string py = ReadMirror();
  ASSERT_FALSE(py.empty()) << "cannot read client/python/opjit/_fast.py";
  EXPECT_GE(Constants(py).size(), 30u);
}

TEST(FastLayoutMirror, ConstantsMatchTheHeader) {
  const auto c = Constants(ReadMirror());
  const std::map<std::string, uint64_t> want = {
      {"MAGIC", kMagic},           {"VERSION", kVersion},
      {"HEADER_BYTES", kHeaderBytes}, {"SLOT_BYTES", kSlotBytes},
      {"REASON_BYTES", kReasonBytes}, {"MESSAGE_BYTES", kMessageBytes},
      {"FREE", kFree},             {"SUBMITTED", kSubmitted},
      {"RUNNING", kRunning},       {"DONE", kDone},
      {"F_KEEP_OUTPUT_BYTES", kKeepOutputBytes},
  };
  for (const auto& [name, value] : want) {
    auto it = c.find(name);
    ASSERT_NE(it, c.end()) << name << " is missing from _fast.py";
    EXPECT_EQ(it->second, value) << name;
  }
}

TEST(FastLayoutMirror, EveryHeaderAndSlotOffsetMatches) {
  const auto c = Constants(ReadMirror());
  const std::map<std::string, size_t> want = {
      {"H_MAGIC", offsetof(Header, magic)},
      {"H_VERSION", offsetof(Header, version)},
      {"H_SLOTS", offsetof(Header, n_slots)},
      {"H_SLOT_BYTES", offsetof(Header, slot_bytes)},
      {"H_MAX_TENSORS", offsetof(Header, max_tensors)},
      {"H_WORKER_PID", offsetof(Header, worker_pid)},
      {"H_DOORBELL", offsetof(Header, doorbell)},
      {"H_WORKER_SLEEPING", offsetof(Header, worker_sleeping)},
      {"H_CLOSED", offsetof(Header, closed)},
      {"H_SPIN_US", offsetof(Header, spin_us)},
      {"S_STATE", offsetof(Slot, state)},
      {"S_CLIENT_WAITING", offsetof(Slot, client_waiting)},
      {"S_N_TENSORS", offsetof(Slot, n_tensors)},
      {"S_FLAGS", offsetof(Slot, flags)},
      {"S_HANDLE", offsetof(Slot, handle)},
      {"S_SEQ", offsetof(Slot, seq)},
      {"S_DEADLINE", offsetof(Slot, deadline_ns)},
      {"S_CODE", offsetof(Slot, code)},
      {"S_MESSAGE_LEN", offsetof(Slot, message_len)},
      {"S_KERNEL_MS", offsetof(Slot, kernel_ms)},
      {"S_REASON", offsetof(Slot, reason)},
      {"S_MESSAGE", offsetof(Slot, message)},
      {"S_TENSORS", offsetof(Slot, tensors)},
  };
  // Every offset the mirror names is checked, so a new one needs a row here.
  for (const auto& [name, value] : c) {
    if (name.rfind("H_", 0) == 0 || name.rfind("S_", 0) == 0) {
      auto it = want.find(name);
      ASSERT_NE(it, want.end()) << name << " in _fast.py has no counterpart in this test";
      EXPECT_EQ(value, it->second) << name;
    }
  }
  for (const char* name : {"H_MAGIC", "H_DOORBELL", "H_SPIN_US", "S_STATE", "S_HANDLE",
                           "S_DEADLINE", "S_CODE", "S_REASON", "S_MESSAGE", "S_TENSORS"}) {
    EXPECT_TRUE(c.count(name)) << name << " is missing from _fast.py";
  }
}

TEST(FastLayoutMirror, StructFormatsLayTheFieldsWhereTheHeaderHasThem) {
  const std::string py = ReadMirror();
  EXPECT_EQ(Layout(StructFormat(py, "_HEADER"), 0),
            (std::vector<Field>{OPJIT_FIELD(Header, magic), OPJIT_FIELD(Header, version),
                                OPJIT_FIELD(Header, n_slots), OPJIT_FIELD(Header, slot_bytes),
                                OPJIT_FIELD(Header, max_tensors),
                                OPJIT_FIELD(Header, worker_pid)}));
  EXPECT_EQ(Layout(StructFormat(py, "_REQUEST"), offsetof(Slot, n_tensors)),
            (std::vector<Field>{OPJIT_FIELD(Slot, n_tensors), OPJIT_FIELD(Slot, flags),
                                OPJIT_FIELD(Slot, handle), OPJIT_FIELD(Slot, seq),
                                OPJIT_FIELD(Slot, deadline_ns)}));
  EXPECT_EQ(Layout(StructFormat(py, "_REPLY"), offsetof(Slot, code)),
            (std::vector<Field>{OPJIT_FIELD(Slot, code), OPJIT_FIELD(Slot, message_len),
                                OPJIT_FIELD(Slot, kernel_ms)}));
  // A tensor reference is (region, offset), two uint64 each.
  EXPECT_EQ(sizeof(TensorRef), 16u);
  EXPECT_NE(py.find(R"(struct.Struct("<%dQ" % (2 * n)))"), std::string::npos);
}

// The parser itself: a drifted mirror is caught, not read as matching.
TEST(FastLayoutMirror, AChangedOffsetInTheMirrorIsSeen) {
  std::string py = ReadMirror();
  const std::string from = "S_CODE, S_MESSAGE_LEN, S_KERNEL_MS, S_REASON, S_MESSAGE, S_TENSORS = 40,";
  const size_t at = py.find(from);
  ASSERT_NE(at, std::string::npos);
  py.replace(at, from.size(), "S_CODE, S_MESSAGE_LEN, S_KERNEL_MS, S_REASON, S_MESSAGE, S_TENSORS = 44,");
  EXPECT_EQ(Constants(py).at("S_CODE"), 44u);
  EXPECT_NE(Constants(py).at("S_CODE"), offsetof(Slot, code));
  EXPECT_NE(Layout("<iId", 44), (std::vector<Field>{OPJIT_FIELD(Slot, code),
                                                   OPJIT_FIELD(Slot, message_len),
                                                   OPJIT_FIELD(Slot, kernel_ms)}));
}

}  // namespace
}  // namespace opjit::fast

// The byte codec of opjit's own binary messages: the executor channel
// (server/runner/worker_protocol.h) and the compile-worker channel
// (server/compiler/cpu/ipc.h). Frames carry these payloads (frame_io.h).
//
// Encoding: integers little-endian, fixed width; a string is a u32 byte
// length then the bytes; a list is a u32 count then its elements.
//
// Trust. A payload may come from a hostile process (a kernel runs inside the
// executor). The Reader treats every length, count and offset as hostile: it
// never reads past its input, and a count is checked against the bytes left
// before anything is reserved, so no input can make it allocate more than
// about the size of the input. The first failure sticks: every later read
// returns zero or empty, and ok() stays false.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace opjit::codec {

// Builds a payload. Not thread-safe.
class Writer {
 public:
  void U8(uint8_t v) { Raw(&v, 1); }
  void Bool(bool v) { U8(v ? 1 : 0); }
  void U32(uint32_t v);
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void U64(uint64_t v);
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void F64(double v);
  // A list's element count (u32). A count past 2^32 - 1 cannot be encoded;
  // such a payload is far over every channel's frame limit, and the frame
  // writer refuses it.
  void Count(size_t n) { U32(static_cast<uint32_t>(n)); }
  void Str(std::string_view s) {
    Count(s.size());
    out_.append(s.data(), s.size());
  }
  void Strs(const std::vector<std::string>& v) {
    Count(v.size());
    for (const auto& s : v) Str(s);
  }
  std::string& out() { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};

// Reads a payload in order. `channel` names the channel in errors (for
// example "executor channel"); it must outlive the Reader. Not thread-safe.
class Reader {
 public:
  explicit Reader(std::string_view in, std::string_view channel = "channel")
      : in_(in), channel_(channel) {}

  uint8_t U8();
  bool Bool() { return U8() != 0; }
  uint32_t U32();
  int32_t I32() { return static_cast<int32_t>(U32()); }
  uint64_t U64();
  int64_t I64() { return static_cast<int64_t>(U64()); }
  double F64();
  // A list's element count, where each element takes at least `min_bytes`
  // (>= 1) bytes of the payload: a count the bytes left cannot hold fails
  // the reader and returns 0, so a caller may reserve or resize to it.
  uint32_t Count(size_t min_bytes);
  std::string Str();
  // The string's bytes, pointing into the input (valid as long as it is).
  std::string_view StrView();
  std::vector<std::string> Strs();

  // Fails the reader (for a value the caller finds out of range).
  void Fail() { ok_ = false; }
  bool ok() const { return ok_; }
  // ok() and the whole input consumed.
  bool done() const { return ok_ && in_.empty(); }
  size_t left() const { return in_.size(); }
  // OK when done(); otherwise DATA_LOSS "malformed <what> on the <channel>".
  absl::Status Finish(std::string_view what) const;

 private:
  bool Take(void* out, size_t n);
  std::string_view in_;
  std::string_view channel_;
  bool ok_ = true;
};

// Whether [offset, offset + length) lies within [0, size), without overflow.
inline bool RangeInside(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

// DATA_LOSS with "malformed <what> on the <channel>" (never a host path).
absl::Status Malformed(std::string_view what, std::string_view channel);

}  // namespace opjit::codec

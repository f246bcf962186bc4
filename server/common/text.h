// Bounding text that came from outside (a client's names and values, a
// compiler's output) before it goes into an error message, a log line or a
// status trailer. A gRPC status travels in HTTP/2 metadata, which clients cap
// at 8 KiB by default, so an error that echoes a 100,000-character input
// whole never reaches its client.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace opjit {

// The default for Excerpt(): enough to recognise a name, short enough that a
// message quoting a few of them stays a line.
inline constexpr size_t kExcerptBytes = 64;

// `s` itself when it holds at most `max` bytes; otherwise its first `max`
// bytes (cut back to a UTF-8 character boundary, so the result is valid UTF-8
// when `s` is) followed by "...(N bytes)", N being s.size(). Use it wherever
// an error quotes user input: Excerpt(name) instead of name.
std::string Excerpt(absl::string_view s, size_t max = kExcerptBytes);

// The longest prefix of `s` with at most `max` bytes that does not end inside
// a UTF-8 sequence (continuation bytes are dropped back to the lead byte).
absl::string_view Utf8Prefix(absl::string_view s, size_t max);

// A byte count for people: "812 bytes", "3.4 KiB", "12.0 MiB".
std::string HumanBytes(size_t n);

}  // namespace opjit

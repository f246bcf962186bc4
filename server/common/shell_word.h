// One argument as a word of a POSIX shell command line, for the lines opjit
// prints to be run again (verify's `reproduce:`): left as it is when every
// byte is plain, else single-quoted with each ' written as '\''.
#pragma once

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/ascii.h"

namespace opjit {

inline std::string ShellWord(const std::string& arg) {
  const bool plain = !arg.empty() && std::all_of(arg.begin(), arg.end(), [](char ch) {
    return absl::ascii_isalnum(static_cast<unsigned char>(ch)) || std::strchr("_./@:=,+-", ch);
  });
  if (plain) return arg;
  std::string out = "'";
  for (char ch : arg) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

}  // namespace opjit

#include "server/compiler/cpu/preamble.h"

#include <algorithm>
#include <string>

namespace opjit::compiler {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }
bool IsIdent(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// Whether a backslash-newline (or backslash-CR-LF) starts at `i`; sets its
// length.
bool Continuation(std::string_view s, size_t i, size_t* len) {
  if (s[i] != '\\') return false;
  if (i + 1 < s.size() && s[i + 1] == '\n') {
    *len = 2;
    return true;
  }
  if (i + 2 < s.size() && s[i + 1] == '\r' && s[i + 2] == '\n') {
    *len = 3;
    return true;
  }
  return false;
}

// Reads one logical line from `*pos`: continuations joined, comments turned
// into a space (a block comment may span lines). Returns false when a block
// comment does not end, or a literal runs past its line.
bool ReadLogicalLine(std::string_view s, size_t* pos, std::string* code) {
  size_t i = *pos;
  code->clear();
  while (i < s.size()) {
    size_t len = 0;
    char c = s[i];
    if (Continuation(s, i, &len)) {
      i += len;
      continue;
    }
    if (c == '\n') {
      ++i;
      break;
    }
    if (c == '/' && i + 1 < s.size() && s[i + 1] == '*') {
      size_t end = s.find("*/", i + 2);
      if (end == std::string_view::npos) return false;
      i = end + 2;
      *code += ' ';
      continue;
    }
    if (c == '/' && i + 1 < s.size() && s[i + 1] == '/') {
      // To the end of the line; a continuation extends a line comment.
      i += 2;
      while (i < s.size()) {
        if (Continuation(s, i, &len)) {
          i += len;
        } else if (s[i] == '\n') {
          break;
        } else {
          ++i;
        }
      }
      *code += ' ';
      continue;
    }
    if (c == '"' || c == '\'') {
      *code += c;
      ++i;
      while (i < s.size() && s[i] != c) {
        if (s[i] == '\n') return false;
        if (s[i] == '\\' && i + 1 < s.size()) {
          if (Continuation(s, i, &len)) {
            i += len;
            continue;
          }
          *code += s[i++];
        }
        *code += s[i++];
      }
      if (i >= s.size()) return false;
      *code += s[i++];
      continue;
    }
    *code += c;
    ++i;
  }
  *pos = i;
  return true;
}

}  // namespace

Preamble ComputePreamble(std::string_view source) {
  Preamble best;
  std::string directives;
  bool has_include = false;
  int depth = 0;
  size_t pos = 0;
  std::string code;
  while (pos < source.size()) {
    size_t next = pos;
    if (!ReadLogicalLine(source, &next, &code)) break;
    std::string_view line = Trim(code);
    if (!line.empty()) {
      if (line.front() != '#') break;
      std::string_view rest = Trim(line.substr(1));
      size_t n = 0;
      while (n < rest.size() && IsIdent(rest[n])) ++n;
      std::string_view name = rest.substr(0, n);
      if (name == "include") {
        has_include = true;
      } else if (name == "define" || name == "undef" || name.empty()) {
        // a definition, or the null directive
      } else if (name == "if" || name == "ifdef" || name == "ifndef") {
        ++depth;
      } else if (name == "elif" || name == "else" || name == "elifdef" || name == "elifndef") {
        if (depth == 0) break;
      } else if (name == "endif") {
        if (depth == 0) break;
        --depth;
      } else {
        break;  // #pragma, #line, #error, #include_next, ...: not a preamble's
      }
      directives.append(line);
      directives += '\n';
    }
    pos = next;
    if (depth == 0) {
      best.bytes = pos;
      best.directives = directives;
      best.has_include = has_include;
    }
  }
  return best;
}

namespace {

enum class Reach { kYes, kNo, kEnd };

// StartsWithInclude's walk of one file (`depth`: files entered).
Reach ReachInclude(std::string_view source, std::string_view header,
                   const std::function<const std::string*(std::string_view)>& file, int depth) {
  if (depth > 8) return Reach::kNo;
  size_t pos = 0;
  std::string code;
  int guards = 0;         // open include guards (#ifndef X #define X)
  std::string guard;      // the macro an #ifndef just named, awaiting its #define
  bool first = true;      // no directive yet in this file
  while (pos < source.size()) {
    if (!ReadLogicalLine(source, &pos, &code)) return Reach::kNo;
    std::string_view line = Trim(code);
    if (line.empty()) continue;
    if (line.front() != '#') return Reach::kNo;
    std::string_view rest = Trim(line.substr(1));
    size_t n = 0;
    while (n < rest.size() && IsIdent(rest[n])) ++n;
    const std::string_view name = rest.substr(0, n);
    const std::string_view arg = Trim(rest.substr(n));
    const bool was_first = first;
    first = false;
    if (!guard.empty()) {
      // Only `#define X` may follow `#ifndef X`.
      if (name != "define" || arg != guard) return Reach::kNo;
      guard.clear();
      ++guards;
      continue;
    }
    if (name == "pragma" && arg == "once") continue;
    if (name == "ifndef" && was_first && !arg.empty() &&
        std::all_of(arg.begin(), arg.end(), IsIdent)) {
      guard = std::string(arg);
      continue;
    }
    if (name == "endif" && guards > 0) {
      --guards;
      continue;
    }
    if (name != "include" || arg.size() < 3) return Reach::kNo;
    const char close = arg.front() == '<' ? '>' : arg.front() == '"' ? '"' : 0;
    if (close == 0 || arg.back() != close) return Reach::kNo;
    const std::string_view target = arg.substr(1, arg.size() - 2);
    if (target == header) return Reach::kYes;
    // An extra file is searched first, <> or "": read through it.
    const std::string* content = file(target);
    if (content == nullptr) {
      if (close == '>') continue;  // another header, included first as written
      return Reach::kNo;
    }
    const Reach r = ReachInclude(*content, header, file, depth + 1);
    if (r != Reach::kEnd) return r;
  }
  return guard.empty() ? Reach::kEnd : Reach::kNo;
}

}  // namespace

bool StartsWithInclude(std::string_view source, std::string_view header,
                       const std::function<const std::string*(std::string_view)>& file) {
  return ReachInclude(source, header, file, 0) == Reach::kYes;
}

std::string BlankPreamble(std::string_view source, size_t bytes) {
  std::string out(source);
  if (bytes > out.size()) bytes = out.size();
  for (size_t i = 0; i < bytes; ++i) {
    if (out[i] != '\n') out[i] = ' ';
  }
  return out;
}

}  // namespace opjit::compiler

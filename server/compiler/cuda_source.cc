#include "server/compiler/cuda_source.h"

#include <algorithm>
#include <cstddef>

#include "absl/strings/str_cat.h"

namespace opjit::compiler {
namespace {

bool IsIdentChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}
bool IsIdentStart(char c) { return IsIdentChar(c) && !(c >= '0' && c <= '9'); }
bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

bool IsStringPrefix(std::string_view p) { return p == "u8" || p == "u" || p == "U" || p == "L"; }
bool IsRawPrefix(std::string_view p) {
  return p == "R" || p == "u8R" || p == "uR" || p == "UR" || p == "LR";
}

void Blank(std::string* out, size_t from, size_t to) {
  for (size_t k = from; k < to && k < out->size(); ++k) {
    if ((*out)[k] != '\n') (*out)[k] = ' ';
  }
}

struct Token {
  std::string_view text;
  size_t pos = 0;
};

// The tokens of `stripped` outside preprocessor directives: identifiers and
// numbers whole, everything else one character each.
std::vector<Token> Tokenize(std::string_view s) {
  std::vector<Token> out;
  bool line_start = true;
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '\n') {
      line_start = true;
      ++i;
      continue;
    }
    if (IsSpace(c)) {
      ++i;
      continue;
    }
    if (line_start && c == '#') {
      // A directive runs to the end of the line, backslash-newlines included.
      while (i < s.size() && s[i] != '\n') {
        if (s[i] == '\\' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
        ++i;
      }
      continue;
    }
    line_start = false;
    size_t j = i + 1;
    if (IsIdentChar(c)) {
      const bool number = !IsIdentStart(c);
      while (j < s.size() && (IsIdentChar(s[j]) || (number && (s[j] == '\'' || s[j] == '.')))) ++j;
    }
    out.push_back({s.substr(i, j - i), i});
    i = j;
  }
  return out;
}

int LineOf(std::string_view s, size_t pos) {
  return 1 + static_cast<int>(std::count(s.begin(), s.begin() + std::min(pos, s.size()), '\n'));
}

// Whether the original text between `from` and `to` (blanks in the stripped
// copy: comments and literals) holds the literal "C".
bool HasCLinkageLiteral(std::string_view original, size_t from, size_t to) {
  std::string_view gap = original.substr(from, to - from);
  return gap.find("\"C\"") != std::string_view::npos;
}

bool IsKeywordMacro(std::string_view id) {
  return id == "__attribute__" || id == "__declspec" || id == "alignas" || id == "decltype" ||
         id == "__launch_bounds__" || id == "__cluster_dims__" || id == "__maxnreg__" ||
         id == "noexcept" || id == "throw";
}

struct Decl {
  size_t end = 0;              // the token after the declaration
  bool host_function = false;  // a definition of a host function
  std::string name;
  size_t name_pos = 0;
};

// The index after the brace group that opens at tokens[i] ("{").
size_t SkipBraces(const std::vector<Token>& t, size_t i) {
  int depth = 0;
  for (; i < t.size(); ++i) {
    if (t[i].text == "{") ++depth;
    if (t[i].text == "}" && --depth == 0) return i + 1;
  }
  return t.size();
}

// One declaration with C linkage, from tokens[i] to its ";" or its body's
// "}".
Decl ParseDecl(const std::vector<Token>& t, size_t i, bool default_device) {
  Decl d;
  int depth = 0;
  bool function = false, initializer = false;
  bool global = false, device = false;
  for (; i < t.size(); ++i) {
    const std::string_view x = t[i].text;
    if (x == "(" || x == "[") {
      if (x == "(" && depth == 0 && !function && !initializer && i > 0 &&
          IsIdentStart(t[i - 1].text[0]) && !IsKeywordMacro(t[i - 1].text)) {
        function = true;
        d.name = std::string(t[i - 1].text);
        d.name_pos = t[i - 1].pos;
      }
      ++depth;
      continue;
    }
    if (x == ")" || x == "]") {
      depth = std::max(0, depth - 1);
      continue;
    }
    if (depth > 0) continue;
    if (x == "__global__") global = true;
    if (x == "__device__") device = true;
    if (x == "=") initializer = true;
    if (x == ";") {
      d.end = i + 1;
      return d;
    }
    if (x == "}") {  // the end of an enclosing block: not ours
      d.end = i;
      return d;
    }
    if (x == "{") {
      if (function && !initializer) {
        d.host_function = !global && !device && !default_device;
        d.end = SkipBraces(t, i);
        return d;
      }
      i = SkipBraces(t, i) - 1;  // a struct body or a braced initializer
    }
  }
  d.end = t.size();
  return d;
}

// A `<<<` ... `>>>` kernel launch in `s` (stripped): its position and the
// kernel's name when it is a plain one.
std::optional<std::pair<size_t, std::string>> FindLaunch(const std::string& s) {
  const size_t last_close = s.rfind(">>>");
  if (last_close == std::string::npos) return std::nullopt;
  for (size_t at = s.find("<<<"); at != std::string::npos && at + 3 <= last_close;
       at = s.find("<<<", at + 3)) {
    if (at > 0 && s[at - 1] == '<') continue;
    size_t p = at;
    while (p > 0 && IsSpace(s[p - 1])) --p;
    if (p == 0) continue;
    const char prev = s[p - 1];
    std::string name;
    if (prev == '>') {
      // Kernel<T, 4><<<...>>>: the name before the template arguments.
      int depth = 0;
      size_t q = p;
      while (q > 0) {
        --q;
        if (s[q] == '>') ++depth;
        if (s[q] == '<' && --depth == 0) break;
      }
      while (q > 0 && IsSpace(s[q - 1])) --q;
      size_t b = q;
      while (b > 0 && IsIdentChar(s[b - 1])) --b;
      name = s.substr(b, q - b);
    } else if (IsIdentChar(prev)) {
      size_t b = p;
      while (b > 0 && IsIdentChar(s[b - 1])) --b;
      name = s.substr(b, p - b);
      if (name == "operator") continue;  // operator<< <T>
      if (!IsIdentStart(name[0])) continue;  // 1<<<...: not a launch
    } else if (prev != ')' && prev != ']') {
      continue;
    }
    return std::make_pair(at, name);
  }
  return std::nullopt;
}

}  // namespace

std::string StripCommentsAndLiterals(std::string_view src) {
  std::string out(src);
  const size_t n = src.size();
  // The identifier or pp-number being read: where it starts (npos: none), and
  // whether it is a number (which keeps ' and . inside: 1'000'000, 1.5).
  size_t run = std::string_view::npos;
  bool number = false;
  size_t i = 0;
  while (i < n) {
    const char c = src[i];
    if (c == '/' && i + 1 < n && src[i + 1] == '/') {
      size_t j = i + 2;
      while (j < n && src[j] != '\n') {
        if (src[j] == '\\' && j + 1 < n && src[j + 1] == '\n') ++j;  // continued
        ++j;
      }
      Blank(&out, i, j);
      i = j;
      run = std::string_view::npos;
      continue;
    }
    if (c == '/' && i + 1 < n && src[i + 1] == '*') {
      size_t end = src.find("*/", i + 2);
      end = end == std::string_view::npos ? n : end + 2;
      Blank(&out, i, end);
      i = end;
      run = std::string_view::npos;
      continue;
    }
    if (c == '\'' && run != std::string_view::npos && number) {
      ++i;  // a digit separator: 1'000'000
      continue;
    }
    if (c == '"' || c == '\'') {
      const size_t start = run == std::string_view::npos ? i : run;
      const std::string_view prefix = src.substr(start, i - start);
      run = std::string_view::npos;
      if (c == '"' && IsRawPrefix(prefix)) {
        // R"delim( ... )delim": the delimiter is at most 16 characters.
        const size_t open = src.substr(0, std::min(n, i + 18)).find('(', i + 1);
        size_t end = n;
        if (open != std::string_view::npos) {
          const std::string close = ")" + std::string(src.substr(i + 1, open - i - 1)) + "\"";
          const size_t f = src.find(close, open + 1);
          if (f != std::string_view::npos) end = f + close.size();
        } else {
          end = src.find('\n', i);
          if (end == std::string_view::npos) end = n;
        }
        Blank(&out, start, end);
        i = end;
        continue;
      }
      size_t j = i + 1;
      while (j < n && src[j] != c && src[j] != '\n') {
        if (src[j] == '\\' && j + 1 < n) ++j;
        ++j;
      }
      if (j < n && src[j] == c) ++j;
      Blank(&out, IsStringPrefix(prefix) ? start : i, j);
      i = j;
      continue;
    }
    if (IsIdentChar(c)) {
      if (run == std::string_view::npos) {
        run = i;
        number = !IsIdentStart(c);
      }
    } else if (!(c == '.' && run != std::string_view::npos && number)) {
      run = std::string_view::npos;
    }
    ++i;
  }
  return out;
}

std::string HostCodeSite::Describe() const {
  if (kind == Kind::kKernelLaunch) {
    return absl::StrCat("a <<<...>>> kernel launch", function.empty() ? "" : " of ", function,
                        " (line ", line, ")");
  }
  return absl::StrCat("the extern \"C\" host function ", function, " (line ", line, ")");
}

std::optional<HostCodeSite> FindHostCode(std::string_view source, bool default_device) {
  const std::string s = StripCommentsAndLiterals(source);
  std::optional<HostCodeSite> best;
  if (auto launch = FindLaunch(s)) {
    best = HostCodeSite{HostCodeSite::Kind::kKernelLaunch, LineOf(s, launch->first), launch->second};
  }
  if (default_device) return best;
  const std::vector<Token> t = Tokenize(s);
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i].text != "extern" || i + 1 >= t.size()) continue;
    const size_t after = t[i].pos + t[i].text.size();
    if (!HasCLinkageLiteral(source, after, t[i + 1].pos)) continue;
    std::optional<Decl> host;
    size_t next = i + 1;
    if (t[i + 1].text == "{") {
      size_t j = i + 2;
      while (j < t.size() && t[j].text != "}") {
        Decl d = ParseDecl(t, j, default_device);
        if (d.host_function && !host) host = d;
        j = std::max(d.end, j + 1);
      }
      next = j;
    } else {
      Decl d = ParseDecl(t, i + 1, default_device);
      if (d.host_function) host = d;
      next = d.end;
    }
    if (host) {
      const int line = LineOf(s, host->name_pos);
      if (!best || line < best->line) {
        best = HostCodeSite{HostCodeSite::Kind::kHostFunction, line, host->name};
      }
      break;
    }
    i = std::max(i, next == 0 ? i : next - 1);
  }
  return best;
}

bool HasDefaultDeviceOption(const std::vector<std::string>& options) {
  return std::any_of(options.begin(), options.end(), [](const std::string& o) {
    return o == "-default-device" || o == "--device-as-default-execution-space";
  });
}

}  // namespace opjit::compiler

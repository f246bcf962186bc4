// The preamble of a C++ kernel source: its leading block of preprocessor
// directives (as clangd computes one), which opjit precompiles once and
// reuses for every kernel with the same block. No hidden prelude: a kernel
// compiles exactly as `clang++ -std=c++17 -O3 kernel.cc` would; the PCH only
// makes that faster.
//
// The preamble is the longest prefix made of blank lines, comments and the
// directives #include, #define, #undef, #if, #ifdef, #ifndef, #elif, #else
// and #endif, ending where every conditional is closed. Anything else
// (#pragma, #line, a declaration, ...) ends it. A compile that uses the PCH
// blanks those bytes of the main file (newlines stay, so line numbers do
// not move); one that cannot use it compiles the source unchanged.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace opjit::compiler {

struct Preamble {
  // Bytes of the source the preamble covers (0: none).
  size_t bytes = 0;
  // Its directives, one per line, comments removed, continuations joined:
  // the text the PCH is built from and keyed by.
  std::string directives;
  // Whether it includes anything (otherwise a PCH would not pay off).
  bool has_include = false;
};

Preamble ComputePreamble(std::string_view source);

// `source` with its first `bytes` bytes blanked: every byte but '\n'
// becomes a space.
std::string BlankPreamble(std::string_view source, size_t bytes);

// Whether `source` reaches `#include <header>` (or "header") before anything
// that could change what the header means, so that a PCH of the header alone,
// loaded ahead of the source (-include-pch), compiles it as it is written:
// its include guard (#pragma once) then skips the source's own #include.
// Before it may come only blank lines, comments, `#pragma once`, an include
// guard (`#ifndef X` `#define X` opening a file, its `#endif`), `#include
// <...>` of other headers, and an include of one of the compile's extra
// files (`file(name)` gives its content, null when it is not one), read
// through by the same rules. Any other directive, code, or a quoted
// include of something else answers false.
bool StartsWithInclude(std::string_view source, std::string_view header,
                       const std::function<const std::string*(std::string_view)>& file);

}  // namespace opjit::compiler

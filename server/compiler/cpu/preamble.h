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

}  // namespace opjit::compiler

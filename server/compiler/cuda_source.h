// What a CUDA source needs to compile: NVRTC compiles device code only, so a
// .cu file with host code (MindSpore's aot kernels: an extern "C" entry that
// launches a __global__ kernel with <<<...>>>) has to go through nvcc. This
// looks at the text, after comments and string literals are taken out; it
// does not preprocess, so host code that only a macro expands to is not seen
// (NVRTC then fails, and its error says how to pick nvcc).
//
// Pure functions; no state, thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace opjit::compiler {

// `source` with every comment and every string and character literal
// (raw strings and encoding prefixes included) replaced by spaces, newlines
// kept: the result has the same length and the same line numbers. A comment
// also stands for a space, as in the language (`a/**/b` gives `a    b`).
// Unterminated literals and comments run to the end of the line (literals)
// or of the text (block comments).
std::string StripCommentsAndLiterals(std::string_view source);

// Where a source has host code.
struct HostCodeSite {
  enum class Kind {
    kKernelLaunch,    // `kernel<<<grid, block>>>(...)`
    kHostFunction,    // an extern "C" function definition that is neither
                      // __global__ nor __device__
  };
  Kind kind;
  int line = 0;          // 1-based
  std::string function;  // kHostFunction: its name; kKernelLaunch: the kernel's, if simple
  // "a <<<...>>> kernel launch (line 12)" / "the extern \"C\" host function
  // CustomAdd (line 9)".
  std::string Describe() const;
};

// The first host code in `source`, or nullopt when it looks like device code
// only (what NVRTC compiles). With `default_device` (NVRTC's -default-device:
// unannotated functions are __device__), only a kernel launch is host code.
// What counts:
//   - a `<<<` ... `>>>` launch after a name, `>`, `)` or `]` (not
//     `operator<<<`), anywhere outside comments and literals, preprocessor
//     lines included (a launching macro);
//   - a definition (with a body) of a function with C linkage, in
//     `extern "C" int f(...) {...}` or inside an `extern "C" { ... }` block,
//     unless it is marked __global__ or __device__. `__host__ __device__` is
//     device code to NVRTC; `__host__` alone is host code. Declarations
//     without a body and variables are not.
std::optional<HostCodeSite> FindHostCode(std::string_view source, bool default_device = false);

// Whether compile `options` make unannotated functions device functions
// (NVRTC's -default-device / --device-as-default-execution-space).
bool HasDefaultDeviceOption(const std::vector<std::string>& options);

}  // namespace opjit::compiler

// Reads the symbol table of an ELF64 relocatable object without loading it.
//
// The daemon never maps user code (kernels run in executor processes), yet
// it must answer "does this object define its entry?" and "will it link?" at
// registration time. Both are questions about the symbol table, which this
// reads with every offset and size checked against the buffer: a malformed
// or hostile object gives INVALID_ARGUMENT, never a read out of bounds.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace opjit::compiler {

struct ElfSymbols {
  // Global or weak symbols the object defines (functions, data, and symbols
  // of no type), sorted and unique: what a loader can find by name.
  std::vector<std::string> defined;
  // The strong, default-visibility global functions and data of `defined`:
  // what an error message lists as "the object defines".
  std::vector<std::string> exported;
  // Global (non-weak) symbols the object uses but does not define, sorted.
  std::vector<std::string> undefined;

  bool Defines(std::string_view name) const;
};

// INVALID_ARGUMENT when `object` is not a little-endian x86-64 ELF64
// relocatable object or any table in it lies outside the buffer.
absl::StatusOr<ElfSymbols> ReadElfSymbols(std::string_view object);

}  // namespace opjit::compiler

// Test helper: compiles kernel sources to ELF objects with clang 16, the way
// opjit's compile worker would (same flags), in a subprocess.
#pragma once

#include <string>
#include <vector>

namespace opjit::testing {

// Compiles `source` (language "c++" or "c") to an object and returns its bytes.
// Fails the current test (and returns "") when clang fails.
std::string CompileKernel(const std::string& source, const std::string& language = "c++",
                          const std::vector<std::string>& extra_flags = {});

}  // namespace opjit::testing

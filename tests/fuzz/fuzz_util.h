// Shared by the libFuzzer targets: a failed invariant aborts, which libFuzzer
// reports as a crash with the input that caused it.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"

#define FUZZ_CHECK(cond)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "fuzz invariant failed at %s:%d: %s\n", __FILE__,    \
                   __LINE__, #cond);                                            \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

namespace opjit::fuzz {

// Parsers answer bad input with INVALID_ARGUMENT (or OUT_OF_RANGE), never
// with an internal error or a code that blames the server.
inline bool IsInputError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInvalidArgument ||
         s.code() == absl::StatusCode::kOutOfRange;
}

}  // namespace opjit::fuzz

// What a request means when it leaves a field empty: the one place for the
// target and language defaults of compiles, registrations and calls.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/registry/op_def.h"

namespace opjit::core {

// The target a request names: CPU when it names none; "CPU"/"GPU" in either
// case. Otherwise INVALID_ARGUMENT `target: unknown "x" (expected CPU or GPU)`
// (the name quoted as an excerpt).
absl::StatusOr<registry::Target> TargetOrDefault(const std::string& name);

// The language a request names, or the target's when it names none: "cuda"
// for GPU, "c++" for CPU.
std::string LanguageOrDefault(const std::string& language, registry::Target target);

}  // namespace opjit::core

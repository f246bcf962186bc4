// Unguessable identifiers from the kernel's CSPRNG.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace opjit {

// 128 random bits (getrandom) as 32 lowercase hex digits. Fails only if the
// kernel's random source does.
absl::StatusOr<std::string> RandomHex128();

}  // namespace opjit

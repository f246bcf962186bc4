#include "server/core/defaults.h"

#include "absl/strings/str_cat.h"
#include "server/common/text.h"

namespace opjit::core {

absl::StatusOr<registry::Target> TargetOrDefault(const std::string& name) {
  if (name.empty()) return registry::Target::kCpu;
  auto t = registry::ParseTarget(name);
  if (!t) {
    return absl::InvalidArgumentError(
        absl::StrCat("target: unknown \"", Excerpt(name), "\" (expected CPU or GPU)"));
  }
  return *t;
}

std::string LanguageOrDefault(const std::string& language, registry::Target target) {
  if (!language.empty()) return language;
  return target == registry::Target::kGpu ? "cuda" : "c++";
}

}  // namespace opjit::core

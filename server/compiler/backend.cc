// What every compile backend shares, and the registration of the built-in
// ones: adding a backend adds one line to MakeDefaultBackends.
#include "server/compiler/backend.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"

namespace opjit::compiler {

absl::Status CompileBackend::ValidateOptions(const std::string& language,
                                             const std::vector<std::string>& options,
                                             const std::string& field) const {
  for (size_t k = 0; k < options.size(); ++k) {
    std::string why = OptionRefusal(language, options[k]);
    if (!why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", k, "]: option \"",
                                                     Excerpt(options[k]), "\" is refused: ", why));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<BackendSet> MakeDefaultBackends(const KernelCompilerOptions& options) {
  BackendSet set;
  OPJIT_ASSIGN_OR_RETURN(set[registry::Target::kCpu], MakeCpuBackend(options));
  set[registry::Target::kGpu] = MakeGpuBackend(options);
  return set;
}

}  // namespace opjit::compiler

#include "server/registry/store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/sha256.h"
#include "server/registry/canonical.h"

namespace opjit::registry {

absl::StatusOr<OpRecord> DecodeRow(const std::string& where, const std::string& ns,
                                   const std::string& name, int64_t version,
                                   const std::string& hash, const std::string& json,
                                   int64_t created_unix_ms) {
  std::string row = absl::StrCat(where, ": row ", ns, "/", name, " version ", version);
  auto def = FromJson(json);
  if (!def.ok()) {
    return absl::DataLossError(absl::StrCat(row, " does not parse: ", def.status().message()));
  }
  if (def->ns != ns || def->name != name) {
    return absl::DataLossError(
        absl::StrCat(row, " holds the definition of ", def->ns, "/", def->name));
  }
  // The stored text must be exactly the canonical form the hash covers.
  if (Sha256Hex(json) != hash || ToJson(*def) != json) {
    return absl::DataLossError(absl::StrCat(row, " does not match its content hash"));
  }
  OpRecord rec;
  rec.def = std::move(*def);
  rec.version = version;
  rec.content_hash = hash;
  rec.created_unix_ms = created_unix_ms;
  return rec;
}

absl::Status VersionsQuotaExceeded(const OpDef& def, size_t limit) {
  return QuotaExceeded("versions", absl::StrCat(limit), def.ns,
                       absl::StrCat("op \"", def.name,
                                    "\" already has that many versions; "
                                    "delete old ones (DeleteOp with a version) first"));
}

absl::Status OpsQuotaExceeded(const OpDef& def, size_t limit) {
  return QuotaExceeded("ops", absl::StrCat(limit), def.ns,
                       "the namespace already holds that many ops; delete some first");
}

}  // namespace opjit::registry

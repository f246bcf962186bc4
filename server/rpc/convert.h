// Conversion between opjit.v1 protobuf messages and the core's domain types.
// Protobuf stops here: everything below the rpc layer speaks domain types.
#pragma once

#include "absl/status/statusor.h"
#include "opjit/v1/op.pb.h"
#include "server/registry/op_def.h"

namespace opjit::rpc {

// Maps a wire OpDef to the domain type. Unknown vocabulary ("param_type":
// "sometimes") is INVALID_ARGUMENT naming the field, e.g.
// `inputs[1].param_type: unknown "sometimes" (expected required, optional or dynamic)`.
// Semantic checks are left to registry::ValidateOpDef.
absl::StatusOr<registry::OpDef> OpDefFromProto(const v1::OpDef& proto);

void OpDefToProto(const registry::OpDef& def, v1::OpDef* proto);
void OpRecordToProto(const registry::OpRecord& record, bool with_sources, v1::OpRecord* proto);

}  // namespace opjit::rpc

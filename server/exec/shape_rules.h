// Output shapes from an op's declarative rules (same_as, broadcast, reduce,
// explicit). The kernel's own InferShape is handled by the executor.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/registry/op_def.h"

namespace opjit::exec {

using Shape = std::vector<int64_t>;

// numpy broadcasting of `shapes`; INVALID_ARGUMENT naming the dims that clash.
absl::StatusOr<Shape> BroadcastShapes(const std::vector<Shape>& shapes);

// The shape of output `output` under `rule`. `inputs` holds the shape of each
// declared input's first tensor; `present` is false for inputs with no shape
// to take (absent optional inputs, null tensors: see TensorArg::Null);
// `attrs` the call's resolved attrs.
absl::StatusOr<Shape> ApplyShapeRule(const registry::OutputRule& rule, int output,
                                     const std::vector<Shape>& inputs,
                                     const std::vector<bool>& present,
                                     const std::map<std::string, registry::AttrValue>& attrs);

}  // namespace opjit::exec

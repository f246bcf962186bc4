// The canonical JSON form of an OpDef: what the store persists and what the
// content hash covers.
//
// ToJson() writes every field, always, in a fixed key order, with no
// whitespace, so equal definitions give byte-identical text and equal hashes.
// Enums use their wire spellings ("required", "listInt", "CPU",
// "same_as_input"). Nothing is normalised: an empty format stays empty.
//
//   {"ns":..,"name":..,
//    "inputs":[{"index":0,"name":"x","param_type":"required"}],
//    "outputs":[..],
//    "attrs":[{"name":..,"param_type":..,"value_type":..,"default_value":..}],
//    "dtype_formats":[[["float32","DefaultFormat"],..],..],
//    "implementations":[{"target":"CPU","language":"c++","source":..,"entry":..,
//                        "compile_options":[..],"libraries":[..],"attr_names":[..]}],
//    "output_rules":[{"kind":"reduce","input":0,"inputs":[],"axis_attr":"axis",
//                     "keep_dim":false,"keep_dim_attr":"","shape":[],"dtype":""}],
//    "backward":{"op":..,"save_for_backward":[..],"non_differentiable":[..],
//                "materialize_grads":true},
//    "doc":..}
//
// FromJson() accepts that form. Missing keys take the OpDef defaults; unknown
// keys and wrongly typed values are errors, so a typo is never silently lost.
//
// Thread-safe (pure functions).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/registry/op_def.h"

namespace opjit::registry {

// The canonical JSON text of `def`. Strings that are not valid UTF-8 (which
// ValidateOpDef refuses) have the bad bytes replaced by U+FFFD.
std::string ToJson(const OpDef& def);

// Parses JSON text in the form ToJson() writes. INVALID_ARGUMENT with the path
// of the bad field ("implementations[0].target: expected CPU or GPU, got
// \"TPU\"") when it does not fit. Does not validate the definition: call
// ValidateOpDef() for that.
absl::StatusOr<OpDef> FromJson(std::string_view json);

// SHA-256 hex of ToJson(def).
std::string ContentHash(const OpDef& def);

// Wire spellings of OutputRule::Kind: same_as_input, broadcast, reduce,
// explicit, infer_shape.
const char* OutputRuleKindName(OutputRule::Kind kind);
std::optional<OutputRule::Kind> ParseOutputRuleKind(const std::string& s);

}  // namespace opjit::registry

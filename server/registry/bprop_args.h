// The arguments of a bprop op: which forward inputs, outputs and output
// grads it takes, and in which order (OpDef::backward.inputs).
//
// MindSpore's bprop is `bprop(x, y, out, dout)`; ported bprops often take a
// subset, e.g. `square_grad(x, dout)`. A forward op names its bprop and, in
// backward.inputs, the bprop's inputs:
//   "x"         a forward input (or output) by name
//   "in:x"      a forward input, explicitly
//   "out:y"     a forward output, explicitly
//   "grad:y"    the grad of output y ("dout:y" is the same)
//   "out"       every output, in order (when no tensor is named "out")
//   "dout"      every output grad, in order (when no tensor is named "dout")
// Empty: (every input, every output, every output grad), MindSpore's full
// signature. The bprop gives one grad per forward input, in order.
#ifndef OPJIT_SERVER_REGISTRY_BPROP_ARGS_H_
#define OPJIT_SERVER_REGISTRY_BPROP_ARGS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/registry/op_def.h"

namespace opjit::registry {

struct BpropArg {
  enum class Kind { kInput, kOutput, kGrad };
  Kind kind = Kind::kInput;
  size_t index = 0;  // into the forward's inputs (kInput) or outputs
  bool operator==(const BpropArg&) const = default;
};

// The bprop's inputs of `fwd`, in order. INVALID_ARGUMENT naming
// backward.inputs[i] for an entry that names no tensor of the op.
absl::StatusOr<std::vector<BpropArg>> ResolveBpropArgs(const OpDef& fwd);

// How an argument reads in messages: "x", "out:y", "grad:y".
std::string BpropArgName(const OpDef& fwd, const BpropArg& arg);

// Checks the registered bprop `bprop` against the forward op `fwd` that
// names it: it declares one input per bprop argument and one output per
// forward input, and for each of fwd's dtype_formats rows it has a row with
// the matching dtypes (an empty dtype, MindSpore's None_None, matches any).
// FAILED_PRECONDITION with reason BPROP_MISMATCH saying what differs.
absl::Status CheckBpropSignature(const OpDef& fwd, const OpDef& bprop);

}  // namespace opjit::registry

#endif  // OPJIT_SERVER_REGISTRY_BPROP_ARGS_H_

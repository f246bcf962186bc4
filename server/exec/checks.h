// Checking one forward call against its op version, and the keys the
// executor caches by. Pure functions of the call and the op definition: no
// kernel runs here.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "server/exec/executor.h"
#include "server/registry/registry.h"

namespace opjit::compiler {
struct CompiledKernel;
}

namespace opjit::exec {

// "ns/name".
std::string OpName(const registry::OpDef& def);

// What the executor keeps per op version and target once the kernel is at
// hand, so a call of a cached op skips the compile cache (its key hashing
// and header checks) and the parsing of attr defaults.
struct OpPlan {
  std::shared_ptr<const registry::OpRecord> record;
  const registry::Implementation* impl = nullptr;  // in record
  int impl_index = 0;
  std::shared_ptr<const compiler::CompiledKernel> kernel;
  std::map<std::string, registry::AttrValue> defaults;
};

// What checking a call against its op version found. It depends only on the
// call's shape (namespace, op, version, target, input dtypes and shapes,
// attrs), so it is shared by every later call of the same shape while the
// registry is unchanged (see ShapeKey). Pointers point into `record`.
struct Checked {
  std::shared_ptr<const registry::OpRecord> record;
  const registry::Implementation* impl = nullptr;
  std::map<std::string, registry::AttrValue> attrs;
  absl::InlinedVector<const registry::TensorParam*, 4> input_params;  // one per flat input
  std::vector<bool> present;                                          // per declared input
  // Per declared input: present with data, so a shape rule can read its
  // shape (false for a null tensor, TensorArg::Null).
  std::vector<bool> shaped;
  absl::InlinedVector<const std::string*, 4> output_dtypes;
  uint64_t input_bytes = 0;
  // Set once the kernel is at hand, before the entry is shared.
  std::shared_ptr<const OpPlan> plan;
  uint64_t registry_generation = 0;
  // The output descriptors (rules, or the kernel's InferShape once).
  std::vector<TensorDesc> out_descs;
  // The kernel instance; not owned: the instance cache decides its life
  // (kernel data is destroyed on eviction), and an expired one is looked up
  // again.
  std::weak_ptr<runner::KernelInstance> instance;
};

// Per call: the call's input descriptors, flattened (dynamic groups
// expanded), pointing into the call.
using FlatInputs = absl::InlinedVector<const TensorDesc*, 4>;
void Flatten(const ForwardCall& call, FlatInputs* flat);
std::vector<TensorDesc> FlatInputDescs(const FlatInputs& flat);
// The shape of each declared input's first tensor (empty if absent), for
// declarative output rules.
std::vector<std::vector<int64_t>> FirstShapes(const ForwardCall& call);

// Counts (required, optional, dynamic), dtypes, and the dtype_format the
// call matches (which gives the output dtypes). INVALID_ARGUMENT naming the
// input and what was expected.
absl::Status CheckInputs(const ForwardCall& call, const registry::OpDef& def, Checked* c);
// The op's attr defaults, parsed once per op version.
absl::StatusOr<std::map<std::string, registry::AttrValue>> ParseDefaults(const registry::OpDef& def);
// Known attrs, their types (text parsed, typed values coerced), required
// ones present; defaults filled in. INVALID_ARGUMENT otherwise.
absl::Status CheckAttrs(const ForwardCall& call, const registry::OpDef& def,
                        const std::map<std::string, registry::AttrValue>& defaults, Checked* c);

// Binary cache keys: exact, and cheap to build on every call.
//
// The call-shape key: everything Checked depends on besides the registry's
// contents. Tensor placement, offsets and bytes are not in it.
std::string ShapeKey(const ForwardCall& call);
// The plan key: the record's address (the plan holds the record, so the
// address is not reused while the entry lives) and the target.
std::string PlanKey(const registry::OpRecord* record, registry::Target target);
// A kernel instance: the namespace (whose executors run it: two namespaces
// never share an instance, even of the same code), the artifact's content
// key, the entry, the input dtypes and shapes, and the attrs.
std::string InstanceKey(const std::string& ns, const std::string& kernel_key, const std::string& entry,
                        absl::Span<const TensorDesc* const> inputs,
                        const std::map<std::string, registry::AttrValue>& attrs);

}  // namespace opjit::exec

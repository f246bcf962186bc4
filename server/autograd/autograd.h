// Autograd: backward through registered bprop ops, with MindSpore's bprop
// convention and Paddle PyLayer semantics.
//
//   - A forward in which any input requires a grad, of an op that names a
//     backward op, keeps a context: copies of the forward inputs and outputs
//     the bprop needs (Backward::save_for_backward; all when empty), the
//     forward's attrs and the requires_grad flags. Copies, not references:
//     the caller may reuse its buffers at once. A context costs the bytes of
//     the tensors it saved; the contexts of a namespace are bounded
//     (Options::namespace_bytes, RESOURCE_EXHAUSTED beyond it) and expire
//     after Options::ttl_ms.
//   - Such a forward of an op WITHOUT a backward op runs too; its outputs are
//     not differentiable. It keeps a context that holds no tensors, and a
//     backward through it fails with FAILED_PRECONDITION, reason
//     NOT_DIFFERENTIABLE (metadata: op, version), naming the op.
//   - When no input requires a grad, no context is kept and a backward is
//     refused with FAILED_PRECONDITION.
//   - Backward runs the bprop op on (forward inputs..., forward outputs...,
//     output grads...) and returns one grad per forward input; inputs that
//     did not require a grad get none (the bprop's value is dropped).
//     Positions are MindSpore's: every forward tensor keeps its slot, so
//     nparam and the indices do not depend on save_for_backward. A tensor
//     not saved is a null slot (exec::TensorArg::Null): params[i] ==
//     nullptr, ndims[i] == 0, dtypes[i] its dtype. Missing output grads are
//     zero-filled (materialize_grads, the default) or null slots; grads
//     given for non-differentiable outputs are treated as missing. Only an
//     optional forward input that was absent in the forward has no slot (as
//     in the forward).
//   - The context is released after its backward unless retain is asked for.
//   - create_graph runs the bprop itself with a context (requiring a grad
//     for each of its inputs that has data), so a bprop that has a backward
//     of its own gives double backward.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/exec/executor.h"

namespace opjit::registry {
class Registry;
}

namespace opjit::autograd {

struct AutogradOptions {
  // A context unused for this long is released. Default: 10 minutes.
  int64_t ttl_ms = 600000;
  // Bytes of saved tensors per namespace. Default: 1 GiB.
  uint64_t namespace_bytes = 1ull << 30;
  // Bytes of saved tensors of all namespaces together. 0: none.
  // Default: 0 (opjitd sets 4 GiB).
  uint64_t total_bytes = 0;
  // Threads that run gradchecks (each runs many forwards). Default: 1.
  int gradcheck_threads = 1;
};

struct GradForwardResult {
  exec::ForwardResult forward;
  std::string context_id;  // empty: no context kept
};

struct BackwardCall {
  std::string ns = "default";
  std::string principal;  // as exec::ForwardCall::principal
  runner::Caller quarantine_caller;  // as exec::ForwardCall::quarantine_caller
  std::string context_id;
  // One per forward output; nullopt: a missing grad.
  std::vector<std::optional<exec::TensorArg>> grad_outputs;
  bool retain_context = false;
  bool create_graph = false;
  std::vector<exec::OutputPlacement> outputs;
  // As exec::ForwardCall::keep_output_bytes, for the bprop's outputs.
  bool keep_output_bytes = false;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

struct BackwardResult {
  // One per declared forward input: the grads of its tensors, or empty.
  std::vector<std::vector<exec::OutputResult>> grad_inputs;
  double kernel_ms = 0;
  double server_ms = 0;
  std::string context_id;  // create_graph: a context on the bprop op
  // One sentence each: e.g. a nonzero grad the bprop returned for an input
  // that needs none, dropped (backward.stop_gradient_grads = "warn").
  std::vector<std::string> warnings;
};

struct GradCheckCall {
  std::string ns = "default";
  std::string principal;  // as exec::ForwardCall::principal
  runner::Caller quarantine_caller;  // as exec::ForwardCall::quarantine_caller
  std::string op;
  int64_t version = 0;
  // Inputs to check at (one group per declared input; may hold inline bytes
  // owned by the caller); empty: random inputs.
  std::vector<std::vector<exec::TensorArg>> inputs;
  std::map<std::string, exec::AttrArg> attrs;
  std::vector<int64_t> random_shape = {4};
  uint64_t seed = 0;
  double eps = 0, atol = 0, rtol = 0;  // 0: defaults for the dtype
  // Checked before every evaluation: past it, DEADLINE_EXCEEDED.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

// Elements a gradcheck may perturb (two forward calls each); more is
// RESOURCE_EXHAUSTED before any call runs.
inline constexpr size_t kMaxGradCheckElements = 4096;

struct GradCheckInput {
  std::string name;
  double max_abs_error = 0, max_rel_error = 0;
  bool passed = true;
  int64_t worst_index = -1;
  double analytic = 0, numeric = 0;
};

struct GradCheckResult {
  bool passed = true;
  std::string dtype;
  std::vector<GradCheckInput> inputs;
  std::string message;
};

class Autograd {
 public:
  using ForwardCallback = std::function<void(absl::StatusOr<GradForwardResult>)>;
  using BackwardCallback = std::function<void(absl::StatusOr<BackwardResult>)>;
  using GradCheckCallback = std::function<void(absl::StatusOr<GradCheckResult>)>;

  // Neither pointer is owned; both must outlive the Autograd.
  static absl::StatusOr<std::unique_ptr<Autograd>> Create(const AutogradOptions& options,
                                                          registry::Registry* registry,
                                                          exec::Executor* executor);
  ~Autograd();

  // A forward; `requires_grad` has one flag per declared input, or is empty.
  void ForwardAsync(exec::ForwardCall call, std::vector<bool> requires_grad,
                    ForwardCallback done);
  void BackwardAsync(BackwardCall call, BackwardCallback done);
  absl::Status Release(const std::string& ns, const std::string& context_id);
  // Runs on the autograd's own pool; RESOURCE_EXHAUSTED when it is busy.
  void GradCheckAsync(GradCheckCall call, GradCheckCallback done);

  // Releases the contexts left by forwards of each (ns, caller) for which
  // `doomed` holds (ForwardCall::caller; a config reload revoking a
  // principal); returns how many.
  int ReleaseWhere(
      const std::function<bool(const std::string& ns, const std::string& caller)>& doomed);
  // Releases contexts idle past the TTL; returns how many.
  int ExpireContexts(std::chrono::steady_clock::time_point now);
  size_t LiveContexts() const;
  // Bytes of saved tensors per namespace, for metrics.
  std::map<std::string, uint64_t> BytesByNamespace() const;

 private:
  struct Impl;
  explicit Autograd(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit::autograd

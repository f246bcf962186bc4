// Calling MindSpore-aot-style CPU kernels (kernels/include/custom_aot_extra.h)
// on host buffers.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "absl/status/statusor.h"
#include "server/common/mutex.h"
#include "server/runner/aot_extra_impl.h"
#include "server/runner/guard_pages.h"
#include "server/loader/loader.h"
#include "server/registry/op_def.h"
#include "server/runner/kernel_runner.h"

namespace opjit::runner {

struct AotKernelOptions {
  // Serialise Run calls on one instance. Aot kernels commonly keep mutable
  // state in their KernelData, and MindSpore never runs one kernel instance on
  // two threads at once. Set to false only for kernels known to be reentrant.
  // Default: true.
  bool serialize_runs = true;
  // Zero every output before the kernel runs, so a kernel that writes less
  // than its whole output hands back zeros, never bytes an earlier call left
  // in the buffer (a reused shm range, an executor's arena). Off only for
  // the zero-fill benchmark (KernelHostOptions::zero_outputs). Default: true.
  bool zero_outputs = true;
};

// One instance of an aot kernel: a (loaded object, entry, input shapes and
// dtypes, attrs) tuple, with its own AotExtra (attrs, workspaces, kernel data).
// `<entry>Init` runs once per instance; `<entry>InferShape` is optional.
//
// Thread-safety: Run and InferShape are const and may be called from many
// threads (share instances as shared_ptr<const AotKernelInstance>). With serialize_runs
// (the default) the calls are serialised per instance; otherwise they run
// concurrently, which is safe only if the kernel is reentrant. Init and
// InferShape are always serialised.
class AotKernelInstance {
 public:
  // Resolves `entry`, `<entry>Init` and `<entry>InferShape` in `kernel`.
  //
  // Init runs here, with the shapes and dtypes of `inputs` then `outputs`,
  // unless `outputs` is empty (output shapes not known yet: the caller calls
  // InferShape() first). Then Init runs at the first Run, with the outputs
  // that Run passes, and its error is returned by that Run and every later
  // one; the outputs of later Runs must match.
  //
  // Errors: INVALID_ARGUMENT when `entry` is not defined ("entry symbol 'Foo'
  // not found; the object defines: a, b, c"), when Init returns non-zero ("Foo
  // Init returned 3") or reads an attr wrongly; INTERNAL when Init throws.
  static absl::StatusOr<std::unique_ptr<AotKernelInstance>> Create(
      std::shared_ptr<const loader::LoadedKernel> kernel, const std::string& entry,
      std::vector<TensorDesc> inputs, std::vector<TensorDesc> outputs,
      std::map<std::string, registry::AttrValue> attrs, AotKernelOptions options = {});

  // Deletes the kernel's KernelData (its vtable lives in the kernel's code),
  // then releases the kernel.
  ~AotKernelInstance();
  AotKernelInstance(const AotKernelInstance&) = delete;
  AotKernelInstance& operator=(const AotKernelInstance&) = delete;

  bool has_init() const { return init_ != nullptr; }
  bool has_infer_shape() const { return infer_shape_ != nullptr; }

  // The output shape from the kernel's InferShape for the instance's inputs:
  // -1 for an unknown dimension, {-2} for an unknown rank.
  // FAILED_PRECONDITION if the kernel has no InferShape; INVALID_ARGUMENT if it
  // read an attr wrongly or returned a malformed shape; INTERNAL if it threw.
  absl::StatusOr<std::vector<int64_t>> InferShape() const;

  // Calls the kernel: params = inputs, outputs (zero-filled first, unless
  // options.zero_outputs is off or the output's HostTensor::keep_bytes is
  // set), then one zero-filled 64-byte-aligned
  // buffer per workspace size the kernel set in Init. Each workspace ends at
  // a guard page (guard_pages.h; another guards its start): a kernel that
  // writes past it faults in this call, and one that writes into the few
  // bytes of slack before the guard gets INVALID_ARGUMENT, KERNEL_FAILED
  // ("wrote past the end of its workspace 0 (16 bytes)"). Workspaces are
  // kept between calls (zeroed at the start of each). Descriptors must match
  // the instance's inputs (and outputs, once known). A null input
  // (HostTensor::null: a rank-0 descriptor) reaches the kernel as
  // params[i] == nullptr, ndims[i] == 0, its dtype, and shapes[i] pointing
  // at a single 0 (never null); Init and InferShape see it as a rank-0
  // tensor of its dtype.
  // Errors: INVALID_ARGUMENT for mismatched tensors or a wrong attr read;
  // ABORTED when the kernel returns non-zero ("kernel Foo returned 7");
  // INTERNAL when it throws; RESOURCE_EXHAUSTED when a workspace cannot be
  // allocated; Init's error when a deferred Init failed.
  absl::Status Run(absl::Span<const HostTensor> inputs,
                   absl::Span<const HostTensor> outputs) const;

  const std::string& entry() const { return entry_; }
  const std::vector<TensorDesc>& inputs() const { return inputs_; }
  // Empty until known (see Create); fixed once known.
  const std::vector<TensorDesc>& outputs() const;
  // Sizes in bytes of the workspaces the kernel asked for in Init.
  std::vector<size_t> workspace_sizes() const;
  const std::shared_ptr<const loader::LoadedKernel>& kernel() const { return kernel_; }

 private:
  using EntryFn = int (*)(int, void**, int*, int64_t**, const char**, void*, void*);
  using InitFn = int (*)(int*, int64_t**, const char**, AotExtra*);
  using InferShapeFn = std::vector<int64_t> (*)(int*, int64_t**, AotExtra*);

  AotKernelInstance(std::shared_ptr<const loader::LoadedKernel> kernel, std::string entry,
                    std::vector<TensorDesc> inputs,
                    std::map<std::string, registry::AttrValue> attrs, AotKernelOptions options);

  // One guarded buffer per workspace size: a set kept from an earlier call
  // (zeroed here), or a new one.
  using Workspaces = absl::InlinedVector<std::unique_ptr<guard::GuardedMapping>, 2>;
  absl::StatusOr<Workspaces> TakeWorkspaces() const;
  // Keeps `ws` for a later call, within the process's budget for kept
  // workspaces (kKeptWorkspaceBytes), else unmaps it.
  void KeepWorkspaces(Workspaces ws) const;
  // OK, or the error of a kernel that wrote into a workspace's slack.
  absl::Status CheckWorkspaces(const Workspaces& ws) const;

  // Runs Init with inputs_ + `outputs`; sets init_done_ and init_status_.
  absl::Status RunInitLocked(const std::vector<TensorDesc>& outputs) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);

  // Declared first: destroyed last, after extra_ dropped the kernel data.
  const std::shared_ptr<const loader::LoadedKernel> kernel_;
  const std::string entry_;
  const std::string what_;  // "kernel <entry>", for messages
  const std::vector<TensorDesc> inputs_;
  const AotKernelOptions options_;
  EntryFn fn_ = nullptr;
  InitFn init_ = nullptr;
  InferShapeFn infer_shape_ = nullptr;
  // Mutable: the kernel gets a non-const AotExtra*; its state is the kernel's.
  mutable AotExtraImpl extra_;

  // Held around Init and InferShape, and around Run when serialize_runs.
  mutable Mutex call_mu_;
  // Set (release) once Init ran or was found absent; the fields below are
  // written under state_mu_ before it is set, and never change after, so
  // readers that saw it set (acquire) read them without the lock (hence no
  // ABSL_GUARDED_BY: the analysis cannot see that publication).
  mutable std::atomic<bool> init_done_{false};
  mutable Mutex state_mu_;
  mutable absl::Status init_status_;
  mutable std::vector<TensorDesc> outputs_;
  mutable std::vector<size_t> workspace_;

  // Workspace sets kept between calls (one per call that ran at once, at
  // most two), and their bytes. Declared after entry_, which their fault
  // descriptions point at.
  mutable Mutex ws_mu_;
  mutable std::vector<Workspaces> ws_kept_ ABSL_GUARDED_BY(ws_mu_);
  mutable uint64_t ws_kept_bytes_ ABSL_GUARDED_BY(ws_mu_) = 0;
};

}  // namespace opjit::runner

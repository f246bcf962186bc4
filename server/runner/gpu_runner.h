// GpuRunner: runs a compiled GPU kernel (NVRTC CUBIN/PTX with a launch spec,
// or an nvcc-built aot shared object) on host tensors. Per call: device
// buffers owned by the daemon, filled from the caller's shm views or inline
// bytes, one stream, results copied back to the caller's output buffers.
//
// The CUDA driver is opened (dlopen) by the first call; without one, calls
// fail with UNAVAILABLE and the reason. Driver errors map to statuses in
// server/gpu/cuda_driver.
//
// Thread-safety: Run may be called from many threads.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/common/mutex.h"
#include "server/compiler/kernel_compiler.h"
#include "server/runner/aot_kernel.h"
#include "server/registry/op_def.h"

namespace opjit::gpu {
class Module;
}

namespace opjit::runner {

class GpuRunner {
 public:
  // `scratch_dir` holds aot shared objects while they are loaded.
  explicit GpuRunner(std::string scratch_dir) : scratch_dir_(std::move(scratch_dir)) {}
  ~GpuRunner();

  // Whether a CUDA driver with a device is usable here; the error says why not.
  static absl::Status Available();

  // `inputs` are the call's flat input tensors and `input_names` the declared
  // input each belongs to; `attrs` the resolved attrs.
  absl::Status Run(const registry::OpDef& def, const registry::Implementation& impl,
                   const compiler::CompiledKernel& kernel,
                   const std::map<std::string, registry::AttrValue>& attrs,
                   absl::Span<const HostTensor> inputs,
                   const std::vector<std::string>& input_names,
                   absl::Span<const HostTensor> outputs);

 private:
  absl::StatusOr<std::shared_ptr<gpu::Module>> ModuleFor(const compiler::CompiledKernel& kernel);
  absl::StatusOr<void*> SharedObjectFor(const compiler::CompiledKernel& kernel);

  const std::string scratch_dir_;
  Mutex mu_;
  std::map<std::string, std::shared_ptr<gpu::Module>> modules_ ABSL_GUARDED_BY(mu_);  // by cache key
  std::map<std::string, void*> shared_objects_ ABSL_GUARDED_BY(mu_);  // dlopen handles
};

}  // namespace opjit::runner

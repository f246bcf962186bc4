// GpuRunner: runs a compiled GPU kernel (NVRTC CUBIN/PTX with a launch spec,
// or an nvcc-built aot shared object) on host tensors. Per call: device
// buffers owned by the daemon, filled from the caller's shm views or inline
// bytes, one stream, results copied back to the caller's output buffers.
//
// Timing: two CUDA events recorded on the call's stream around the launch
// (cuLaunchKernel, or the aot entry, which queues its kernels on the stream
// it is given) time the kernel on the device: HostCall::kernel_ms, without
// the copies, allocations or the host's launch overhead. When events fail,
// kernel_ms stays -1 and the caller times the whole Run (RunTimed).
//
// Cache flush (HostCall::flush_caches): before the start event, the stream
// fills a scratch buffer of the L2's size (cuMemsetD8Async), which evicts
// the kernel's tensors from L2. The buffer is allocated on the first
// flushed call and kept; without the L2's size, or without the memory, no
// flush happens (flushed_bytes 0).
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
class DeviceBuffer;
class Device;
class Module;
}

namespace opjit::runner {

class GpuRunner {
 public:
  // `scratch_dir` holds aot shared objects while they are loaded.
  explicit GpuRunner(std::string scratch_dir);
  ~GpuRunner();

  // Whether a CUDA driver with a device is usable here; the error says why not.
  static absl::Status Available();

  // `inputs` are the call's flat input tensors and `input_names` the declared
  // input each belongs to; `attrs` the resolved attrs.
  // `call`: the flush it asks for and what is measured (see above).
  absl::Status Run(const registry::OpDef& def, const registry::Implementation& impl,
                   const compiler::CompiledKernel& kernel,
                   const std::map<std::string, registry::AttrValue>& attrs,
                   absl::Span<const HostTensor> inputs,
                   const std::vector<std::string>& input_names,
                   absl::Span<const HostTensor> outputs, HostCall* call);

  // The call's tensors on the device, and the rest of one Run.
  struct Launch;

 private:
  absl::StatusOr<std::shared_ptr<gpu::Module>> ModuleFor(const compiler::CompiledKernel& kernel);
  absl::StatusOr<void*> SharedObjectFor(const compiler::CompiledKernel& kernel);
  // The scratch buffer an L2 flush fills, or nullptr when there can be none.
  gpu::DeviceBuffer* L2Scratch(const gpu::Device& device);
  absl::Status RunAot(Launch& l);
  absl::Status RunNvrtc(Launch& l);

  const std::string scratch_dir_;
  Mutex mu_;
  std::map<std::string, std::shared_ptr<gpu::Module>> modules_ ABSL_GUARDED_BY(mu_);  // by cache key
  std::map<std::string, void*> shared_objects_ ABSL_GUARDED_BY(mu_);  // dlopen handles
  // Filled by flushed calls on their streams, possibly at once (harmless:
  // nobody reads it). Allocated once, never freed before the runner.
  bool l2_tried_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<gpu::DeviceBuffer> l2_scratch_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opjit::runner

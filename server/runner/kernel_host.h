// KernelHost: loads compiled kernels into the calling process and runs them
// on host pointers. This is where user code executes: in an
// opjit-exec-worker (process isolation) or, in "in-daemon" mode, in opjitd.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/runner/kernel_runner.h"

namespace opjit::runner {

// The benchmark-only switch that leaves outputs as they are (see
// KernelHostOptions::zero_outputs).
inline constexpr char kNoZeroFillEnv[] = "OPJIT_BENCH_NO_ZERO_FILL";

struct KernelHostOptions {
  // Shared libraries kernels may link against (the compiler's allow-list).
  // Default: none.
  std::vector<std::string> allowed_libraries;
  // Where aot GPU shared objects are written while being loaded. Default: /tmp.
  std::string scratch_dir = "/tmp";
  // Loaded CPU objects kept for new instances. Default: 256.
  size_t loaded_kernels = 256;
  // Outputs start zero-filled (AotKernelOptions::zero_outputs). Only the
  // zero-fill benchmark turns it off, through the environment variable
  // OPJIT_BENCH_NO_ZERO_FILL=1 in opjitd's environment (Create reads it;
  // executors get it from their daemon). Default: true.
  bool zero_outputs = true;
};

// One instance living in this process. Run and InferShape are thread-safe.
class HostInstance {
 public:
  virtual ~HostInstance() = default;
  virtual absl::StatusOr<std::vector<int64_t>> InferShape() = 0;
  // Runs the kernel once, flushing first when `call` asks, and fills in
  // what `call` measures (see HostCall).
  virtual absl::Status Run(absl::Span<const HostTensor> inputs,
                           absl::Span<const HostTensor> outputs, HostCall* call) = 0;
};

// inst.Run, with call->kernel_ms the host clock around it when the instance
// did not measure the kernel itself. For every caller of HostInstance::Run.
absl::Status RunTimed(HostInstance& inst, absl::Span<const HostTensor> inputs,
                      absl::Span<const HostTensor> outputs, HostCall* call);

class KernelHost {
 public:
  // INTERNAL when the JIT cannot be set up.
  static absl::StatusOr<std::unique_ptr<KernelHost>> Create(const KernelHostOptions& options);
  ~KernelHost();

  // Loads spec.kernel (once per cache key while cached) and makes an
  // instance; Init runs now when spec.outputs is set. Errors: the loader's
  // (INVALID_ARGUMENT for a link error, PERMISSION_DENIED for a library off
  // the allow-list), AotKernelInstance::Create's, UNAVAILABLE for a GPU
  // kernel without a GPU.
  absl::StatusOr<std::unique_ptr<HostInstance>> NewInstance(const InstanceSpec& spec);

  struct Stats {
    uint64_t loads = 0;     // objects linked
    uint64_t loaded = 0;    // objects cached now
  };
  Stats GetStats() const;

 private:
  struct Impl;
  explicit KernelHost(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit::runner

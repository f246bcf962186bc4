// InProcessRunner: kernels run inside the calling process (opjitd).
//
// [exec] isolation = "in-daemon". Unsafe on a shared server: a kernel that
// crashes takes the daemon down, a kernel that spins holds a thread until it
// returns (deadlines are checked only before and after it runs), and a
// kernel can read and write whatever the daemon can. For a trusted single
// user, and as the baseline the process runner is measured against.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <memory>

#include "server/runner/kernel_host.h"
#include "server/runner/kernel_runner.h"

namespace opjit::runner {

class InProcessRunner : public KernelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<InProcessRunner>> Create(const KernelHostOptions& options);

  absl::StatusOr<std::shared_ptr<KernelInstance>> Instance(const InstanceSpec& spec) override;
  RunnerStats Stats() const override { return {}; }
  const char* mode() const override { return "in-daemon"; }

 private:
  explicit InProcessRunner(std::unique_ptr<KernelHost> host) : host_(std::move(host)) {}
  std::unique_ptr<KernelHost> host_;
};

// The host pointer of a checked tensor location (region base + offset, or
// the caller's buffer).
HostTensor ToHost(const TensorLoc& loc);

}  // namespace opjit::runner

// Finds out, without linking it, whether the CUDA driver and a GPU are usable.
// The driver is opened with dlopen("libcuda.so.1") when first asked, so the
// daemon starts on hosts with no driver at all.
#pragma once

#include <string>
#include <vector>

namespace opjit::gpu {

struct GpuStatus {
  bool available = false;
  std::string reason;  // why not, when !available
  std::vector<std::string> devices;
};

// Probes once and remembers the answer. Thread-safe.
const GpuStatus& ProbeGpu();

}  // namespace opjit::gpu

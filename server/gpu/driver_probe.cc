#include "server/gpu/driver_probe.h"

#include <dlfcn.h>

#include <string>

namespace opjit::gpu {
namespace {

// The few driver API entry points the probe needs, by their documented C ABI.
using CuInit = int (*)(unsigned int);
using CuDeviceGetCount = int (*)(int*);
using CuDeviceGet = int (*)(int*, int);
using CuDeviceGetName = int (*)(char*, int, int);
using CuGetErrorString = int (*)(int, const char**);

GpuStatus Probe() {
  GpuStatus st;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    st.reason = std::string("the CUDA driver (libcuda.so.1) could not be loaded: ") +
                (err ? err : "unknown error") + "; no NVIDIA driver on this host";
    return st;
  }
  auto init = reinterpret_cast<CuInit>(dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CuDeviceGetCount>(dlsym(lib, "cuDeviceGetCount"));
  auto get = reinterpret_cast<CuDeviceGet>(dlsym(lib, "cuDeviceGet"));
  auto name = reinterpret_cast<CuDeviceGetName>(dlsym(lib, "cuDeviceGetName"));
  auto errstr = reinterpret_cast<CuGetErrorString>(dlsym(lib, "cuGetErrorString"));
  if (!init || !count || !get || !name) {
    st.reason = "libcuda.so.1 lacks cuInit/cuDeviceGetCount; the driver is too old or broken";
    return st;
  }
  if (int rc = init(0); rc != 0) {
    const char* msg = nullptr;
    if (errstr) errstr(rc, &msg);
    st.reason = "cuInit failed (CUresult " + std::to_string(rc) + (msg ? std::string(": ") + msg : "") + ")";
    return st;
  }
  int n = 0;
  if (count(&n) != 0 || n == 0) {
    st.reason = "the CUDA driver reports no GPU devices";
    return st;
  }
  for (int i = 0; i < n; ++i) {
    int dev = 0;
    char buf[256] = {0};
    if (get(&dev, i) == 0 && name(buf, sizeof(buf) - 1, dev) == 0) st.devices.push_back(buf);
  }
  // Devices exist, but this build has no GPU execution path yet.
  st.reason = "found " + std::to_string(n) +
              " device(s), but GPU execution is not implemented in this opjitd version";
  return st;
}

}  // namespace

const GpuStatus& ProbeGpu() {
  static const GpuStatus status = Probe();
  return status;
}

}  // namespace opjit::gpu

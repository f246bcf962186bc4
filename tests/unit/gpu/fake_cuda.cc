// A host-only stand-in for libcuda.so.1, for testing opjit's driver wrappers
// on machines without a GPU. It exports the versioned entry points that
// <cuda.h> names (cuMemAlloc_v2 ...), keeps "device memory" in host memory,
// accepts CUBIN (ELF with EM_CUDA) and PTX images, finds a kernel when its
// name occurs in the image, and records launches. Work queued on a stream
// runs at once, so an event holds the host's steady clock when it was
// recorded, and the time between two events is the time between their
// records (a launch can be made to take a while: FakeCudaTiming). The L2
// cache is 4 MiB. Tests steer it through the FakeCuda* functions at the end.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace {

using SteadyClock = std::chrono::steady_clock;

struct FakeFunction {
  std::string name;
};
// Like the real driver's, functions belong to their module and go with it.
struct FakeModule {
  std::string image;
  std::deque<std::unique_ptr<FakeFunction>> functions;
};

struct FakeEvent {
  SteadyClock::time_point at;
  bool recorded = false;
};

std::mutex mu;
CUresult init_result = CUDA_SUCCESS;
CUresult sync_result = CUDA_SUCCESS;
int device_count = 1;
size_t memory_limit = size_t{1} << 30;
int live_buffers = 0, live_streams = 0, live_modules = 0, live_contexts = 0;
int launches = 0;
unsigned last_grid[3], last_block[3], last_shared = 0;
long long last_first_param = 0;
int ctx_dummy, stream_dummy;
constexpr int kL2CacheBytes = 4 << 20;
int live_events = 0;
CUresult event_create_result = CUDA_SUCCESS;
int launch_ms = 0, sync_ms = 0;  // how long a launch, a stream sync take
// What was queued on streams, in order: "memset:BYTES", "record", "launch".
std::string trace;

// Frees an object the fake handed out as `handle`, counting it gone.
template <typename T, typename Handle>
CUresult Release(int* live, Handle handle) {
  std::lock_guard<std::mutex> l(mu);
  --*live;
  delete reinterpret_cast<T*>(handle);
  return CUDA_SUCCESS;
}

void Trace(const std::string& op) {
  if (trace.size() > (64 << 10)) trace.clear();  // bounded; tests take it often
  if (!trace.empty()) trace += ' ';
  trace += op;
}

struct ErrorName {
  CUresult code;
  const char* name;
  const char* text;
};
constexpr ErrorName kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
};

}  // namespace

extern "C" {

CUresult cuInit(unsigned int) { return init_result; }
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
  for (const auto& x : kErrors) {
    if (x.code == e) {
      *s = x.name;
      return CUDA_SUCCESS;
    }
  }
  *s = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  for (const auto& x : kErrors) {
    if (x.code == e) {
      *s = x.text;
      return CUDA_SUCCESS;
    }
  }
  *s = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuDeviceGetCount(int* n) {
  *n = device_count;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
  std::strncpy(name, "Fake GPU", static_cast<size_t>(len));
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *v = 9;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
      *v = 0;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
      *v = 232448;
      break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE:
      *v = kL2CacheBytes;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem(size_t* bytes, CUdevice) {
  *bytes = memory_limit;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice) {
  std::lock_guard<std::mutex> l(mu);
  ++live_contexts;
  *ctx = reinterpret_cast<CUcontext>(&ctx_dummy);
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice) {
  std::lock_guard<std::mutex> l(mu);
  --live_contexts;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }

CUresult cuModuleLoadDataEx(CUmodule* m, const void* image, unsigned int n, CUjit_option* opts,
                            void** vals) {
  const char* p = static_cast<const char*>(image);
  std::string bytes;
  if (std::memcmp(p,
                  "\x7f"
                  "ELF",
                  4) == 0) {
    uint16_t machine;
    std::memcpy(&machine, p + 18, 2);
    if (machine != 190) return CUDA_ERROR_INVALID_IMAGE;
    uint64_t shoff;
    uint16_t shentsize, shnum;
    std::memcpy(&shoff, p + 40, 8);
    std::memcpy(&shentsize, p + 58, 2);
    std::memcpy(&shnum, p + 60, 2);
    bytes.assign(p, shoff + uint64_t{shentsize} * shnum);
  } else {
    bytes = p;  // PTX, NUL-terminated
    if (bytes.find(".entry") == std::string::npos) {
      for (unsigned i = 0; i < n; ++i) {
        if (opts[i] == CU_JIT_ERROR_LOG_BUFFER)
          std::strcpy(static_cast<char*>(vals[i]), "ptxas fatal: no .entry");
      }
      return CUDA_ERROR_INVALID_PTX;
    }
  }
  std::lock_guard<std::mutex> l(mu);
  ++live_modules;
  *m = reinterpret_cast<CUmodule>(new FakeModule{std::move(bytes)});
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule m) { return Release<FakeModule>(&live_modules, m); }
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  auto* mod = reinterpret_cast<FakeModule*>(m);
  // A whole-word match: the name followed by a NUL (ELF strtab) or '(' (PTX).
  const std::string n(name);
  for (size_t pos = 0; (pos = mod->image.find(n, pos)) != std::string::npos; pos += n.size()) {
    const size_t end = pos + n.size();
    if (end < mod->image.size() && (mod->image[end] == '\0' || mod->image[end] == '(')) {
      static std::mutex fmu;
      std::lock_guard<std::mutex> l(fmu);
      mod->functions.push_back(std::make_unique<FakeFunction>(FakeFunction{n}));
      *f = reinterpret_cast<CUfunction>(mod->functions.back().get());
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_NOT_FOUND;
}
CUresult cuFuncSetAttribute(CUfunction, CUfunction_attribute, int) { return CUDA_SUCCESS; }
CUresult cuLaunchKernel(CUfunction, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shm, CUstream, void** params, void**) {
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0)
    return CUDA_ERROR_INVALID_VALUE;
  int sleep_ms;
  {
    std::lock_guard<std::mutex> l(mu);
    sleep_ms = launch_ms;
  }
  // The kernel "runs" now, for launch_ms.
  if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  std::lock_guard<std::mutex> l(mu);
  Trace("launch");
  ++launches;
  last_grid[0] = gx, last_grid[1] = gy, last_grid[2] = gz;
  last_block[0] = bx, last_block[1] = by, last_block[2] = bz;
  last_shared = shm;
  last_first_param = params != nullptr ? *static_cast<long long*>(params[0]) : 0;
  return CUDA_SUCCESS;
}
CUresult cuMemAlloc(CUdeviceptr* p, size_t bytes) {
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (bytes > memory_limit) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> l(mu);
  ++live_buffers;
  void* m = std::malloc(bytes);
  // As a real allocation may: the bytes of whatever used this memory before.
  if (m != nullptr) std::memset(m, 0xa5, bytes);
  *p = reinterpret_cast<CUdeviceptr>(m);
  return CUDA_SUCCESS;
}
CUresult cuMemFree(CUdeviceptr p) {
  std::lock_guard<std::mutex> l(mu);
  --live_buffers;
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream) {
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream) {
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char value, size_t n, CUstream) {
  std::memset(reinterpret_cast<void*>(p), value, n);
  std::lock_guard<std::mutex> l(mu);
  Trace("memset:" + std::to_string(n));
  return CUDA_SUCCESS;
}
CUresult cuStreamCreate(CUstream* s, unsigned int) {
  std::lock_guard<std::mutex> l(mu);
  ++live_streams;
  *s = reinterpret_cast<CUstream>(&stream_dummy);
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream) {
  int sleep_ms;
  {
    std::lock_guard<std::mutex> l(mu);
    sleep_ms = sync_ms;
  }
  if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
  return sync_result;
}
CUresult cuStreamDestroy(CUstream) {
  std::lock_guard<std::mutex> l(mu);
  --live_streams;
  return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent* e, unsigned int) {
  std::lock_guard<std::mutex> l(mu);
  if (event_create_result != CUDA_SUCCESS) return event_create_result;
  ++live_events;
  *e = reinterpret_cast<CUevent>(new FakeEvent);
  return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream) {
  auto* event = reinterpret_cast<FakeEvent*>(e);
  std::lock_guard<std::mutex> l(mu);
  Trace("record");
  event->at = SteadyClock::now();
  event->recorded = true;
  return CUDA_SUCCESS;
}
CUresult cuEventSynchronize(CUevent e) {
  return reinterpret_cast<FakeEvent*>(e)->recorded ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  const auto* a = reinterpret_cast<FakeEvent*>(start);
  const auto* b = reinterpret_cast<FakeEvent*>(end);
  if (!a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy(CUevent e) { return Release<FakeEvent>(&live_events, e); }

// ---- test controls ----
// Also puts timing (FakeCudaTiming) back to instant and forgets the trace.
void FakeCudaConfigure(int init, int devices, size_t memory, int sync) {
  std::lock_guard<std::mutex> l(mu);
  init_result = static_cast<CUresult>(init);
  device_count = devices;
  memory_limit = memory;
  sync_result = static_cast<CUresult>(sync);
  launch_ms = sync_ms = 0;
  event_create_result = CUDA_SUCCESS;
  trace.clear();
}
void FakeCudaLive(int* buffers, int* streams, int* modules, int* contexts) {
  std::lock_guard<std::mutex> l(mu);
  *buffers = live_buffers, *streams = live_streams, *modules = live_modules,
  *contexts = live_contexts;
}
// A launch takes `launch` ms, a stream sync `sync` ms; cuEventCreate answers
// `event_create` (a CUresult).
void FakeCudaTiming(int launch, int sync, int event_create) {
  std::lock_guard<std::mutex> l(mu);
  launch_ms = launch;
  sync_ms = sync;
  event_create_result = static_cast<CUresult>(event_create);
}
int FakeCudaLiveEvents() {
  std::lock_guard<std::mutex> l(mu);
  return live_events;
}
// Copies what was queued on streams since the last call (see `trace`) into
// `out` (NUL-terminated, cut at `len`) and forgets it.
void FakeCudaTakeTrace(char* out, size_t len) {
  std::lock_guard<std::mutex> l(mu);
  if (len == 0) return;
  const size_t n = std::min(trace.size(), len - 1);
  std::memcpy(out, trace.data(), n);
  out[n] = '\0';
  trace.clear();
}
int FakeCudaLastLaunch(unsigned* grid, unsigned* block, unsigned* shared, long long* first_param) {
  std::lock_guard<std::mutex> l(mu);
  std::memcpy(grid, last_grid, sizeof(last_grid));
  std::memcpy(block, last_block, sizeof(last_block));
  *shared = last_shared;
  *first_param = last_first_param;
  return launches;
}

}  // extern "C"

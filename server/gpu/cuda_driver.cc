#include "server/gpu/cuda_driver.h"

#include <cuda.h>
#include <dlfcn.h>

#include <cstdlib>

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"

namespace opjit::gpu {

// cuda.h maps most API names to versioned symbols (cuMemAlloc ->
// cuMemAlloc_v2). Stringifying the macro-expanded name yields the symbol that
// matches the prototype decltype() sees, so types and symbols cannot drift.
#define OPJIT_CU_STR2(x) #x
#define OPJIT_CU_STR(x) OPJIT_CU_STR2(x)
#define OPJIT_CU_FN(fn) decltype(&::fn) fn = nullptr

struct CudaDriver::Api {
  void* handle = nullptr;
  OPJIT_CU_FN(cuInit);
  OPJIT_CU_FN(cuDriverGetVersion);
  OPJIT_CU_FN(cuGetErrorName);
  OPJIT_CU_FN(cuGetErrorString);
  OPJIT_CU_FN(cuDeviceGet);
  OPJIT_CU_FN(cuDeviceGetCount);
  OPJIT_CU_FN(cuDeviceGetName);
  OPJIT_CU_FN(cuDeviceGetAttribute);
  OPJIT_CU_FN(cuDeviceTotalMem);
  OPJIT_CU_FN(cuDevicePrimaryCtxRetain);
  OPJIT_CU_FN(cuDevicePrimaryCtxRelease);
  OPJIT_CU_FN(cuCtxSetCurrent);
  OPJIT_CU_FN(cuModuleLoadDataEx);
  OPJIT_CU_FN(cuModuleGetFunction);
  OPJIT_CU_FN(cuModuleUnload);
  OPJIT_CU_FN(cuFuncSetAttribute);
  OPJIT_CU_FN(cuLaunchKernel);
  OPJIT_CU_FN(cuMemAlloc);
  OPJIT_CU_FN(cuMemFree);
  OPJIT_CU_FN(cuMemcpyHtoDAsync);
  OPJIT_CU_FN(cuMemcpyDtoHAsync);
  OPJIT_CU_FN(cuMemsetD8Async);
  OPJIT_CU_FN(cuStreamCreate);
  OPJIT_CU_FN(cuStreamSynchronize);
  OPJIT_CU_FN(cuStreamDestroy);
  OPJIT_CU_FN(cuEventCreate);
  OPJIT_CU_FN(cuEventRecord);
  OPJIT_CU_FN(cuEventSynchronize);
  OPJIT_CU_FN(cuEventElapsedTime);
  OPJIT_CU_FN(cuEventDestroy);
};

absl::StatusCode CuResultToStatusCode(int cu_result) {
  switch (static_cast<CUresult>(cu_result)) {
    case CUDA_SUCCESS:
      return absl::StatusCode::kOk;
    case CUDA_ERROR_OUT_OF_MEMORY:
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_DEVICE_NOT_LICENSED:
    case CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER:
    case CUDA_ERROR_SYSTEM_NOT_READY:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
      return absl::StatusCode::kUnavailable;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_INVALID_IMAGE:
    case CUDA_ERROR_INVALID_PTX:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_INVALID_SOURCE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_NOT_FOUND:
    case CUDA_ERROR_INVALID_CLUSTER_SIZE:
    case CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
      return absl::StatusCode::kInvalidArgument;
    default:  // launch failures (ILLEGAL_ADDRESS, LAUNCH_FAILED, ...) and the rest
      return absl::StatusCode::kInternal;
  }
}

absl::Status CudaDriver::ToStatus(int cu_result, const char* call) const {
  if (cu_result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_ && api_->cuGetErrorName) api_->cuGetErrorName(static_cast<CUresult>(cu_result), &name);
  if (api_ && api_->cuGetErrorString)
    api_->cuGetErrorString(static_cast<CUresult>(cu_result), &text);
  std::string msg =
      absl::StrCat(call, " failed: ", name != nullptr ? name : "CUresult", " (", cu_result, ")");
  if (text != nullptr) absl::StrAppend(&msg, ": ", text);
  return absl::Status(CuResultToStatusCode(cu_result), msg);
}

absl::StatusOr<std::unique_ptr<CudaDriver>> CudaDriver::Open(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::UnavailableError(absl::StrCat("no CUDA driver: ", library, " not found (",
                                               err != nullptr ? err : "dlopen failed",
                                               "); install the NVIDIA driver"));
  }
  std::unique_ptr<CudaDriver> d(new CudaDriver());
  d->api_ = std::make_unique<Api>();
  Api& api = *d->api_;
  api.handle = handle;
  std::vector<std::string> missing;
#define OPJIT_CU_RESOLVE(fn)                                                    \
  api.fn = reinterpret_cast<decltype(api.fn)>(dlsym(handle, OPJIT_CU_STR(fn))); \
  if (api.fn == nullptr) missing.push_back(OPJIT_CU_STR(fn))
  OPJIT_CU_RESOLVE(cuInit);
  OPJIT_CU_RESOLVE(cuDriverGetVersion);
  OPJIT_CU_RESOLVE(cuGetErrorName);
  OPJIT_CU_RESOLVE(cuGetErrorString);
  OPJIT_CU_RESOLVE(cuDeviceGet);
  OPJIT_CU_RESOLVE(cuDeviceGetCount);
  OPJIT_CU_RESOLVE(cuDeviceGetName);
  OPJIT_CU_RESOLVE(cuDeviceGetAttribute);
  OPJIT_CU_RESOLVE(cuDeviceTotalMem);
  OPJIT_CU_RESOLVE(cuDevicePrimaryCtxRetain);
  OPJIT_CU_RESOLVE(cuDevicePrimaryCtxRelease);
  OPJIT_CU_RESOLVE(cuCtxSetCurrent);
  OPJIT_CU_RESOLVE(cuModuleLoadDataEx);
  OPJIT_CU_RESOLVE(cuModuleGetFunction);
  OPJIT_CU_RESOLVE(cuModuleUnload);
  OPJIT_CU_RESOLVE(cuFuncSetAttribute);
  OPJIT_CU_RESOLVE(cuLaunchKernel);
  OPJIT_CU_RESOLVE(cuMemAlloc);
  OPJIT_CU_RESOLVE(cuMemFree);
  OPJIT_CU_RESOLVE(cuMemcpyHtoDAsync);
  OPJIT_CU_RESOLVE(cuMemcpyDtoHAsync);
  OPJIT_CU_RESOLVE(cuMemsetD8Async);
  OPJIT_CU_RESOLVE(cuStreamCreate);
  OPJIT_CU_RESOLVE(cuStreamSynchronize);
  OPJIT_CU_RESOLVE(cuStreamDestroy);
  OPJIT_CU_RESOLVE(cuEventCreate);
  OPJIT_CU_RESOLVE(cuEventRecord);
  OPJIT_CU_RESOLVE(cuEventSynchronize);
  OPJIT_CU_RESOLVE(cuEventElapsedTime);
  OPJIT_CU_RESOLVE(cuEventDestroy);
#undef OPJIT_CU_RESOLVE
  if (!missing.empty()) {
    return absl::UnavailableError(absl::StrCat("the CUDA driver ", library, " lacks ",
                                               absl::StrJoin(missing, ", "),
                                               "; it is too old or not a CUDA driver"));
  }
  OPJIT_RETURN_IF_ERROR(d->ToStatus(api.cuInit(0), "cuInit"));
  OPJIT_RETURN_IF_ERROR(d->ToStatus(api.cuDriverGetVersion(&d->version_), "cuDriverGetVersion"));
  OPJIT_RETURN_IF_ERROR(d->ToStatus(api.cuDeviceGetCount(&d->device_count_), "cuDeviceGetCount"));
  if (d->device_count_ <= 0)
    return absl::UnavailableError("the CUDA driver reports no GPU devices");
  {
    MutexLock lock(&d->mu_);
    d->devices_.resize(d->device_count_);
  }
  Logger("gpu")->info("{} loaded from {}: {} device(s)", d->Version(), library, d->device_count_);
  return d;
}

absl::StatusOr<CudaDriver*> CudaDriver::Get() {
  // Leaked on purpose: kernels and buffers may be released by other static
  // destructors, and the driver must outlive them.
  static const auto* const kDriver =
      new absl::StatusOr<CudaDriver*>([]() -> absl::StatusOr<CudaDriver*> {
        // $OPJIT_CUDA_DRIVER names another driver library (non-standard
        // installs, and the test suite's stand-in).
        const char* env = std::getenv("OPJIT_CUDA_DRIVER");
        const std::string library = env != nullptr && *env ? env : "libcuda.so.1";
        absl::StatusOr<std::unique_ptr<CudaDriver>> d = Open(library);
        if (!d.ok()) {
          Logger("gpu")->info("CUDA driver unavailable: {}", d.status().ToString());
          return d.status();
        }
        return d->release();
      }());
  return *kDriver;
}

CudaDriver::~CudaDriver() {
  MutexLock lock(&mu_);
  for (auto& dev : devices_) {
    if (dev != nullptr && dev->context_ != nullptr) api_->cuDevicePrimaryCtxRelease(dev->handle_);
  }
  // libcuda stays loaded: unloading a driver library is not supported.
}

std::string CudaDriver::Version() const {
  return absl::StrCat("cuda driver ", version_ / 1000, ".", (version_ % 1000) / 10);
}

absl::StatusOr<Device*> CudaDriver::GetDevice(int ordinal) {
  if (ordinal < 0 || ordinal >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU ", ordinal, " does not exist (", device_count_, " device(s))"));
  }
  MutexLock lock(&mu_);
  if (devices_[ordinal] != nullptr) return devices_[ordinal].get();
  std::unique_ptr<Device> dev(new Device());
  dev->driver_ = this;
  dev->ordinal_ = ordinal;
  CUdevice handle = 0;
  OPJIT_RETURN_IF_ERROR(ToStatus(api_->cuDeviceGet(&handle, ordinal), "cuDeviceGet"));
  dev->handle_ = handle;
  char name[256] = {0};
  OPJIT_RETURN_IF_ERROR(
      ToStatus(api_->cuDeviceGetName(name, sizeof(name) - 1, handle), "cuDeviceGetName"));
  dev->name_ = name;
  OPJIT_RETURN_IF_ERROR(
      ToStatus(api_->cuDeviceGetAttribute(&dev->cc_major_,
                                          CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle),
               "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)"));
  OPJIT_RETURN_IF_ERROR(
      ToStatus(api_->cuDeviceGetAttribute(&dev->cc_minor_,
                                          CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle),
               "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)"));
  OPJIT_RETURN_IF_ERROR(ToStatus(
      api_->cuDeviceGetAttribute(&dev->max_shared_mem_optin_,
                                 CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, handle),
      "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)"));
  // Only cache flushes need the L2's size: a driver that does not tell it
  // leaves it 0 (no flush), not the device unusable.
  int l2 = 0;
  if (api_->cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, handle) == CUDA_SUCCESS &&
      l2 > 0) {
    dev->l2_cache_bytes_ = static_cast<uint64_t>(l2);
  }
  size_t total = 0;
  OPJIT_RETURN_IF_ERROR(ToStatus(api_->cuDeviceTotalMem(&total, handle), "cuDeviceTotalMem"));
  dev->total_memory_ = total;
  CUcontext ctx = nullptr;
  OPJIT_RETURN_IF_ERROR(
      ToStatus(api_->cuDevicePrimaryCtxRetain(&ctx, handle), "cuDevicePrimaryCtxRetain"));
  dev->context_ = ctx;
  static std::atomic<uint64_t> next_id{1};
  dev->id_ = next_id.fetch_add(1);
  Logger("gpu")->info("GPU {}: {} ({}, {} MiB)", ordinal, dev->name_, dev->Arch(), total >> 20);
  devices_[ordinal] = std::move(dev);
  return devices_[ordinal].get();
}

// ------------------------------------------------------------------ Device

std::string Device::Arch() const { return absl::StrCat("sm_", cc_major_, cc_minor_); }

absl::Status Device::MakeCurrent() const {
  // The Device whose context this code last made current on this thread, by
  // its unique id (a context handle can be reused after a release). Other
  // code that switches contexts (a runtime-API kernel library) uses the
  // primary context too, so the cache stays right in practice.
  thread_local uint64_t current_id = 0;
  if (current_id == id_) return absl::OkStatus();
  OPJIT_RETURN_IF_ERROR(
      driver_->ToStatus(driver_->api().cuCtxSetCurrent(context_), "cuCtxSetCurrent"));
  current_id = id_;
  return absl::OkStatus();
}

// ------------------------------------------------------------------ Stream

absl::StatusOr<Stream> Stream::Create(const Device& device) {
  OPJIT_RETURN_IF_ERROR(device.MakeCurrent());
  const CudaDriver& d = device.driver();
  CUstream s = nullptr;
  OPJIT_RETURN_IF_ERROR(
      d.ToStatus(d.api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate"));
  Stream out;
  out.device_ = &device;
  out.stream_ = s;
  return out;
}

Stream::Stream(Stream&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Stream::~Stream() { Reset(); }

void Stream::Reset() {
  if (stream_ == nullptr) return;
  const CudaDriver& d = device_->driver();
  absl::Status s = device_->MakeCurrent();
  if (s.ok()) s = d.ToStatus(d.api().cuStreamDestroy(stream_), "cuStreamDestroy");
  if (!s.ok()) Logger("gpu")->warn("leaking a CUDA stream: {}", s.ToString());
  stream_ = nullptr;
}

absl::Status Stream::Synchronize() const {
  if (stream_ == nullptr) return absl::FailedPreconditionError("Synchronize on an empty Stream");
  OPJIT_RETURN_IF_ERROR(device_->MakeCurrent());
  const CudaDriver& d = device_->driver();
  return d.ToStatus(d.api().cuStreamSynchronize(stream_), "cuStreamSynchronize");
}

// ------------------------------------------------------------ DeviceBuffer

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(const Device& device, size_t bytes) {
  DeviceBuffer out;
  out.device_ = &device;
  if (bytes == 0) return out;
  OPJIT_RETURN_IF_ERROR(device.MakeCurrent());
  const CudaDriver& d = device.driver();
  CUdeviceptr p = 0;
  absl::Status s = d.ToStatus(d.api().cuMemAlloc(&p, bytes), "cuMemAlloc");
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(s.message(), " (", bytes, " bytes)"));
  out.ptr_ = p;
  out.size_ = bytes;
  return out;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      ptr_(std::exchange(other.ptr_, 0)),
      size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, nullptr);
    ptr_ = std::exchange(other.ptr_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

void DeviceBuffer::Reset() {
  if (ptr_ == 0) return;
  const CudaDriver& d = device_->driver();
  absl::Status s = device_->MakeCurrent();
  if (s.ok()) s = d.ToStatus(d.api().cuMemFree(ptr_), "cuMemFree");
  if (!s.ok()) Logger("gpu")->warn("leaking {} bytes of device memory: {}", size_, s.ToString());
  ptr_ = 0;
  size_ = 0;
}

namespace {
absl::Status CheckRange(size_t offset, size_t bytes, size_t size) {
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("copy of ", bytes, " bytes at offset ", offset,
                                                   " is outside a ", size, "-byte device buffer"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, const Stream& stream,
                                        size_t offset) {
  OPJIT_RETURN_IF_ERROR(CheckRange(offset, bytes, size_));
  if (bytes == 0) return absl::OkStatus();
  OPJIT_RETURN_IF_ERROR(device_->MakeCurrent());
  const CudaDriver& d = device_->driver();
  return d.ToStatus(d.api().cuMemcpyHtoDAsync(ptr_ + offset, src, bytes, stream.get()),
                    "cuMemcpyHtoDAsync");
}

absl::Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, const Stream& stream,
                                      size_t offset) const {
  OPJIT_RETURN_IF_ERROR(CheckRange(offset, bytes, size_));
  if (bytes == 0) return absl::OkStatus();
  OPJIT_RETURN_IF_ERROR(device_->MakeCurrent());
  const CudaDriver& d = device_->driver();
  return d.ToStatus(d.api().cuMemcpyDtoHAsync(dst, ptr_ + offset, bytes, stream.get()),
                    "cuMemcpyDtoHAsync");
}

absl::Status DeviceBuffer::Fill(uint8_t value, const Stream& stream) {
  if (size_ == 0) return absl::OkStatus();
  OPJIT_RETURN_IF_ERROR(device_->MakeCurrent());
  const CudaDriver& d = device_->driver();
  return d.ToStatus(d.api().cuMemsetD8Async(ptr_, value, size_, stream.get()), "cuMemsetD8Async");
}

// ------------------------------------------------------------------- Event

absl::StatusOr<Event> Event::Create(const Device& device) {
  OPJIT_RETURN_IF_ERROR(device.MakeCurrent());
  const CudaDriver& d = device.driver();
  CUevent e = nullptr;
  OPJIT_RETURN_IF_ERROR(d.ToStatus(d.api().cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate"));
  Event out;
  out.event_ = std::unique_ptr<CUevent_st, Destroy>(e, Destroy{&device});
  return out;
}

void Event::Destroy::operator()(CUevent_st* event) const {
  const CudaDriver& d = device->driver();
  absl::Status s = device->MakeCurrent();
  if (s.ok()) s = d.ToStatus(d.api().cuEventDestroy(event), "cuEventDestroy");
  if (!s.ok()) Logger("gpu")->warn("leaking a CUDA event: {}", s.ToString());
}

absl::Status Event::Record(const Stream& stream) {
  if (event_ == nullptr) return absl::FailedPreconditionError("Record of an empty Event");
  const Device* device = event_.get_deleter().device;
  OPJIT_RETURN_IF_ERROR(device->MakeCurrent());
  const CudaDriver& d = device->driver();
  return d.ToStatus(d.api().cuEventRecord(event_.get(), stream.get()), "cuEventRecord");
}

absl::Status Event::Synchronize() const {
  if (event_ == nullptr) return absl::FailedPreconditionError("Synchronize on an empty Event");
  const Device* device = event_.get_deleter().device;
  OPJIT_RETURN_IF_ERROR(device->MakeCurrent());
  const CudaDriver& d = device->driver();
  return d.ToStatus(d.api().cuEventSynchronize(event_.get()), "cuEventSynchronize");
}

absl::StatusOr<double> Event::ElapsedMs(const Event& start, const Event& end) {
  if (start.event_ == nullptr) return absl::FailedPreconditionError("ElapsedMs of an empty Event");
  OPJIT_RETURN_IF_ERROR(end.Synchronize());
  const CudaDriver& d = end.event_.get_deleter().device->driver();
  float ms = 0;
  OPJIT_RETURN_IF_ERROR(d.ToStatus(
      d.api().cuEventElapsedTime(&ms, start.event_.get(), end.event_.get()), "cuEventElapsedTime"));
  return static_cast<double>(ms);
}

// ------------------------------------------------------------------ Module

absl::StatusOr<std::unique_ptr<Module>> Module::Load(const Device& device, std::string_view image) {
  if (image.empty()) return absl::InvalidArgumentError("empty module image");
  OPJIT_RETURN_IF_ERROR(device.MakeCurrent());
  const CudaDriver& d = device.driver();
  // ELF and fatbin images carry their size in their headers; PTX is text and
  // must end with a NUL.
  std::string ptx;
  const void* data = image.data();
  const bool is_elf = image.size() >= 4 && std::memcmp(image.data(),
                                                       "\x7f"
                                                       "ELF",
                                                       4) == 0;
  const bool is_fatbin = image.size() >= 4 && std::memcmp(image.data(), "\x50\xed\x55\xba", 4) == 0;
  if (!is_elf && !is_fatbin) {
    ptx.assign(image.data(), image.size());
    data = ptx.c_str();
  }
  char error_log[8192] = {0};
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {error_log,
                    reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(error_log) - 1))};
  CUmodule m = nullptr;
  absl::Status s =
      d.ToStatus(d.api().cuModuleLoadDataEx(&m, data, 2, options, values), "cuModuleLoadData");
  if (!s.ok()) {
    if (error_log[0] != '\0')
      return absl::Status(s.code(), absl::StrCat(s.message(), "\n", error_log));
    return s;
  }
  std::unique_ptr<Module> out(new Module());
  out->device_ = &device;
  out->module_ = m;
  return out;
}

Module::~Module() {
  if (module_ == nullptr) return;
  const CudaDriver& d = device_->driver();
  absl::Status s = device_->MakeCurrent();
  if (s.ok()) s = d.ToStatus(d.api().cuModuleUnload(module_), "cuModuleUnload");
  if (!s.ok()) Logger("gpu")->warn("leaking a CUDA module: {}", s.ToString());
}

absl::StatusOr<Kernel> Module::GetKernel(const std::string& name) const {
  OPJIT_RETURN_IF_ERROR(device_->MakeCurrent());
  const CudaDriver& d = device_->driver();
  CUfunction f = nullptr;
  absl::Status s =
      d.ToStatus(d.api().cuModuleGetFunction(&f, module_, name.c_str()), "cuModuleGetFunction");
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat(s.message(), ": no kernel named '", name, "' in the module"));
  }
  Kernel k;
  k.device_ = device_;
  k.function_ = f;
  k.name_ = name;
  return k;
}

// ------------------------------------------------------------------ Kernel

absl::Status Kernel::Launch(const LaunchConfig& c, const Stream& stream, void** params) const {
  if (function_ == nullptr) return absl::FailedPreconditionError("Launch of an empty Kernel");
  OPJIT_RETURN_IF_ERROR(device_->MakeCurrent());
  const CudaDriver& d = device_->driver();
  if (c.shared_mem > 48 * 1024) {
    if (c.shared_mem > static_cast<unsigned>(device_->max_shared_mem_optin())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kernel ", name_, ": ", c.shared_mem,
          " bytes of dynamic shared memory exceed the device's ", device_->max_shared_mem_optin()));
    }
    OPJIT_RETURN_IF_ERROR(d.ToStatus(
        d.api().cuFuncSetAttribute(function_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   static_cast<int>(c.shared_mem)),
        "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)"));
  }
  absl::Status s = d.ToStatus(
      d.api().cuLaunchKernel(function_, c.grid[0], c.grid[1], c.grid[2], c.block[0], c.block[1],
                             c.block[2], c.shared_mem, stream.get(), params, nullptr),
      "cuLaunchKernel");
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(s.message(), " (kernel ", name_, ")"));
  return absl::OkStatus();
}

}  // namespace opjit::gpu

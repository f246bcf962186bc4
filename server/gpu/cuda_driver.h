// The CUDA driver API, opened with dlopen("libcuda.so.1") when first needed
// and never linked, so opjitd starts on hosts without an NVIDIA driver. Every
// CUresult is turned into an absl::Status here, naming the failed call:
//   CUDA_ERROR_OUT_OF_MEMORY, LAUNCH_OUT_OF_RESOURCES    -> RESOURCE_EXHAUSTED
//   no driver, NO_DEVICE, NOT_INITIALIZED, DEINITIALIZED,
//   STUB_LIBRARY, DEVICE_UNAVAILABLE, driver too old     -> UNAVAILABLE
//   INVALID_VALUE, INVALID_IMAGE/PTX, NO_BINARY_FOR_GPU,
//   NOT_FOUND (no such kernel), INVALID_HANDLE ...      -> INVALID_ARGUMENT
//   launch errors (ILLEGAL_ADDRESS, LAUNCH_FAILED, ...)  -> INTERNAL
//   anything else                                        -> INTERNAL
// Launch errors are sticky in CUDA: the context is unusable afterwards, and
// only a process restart recovers the device.
//
// No CUDA header is included here: handles are the driver's opaque struct
// pointers, forward-declared, and device pointers are uint64_t (CUdeviceptr).
//
// Every object below works on the primary context of its Device, made current
// on the calling thread as needed, so any thread may use them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/common/mutex.h"
#include "server/gpu/launch_spec.h"

// The driver's opaque handle types (cuda.h: typedef struct CUctx_st* CUcontext).
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;

namespace opjit::gpu {

// The status code for a CUresult value (see the table above). Exposed for
// tests; callers get full statuses from the classes below.
absl::StatusCode CuResultToStatusCode(int cu_result);

class CudaDriver;

// One GPU and its retained primary context. Owned by its CudaDriver and valid
// as long as it. Thread-safe.
class Device {
 public:
  int ordinal() const { return ordinal_; }
  const std::string& name() const { return name_; }
  // "sm_90" for compute capability 9.0: the CUBIN arch that runs here.
  std::string Arch() const;
  uint64_t total_memory() const { return total_memory_; }
  // Largest dynamic shared memory per block with the opt-in attribute set.
  int max_shared_mem_optin() const { return max_shared_mem_optin_; }
  // The L2 cache's size in bytes (CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE); 0 when
  // the driver does not tell it.
  uint64_t l2_cache_bytes() const { return l2_cache_bytes_; }
  CudaDriver& driver() const { return *driver_; }

  // Makes the primary context current on the calling thread (cheap when it
  // already is). The classes below call it themselves.
  absl::Status MakeCurrent() const;

 private:
  friend class CudaDriver;
  Device() = default;

  CudaDriver* driver_ = nullptr;
  int ordinal_ = 0;
  int handle_ = 0;  // CUdevice
  CUctx_st* context_ = nullptr;
  uint64_t id_ = 0;  // unique in the process, for MakeCurrent's cache
  std::string name_;
  int cc_major_ = 0, cc_minor_ = 0;
  uint64_t total_memory_ = 0;
  int max_shared_mem_optin_ = 48 * 1024;
  uint64_t l2_cache_bytes_ = 0;
};

// The loaded driver library. Thread-safe.
class CudaDriver {
 public:
  struct Api;  // resolved entry points (cuda_driver.cc)

  // The process-wide driver: Open("libcuda.so.1") on the first call; later
  // calls return the same pointer, or the same error. Never destroyed.
  // Errors: UNAVAILABLE "no CUDA driver: libcuda.so.1 not found (...)", or
  // the reason cuInit / device enumeration failed, or no devices.
  static absl::StatusOr<CudaDriver*> Get();

  // Loads `library` (a name for dlopen or a path), resolves the entry points,
  // runs cuInit and counts devices. For Get() and for tests (a fake driver).
  // Errors as for Get().
  static absl::StatusOr<std::unique_ptr<CudaDriver>> Open(const std::string& library);

  // Releases the primary contexts retained by GetDevice(). The library stays
  // loaded. Every Module, Stream and DeviceBuffer must be gone by then.
  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  int device_count() const { return device_count_; }
  // "cuda driver 13.0".
  std::string Version() const;

  // Device `ordinal`, retaining its primary context on first use.
  // INVALID_ARGUMENT for an ordinal out of range; driver errors as statuses.
  absl::StatusOr<Device*> GetDevice(int ordinal);

  // The status for a CUresult returned by `call` ("cuMemAlloc"): OK for
  // CUDA_SUCCESS, else the mapped code with the call, the error's name and
  // description.
  absl::Status ToStatus(int cu_result, const char* call) const;

  const Api& api() const { return *api_; }

 private:
  CudaDriver() = default;

  // Constant after Open().
  std::unique_ptr<Api> api_;
  int device_count_ = 0;
  int version_ = 0;  // e.g. 13000

  Mutex mu_;
  std::vector<std::unique_ptr<Device>> devices_
      ABSL_GUARDED_BY(mu_);  // by ordinal; null until used
};

// A CUDA stream on one device; destroyed with the object. Movable. Use from
// one thread at a time.
class Stream {
 public:
  static absl::StatusOr<Stream> Create(const Device& device);
  Stream() = default;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  ~Stream();

  // Blocks until all work queued on the stream is done; reports the first
  // error of that work (a kernel fault shows up here).
  absl::Status Synchronize() const;
  CUstream_st* get() const { return stream_; }
  const Device* device() const { return device_; }

 private:
  void Reset();
  const Device* device_ = nullptr;
  CUstream_st* stream_ = nullptr;
};

// Device memory; freed with the object. Movable. Thread-compatible.
class DeviceBuffer {
 public:
  // `bytes` may be 0 (no allocation, ptr() == 0). RESOURCE_EXHAUSTED when
  // the device is full.
  static absl::StatusOr<DeviceBuffer> Allocate(const Device& device, size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  uint64_t ptr() const { return ptr_; }  // CUdeviceptr
  size_t size() const { return size_; }

  // Queue copies on `stream`. The host memory must stay valid and untouched
  // until the stream is synchronized. INVALID_ARGUMENT when
  // [offset, offset + bytes) is outside the buffer.
  absl::Status CopyFromHost(const void* src, size_t bytes, const Stream& stream, size_t offset = 0);
  absl::Status CopyToHost(void* dst, size_t bytes, const Stream& stream, size_t offset = 0) const;
  // Queues a fill of the whole buffer with zero bytes on `stream` (a fresh
  // cuMemAlloc may hold an earlier allocation's bytes).
  absl::Status Zero(const Stream& stream) { return Fill(0, stream); }
  // Queues a fill of the whole buffer with `value` on `stream`
  // (cuMemsetD8Async).
  absl::Status Fill(uint8_t value, const Stream& stream);

 private:
  void Reset();
  const Device* device_ = nullptr;
  uint64_t ptr_ = 0;
  size_t size_ = 0;
};

// A CUDA event with timing (CU_EVENT_DEFAULT) on one device; destroyed with
// the object. Movable. Use from one thread at a time.
//
// Timing work on a stream: Record a start event, queue the work, Record an
// end event, then ElapsedMs(start, end), which waits for the end event. The
// time is the device's, between the two points in the stream: none of the
// host's launch overhead or waiting counts.
class Event {
 public:
  static absl::StatusOr<Event> Create(const Device& device);
  Event() = default;

  // Queues the event on `stream`: it completes once the work queued there
  // before it is done. Recording again moves it to the new point.
  absl::Status Record(const Stream& stream);
  // Blocks until the recorded event has completed.
  absl::Status Synchronize() const;
  // Milliseconds between two events recorded on one stream, once `end` has
  // completed (this waits for it). Errors: the driver's, e.g.
  // INVALID_ARGUMENT (CUDA_ERROR_INVALID_HANDLE) when one was never recorded.
  static absl::StatusOr<double> ElapsedMs(const Event& start, const Event& end);

  CUevent_st* get() const { return event_.get(); }

 private:
  struct Destroy {
    const Device* device;  // value-initialized (null) in an empty Event
    void operator()(CUevent_st* event) const;
  };
  std::unique_ptr<CUevent_st, Destroy> event_;
};

// A kernel in a loaded Module; valid while the Module lives.
class Kernel {
 public:
  Kernel() = default;
  const std::string& name() const { return name_; }
  CUfunc_st* get() const { return function_; }

  // Queues one launch on `stream`. `params` holds one pointer per kernel
  // parameter, pointing at its value (cuLaunchKernel's kernelParams). Sets
  // the dynamic shared memory opt-in above 48 KiB. Errors: INVALID_ARGUMENT
  // for a config the device refuses, RESOURCE_EXHAUSTED for too many
  // resources, others as mapped. Faults inside the kernel surface at the next
  // Stream::Synchronize().
  absl::Status Launch(const LaunchConfig& config, const Stream& stream, void** params) const;

 private:
  friend class Module;
  const Device* device_ = nullptr;
  CUfunc_st* function_ = nullptr;
  std::string name_;
};

// A loaded CUBIN, PTX or fatbin image; unloaded with the object. Thread-safe
// for GetKernel() and launches.
class Module {
 public:
  // Loads `image`: CUBIN (ELF), fatbin, or PTX text (the driver JIT-compiles
  // it; no NUL needed). INVALID_ARGUMENT for an image the device cannot use,
  // with the JIT's error log for PTX.
  static absl::StatusOr<std::unique_ptr<Module>> Load(const Device& device, std::string_view image);
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The kernel with this (mangled or extern "C") name. INVALID_ARGUMENT when
  // the module has none.
  absl::StatusOr<Kernel> GetKernel(const std::string& name) const;

 private:
  Module() = default;
  const Device* device_ = nullptr;
  CUmod_st* module_ = nullptr;
};

}  // namespace opjit::gpu

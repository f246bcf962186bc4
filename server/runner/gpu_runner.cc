#include "server/runner/gpu_runner.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/runner/aot_extra_impl.h"
#include "server/gpu/cuda_driver.h"
#include "server/gpu/launch_spec.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::runner {
namespace {

using AotEntry = int (*)(int, void**, int*, int64_t**, const char**, void*, void*);

absl::StatusOr<gpu::Device*> DefaultDevice() {
  OPJIT_ASSIGN_OR_RETURN(gpu::CudaDriver * driver, gpu::CudaDriver::Get());
  if (driver->device_count() == 0) {
    return absl::UnavailableError("the CUDA driver reports no GPU devices");
  }
  return driver->GetDevice(0);
}

}  // namespace

GpuRunner::GpuRunner(std::string scratch_dir) : scratch_dir_(std::move(scratch_dir)) {}

GpuRunner::~GpuRunner() {
  // Modules unload through their destructors; shared objects stay mapped
  // (their code may be referenced by the CUDA runtime's atexit handlers).
}

absl::Status GpuRunner::Available() { return DefaultDevice().status(); }

absl::StatusOr<std::shared_ptr<gpu::Module>> GpuRunner::ModuleFor(
    const compiler::CompiledKernel& kernel) {
  MutexLock lock(&mu_);
  auto it = modules_.find(kernel.cache_key);
  if (it != modules_.end()) return it->second;
  const compiler::GpuBinary* binary = kernel.gpu();
  if (binary == nullptr) return absl::InternalError("not a GPU kernel");
  OPJIT_ASSIGN_OR_RETURN(gpu::Device * device, DefaultDevice());
  // The CUBIN for this device's arch, else the PTX (the driver JIT-compiles it).
  const std::string arch = device->Arch();
  auto cubin = binary->cubins.find(arch);
  const std::string& image = cubin != binary->cubins.end() ? cubin->second : binary->ptx;
  if (image.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUBIN for ", arch, " and no PTX in the compiled kernel"));
  }
  OPJIT_ASSIGN_OR_RETURN(auto module, gpu::Module::Load(*device, image));
  std::shared_ptr<gpu::Module> shared(std::move(module));
  modules_[kernel.cache_key] = shared;
  Logger("runner")->info("loaded GPU module {} for {} ({})", kernel.cache_key.substr(0, 12), arch,
                       cubin != binary->cubins.end() ? "CUBIN" : "PTX");
  return shared;
}

absl::StatusOr<void*> GpuRunner::SharedObjectFor(const compiler::CompiledKernel& kernel) {
  MutexLock lock(&mu_);
  auto it = shared_objects_.find(kernel.cache_key);
  if (it != shared_objects_.end()) return it->second;
  const compiler::GpuBinary* binary = kernel.gpu();
  if (binary == nullptr) return absl::InternalError("not a GPU kernel");
  std::error_code ec;
  std::filesystem::create_directories(scratch_dir_, ec);
  const std::string path = absl::StrCat(scratch_dir_, "/", kernel.cache_key.substr(0, 32), ".so");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(binary->shared_object.data(),
              static_cast<std::streamsize>(binary->shared_object.size()));
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  unlink(path.c_str());  // mapped now; the file is not needed
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load the aot shared object: ", err ? err : "dlopen failed"));
  }
  shared_objects_[kernel.cache_key] = handle;
  return handle;
}

gpu::DeviceBuffer* GpuRunner::L2Scratch(const gpu::Device& device) {
  MutexLock lock(&mu_);
  if (!l2_tried_) {
    l2_tried_ = true;
    absl::StatusOr<gpu::DeviceBuffer> b =
        device.l2_cache_bytes() == 0
            ? absl::UnavailableError("the driver does not tell the L2 cache's size")
            : gpu::DeviceBuffer::Allocate(device, device.l2_cache_bytes());
    if (b.ok()) {
      l2_scratch_ = std::make_unique<gpu::DeviceBuffer>(*std::move(b));
    } else {
      Logger("runner")->warn("GPU calls will not flush L2: {}", b.status().ToString());
    }
  }
  return l2_scratch_.get();
}

namespace {

// What surrounds a kernel's launch on its stream: the L2 flush when the call
// asks for one, then the start event; the end event; their time once the
// stream is done. Events that fail leave the call's kernel_ms alone (-1).
class LaunchTimer {
 public:
  LaunchTimer(const gpu::Device& device, const gpu::Stream& stream, HostCall* call)
      : device_(device), stream_(stream), call_(call) {}

  // `l2_scratch`: the buffer to fill first, or nullptr for no flush.
  absl::Status Start(gpu::DeviceBuffer* l2_scratch) {
    if (l2_scratch != nullptr) {
      OPJIT_RETURN_IF_ERROR(l2_scratch->Fill(++flush_value_, stream_));
      call_->flushed_bytes = l2_scratch->size();
    }
    absl::StatusOr<gpu::Event> start = gpu::Event::Create(device_);
    absl::StatusOr<gpu::Event> end = gpu::Event::Create(device_);
    if (start.ok() && end.ok()) {
      start_ = *std::move(start);
      end_ = *std::move(end);
      Check(start_.Record(stream_));
    } else {
      Check(start.ok() ? end.status() : start.status());
    }
    return absl::OkStatus();
  }
  void Stop() {
    if (timing_) Check(end_.Record(stream_));
  }
  // After the stream's work is done.
  void Report() {
    if (!timing_) return;
    absl::StatusOr<double> ms = gpu::Event::ElapsedMs(start_, end_);
    Check(ms.status());
    if (ms.ok()) call_->kernel_ms = *ms;
  }

 private:
  void Check(const absl::Status& s) {
    if (s.ok()) return;
    timing_ = false;
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      Logger("runner")->warn("GPU kernels are timed on the host: {}", s.ToString());
    }
  }

  const gpu::Device& device_;
  const gpu::Stream& stream_;
  HostCall* const call_;
  gpu::Event start_, end_;
  bool timing_ = true;
  static inline std::atomic<uint8_t> flush_value_{0};
};

}  // namespace

struct GpuRunner::Launch {
  const registry::OpDef& def;
  const registry::Implementation& impl;
  const compiler::CompiledKernel& kernel;
  const std::map<std::string, registry::AttrValue>& attrs;
  absl::Span<const HostTensor> inputs;
  const std::vector<std::string>& input_names;
  absl::Span<const HostTensor> outputs;
  const gpu::Stream& stream;
  LaunchTimer& timer;
  gpu::DeviceBuffer* l2_scratch;  // null: no flush
  std::vector<gpu::DeviceBuffer> in_bufs, out_bufs;
  std::vector<uint64_t> out_bytes;
};

namespace {

// Device copies of every tensor: inputs uploaded on the call's stream,
// outputs zeroed (device memory may hold an earlier call's bytes, and the
// whole buffer is copied back), as on the CPU (AotKernelInstance).
absl::Status Upload(const gpu::Device& device, GpuRunner::Launch& l) {
  for (const auto& t : l.inputs) {
    if (t.null) {  // no data (not saved for a bprop): a null device pointer
      l.in_bufs.emplace_back();
      continue;
    }
    OPJIT_ASSIGN_OR_RETURN(uint64_t n, tensor::ByteSize(t.desc.dtype, t.desc.shape));
    OPJIT_ASSIGN_OR_RETURN(gpu::DeviceBuffer b, gpu::DeviceBuffer::Allocate(device, n ? n : 1));
    if (n) OPJIT_RETURN_IF_ERROR(b.CopyFromHost(t.data, n, l.stream));
    l.in_bufs.push_back(std::move(b));
  }
  for (const auto& t : l.outputs) {
    OPJIT_ASSIGN_OR_RETURN(uint64_t n, tensor::ByteSize(t.desc.dtype, t.desc.shape));
    OPJIT_ASSIGN_OR_RETURN(gpu::DeviceBuffer b, gpu::DeviceBuffer::Allocate(device, n ? n : 1));
    OPJIT_RETURN_IF_ERROR(b.Zero(l.stream));
    l.out_bufs.push_back(std::move(b));
    l.out_bytes.push_back(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuRunner::Run(const registry::OpDef& def, const registry::Implementation& impl,
                            const compiler::CompiledKernel& kernel,
                            const std::map<std::string, registry::AttrValue>& attrs,
                            absl::Span<const HostTensor> inputs,
                            const std::vector<std::string>& input_names,
                            absl::Span<const HostTensor> outputs, HostCall* call) {
  const compiler::GpuBinary* binary = kernel.gpu();
  if (binary == nullptr) return absl::InternalError("not a GPU kernel");
  OPJIT_ASSIGN_OR_RETURN(gpu::Device * device, DefaultDevice());
  OPJIT_ASSIGN_OR_RETURN(gpu::Stream stream, gpu::Stream::Create(*device));
  LaunchTimer timer(*device, stream, call);
  Launch l{def,    impl,  kernel, attrs, inputs, input_names, outputs,
           stream, timer, call->flush_caches ? L2Scratch(*device) : nullptr};
  OPJIT_RETURN_IF_ERROR(Upload(*device, l));
  OPJIT_RETURN_IF_ERROR(binary->shared_object.empty() ? RunNvrtc(l) : RunAot(l));
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (l.out_bytes[j] == 0) continue;
    OPJIT_RETURN_IF_ERROR(l.out_bufs[j].CopyToHost(outputs[j].data, l.out_bytes[j], stream));
  }
  OPJIT_RETURN_IF_ERROR(stream.Synchronize());
  timer.Report();
  return absl::OkStatus();
}

// A MindSpore aot .cu kernel: its host launcher gets device pointers and the
// stream, and queues its kernels there.
absl::Status GpuRunner::RunAot(Launch& l) {
  OPJIT_ASSIGN_OR_RETURN(void* handle, SharedObjectFor(l.kernel));
  auto entry = reinterpret_cast<AotEntry>(dlsym(handle, l.impl.entry.c_str()));
  if (entry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("entry symbol \"", l.impl.entry, "\" is not exported by the aot .cu file"));
  }
  std::vector<void*> params;
  std::vector<int> ndims;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<const char*> dtypes;
  auto add = [&](const gpu::DeviceBuffer& b, const TensorDesc& d) {
    params.push_back(reinterpret_cast<void*>(b.ptr()));
    ndims.push_back(static_cast<int>(d.shape.size()));
    shapes.push_back(d.shape);
    dtypes.push_back(d.dtype.c_str());
  };
  for (size_t i = 0; i < l.inputs.size(); ++i) {
    add(l.in_bufs[i], l.inputs[i].desc);
    // A null slot: params[i] == nullptr (ptr() is 0), ndims[i] == 0, and
    // shapes[i] at a single 0, as on the CPU.
    if (l.inputs[i].null) shapes.back() = {0};
  }
  for (size_t j = 0; j < l.outputs.size(); ++j) add(l.out_bufs[j], l.outputs[j].desc);
  std::vector<int64_t*> shape_ptrs;
  for (auto& s : shapes) shape_ptrs.push_back(s.data());
  AotExtraImpl extra(l.attrs);
  OPJIT_RETURN_IF_ERROR(l.timer.Start(l.l2_scratch));
  const int rc = entry(static_cast<int>(params.size()), params.data(), ndims.data(),
                       shape_ptrs.data(), dtypes.data(), l.stream.get(), &extra);
  l.timer.Stop();
  OPJIT_RETURN_IF_ERROR(extra.TakeStatus(l.impl.entry));
  if (rc != 0) return absl::AbortedError(absl::StrCat("kernel ", l.impl.entry, " returned ", rc));
  return absl::OkStatus();
}

namespace {

// The names and shapes a launch spec's expressions see: the declared inputs
// (the first tensor of a dynamic one) and outputs, and the numeric attrs.
// `env_input_index`: per declared input, its flat index (SIZE_MAX: absent).
gpu::LaunchEnv EnvFor(const GpuRunner::Launch& l, std::vector<size_t>* env_input_index) {
  gpu::LaunchEnv env;
  std::map<std::string, size_t> first_of;
  for (size_t i = 0; i < l.inputs.size(); ++i) first_of.emplace(l.input_names[i], i);
  for (const auto& p : l.def.inputs) {
    auto it = first_of.find(p.name);
    env.input_names.push_back(p.name);
    env.input_shapes.push_back(it == first_of.end() ? std::vector<int64_t>{}
                                                    : l.inputs[it->second].desc.shape);
    env_input_index->push_back(it == first_of.end() ? SIZE_MAX : it->second);
  }
  for (size_t j = 0; j < l.def.outputs.size(); ++j) {
    env.output_names.push_back(l.def.outputs[j].name);
    env.output_shapes.push_back(l.outputs[j].desc.shape);
  }
  for (const auto& [name, v] : l.attrs) {
    if (const auto* i = std::get_if<int64_t>(&v)) env.attrs[name] = static_cast<double>(*i);
    if (const auto* f = std::get_if<double>(&v)) {
      env.attrs[name] = *f;
      env.float_attrs.insert(name);
    }
  }
  return env;
}

// The value of one kernel parameter, into `slot`.
absl::Status BindArg(const GpuRunner::Launch& l, const std::vector<size_t>& env_input_index,
                     size_t k, const gpu::KernelArg& a, uint64_t* slot) {
  switch (a.kind) {
    case gpu::KernelArg::Kind::kInputPointer: {
      const size_t flat = a.tensor >= 0 && static_cast<size_t>(a.tensor) < env_input_index.size()
                              ? env_input_index[a.tensor]
                              : SIZE_MAX;
      if (flat == SIZE_MAX) {
        return absl::InvalidArgumentError(
            absl::StrCat("launch.args[", k, "] binds an input that this call left absent"));
      }
      if (l.inputs[flat].null) {
        return absl::InvalidArgumentError(
            absl::StrCat("launch.args[", k, "] binds input ", l.input_names[flat],
                         ", which has no data (not saved for backward)"));
      }
      *slot = l.in_bufs[flat].ptr();
      break;
    }
    case gpu::KernelArg::Kind::kOutputPointer:
      *slot = l.out_bufs[a.tensor].ptr();
      break;
    case gpu::KernelArg::Kind::kInt64:
      std::memcpy(slot, &a.i64, sizeof(a.i64));
      break;
    case gpu::KernelArg::Kind::kFloat32:
      std::memcpy(slot, &a.f32, sizeof(a.f32));
      break;
  }
  return absl::OkStatus();
}

}  // namespace

// An NVRTC kernel: the launch spec gives the grid and the parameters.
absl::Status GpuRunner::RunNvrtc(Launch& l) {
  gpu::LaunchSpec spec;
  spec.kernel = l.impl.launch.kernel.empty() ? l.impl.entry : l.impl.launch.kernel;
  spec.grid = l.impl.launch.grid;
  spec.block = l.impl.launch.block;
  spec.shared_mem = l.impl.launch.shared_mem.empty() ? "0" : l.impl.launch.shared_mem;
  spec.args = l.impl.launch.args;
  std::vector<size_t> env_input_index;
  const gpu::LaunchEnv env = EnvFor(l, &env_input_index);
  OPJIT_ASSIGN_OR_RETURN(gpu::LaunchConfig config, gpu::Resolve(spec, env));
  OPJIT_ASSIGN_OR_RETURN(std::vector<gpu::KernelArg> args, gpu::ResolveArgs(spec, env));
  OPJIT_ASSIGN_OR_RETURN(auto module, ModuleFor(l.kernel));
  const compiler::GpuBinary* binary = l.kernel.gpu();
  auto lowered = binary->lowered_names.find(spec.kernel);
  const std::string name = lowered != binary->lowered_names.end() ? lowered->second : spec.kernel;
  OPJIT_ASSIGN_OR_RETURN(gpu::Kernel fn, module->GetKernel(name));
  // Parameter storage: every value lives in `slots`; params point at them.
  std::vector<uint64_t> slots(args.size());
  std::vector<void*> params(args.size());
  for (size_t k = 0; k < args.size(); ++k) {
    OPJIT_RETURN_IF_ERROR(BindArg(l, env_input_index, k, args[k], &slots[k]));
    params[k] = &slots[k];
  }
  OPJIT_RETURN_IF_ERROR(l.timer.Start(l.l2_scratch));
  absl::Status launched = fn.Launch(config, l.stream, params.data());
  l.timer.Stop();
  return launched;
}

}  // namespace opjit::runner

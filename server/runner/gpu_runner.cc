#include "server/runner/gpu_runner.h"

#include <dlfcn.h>
#include <unistd.h>

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

absl::Status GpuRunner::Run(const registry::OpDef& def, const registry::Implementation& impl,
                            const compiler::CompiledKernel& kernel,
                            const std::map<std::string, registry::AttrValue>& attrs,
                            absl::Span<const HostTensor> inputs,
                            const std::vector<std::string>& input_names,
                            absl::Span<const HostTensor> outputs) {
  const compiler::GpuBinary* binary = kernel.gpu();
  if (binary == nullptr) return absl::InternalError("not a GPU kernel");
  OPJIT_ASSIGN_OR_RETURN(gpu::Device * device, DefaultDevice());
  OPJIT_ASSIGN_OR_RETURN(gpu::Stream stream, gpu::Stream::Create(*device));

  // Device copies of every tensor; inputs uploaded on the call's stream.
  std::vector<gpu::DeviceBuffer> in_bufs, out_bufs;
  std::vector<uint64_t> in_bytes, out_bytes;
  for (const auto& t : inputs) {
    if (t.null) {  // no data (not saved for a bprop): a null device pointer
      in_bufs.emplace_back();
      in_bytes.push_back(0);
      continue;
    }
    OPJIT_ASSIGN_OR_RETURN(uint64_t n, tensor::ByteSize(t.desc.dtype, t.desc.shape));
    OPJIT_ASSIGN_OR_RETURN(gpu::DeviceBuffer b, gpu::DeviceBuffer::Allocate(*device, n ? n : 1));
    if (n) OPJIT_RETURN_IF_ERROR(b.CopyFromHost(t.data, n, stream));
    in_bufs.push_back(std::move(b));
    in_bytes.push_back(n);
  }
  for (const auto& t : outputs) {
    OPJIT_ASSIGN_OR_RETURN(uint64_t n, tensor::ByteSize(t.desc.dtype, t.desc.shape));
    OPJIT_ASSIGN_OR_RETURN(gpu::DeviceBuffer b, gpu::DeviceBuffer::Allocate(*device, n ? n : 1));
    // Outputs start zeroed, as on the CPU (AotKernelInstance): device memory
    // may hold an earlier call's bytes, and the whole buffer is copied back.
    OPJIT_RETURN_IF_ERROR(b.Zero(stream));
    out_bufs.push_back(std::move(b));
    out_bytes.push_back(n);
  }

  if (!binary->shared_object.empty()) {
    // A MindSpore aot .cu kernel: its host launcher gets device pointers and the stream.
    OPJIT_ASSIGN_OR_RETURN(void* handle, SharedObjectFor(kernel));
    auto entry = reinterpret_cast<AotEntry>(dlsym(handle, impl.entry.c_str()));
    if (entry == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry symbol \"", impl.entry, "\" is not exported by the aot .cu file"));
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
    for (size_t i = 0; i < inputs.size(); ++i) {
      add(in_bufs[i], inputs[i].desc);
      // A null slot: params[i] == nullptr (ptr() is 0), ndims[i] == 0, and
      // shapes[i] at a single 0, as on the CPU.
      if (inputs[i].null) shapes.back() = {0};
    }
    for (size_t j = 0; j < outputs.size(); ++j) add(out_bufs[j], outputs[j].desc);
    std::vector<int64_t*> shape_ptrs;
    for (auto& s : shapes) shape_ptrs.push_back(s.data());
    AotExtraImpl extra(attrs);
    const int rc = entry(static_cast<int>(params.size()), params.data(), ndims.data(),
                         shape_ptrs.data(), dtypes.data(), stream.get(), &extra);
    OPJIT_RETURN_IF_ERROR(extra.TakeStatus(impl.entry));
    if (rc != 0) return absl::AbortedError(absl::StrCat("kernel ", impl.entry, " returned ", rc));
  } else {
    // An NVRTC kernel: the launch spec gives the grid and the parameters.
    gpu::LaunchSpec spec;
    spec.kernel = impl.launch.kernel.empty() ? impl.entry : impl.launch.kernel;
    spec.grid = impl.launch.grid;
    spec.block = impl.launch.block;
    spec.shared_mem = impl.launch.shared_mem.empty() ? "0" : impl.launch.shared_mem;
    spec.args = impl.launch.args;
    gpu::LaunchEnv env;
    // Tensor names in expressions: the declared inputs (the first tensor of a
    // dynamic one) and outputs.
    std::map<std::string, size_t> first_of;
    for (size_t i = 0; i < inputs.size(); ++i) first_of.emplace(input_names[i], i);
    std::vector<size_t> env_input_index;
    for (const auto& p : def.inputs) {
      auto it = first_of.find(p.name);
      env.input_names.push_back(p.name);
      env.input_shapes.push_back(it == first_of.end() ? std::vector<int64_t>{}
                                                      : inputs[it->second].desc.shape);
      env_input_index.push_back(it == first_of.end() ? SIZE_MAX : it->second);
    }
    for (size_t j = 0; j < def.outputs.size(); ++j) {
      env.output_names.push_back(def.outputs[j].name);
      env.output_shapes.push_back(outputs[j].desc.shape);
    }
    for (const auto& [name, v] : attrs) {
      if (const auto* i = std::get_if<int64_t>(&v)) env.attrs[name] = static_cast<double>(*i);
      if (const auto* f = std::get_if<double>(&v)) {
        env.attrs[name] = *f;
        env.float_attrs.insert(name);
      }
    }
    OPJIT_ASSIGN_OR_RETURN(gpu::LaunchConfig config, gpu::Resolve(spec, env));
    OPJIT_ASSIGN_OR_RETURN(std::vector<gpu::KernelArg> args, gpu::ResolveArgs(spec, env));
    OPJIT_ASSIGN_OR_RETURN(auto module, ModuleFor(kernel));
    auto lowered = binary->lowered_names.find(spec.kernel);
    const std::string name =
        lowered != binary->lowered_names.end() ? lowered->second : spec.kernel;
    OPJIT_ASSIGN_OR_RETURN(gpu::Kernel fn, module->GetKernel(name));
    // Parameter storage: every value lives in `slots`; params point at them.
    std::vector<uint64_t> slots(args.size());
    std::vector<void*> params(args.size());
    for (size_t k = 0; k < args.size(); ++k) {
      const gpu::KernelArg& a = args[k];
      switch (a.kind) {
        case gpu::KernelArg::Kind::kInputPointer: {
          const size_t flat = a.tensor >= 0 && static_cast<size_t>(a.tensor) < env_input_index.size()
                                  ? env_input_index[a.tensor]
                                  : SIZE_MAX;
          if (flat == SIZE_MAX) {
            return absl::InvalidArgumentError(absl::StrCat(
                "launch.args[", k, "] binds an input that this call left absent"));
          }
          if (inputs[flat].null) {
            return absl::InvalidArgumentError(absl::StrCat(
                "launch.args[", k, "] binds input ", input_names[flat],
                ", which has no data (not saved for backward)"));
          }
          slots[k] = in_bufs[flat].ptr();
          break;
        }
        case gpu::KernelArg::Kind::kOutputPointer:
          slots[k] = out_bufs[a.tensor].ptr();
          break;
        case gpu::KernelArg::Kind::kInt64:
          std::memcpy(&slots[k], &a.i64, sizeof(a.i64));
          break;
        case gpu::KernelArg::Kind::kFloat32:
          std::memcpy(&slots[k], &a.f32, sizeof(a.f32));
          break;
      }
      params[k] = &slots[k];
    }
    OPJIT_RETURN_IF_ERROR(fn.Launch(config, stream, params.data()));
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (out_bytes[j]) OPJIT_RETURN_IF_ERROR(out_bufs[j].CopyToHost(outputs[j].data, out_bytes[j], stream));
  }
  return stream.Synchronize();
}

}  // namespace opjit::runner

#include "server/runner/kernel_host.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "server/cache/lru_cache.h"
#include "server/common/cache_flush.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/compiler/kernel_compiler.h"
#include "server/loader/loader.h"
#include "server/runner/aot_kernel.h"
#include "server/runner/gpu_runner.h"

namespace opjit::runner {
namespace {

using SteadyClock = std::chrono::steady_clock;

double MsSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
}

class CpuInstance : public HostInstance {
 public:
  explicit CpuInstance(std::unique_ptr<AotKernelInstance> inst) : inst_(std::move(inst)) {}
  absl::StatusOr<std::vector<int64_t>> InferShape() override { return inst_->InferShape(); }
  absl::Status Run(absl::Span<const HostTensor> inputs, absl::Span<const HostTensor> outputs,
                   HostCall* call) override {
    // The sweep runs on this thread, the kernel's, right before it.
    if (call->flush_caches) call->flushed_bytes = SweepCpuCaches();
    const auto t0 = SteadyClock::now();
    absl::Status s = inst_->Run(inputs, outputs);
    call->kernel_ms = MsSince(t0);
    return s;
  }

 private:
  std::unique_ptr<AotKernelInstance> inst_;
};

class GpuInstance : public HostInstance {
 public:
  GpuInstance(InstanceSpec spec, GpuRunner* gpu) : spec_(std::move(spec)), gpu_(gpu) {}
  absl::StatusOr<std::vector<int64_t>> InferShape() override {
    return absl::FailedPreconditionError(
        "GPU implementations have no InferShape; give the output a declarative rule");
  }
  absl::Status Run(absl::Span<const HostTensor> inputs, absl::Span<const HostTensor> outputs,
                   HostCall* call) override {
    const auto& impl = spec_.def->implementations.at(spec_.impl_index);
    return gpu_->Run(*spec_.def, impl, *spec_.kernel, spec_.attrs, inputs, spec_.input_names,
                     outputs, call);
  }

 private:
  const InstanceSpec spec_;
  GpuRunner* const gpu_;
};

}  // namespace

absl::Status RunTimed(HostInstance& inst, absl::Span<const HostTensor> inputs,
                      absl::Span<const HostTensor> outputs, HostCall* call) {
  call->kernel_ms = -1;
  const auto t0 = SteadyClock::now();
  absl::Status s = inst.Run(inputs, outputs, call);
  if (call->kernel_ms < 0) call->kernel_ms = MsSince(t0);
  return s;
}

struct KernelHost::Impl {
  KernelHostOptions options;
  std::unique_ptr<loader::JitLoader> loader;
  std::unique_ptr<cache::LruCache<loader::LoadedKernel>> loaded;
  std::unique_ptr<GpuRunner> gpu;
  std::atomic<uint64_t> loads{0};
};

KernelHost::KernelHost(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KernelHost::~KernelHost() = default;

absl::StatusOr<std::unique_ptr<KernelHost>> KernelHost::Create(const KernelHostOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (const char* v = std::getenv(kNoZeroFillEnv); v != nullptr && std::string_view(v) == "1") {
    impl->options.zero_outputs = false;
    Logger("runner")->warn("{}=1: kernel outputs are not zero-filled (a benchmark's setting)",
                           kNoZeroFillEnv);
  }
  OPJIT_ASSIGN_OR_RETURN(impl->loader,
                         loader::JitLoader::Create({.allowed_libraries = options.allowed_libraries}));
  impl->loaded = std::make_unique<cache::LruCache<loader::LoadedKernel>>(options.loaded_kernels,
                                                                         ~uint64_t{0});
  impl->gpu = std::make_unique<GpuRunner>(options.scratch_dir);
  return std::unique_ptr<KernelHost>(new KernelHost(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<HostInstance>> KernelHost::NewInstance(const InstanceSpec& spec) {
  if (spec.kernel == nullptr) return absl::InternalError("no kernel given");
  if (spec.kernel->target == registry::Target::kGpu) {
    if (spec.def == nullptr || spec.impl_index < 0 ||
        static_cast<size_t>(spec.impl_index) >= spec.def->implementations.size()) {
      return absl::InternalError("GPU instance without its op definition");
    }
    OPJIT_RETURN_IF_ERROR(GpuRunner::Available());
    return std::unique_ptr<HostInstance>(new GpuInstance(spec, impl_->gpu.get()));
  }
  const compiler::CpuObject* cpu = spec.kernel->cpu_object();
  if (cpu == nullptr) return absl::InternalError("not a CPU kernel");
  std::shared_ptr<const loader::LoadedKernel> kernel = impl_->loaded->Get(spec.kernel->cache_key);
  if (kernel == nullptr) {
    OPJIT_ASSIGN_OR_RETURN(kernel, impl_->loader->Load(cpu->elf,
                                                       spec.kernel->cache_key.substr(0, 16),
                                                       cpu->libraries));
    impl_->loads.fetch_add(1, std::memory_order_relaxed);
    impl_->loaded->Put(spec.kernel->cache_key, kernel, kernel->code_bytes());
  }
  AotKernelOptions opts;
  // A kernel with Init may keep state in its kernel data; calls into one
  // instance are serialised then. Without Init, calls run concurrently.
  opts.serialize_runs = kernel->Find(spec.entry + "Init") != nullptr;
  opts.zero_outputs = impl_->options.zero_outputs;
  OPJIT_ASSIGN_OR_RETURN(auto inst, AotKernelInstance::Create(std::move(kernel), spec.entry,
                                                              spec.inputs, spec.outputs,
                                                              spec.attrs, opts));
  return std::unique_ptr<HostInstance>(new CpuInstance(std::move(inst)));
}

KernelHost::Stats KernelHost::GetStats() const {
  return {impl_->loads.load(), impl_->loaded->Stats().entries};
}

}  // namespace opjit::runner

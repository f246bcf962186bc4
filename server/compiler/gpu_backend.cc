// The GPU compile backend: CUDA through NVRTC (CUBIN per arch plus PTX) or,
// for MindSpore aot .cu files with host code, nvcc (a shared object). Both
// run confined in opjit-gpu-sandbox processes; both are found on first use.
//
// Which one: nvcc when the job asks for it (aot_shared_object: `opjit compile
// --aot`, or a registered GPU implementation without a launch spec), or when
// it names no NVRTC name expressions and its source has host code (a <<<>>>
// launch, an extern "C" host function: cuda_source.h); NVRTC otherwise. When
// NVRTC fails on host code anyway, its error says how to pick nvcc.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/common/logging.h"
#include "server/common/mutex.h"
#include "server/common/status_macros.h"
#include "server/compiler/backend.h"
#include "server/compiler/compile_options.h"
#include "server/compiler/cuda_source.h"
#include "server/gpu/nvcc_compiler.h"
#include "server/gpu/nvrtc_compiler.h"

namespace opjit::compiler {
namespace {

constexpr char kGpuMagic[] = "OPJG1";
// Headers a GPU compile may read besides the toolkit's (which the toolchain
// identity covers), listed at most this many per compile.
constexpr size_t kMaxListedHeaders = 4096;

void PutField(std::string* out, std::string_view v) {
  absl::StrAppend(out, v.size(), ":");
  out->append(v);
}

bool GetField(std::string_view* in, std::string* v) {
  auto colon = in->find(':');
  if (colon == std::string_view::npos || colon > 20) return false;
  size_t n = 0;
  for (size_t i = 0; i < colon; ++i) {
    if ((*in)[i] < '0' || (*in)[i] > '9') return false;
    n = n * 10 + ((*in)[i] - '0');
  }
  if (n > in->size() - colon - 1) return false;
  v->assign(in->substr(colon + 1, n));
  in->remove_prefix(colon + 1 + n);
  return true;
}

// Host code in `job`'s source, as NVRTC would see it.
std::optional<HostCodeSite> HostCodeOf(const CompileJob& job) {
  return FindHostCode(job.source, HasDefaultDeviceOption(job.options));
}

// nvcc (a shared object) rather than NVRTC. Name expressions are NVRTC's, and
// a registered op's launch spec needs them: such a job stays with NVRTC.
bool UsesNvcc(const CompileJob& job) {
  return job.aot_shared_object || (job.name_expressions.empty() && HostCodeOf(job).has_value());
}

// Whether an NVRTC log complains about host code.
bool NvrtcRefusedHostCode(std::string_view log) {
  return log.find("host functions are not allowed in JIT mode") != std::string_view::npos ||
         log.find("is considered a host function") != std::string_view::npos ||
         log.find("device-side kernel launch") != std::string_view::npos;
}

// How to build a source with host code through nvcc instead, for an NVRTC
// error: `status` with that appended, code and reason kept. Other errors
// come back unchanged.
absl::Status WithNvccHint(const absl::Status& status, const CompileJob& job) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  const auto site = HostCodeOf(job);
  if (!site && !NvrtcRefusedHostCode(std::string(status.message()))) return status;
  constexpr char kHowToNvcc[] =
      "build it with nvcc as a MindSpore aot .cu file: `opjit compile --aot FILE` "
      "(aot_shared_object in a CompileRequest), or register the GPU implementation "
      "without a \"launch\" spec";
  std::string hint;
  if (site) {
    // Only name expressions keep a source with host code on NVRTC.
    hint = absl::StrCat("hint: this source has host code (", site->Describe(),
                        "), which NVRTC cannot compile; NVRTC was used because name expressions "
                        "were given (--name-expr, or a registered op's launch spec). To ",
                        kHowToNvcc, ".");
  } else {
    hint = absl::StrCat(
        "hint: NVRTC compiles device code only: mark helper functions __device__ (or pass the "
        "compile option -default-device), or ",
        kHowToNvcc, ".");
  }
  std::string message(status.message());
  if (!message.empty() && message.back() != '\n') message += '\n';
  absl::Status out(status.code(), absl::StrCat(message, hint));
  status.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

// NVRTC's toolchain id without host paths, for keys (cache_key.h): the
// library by its real file name (libnvrtc.so.12.4.127: the exact release),
// neither the CUDA root nor the include dirs (which enter keys by content).
std::string PortableNvrtcId(const std::string& id) {
  std::vector<std::string> kept;
  for (absl::string_view field : absl::StrSplit(id, ';')) {
    if (absl::StartsWith(field, "cuda_root=") || absl::StartsWith(field, "include=")) continue;
    if (absl::StartsWith(field, "lib=")) {
      std::error_code ec;
      std::filesystem::path lib(std::string(field.substr(4)));
      std::filesystem::path real = std::filesystem::canonical(lib, ec);
      kept.push_back(absl::StrCat("lib=", (ec ? lib : real).filename().string()));
      continue;
    }
    kept.emplace_back(field);
  }
  return absl::StrJoin(kept, ";");
}

class GpuBackend : public CompileBackend {
 public:
  explicit GpuBackend(KernelCompilerOptions options) : options_(std::move(options)) {}

  registry::Target target() const override { return registry::Target::kGpu; }

  std::vector<std::string> Languages() const override { return CudaLanguages(); }

  std::string OptionRefusal(const std::string& language, std::string_view option) const override {
    return CudaOptionRefusal(option);
  }

  absl::StatusOr<std::string> Identity(const CompileJob& job) override {
    if (job.language != "cuda") {
      return absl::InvalidArgumentError(
          absl::StrCat("language \"", job.language, "\" is not a GPU language (expected cuda)"));
    }
    std::string id;
    if (UsesNvcc(job)) {
      MutexLock lock(&mu_);
      if (nvcc_id_.empty()) {
        OPJIT_ASSIGN_OR_RETURN(nvcc_id_, gpu::NvccToolchainId(options_.cuda_root));
      }
      id = absl::StrCat(nvcc_id_, ";nvcc-aot");
    } else {
      OPJIT_ASSIGN_OR_RETURN(gpu::NvrtcCompiler * c, Nvrtc());
      id = absl::StrCat(PortableNvrtcId(c->ToolchainId()), ";nvrtc");
    }
    return absl::StrCat(id, ";archs=", absl::StrJoin(Archs(job), ","),
                        ";names=", absl::StrJoin(job.name_expressions, "\x1f"));
  }

  absl::StatusOr<BackendOutput> Compile(const CompileJob& job) override {
    const std::vector<std::string> archs = Archs(job);
    BackendOutput out;
    out.kernel = std::make_shared<CompiledKernel>();
    out.kernel->target = registry::Target::kGpu;
    GpuBinary* g = &out.kernel->artifact.emplace<GpuBinary>();
    g->archs = archs;
    if (UsesNvcc(job)) {
      if (!job.aot_shared_object) {
        Logger("compiler")->info("{}: host code ({}): compiling with nvcc", job.file_name,
                                 HostCodeOf(job)->Describe());
      }
      gpu::NvccRequest req;
      req.source = job.source;
      req.file_name = job.file_name;
      req.options = job.options;
      for (const registry::SourceFile& f : job.files) req.files.emplace_back(f.name, f.content);
      req.archs = archs;
      req.cuda_root = options_.cuda_root;
      req.kernel_include_dir = options_.kernel_include_dir;
      req.extra_include_dirs = options_.extra_include_dirs;
      req.sandbox_path = SandboxPath();
      req.memory_limit_bytes = options_.memory_limit_bytes;
      req.compile_uid = options_.compile_uid;
      req.compile_gid = options_.compile_gid;
      if (req.sandbox_path.empty()) return NoSandbox();
      OPJIT_ASSIGN_OR_RETURN(gpu::NvccOutput r, gpu::CompileAotSharedObject(req));
      g->shared_object = std::move(r.shared_object);
      out.kernel->compile_ms = r.compile_ms;
      out.kernel->diagnostics = std::move(r.diagnostics);
    } else {
      OPJIT_ASSIGN_OR_RETURN(gpu::NvrtcCompiler * c, Nvrtc());
      gpu::GpuCompileRequest req;
      req.source = job.source;
      req.file_name = job.file_name;
      req.options = job.options;
      req.name_expressions = job.name_expressions;
      req.archs = archs;
      for (const registry::SourceFile& f : job.files) req.headers.emplace_back(f.name, f.content);
      req.tenant = job.ns;
      auto compiled = c->Compile(req);
      if (!compiled.ok()) return WithNvccHint(compiled.status(), job);
      gpu::GpuCompileOutput r = *std::move(compiled);
      g->cubins = std::move(r.cubins);
      g->ptx = std::move(r.ptx);
      g->ptx_arch = std::move(r.ptx_arch);
      g->lowered_names = std::move(r.lowered_names);
      out.kernel->compile_ms = r.compile_ms;
      out.kernel->diagnostics = std::move(r.diagnostics);
    }
    // NVRTC and nvcc do not say which headers they read: depend on every
    // header they may read besides the toolkit's, so an edited one misses.
    out.dependencies = IncludeTreeFiles();
    return out;
  }

  absl::Status Check(const CompileJob&, CompiledKernel*) const override {
    // A GPU kernel's name is checked through its lowered name (NVRTC) or at
    // its first launch (aot shared objects); nothing here reads the binary.
    return absl::OkStatus();
  }

  std::string DiskKind() const override { return "gpu"; }

  // Fields as "<len>:<bytes>".
  std::string Encode(const CompiledKernel& k) const override {
    const GpuBinary& g = std::get<GpuBinary>(k.artifact);  // this backend's kernels
    std::string out = kGpuMagic;
    PutField(&out, absl::StrCat(k.compile_ms));
    PutField(&out, k.diagnostics);
    PutField(&out, g.ptx);
    PutField(&out, g.ptx_arch);
    PutField(&out, g.shared_object);
    PutField(&out, absl::StrCat(g.cubins.size()));
    for (const auto& [arch, bin] : g.cubins) {
      PutField(&out, arch);
      PutField(&out, bin);
    }
    PutField(&out, absl::StrCat(g.lowered_names.size()));
    for (const auto& [expr, name] : g.lowered_names) {
      PutField(&out, expr);
      PutField(&out, name);
    }
    PutField(&out, absl::StrJoin(g.archs, ","));
    return out;
  }

  absl::StatusOr<std::shared_ptr<CompiledKernel>> Decode(std::string_view in) const override {
    const auto malformed = [] { return absl::DataLossError("malformed GPU entry"); };
    if (in.substr(0, sizeof(kGpuMagic) - 1) != kGpuMagic) return malformed();
    in.remove_prefix(sizeof(kGpuMagic) - 1);
    auto k = std::make_shared<CompiledKernel>();
    GpuBinary* g = &k->artifact.emplace<GpuBinary>();
    std::string ms, count, archs;
    if (!GetField(&in, &ms) || !GetField(&in, &k->diagnostics) || !GetField(&in, &g->ptx) ||
        !GetField(&in, &g->ptx_arch) || !GetField(&in, &g->shared_object) ||
        !GetField(&in, &count)) {
      return malformed();
    }
    k->compile_ms = std::atof(ms.c_str());
    for (long i = 0, n = std::atol(count.c_str()); i < n; ++i) {
      std::string arch, bin;
      if (!GetField(&in, &arch) || !GetField(&in, &bin)) return malformed();
      g->cubins[arch] = std::move(bin);
    }
    if (!GetField(&in, &count)) return malformed();
    for (long i = 0, n = std::atol(count.c_str()); i < n; ++i) {
      std::string expr, name;
      if (!GetField(&in, &expr) || !GetField(&in, &name)) return malformed();
      g->lowered_names[expr] = std::move(name);
    }
    if (!GetField(&in, &archs) || !in.empty()) return malformed();
    if (!archs.empty()) g->archs = absl::StrSplit(archs, ',');
    k->target = registry::Target::kGpu;
    return k;
  }

  std::string ToolchainId() const override {
    MutexLock lock(&mu_);
    return nvrtc_ ? nvrtc_->ToolchainId() : std::string();
  }

 private:
  std::vector<std::string> Archs(const CompileJob& job) const {
    return job.archs.empty() ? options_.gpu_archs : job.archs;
  }

  static absl::Status NoSandbox() {
    return absl::UnavailableError(
        "the GPU compiler sandbox (opjit-gpu-sandbox) is missing; GPU compiles are off");
  }

  // The opjit-gpu-sandbox binary, or "" when it is not there.
  std::string SandboxPath() const {
    std::string p = options_.gpu_sandbox_path;
    if (p.empty()) {
      std::string near = options_.worker_path;
      if (near.empty()) {
        std::error_code ec;
        near = std::filesystem::read_symlink("/proc/self/exe", ec).string();
      }
      p = near.substr(0, near.rfind('/') + 1) + "opjit-gpu-sandbox";
    }
    return !p.empty() && ::access(p.c_str(), X_OK) == 0 ? p : std::string();
  }

  absl::StatusOr<gpu::NvrtcCompiler*> Nvrtc() {
    MutexLock lock(&mu_);
    if (nvrtc_) return nvrtc_.get();
    if (!nvrtc_status_.ok()) return nvrtc_status_;
    gpu::NvrtcOptions o;
    o.cuda_root = options_.cuda_root;
    o.archs = options_.gpu_archs;
    o.extra_include_dirs = {options_.kernel_include_dir};
    o.worker_path = SandboxPath();
    o.timeout_ms = options_.timeout_ms;
    o.memory_limit_bytes = options_.memory_limit_bytes;
    // The CPU compile workers' bounds: [compiler] workers, recycle_after.
    o.workers = options_.workers;
    o.recycle_after_compiles = options_.recycle_after_compiles;
    o.recycle_memory_bytes = options_.recycle_memory_bytes;
    o.sandbox_uid = options_.compile_uid;
    o.sandbox_gid = options_.compile_gid;
    if (o.worker_path.empty()) {
      nvrtc_status_ = NoSandbox();
      return nvrtc_status_;
    }
    auto created = gpu::NvrtcCompiler::Create(o);
    if (!created.ok()) {
      nvrtc_status_ = created.status();
      return nvrtc_status_;
    }
    nvrtc_ = *std::move(created);
    Logger("compiler")->info("GPU compiler ready: {}", nvrtc_->Version());
    return nvrtc_.get();
  }

  // Every regular file under the kernel include dir and the extra include
  // dirs, sorted per root.
  std::vector<std::string> IncludeTreeFiles() const {
    std::vector<std::string> roots = {options_.kernel_include_dir};
    roots.insert(roots.end(), options_.extra_include_dirs.begin(), options_.extra_include_dirs.end());
    std::vector<std::string> out;
    for (const auto& root : roots) {
      std::error_code ec;
      std::vector<std::string> paths;
      for (auto it = std::filesystem::recursive_directory_iterator(
               root, std::filesystem::directory_options::skip_permission_denied, ec);
           !ec && it != std::filesystem::recursive_directory_iterator() &&
           out.size() + paths.size() < kMaxListedHeaders;
           it.increment(ec)) {
        if (it->is_regular_file(ec)) paths.push_back(it->path().string());
      }
      std::sort(paths.begin(), paths.end());
      out.insert(out.end(), paths.begin(), paths.end());
    }
    return out;
  }

  const KernelCompilerOptions options_;
  mutable Mutex mu_;
  // Created on first use; what Nvrtc() returns stays valid for the backend's
  // life.
  std::unique_ptr<gpu::NvrtcCompiler> nvrtc_ ABSL_GUARDED_BY(mu_);
  absl::Status nvrtc_status_ ABSL_GUARDED_BY(mu_);
  std::string nvcc_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<CompileBackend> MakeGpuBackend(const KernelCompilerOptions& options) {
  return std::make_unique<GpuBackend>(options);
}

}  // namespace opjit::compiler

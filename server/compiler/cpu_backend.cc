// The CPU compile backend: C and C++ through the sandboxed clang worker pool
// (server/compiler/cpu) to an ELF object, checked without being loaded.
#include <dlfcn.h>

#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/status_macros.h"
#include "server/common/vector_math.h"
#include "server/compiler/backend.h"
#include "server/compiler/compile_options.h"
#include "server/compiler/cpu/cpu_compiler.h"
#include "server/compiler/elf_symbols.h"

namespace opjit::compiler {
namespace {

constexpr char kObjectMagic[] = "OPJO1";

// Symbols the CPU loader itself provides to every kernel (server/loader).
bool ProvidedByLoader(const std::string& sym) {
  return sym == "__dso_handle" || sym == "_GLOBAL_OFFSET_TABLE_" || sym == "__cxa_atexit" ||
         sym == "atexit";
}

class CpuBackend : public CompileBackend {
 public:
  explicit CpuBackend(std::unique_ptr<CpuCompiler> cpu) : cpu_(std::move(cpu)) {}

  registry::Target target() const override { return registry::Target::kCpu; }

  std::vector<std::string> Languages() const override { return CpuLanguages(); }

  std::string OptionRefusal(const std::string& language, std::string_view option) const override {
    return CpuOptionRefusal(language, option);
  }

  absl::StatusOr<std::string> Identity(const CompileJob& job) override {
    if (job.language != "c++" && job.language != "c") {
      return absl::InvalidArgumentError(absl::StrCat(
          "language \"", job.language, "\" is not a CPU language (expected c++ or c)"));
    }
    // A profile's include dirs change what a source compiles to: its name
    // keys the job (no host path; the headers it read key the final key).
    if (!job.profile.empty()) return absl::StrCat(cpu_->ToolchainId(), "; profile=", job.profile);
    return cpu_->ToolchainId();
  }

  absl::StatusOr<BackendOutput> Compile(const CompileJob& job) override {
    CpuCompileRequest req;
    req.language = job.language == "c" ? Language::kC : Language::kCxx;
    req.source = job.source;
    req.file_name = job.file_name;
    req.options = job.options;
    for (const registry::SourceFile& f : job.files) req.files.emplace_back(f.name, f.content);
    req.tenant = job.ns;
    req.profile = job.profile;
    OPJIT_ASSIGN_OR_RETURN(CpuCompileOutput out, cpu_->Compile(req));
    BackendOutput result;
    result.kernel = std::make_shared<CompiledKernel>();
    result.kernel->target = registry::Target::kCpu;
    result.kernel->artifact = CpuObject{std::move(out.object), {}, {}, {}};
    result.kernel->diagnostics = std::move(out.diagnostics);
    result.kernel->compile_ms = out.compile_ms;
    result.dependencies = std::move(out.dependencies);
    return result;
  }

  // The object is checked, never linked here: user code runs only where a
  // kernel runner loads it.
  absl::Status Check(const CompileJob& job, CompiledKernel* k) const override {
    CpuObject* cpu = k->cpu_object();
    if (cpu == nullptr) return absl::InvalidArgumentError("not a CPU object");
    OPJIT_ASSIGN_OR_RETURN(ElfSymbols symbols, ReadElfSymbols(cpu->elf));
    if (job.libraries.empty()) {
      // Everything it uses must come from the C/C++ runtime the runners
      // offer (the same libraries this process links), or the first call
      // would fail to link. With extra libraries the runner decides.
      std::vector<std::string> missing;
      LoadVectorMath();  // the runners resolve libmvec's _ZGV* calls from it too
      for (const auto& sym : symbols.undefined) {
        if (!ProvidedByLoader(sym) && ::dlsym(RTLD_DEFAULT, sym.c_str()) == nullptr) {
          missing.push_back(sym);
        }
      }
      if (!missing.empty()) {
        if (missing.size() > 8) missing.resize(8);
        return absl::InvalidArgumentError(absl::StrCat(
            "the kernel uses undefined symbol(s) ", absl::StrJoin(missing, ", "),
            " (not in the C/C++ runtime and no library was named; define them, or name an "
            "allowed library)"));
      }
    }
    cpu->libraries = job.libraries;
    cpu->defined_symbols = std::move(symbols.exported);
    cpu->entry_points = std::move(symbols.defined);
    return absl::OkStatus();
  }

  std::string DiskKind() const override { return "obj"; }

  // Magic, compile_ms, diagnostics length, diagnostics, object.
  std::string Encode(const CompiledKernel& k) const override {
    std::string blob = kObjectMagic;
    absl::StrAppend(&blob, "\n", k.compile_ms, "\n", k.diagnostics.size(), "\n");
    blob += k.diagnostics;
    if (const CpuObject* cpu = k.cpu_object()) blob += cpu->elf;
    return blob;
  }

  absl::StatusOr<std::shared_ptr<CompiledKernel>> Decode(std::string_view blob) const override {
    const std::string text(blob);
    std::istringstream in(text);
    std::string magic;
    size_t diag_len = 0;
    auto k = std::make_shared<CompiledKernel>();
    if (!std::getline(in, magic) || magic != kObjectMagic ||
        !(in >> k->compile_ms >> diag_len) || in.get() != '\n') {
      return absl::DataLossError("malformed object entry");
    }
    const size_t off = static_cast<size_t>(in.tellg());
    if (off > text.size() || diag_len > text.size() - off) {
      return absl::DataLossError("malformed object entry");
    }
    k->target = registry::Target::kCpu;
    k->diagnostics = text.substr(off, diag_len);
    k->artifact = CpuObject{text.substr(off + diag_len), {}, {}, {}};
    return k;
  }

  std::string ToolchainId() const override { return cpu_->ToolchainId(); }

 private:
  std::unique_ptr<CpuCompiler> cpu_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CompileBackend>> MakeCpuBackend(const KernelCompilerOptions& options) {
  CpuCompilerOptions copts;
  copts.worker_path = options.worker_path;
  copts.num_workers = options.workers;
  copts.timeout_ms = options.timeout_ms;
  copts.memory_limit_bytes = options.memory_limit_bytes;
  copts.kernel_include_dir = options.kernel_include_dir;
  copts.extra_include_dirs = options.extra_include_dirs;
  copts.profiles = options.profiles;
  copts.pch_dir = options.cache_dir + "/pch";
  copts.pch_max_bytes = options.disk_bytes;  // PCHs are bounded like the cache they serve
  copts.recycle_after_compiles = options.recycle_after_compiles;
  copts.recycle_memory_bytes = options.recycle_memory_bytes;
  copts.long_after_ms = options.long_after_ms;
  copts.long_workers = options.long_workers;
  copts.long_timeout_ms = options.long_timeout_ms;
  copts.worker_uid = options.compile_uid;
  copts.worker_gid = options.compile_gid;
  OPJIT_ASSIGN_OR_RETURN(auto cpu, CpuCompiler::Create(copts));
  return std::unique_ptr<CompileBackend>(new CpuBackend(std::move(cpu)));
}

}  // namespace opjit::compiler

#include "server/compiler/kernel_compiler.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <tuple>
#include <mutex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/cache/disk_cache.h"
#include "server/cache/file_digest_cache.h"
#include "server/cache/lru_cache.h"
#include "server/cache/single_flight.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/common/thread_pool.h"
#include "server/compiler/cpu/cpu_compiler.h"
#include "server/compiler/elf_symbols.h"
#include "server/gpu/nvcc_compiler.h"
#include "server/gpu/nvrtc_compiler.h"

namespace opjit::compiler {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A header the compile read, the digest of its content then, and its stat
// stamp (size, mtime in ns) when it was hashed.
struct Dependency {
  std::string path;
  std::string digest;
  int64_t size = -1;
  int64_t mtime_ns = -1;
};

// The (size, mtime) stamp of `path`; false if it cannot be stat'ed.
bool Stamp(const std::string& path, int64_t* size, int64_t* mtime_ns) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return false;
  *size = st.st_size;
  *mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return true;
}

// What the memory cache keeps per request key.
struct MemoryEntry {
  std::shared_ptr<const CompiledKernel> kernel;
  std::vector<Dependency> deps;
  // CPU: every global symbol the object defines (weak ones too), sorted:
  // what an entry must be one of.
  std::vector<std::string> findable;
};

// Symbols the CPU loader itself provides to every kernel (server/loader).
bool ProvidedByLoader(const std::string& sym) {
  return sym == "__dso_handle" || sym == "_GLOBAL_OFFSET_TABLE_" || sym == "__cxa_atexit" ||
         sym == "atexit";
}

// What one compile flight produces for all its waiters.
struct FlightResult {
  std::shared_ptr<const MemoryEntry> entry;
  std::string hit;  // "disk" or ""
  // Disk writes of a fresh compile, in order: (kind, key, bytes). They run
  // after the waiters have their answer; fsync is not on their critical path.
  std::vector<std::tuple<std::string, std::string, std::string>> persist;
};

constexpr char kManifestMagic[] = "opjit-manifest 2";
constexpr char kObjectMagic[] = "OPJO1";

// Manifest: the final key and each dependency, one per line:
// "<digest> <size> <mtime_ns> <path>".
std::string EncodeManifest(const std::string& final_key, const std::vector<Dependency>& deps) {
  std::string out = absl::StrCat(kManifestMagic, "\n", final_key, "\n");
  for (const auto& d : deps) {
    absl::StrAppend(&out, d.digest, " ", d.size, " ", d.mtime_ns, " ", d.path, "\n");
  }
  return out;
}

bool DecodeManifest(const std::string& text, std::string* final_key,
                    std::vector<Dependency>* deps) {
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != kManifestMagic) return false;
  if (!std::getline(in, *final_key) || final_key->size() != 64) return false;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    Dependency d;
    if (!(fields >> d.digest >> d.size >> d.mtime_ns) || d.digest.size() != 64) return false;
    fields.get();  // the space before the path, which may itself hold spaces
    std::getline(fields, d.path);
    if (d.path.empty()) return false;
    deps->push_back(std::move(d));
  }
  return true;
}

// Object entry: magic, compile_ms, diagnostics length, diagnostics, object.
std::string EncodeObject(const CpuCompileOutput& out) {
  std::string blob = kObjectMagic;
  absl::StrAppend(&blob, "\n", out.compile_ms, "\n", out.diagnostics.size(), "\n");
  blob += out.diagnostics;
  blob += out.object;
  return blob;
}

bool DecodeObject(const std::string& blob, double* compile_ms, std::string* diagnostics,
                  std::string* object) {
  std::istringstream in(blob);
  std::string magic;
  size_t diag_len = 0;
  if (!std::getline(in, magic) || magic != kObjectMagic) return false;
  if (!(in >> *compile_ms >> diag_len) || in.get() != '\n') return false;
  const size_t off = static_cast<size_t>(in.tellg());
  if (off + diag_len > blob.size()) return false;
  *diagnostics = blob.substr(off, diag_len);
  *object = blob.substr(off + diag_len);
  return true;
}

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
  if (colon + 1 + n > in->size()) return false;
  v->assign(in->substr(colon + 1, n));
  in->remove_prefix(colon + 1 + n);
  return true;
}

constexpr char kGpuMagic[] = "OPJG1";

// A GPU binary as one blob: fields as "<len>:<bytes>".
std::string EncodeGpu(const GpuBinary& g, double compile_ms, const std::string& diagnostics) {
  std::string out = kGpuMagic;
  PutField(&out, absl::StrCat(compile_ms));
  PutField(&out, diagnostics);
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

bool DecodeGpu(std::string_view in, GpuBinary* g, double* compile_ms, std::string* diagnostics) {
  if (in.substr(0, sizeof(kGpuMagic) - 1) != kGpuMagic) return false;
  in.remove_prefix(sizeof(kGpuMagic) - 1);
  std::string ms, count, archs;
  if (!GetField(&in, &ms) || !GetField(&in, diagnostics) || !GetField(&in, &g->ptx) ||
      !GetField(&in, &g->ptx_arch) || !GetField(&in, &g->shared_object) || !GetField(&in, &count)) {
    return false;
  }
  *compile_ms = std::atof(ms.c_str());
  for (int i = 0, n = std::atoi(count.c_str()); i < n; ++i) {
    std::string arch, bin;
    if (!GetField(&in, &arch) || !GetField(&in, &bin)) return false;
    g->cubins[arch] = std::move(bin);
  }
  if (!GetField(&in, &count)) return false;
  for (int i = 0, n = std::atoi(count.c_str()); i < n; ++i) {
    std::string expr, name;
    if (!GetField(&in, &expr) || !GetField(&in, &name)) return false;
    g->lowered_names[expr] = std::move(name);
  }
  if (!GetField(&in, &archs)) return false;
  if (!archs.empty()) g->archs = absl::StrSplit(archs, ',');
  return in.empty();
}

std::string FinalKey(const std::string& request_key, const std::vector<Dependency>& deps) {
  Sha256 h;
  h.UpdateField(request_key);
  for (const auto& d : deps) {
    h.UpdateField(d.path);
    h.UpdateField(d.digest);
  }
  return h.HexDigest();
}

}  // namespace

struct KernelCompiler::Impl {
  KernelCompilerOptions options;
  std::unique_ptr<CpuCompiler> cpu;
  std::unique_ptr<cache::DiskCache> disk;
  std::unique_ptr<cache::LruCache<MemoryEntry>> memory;
  cache::SingleFlight<FlightResult> flights;
  // Headers are re-hashed when their stat changes, checked at most once a
  // second per path, so a memory hit costs no syscalls.
  cache::FileDigestCache digests{1000};
  std::unique_ptr<ThreadPool> pool;
  std::string toolchain_id;

  // GPU compilers, created on first use: a host without the CUDA toolkit
  // still compiles for the CPU.
  std::mutex gpu_mu;
  std::unique_ptr<gpu::NvrtcCompiler> nvrtc;  // GUARDED_BY(gpu_mu) until set
  absl::Status nvrtc_status;                  // GUARDED_BY(gpu_mu)
  std::string nvcc_id;                        // GUARDED_BY(gpu_mu)

  std::atomic<uint64_t> compiles{0}, compile_failures{0}, joins{0};
  std::atomic<uint64_t> compile_us_total{0};

  std::string RequestKey(const CompileJob& job, const std::string& gpu_toolchain) const;
  absl::StatusOr<std::vector<Dependency>> DigestDependencies(
      const std::vector<std::string>& paths);
  // `stamps`: trust a file whose size and mtime match the recorded stamp
  // (disk hits, where the digest memo is cold); otherwise ask the digest memo,
  // which answers without syscalls for a second after it last looked.
  bool DependenciesUnchanged(const std::vector<Dependency>& deps, bool stamps);
  absl::StatusOr<FlightResult> Produce(const CompileJob& job, const std::string& request_key);
  absl::StatusOr<FlightResult> ProduceGpu(const CompileJob& job, const std::string& request_key);
  absl::StatusOr<gpu::NvrtcCompiler*> Nvrtc();
  // The opjit-gpu-sandbox binary, or "" when it is not there.
  std::string GpuSandboxPath() const {
    std::string p = options.gpu_sandbox_path;
    if (p.empty()) {
      std::string near = options.worker_path;
      if (near.empty()) {
        std::error_code ec;
        near = std::filesystem::read_symlink("/proc/self/exe", ec).string();
      }
      p = near.substr(0, near.rfind('/') + 1) + "opjit-gpu-sandbox";
    }
    return !p.empty() && ::access(p.c_str(), X_OK) == 0 ? p : std::string();
  }
  // SHA-256 over the path and content digest of every file under the
  // kernel include dir and the extra include dirs (at most 4096 files).
  std::string IncludeTreeDigest() {
    Sha256 h;
    std::vector<std::string> roots = {options.kernel_include_dir};
    roots.insert(roots.end(), options.extra_include_dirs.begin(), options.extra_include_dirs.end());
    size_t files = 0;
    for (const auto& root : roots) {
      std::error_code ec;
      std::vector<std::string> paths;
      for (auto it = std::filesystem::recursive_directory_iterator(
               root, std::filesystem::directory_options::skip_permission_denied, ec);
           !ec && it != std::filesystem::recursive_directory_iterator() && files < 4096;
           it.increment(ec)) {
        if (it->is_regular_file(ec)) {
          paths.push_back(it->path().string());
          ++files;
        }
      }
      std::sort(paths.begin(), paths.end());
      for (const auto& p : paths) {
        h.UpdateField(p);
        h.UpdateField(HeaderDigest(p));
      }
    }
    return h.HexDigest().substr(0, 32);
  }
  // The content digest of `path`, rehashed whenever its (size, mtime)
  // stamp changed since it was last hashed.
  std::string HeaderDigest(const std::string& path) {
    int64_t size = -1, mtime = -1;
    if (!Stamp(path, &size, &mtime)) return "unreadable";
    {
      std::lock_guard<std::mutex> lock(header_mu);
      auto it = header_memo.find(path);
      if (it != header_memo.end() && std::get<0>(it->second) == size &&
          std::get<1>(it->second) == mtime) {
        return std::get<2>(it->second);
      }
    }
    std::ifstream in(path, std::ios::binary);
    std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::string digest = Sha256Hex(content);
    std::lock_guard<std::mutex> lock(header_mu);
    header_memo[path] = {size, mtime, digest};
    return digest;
  }
  std::mutex header_mu;
  std::map<std::string, std::tuple<int64_t, int64_t, std::string>> header_memo;  // GUARDED_BY(header_mu)
  // The GPU toolchain's identity for cache keys ("" for CPU jobs).
  absl::StatusOr<std::string> GpuToolchainId(const CompileJob& job);
  absl::StatusOr<std::shared_ptr<const MemoryEntry>> CpuEntry(
      const CompileJob& job, const std::string& final_key, const std::string& object,
      std::string diagnostics, double compile_ms, std::vector<Dependency> deps);
};

std::string KernelCompiler::Impl::RequestKey(const CompileJob& job,
                                            const std::string& gpu_toolchain) const {
  Sha256 h;
  h.UpdateField(absl::StrCat("opjit-kernel-abi-", kKernelAbiVersion));
  const bool gpu = job.target == registry::Target::kGpu;
  h.UpdateField(gpu ? gpu_toolchain : toolchain_id);
  if (gpu) {
    h.UpdateField(absl::StrJoin(job.archs.empty() ? options.gpu_archs : job.archs, ","));
    h.UpdateField(absl::StrJoin(job.name_expressions, "\x1f"));
    h.UpdateField(job.aot_shared_object ? "nvcc-aot" : "nvrtc");
  }
  h.UpdateField(registry::TargetName(job.target));
  h.UpdateField(job.language);
  h.UpdateField(absl::StrJoin(job.options, "\x1f"));
  h.UpdateField(absl::StrJoin(job.libraries, "\x1f"));
  h.UpdateField(job.source);
  // The file name appears in diagnostics and debug info, so it changes output.
  h.UpdateField(job.file_name);
  return h.HexDigest();
}

absl::StatusOr<std::vector<Dependency>> KernelCompiler::Impl::DigestDependencies(
    const std::vector<std::string>& paths) {
  std::vector<Dependency> deps;
  deps.reserve(paths.size());
  for (const auto& p : paths) {
    Dependency d;
    d.path = p;
    // Stamp first: if the file changes while it is hashed, the stamp is stale
    // and the next lookup rehashes instead of trusting it.
    if (!Stamp(p, &d.size, &d.mtime_ns)) d.size = d.mtime_ns = -1;
    OPJIT_ASSIGN_OR_RETURN(d.digest, digests.Digest(p));
    deps.push_back(std::move(d));
  }
  return deps;
}

bool KernelCompiler::Impl::DependenciesUnchanged(const std::vector<Dependency>& deps,
                                                 bool stamps) {
  for (const auto& d : deps) {
    // Same size and mtime as when it was hashed: trusted without rereading
    // (as ccache's direct mode does); otherwise the content decides.
    int64_t size, mtime_ns;
    if (stamps && d.size >= 0 && Stamp(d.path, &size, &mtime_ns) && size == d.size && mtime_ns == d.mtime_ns) {
      continue;
    }
    auto digest = digests.Digest(d.path);
    if (!digest.ok() || *digest != d.digest) return false;
  }
  return true;
}

absl::StatusOr<std::shared_ptr<const MemoryEntry>> KernelCompiler::Impl::CpuEntry(
    const CompileJob& job, const std::string& final_key, const std::string& object,
    std::string diagnostics, double compile_ms, std::vector<Dependency> deps) {
  // The object is checked, never linked here: user code runs only where a
  // kernel runner loads it.
  OPJIT_ASSIGN_OR_RETURN(ElfSymbols symbols, ReadElfSymbols(object));
  if (job.libraries.empty()) {
    // Everything it uses must come from the C/C++ runtime the runners
    // offer (the same libraries this process links), or the first call
    // would fail to link. With extra libraries the runner decides.
    std::vector<std::string> missing;
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
  auto kernel = std::make_shared<CompiledKernel>();
  kernel->target = registry::Target::kCpu;
  kernel->cache_key = final_key;
  kernel->object = object;
  kernel->libraries = job.libraries;
  kernel->defined_symbols = std::move(symbols.exported);
  kernel->diagnostics = std::move(diagnostics);
  kernel->compile_ms = compile_ms;
  auto entry = std::make_shared<MemoryEntry>();
  entry->kernel = std::move(kernel);
  entry->deps = std::move(deps);
  entry->findable = std::move(symbols.defined);
  return std::shared_ptr<const MemoryEntry>(std::move(entry));
}

absl::StatusOr<FlightResult> KernelCompiler::Impl::Produce(const CompileJob& job,
                                                           const std::string& request_key) {
  if (job.target == registry::Target::kGpu) return ProduceGpu(job, request_key);
  auto log = Logger("compiler");
  // Disk: the manifest names the headers; if they still hash the same, the
  // object under the final key is what a compile would produce.
  if (auto manifest = disk->Get("manifest", request_key); manifest.ok()) {
    std::string final_key;
    std::vector<Dependency> deps;
    if (DecodeManifest(*manifest, &final_key, &deps) && DependenciesUnchanged(deps, true) &&
        FinalKey(request_key, deps) == final_key) {
      if (auto blob = disk->Get("obj", final_key); blob.ok()) {
        double compile_ms = 0;
        std::string diagnostics, object;
        if (DecodeObject(*blob, &compile_ms, &diagnostics, &object)) {
          auto entry = CpuEntry(job, final_key, object, std::move(diagnostics), compile_ms,
                                std::move(deps));
          if (entry.ok()) return FlightResult{*std::move(entry), "disk"};
          if (!absl::IsInvalidArgument(entry.status()) && !absl::IsPermissionDenied(entry.status())) {
            return entry.status();
          }
          log->warn("key={} cached object failed its checks ({}); recompiling",
                    final_key.substr(0, 12), entry.status().ToString());
        } else {
          log->warn("key={} cached object is malformed; recompiling", final_key.substr(0, 12));
        }
      }
    }
  }

  CpuCompileRequest req;
  req.language = job.language == "c" ? Language::kC : Language::kCxx;
  req.source = job.source;
  req.file_name = job.file_name;
  req.options = job.options;
  compiles.fetch_add(1);
  auto out = cpu->Compile(req);
  if (!out.ok()) {
    compile_failures.fetch_add(1);
    return out.status();
  }
  compile_us_total.fetch_add(static_cast<uint64_t>(out->compile_ms * 1000));
  OPJIT_ASSIGN_OR_RETURN(auto deps, DigestDependencies(out->dependencies));
  const std::string final_key = FinalKey(request_key, deps);
  log->debug("key={} compiled {} in {:.1f} ms ({} headers)", final_key.substr(0, 12),
             job.file_name, out->compile_ms, deps.size());
  OPJIT_ASSIGN_OR_RETURN(auto entry, CpuEntry(job, final_key, out->object, out->diagnostics,
                                              out->compile_ms, deps));
  // Object before manifest: a manifest never names an object that was not written.
  FlightResult result{std::move(entry), ""};
  result.persist.emplace_back("obj", final_key, EncodeObject(*out));
  result.persist.emplace_back("manifest", request_key, EncodeManifest(final_key, deps));
  return result;
}

CompileJob JobForImplementation(const registry::OpDef& def, const registry::Implementation& impl) {
  CompileJob job;
  job.target = impl.target;
  job.language = impl.language;
  job.source = impl.source;
  // Not the op's name: the file name is part of the cache key, and a renamed
  // copy of the same source must hit what is cached. `opjit compile` uses the
  // same names, so it warms the cache for registration.
  job.file_name = impl.language == "c" ? "kernel.c" : "kernel.cc";
  job.entry = impl.entry;
  job.options = impl.compile_options;
  job.libraries = impl.libraries;
  if (impl.target == registry::Target::kGpu) {
    job.file_name = "kernel.cu";
    if (impl.launch.grid.empty()) {
      job.aot_shared_object = true;
    } else {
      job.name_expressions = {impl.launch.kernel.empty() ? impl.entry : impl.launch.kernel};
      job.archs = impl.launch.archs;
      job.entry.clear();  // a GPU kernel's name is checked through its lowered name
    }
  }
  return job;
}

size_t GpuBinary::bytes() const {
  size_t n = ptx.size() + shared_object.size();
  for (const auto& [arch, bin] : cubins) n += bin.size();
  return n;
}

absl::StatusOr<gpu::NvrtcCompiler*> KernelCompiler::Impl::Nvrtc() {
  std::lock_guard<std::mutex> lock(gpu_mu);
  if (nvrtc) return nvrtc.get();
  if (!nvrtc_status.ok()) return nvrtc_status;
  gpu::NvrtcOptions o;
  o.cuda_root = options.cuda_root;
  o.archs = options.gpu_archs;
  o.extra_include_dirs = {options.kernel_include_dir};
  o.worker_path = GpuSandboxPath();
  o.timeout_ms = options.timeout_ms;
  o.memory_limit_bytes = options.memory_limit_bytes;
  if (o.worker_path.empty()) {
    nvrtc_status = absl::UnavailableError(
        "the GPU compiler sandbox (opjit-gpu-sandbox) is missing; GPU compiles are off");
    return nvrtc_status;
  }
  auto created = gpu::NvrtcCompiler::Create(o);
  if (!created.ok()) {
    nvrtc_status = created.status();
    return nvrtc_status;
  }
  nvrtc = *std::move(created);
  Logger("compiler")->info("GPU compiler ready: {}", nvrtc->Version());
  return nvrtc.get();
}

absl::StatusOr<std::string> KernelCompiler::Impl::GpuToolchainId(const CompileJob& job) {
  if (job.target != registry::Target::kGpu) return std::string();
  if (job.aot_shared_object) {
    std::lock_guard<std::mutex> lock(gpu_mu);
    if (nvcc_id.empty()) {
      OPJIT_ASSIGN_OR_RETURN(nvcc_id, gpu::NvccToolchainId(options.cuda_root));
    }
    return nvcc_id;
  }
  OPJIT_ASSIGN_OR_RETURN(gpu::NvrtcCompiler * c, Nvrtc());
  return c->ToolchainId();
}

absl::StatusOr<FlightResult> KernelCompiler::Impl::ProduceGpu(const CompileJob& job,
                                                              const std::string& request_key) {
  auto log = Logger("compiler");
  auto entry_of = [&](GpuBinary g, double ms, std::string diag) {
    auto kernel = std::make_shared<CompiledKernel>();
    kernel->target = registry::Target::kGpu;
    kernel->cache_key = request_key;
    kernel->gpu = std::make_shared<const GpuBinary>(std::move(g));
    kernel->diagnostics = std::move(diag);
    kernel->compile_ms = ms;
    auto entry = std::make_shared<MemoryEntry>();
    entry->kernel = std::move(kernel);
    return std::shared_ptr<const MemoryEntry>(std::move(entry));
  };
  if (auto blob = disk->Get("gpu", request_key); blob.ok()) {
    GpuBinary g;
    double ms = 0;
    std::string diag;
    if (DecodeGpu(*blob, &g, &ms, &diag)) return FlightResult{entry_of(std::move(g), ms, diag), "disk"};
    log->warn("key={} cached GPU binary is malformed; recompiling", request_key.substr(0, 12));
  }
  const std::vector<std::string> archs = job.archs.empty() ? options.gpu_archs : job.archs;
  GpuBinary g;
  g.archs = archs;
  double ms = 0;
  std::string diag;
  compiles.fetch_add(1);
  if (job.aot_shared_object) {
    gpu::NvccRequest req;
    req.source = job.source;
    req.file_name = job.file_name;
    req.options = job.options;
    req.archs = archs;
    req.cuda_root = options.cuda_root;
    req.kernel_include_dir = options.kernel_include_dir;
    req.extra_include_dirs = options.extra_include_dirs;
    req.sandbox_path = GpuSandboxPath();
    req.memory_limit_bytes = options.memory_limit_bytes;
    if (req.sandbox_path.empty()) {
      compile_failures.fetch_add(1);
      return absl::UnavailableError(
          "the GPU compiler sandbox (opjit-gpu-sandbox) is missing; GPU compiles are off");
    }
    auto out = gpu::CompileAotSharedObject(req);
    if (!out.ok()) {
      compile_failures.fetch_add(1);
      return out.status();
    }
    g.shared_object = std::move(out->shared_object);
    ms = out->compile_ms;
    diag = std::move(out->diagnostics);
  } else {
    OPJIT_ASSIGN_OR_RETURN(gpu::NvrtcCompiler * c, Nvrtc());
    gpu::GpuCompileRequest req;
    req.source = job.source;
    req.file_name = job.file_name;
    req.options = job.options;
    req.name_expressions = job.name_expressions;
    req.archs = archs;
    auto out = c->Compile(req);
    if (!out.ok()) {
      compile_failures.fetch_add(1);
      return out.status();
    }
    g.cubins = std::move(out->cubins);
    g.ptx = std::move(out->ptx);
    g.ptx_arch = std::move(out->ptx_arch);
    g.lowered_names = std::move(out->lowered_names);
    ms = out->compile_ms;
    diag = std::move(out->diagnostics);
  }
  compile_us_total.fetch_add(static_cast<uint64_t>(ms * 1000));
  log->debug("key={} compiled {} for {} in {:.1f} ms", request_key.substr(0, 12), job.file_name,
             absl::StrJoin(archs, ","), ms);
  std::string blob = EncodeGpu(g, ms, diag);
  FlightResult result{entry_of(std::move(g), ms, std::move(diag)), ""};
  result.persist.emplace_back("gpu", request_key, std::move(blob));
  return result;
}

KernelCompiler::KernelCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KernelCompiler::~KernelCompiler() {
  // Finish queued compiles before the members they use go away.
  impl_->pool.reset();
}

absl::StatusOr<std::unique_ptr<KernelCompiler>> KernelCompiler::Create(
    const KernelCompilerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  CpuCompilerOptions copts;
  copts.worker_path = options.worker_path;
  copts.num_workers = options.workers;
  copts.timeout_ms = options.timeout_ms;
  copts.memory_limit_bytes = options.memory_limit_bytes;
  copts.kernel_include_dir = options.kernel_include_dir;
  copts.extra_include_dirs = options.extra_include_dirs;
  copts.pch_dir = options.cache_dir + "/pch";
  OPJIT_ASSIGN_OR_RETURN(impl->cpu, CpuCompiler::Create(copts));
  OPJIT_ASSIGN_OR_RETURN(impl->disk, cache::DiskCache::Create(
                                         {.dir = options.cache_dir, .max_bytes = options.disk_bytes}));
  impl->memory = std::make_unique<cache::LruCache<MemoryEntry>>(options.memory_entries,
                                                                options.memory_bytes);
  impl->toolchain_id = impl->cpu->ToolchainId();
  impl->pool = std::make_unique<ThreadPool>(options.pool_threads, /*max_queue=*/256, "opjit-compile");
  Logger("compiler")->info("compiler ready: {} worker(s), cache {}, toolchain {}", options.workers,
                           options.cache_dir, impl->toolchain_id.substr(0, 80));
  return std::unique_ptr<KernelCompiler>(new KernelCompiler(std::move(impl)));
}

void KernelCompiler::CompileAsync(CompileJob job, Callback done) {
  const auto t0 = Clock::now();
  Impl* impl = impl_.get();
  const bool gpu = job.target == registry::Target::kGpu;
  if (gpu && job.language != "cuda") {
    done(absl::InvalidArgumentError(
        absl::StrCat("language \"", job.language, "\" is not a GPU language (expected cuda)")));
    return;
  }
  if (!gpu && job.language != "c++" && job.language != "c") {
    done(absl::InvalidArgumentError(
        absl::StrCat("language \"", job.language, "\" is not a CPU language (expected c++ or c)")));
    return;
  }
  for (const auto& lib : job.libraries) {
    const auto& allowed = impl->options.allowed_libraries;
    if (std::find(allowed.begin(), allowed.end(), lib) == allowed.end()) {
      done(absl::PermissionDeniedError(absl::StrCat(
          "library \"", lib, "\" is not on this server's allow-list (",
          allowed.empty() ? "empty" : absl::StrJoin(allowed, ", "),
          "); ask the operator to add it to [compiler] allowed_libraries")));
      return;
    }
  }
  if (job.file_name.empty()) {
    job.file_name = job.language == "c" ? "kernel.c" : job.language == "cuda" ? "kernel.cu" : "kernel.cc";
  }
  auto gpu_toolchain = impl->GpuToolchainId(job);
  if (!gpu_toolchain.ok()) {
    done(gpu_toolchain.status());
    return;
  }
  if (job.target == registry::Target::kGpu) {
    // NVRTC and nvcc do not say which headers they read, so a GPU key takes
    // the content of every header they may read besides the toolkit's
    // (which the toolchain identity covers): a changed header misses.
    *gpu_toolchain += ";headers=" + impl->IncludeTreeDigest();
  }
  const std::string request_key = impl->RequestKey(job, *gpu_toolchain);

  // Checks the entry symbol of a kernel against this job and answers.
  auto finish = [t0, entry = job.entry, done](std::shared_ptr<const MemoryEntry> e,
                                              std::string hit) {
    if (!entry.empty() && e->kernel->target == registry::Target::kCpu &&
        !std::binary_search(e->findable.begin(), e->findable.end(), entry)) {
      const auto& syms = e->kernel->defined_symbols;
      std::string hint;
      for (const auto& s : syms) {
        if (s.find(entry) != std::string::npos && s != entry) {
          hint = absl::StrCat(" (\"", s, "\" looks like a C++-mangled ", entry,
                              ": declare it extern \"C\")");
        }
      }
      done(absl::InvalidArgumentError(absl::StrCat(
          "entry symbol \"", entry, "\" is not defined by the source", hint,
          "; it defines: ", syms.empty() ? "(nothing)" : absl::StrJoin(syms, ", "))));
      return;
    }
    done(CompileOutcome{e->kernel, std::move(hit), MsSince(t0)});
  };

  if (auto hit = impl->memory->Get(request_key)) {
    if (impl->DependenciesUnchanged(hit->deps, false)) {
      finish(std::move(hit), "memory");
      return;
    }
    impl->memory->Erase(request_key);
  }

  const bool leader =
      impl->flights.Join(request_key, [finish, done](const absl::StatusOr<FlightResult>& r) {
        if (!r.ok()) {
          done(r.status());
          return;
        }
        finish(r->entry, r->hit);
      });
  if (!leader) {
    impl->joins.fetch_add(1);
    return;
  }
  auto work = [impl, job = std::move(job), request_key]() {
    auto result = impl->Produce(job, request_key);
    if (result.ok()) {
      const CompiledKernel& k = *result->entry->kernel;
      impl->memory->Put(request_key, result->entry, k.binary_bytes());
    }
    std::vector<std::tuple<std::string, std::string, std::string>> persist;
    if (result.ok()) persist = std::move(result->persist);
    impl->flights.Complete(request_key, result);
    for (const auto& [kind, key, bytes] : persist) {
      if (absl::Status s = impl->disk->Put(kind, key, bytes); !s.ok()) {
        Logger("compiler")->warn("key={} not cached on disk ({}): {}", key.substr(0, 12), kind,
                                 s.ToString());
        break;  // keep the object-before-manifest order
      }
    }
  };
  if (!impl->pool->Submit(std::move(work))) {
    impl->flights.Complete(request_key,
                           absl::ResourceExhaustedError(
                               "the compile queue is full (256 waiting); retry later"));
  }
}

absl::StatusOr<CompileOutcome> KernelCompiler::Compile(CompileJob job) {
  std::promise<absl::StatusOr<CompileOutcome>> promise;
  auto future = promise.get_future();
  CompileAsync(std::move(job), [&promise](absl::StatusOr<CompileOutcome> r) {
    promise.set_value(std::move(r));
  });
  return future.get();
}

KernelCacheStats KernelCompiler::Stats() const {
  KernelCacheStats s;
  const auto m = impl_->memory->Stats();
  s.memory_entries = m.entries;
  s.memory_bytes = m.bytes;
  s.memory_hits = m.hits;
  s.memory_misses = m.misses;
  s.evictions = m.evictions;
  const auto d = impl_->disk->Stats();
  s.disk_entries = d.entries;
  s.disk_bytes = d.bytes;
  s.disk_hits = d.hits;
  s.disk_misses = d.misses;
  s.disk_corrupt = d.corrupt;
  s.compiles = impl_->compiles.load();
  s.compile_failures = impl_->compile_failures.load();
  s.single_flight_joins = impl_->joins.load();
  s.compile_ms_total = impl_->compile_us_total.load() / 1000.0;
  return s;
}

uint64_t KernelCompiler::Clear(bool memory_only) {
  uint64_t removed = impl_->memory->Stats().entries;
  impl_->memory->Clear();
  if (!memory_only) {
    removed += impl_->disk->Stats().entries;
    if (absl::Status s = impl_->disk->Clear(); !s.ok()) {
      Logger("compiler")->warn("clearing the disk cache: {}", s.ToString());
    }
  }
  return removed;
}

const std::string& KernelCompiler::ToolchainId() const { return impl_->toolchain_id; }

}  // namespace opjit::compiler

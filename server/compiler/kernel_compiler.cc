#include "server/compiler/kernel_compiler.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <sstream>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/cache/disk_cache.h"
#include "server/cache/file_digest_cache.h"
#include "server/cache/lru_cache.h"
#include "server/cache/remote_tier.h"
#include "server/cache/single_flight.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"
#include "server/common/thread_pool.h"
#include "server/compiler/backend.h"
#include "server/compiler/cache_key.h"
#include "server/compiler/compile_watch.h"

namespace opjit::compiler {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A file the compile depends on (its path on this host), the digest of its
// content then, and its stat stamp (size, mtime in ns) when it was hashed.
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
};

using Writes = std::vector<std::tuple<std::string, std::string, std::string>>;

// What one compile flight produces for all its waiters.
struct FlightResult {
  std::shared_ptr<const MemoryEntry> entry;
  CacheTier hit = CacheTier::kNone;  // kDisk, kRemote or kNone (compiled now)
  // Disk writes of a fresh compile or a remote hit, in order: (kind, key,
  // bytes). They run after the waiters have their answer; fsync is not on
  // their critical path.
  Writes persist;
  // Also offer them to the remote tier (a fresh compile, not a remote hit).
  bool share = false;
};

// A cached artifact that passed every check, and the bytes it was read from.
struct Found {
  std::shared_ptr<MemoryEntry> entry;
  std::string final_key;
  std::string blob;
};

constexpr char kManifestMagic[] = "opjit-manifest 3";

// Manifest: the final key and each dependency, one per line:
// "<digest> <size> <mtime_ns> <portable name>" (cache_key.h: no host path
// under an include root, so another daemon maps it onto its own roots).
std::string EncodeManifest(const IncludeRoots& roots, const std::string& final_key,
                           const std::vector<Dependency>& deps) {
  std::string out = absl::StrCat(kManifestMagic, "\n", final_key, "\n");
  for (const auto& d : deps) {
    absl::StrAppend(&out, d.digest, " ", d.size, " ", d.mtime_ns, " ", roots.Portable(d.path),
                    "\n");
  }
  return out;
}

// False when it does not decode or names an include root this daemon lacks.
bool DecodeManifest(const IncludeRoots& roots, const std::string& text, std::string* final_key,
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
    std::string name;
    std::getline(fields, name);
    d.path = roots.Local(name);
    if (d.path.empty()) return false;
    deps->push_back(std::move(d));
  }
  return true;
}

std::string FinalKeyOf(const IncludeRoots& roots, const std::string& request_key,
                       const std::vector<Dependency>& deps) {
  std::vector<std::pair<std::string, std::string>> named;
  named.reserve(deps.size());
  for (const auto& d : deps) named.emplace_back(roots.Portable(d.path), d.digest);
  return FinalKey(request_key, named);
}

bool IsNameBoundary(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '"' || c == '\'' || c == '(' || c == '`';
}

// `text` with each mention of the file `from` (as a compiler writes it:
// "kernel.cc:3:5", "kernel.cu(12)", "from kernel.cc:1") naming `to`.
std::string RenameFile(const std::string& text, const std::string& from, const std::string& to) {
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = text.find(from, pos)) != std::string::npos;) {
    const size_t end = hit + from.size();
    const bool starts = hit == 0 || IsNameBoundary(text[hit - 1]);
    const bool ends = end == text.size() || text[end] == ':' || text[end] == '(' ||
                      text[end] == '"' || text[end] == '\'' || text[end] == '`';
    out.append(text, pos, hit - pos);
    out += starts && ends ? to : from;
    pos = end;
  }
  out.append(text, pos, std::string::npos);
  return out;
}

absl::Status RenameFile(const absl::Status& s, const std::string& from, const std::string& to) {
  return WithMessage(s, RenameFile(std::string(s.message()), from, to));
}

}  // namespace

std::string_view CacheTierName(CacheTier tier) {
  switch (tier) {
    case CacheTier::kMemory:
      return "memory";
    case CacheTier::kDisk:
      return "disk";
    case CacheTier::kRemote:
      return "remote";
    case CacheTier::kNone:
      break;
  }
  return "";
}

std::string CanonicalFileName(const std::string& language) {
  return language == "c" ? "kernel.c" : language == "cuda" ? "kernel.cu" : "kernel.cc";
}

// The rules of a compiler's backends, as the registry asks for them.
class BackendRules : public registry::TargetRules {
 public:
  explicit BackendRules(const BackendSet* backends) : backends_(backends) {}
  std::vector<std::string> Languages(registry::Target target) const override {
    auto it = backends_->find(target);
    return it == backends_->end() ? std::vector<std::string>{} : it->second->Languages();
  }
  std::string OptionRefusal(registry::Target target, const std::string& language,
                            std::string_view option) const override {
    auto it = backends_->find(target);
    if (it == backends_->end()) {
      return absl::StrCat("no compile backend for target ", registry::TargetName(target));
    }
    return it->second->OptionRefusal(language, option);
  }

 private:
  const BackendSet* backends_;
};

struct KernelCompiler::Impl {
  KernelCompilerOptions options;
  BackendSet backends;
  BackendRules rules{&backends};
  std::unique_ptr<cache::DiskCache> disk;
  std::unique_ptr<cache::RemoteTier> remote;  // null when off
  std::unique_ptr<cache::LruCache<MemoryEntry>> memory;
  cache::SingleFlight<FlightResult> flights;
  // Headers are re-hashed when their stat changes, checked at most once per
  // header_recheck_ms per path, so a memory hit costs no syscalls.
  std::unique_ptr<cache::FileDigestCache> digests;
  std::unique_ptr<ThreadPool> pool;
  std::string toolchain_id;  // the CPU backend's (else the first's), for ServerInfo
  IncludeRoots roots;        // include dirs by label, their tree digest
  std::unique_ptr<CompileWatch> watch;  // logs slow compiles

  std::atomic<uint64_t> compiles{0}, compile_failures{0}, joins{0};
  std::atomic<uint64_t> compile_us_total{0};

  // The backend for `t`; nullptr when there is none.
  CompileBackend* For(registry::Target t) {
    auto it = backends.find(t);
    return it == backends.end() ? nullptr : it->second.get();
  }

  absl::StatusOr<std::vector<Dependency>> DigestDependencies(
      const std::vector<std::string>& paths);
  // `stamps`: trust a file whose size and mtime match the recorded stamp
  // (disk hits, where the digest memo is cold); otherwise ask the digest memo.
  bool DependenciesUnchanged(const std::vector<Dependency>& deps, bool stamps);
  // For a manifest from another host, whose stamps mean nothing here: true if
  // every dependency still has its recorded digest, with each stamp replaced
  // by this host's (taken before the digest, as DigestDependencies does).
  bool RestampDependencies(std::vector<Dependency>* deps);
  // What `tier` (disk or remote) holds for the job, verified as a unit: the
  // manifest decodes, its dependencies still hash the same, the final key
  // follows from them, and the artifact decodes and passes the backend's
  // checks. nullopt if any step fails (logged when an entry exists but is
  // unusable).
  std::optional<Found> Lookup(CacheTier tier, const CompileJob& job,
                             const std::string& request_key);
  // Disk, else the remote tier, else a compile; the same for every backend.
  absl::StatusOr<FlightResult> Produce(const CompileJob& job, const std::string& request_key);
};

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
    OPJIT_ASSIGN_OR_RETURN(d.digest, digests->Digest(p));
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
    if (stamps && d.size >= 0 && Stamp(d.path, &size, &mtime_ns) && size == d.size &&
        mtime_ns == d.mtime_ns) {
      continue;
    }
    auto digest = digests->Digest(d.path);
    if (!digest.ok() || *digest != d.digest) return false;
  }
  return true;
}

bool KernelCompiler::Impl::RestampDependencies(std::vector<Dependency>* deps) {
  for (auto& d : *deps) {
    int64_t size, mtime_ns;
    if (!Stamp(d.path, &size, &mtime_ns)) return false;
    auto digest = digests->Digest(d.path);
    if (!digest.ok() || *digest != d.digest) return false;
    d.size = size;
    d.mtime_ns = mtime_ns;
  }
  return true;
}

std::optional<Found> KernelCompiler::Impl::Lookup(CacheTier tier, const CompileJob& job,
                                                  const std::string& request_key) {
  CompileBackend* backend = For(job.target);
  const std::string kind = backend->DiskKind();
  const auto get = [&](const std::string& k, const std::string& key) {
    return tier == CacheTier::kDisk ? disk->Get(k, key) : remote->Get(k, key);
  };
  const std::string_view where = CacheTierName(tier);
  // The manifest names the dependencies; if they still hash the same, the
  // artifact under the final key is what a compile would produce.
  auto manifest = get("manifest", request_key);
  if (!manifest.ok()) return std::nullopt;
  Found found;
  std::vector<Dependency> deps;
  if (!DecodeManifest(roots, *manifest, &found.final_key, &deps)) {
    Logger("compiler")->warn("key={} {} manifest does not decode; recompiling",
                             request_key.substr(0, 12), where);
    return std::nullopt;
  }
  // A remote manifest's stamps were taken on another host: only content
  // digests count, and the stamps kept are this host's.
  const bool unchanged =
      tier == CacheTier::kDisk ? DependenciesUnchanged(deps, true) : RestampDependencies(&deps);
  if (!unchanged || FinalKeyOf(roots, request_key, deps) != found.final_key) return std::nullopt;
  auto blob = get(kind, found.final_key);
  if (!blob.ok()) return std::nullopt;
  auto kernel = backend->Decode(*blob);
  absl::Status checked = kernel.ok() ? backend->Check(job, kernel->get()) : kernel.status();
  if (!checked.ok()) {
    Logger("compiler")->warn("key={} cached {} entry ({}) is unusable ({}); recompiling",
                             found.final_key.substr(0, 12), kind, where, checked.ToString());
    return std::nullopt;
  }
  (*kernel)->cache_key = found.final_key;
  found.entry = std::make_shared<MemoryEntry>();
  found.entry->kernel = *std::move(kernel);
  found.entry->deps = std::move(deps);
  found.blob = *std::move(blob);
  return found;
}

absl::StatusOr<FlightResult> KernelCompiler::Impl::Produce(const CompileJob& job,
                                                           const std::string& request_key) {
  auto log = Logger("compiler");
  CompileBackend* backend = For(job.target);
  const std::string kind = backend->DiskKind();
  if (auto found = Lookup(CacheTier::kDisk, job, request_key)) {
    return FlightResult{std::move(found->entry), CacheTier::kDisk};
  }
  if (remote != nullptr) {
    if (auto found = Lookup(CacheTier::kRemote, job, request_key)) {
      log->debug("key={} {} from the remote tier", found->final_key.substr(0, 12), kind);
      FlightResult result{found->entry, CacheTier::kRemote};
      // To disk as a compile would write it, so a restart hits disk.
      result.persist.emplace_back(kind, found->final_key, std::move(found->blob));
      result.persist.emplace_back("manifest", request_key,
                                  EncodeManifest(roots, found->final_key, found->entry->deps));
      return result;
    }
  }

  // The backend's allow-list, before anything runs (callers checked it too:
  // registration and the compile call, through Rules()).
  OPJIT_RETURN_IF_ERROR(backend->ValidateOptions(job.language, job.options));
  compiles.fetch_add(1);
  const uint64_t ticket = watch->Begin(absl::StrCat(job.label, " (", registry::TargetName(job.target),
                                                    ", key ", request_key.substr(0, 12), ")"));
  auto out = backend->Compile(job);
  watch->End(ticket, out.ok());
  if (!out.ok()) {
    compile_failures.fetch_add(1);
    return out.status();
  }
  CompiledKernel& k = *out->kernel;
  compile_us_total.fetch_add(static_cast<uint64_t>(k.compile_ms * 1000));
  OPJIT_ASSIGN_OR_RETURN(auto deps, DigestDependencies(out->dependencies));
  const std::string final_key = FinalKeyOf(roots, request_key, deps);
  log->debug("key={} compiled {} ({}) in {:.1f} ms ({} dependencies)", final_key.substr(0, 12),
             job.file_name, registry::TargetName(job.target), k.compile_ms, deps.size());
  OPJIT_RETURN_IF_ERROR(backend->Check(job, &k));
  k.cache_key = final_key;
  FlightResult result;
  result.share = true;
  // The artifact before the manifest: a manifest never names one that was
  // not written.
  result.persist.emplace_back(kind, final_key, backend->Encode(k));
  result.persist.emplace_back("manifest", request_key, EncodeManifest(roots, final_key, deps));
  auto entry = std::make_shared<MemoryEntry>();
  entry->kernel = std::move(out->kernel);
  entry->deps = std::move(deps);
  result.entry = std::move(entry);
  return result;
}

absl::Status SelectProfile(const KernelCompilerOptions& options, CompileJob* job) {
  job->profile.clear();
  const auto& allowed = options.allowed_libraries;
  for (const std::string& lib : job->libraries) {
    const bool listed = std::find(allowed.begin(), allowed.end(), lib) != allowed.end();
    const ToolchainProfile* profile = nullptr;
    for (const ToolchainProfile& p : options.profiles) {
      if (std::find(p.libraries.begin(), p.libraries.end(), lib) != p.libraries.end()) {
        profile = &p;
        break;
      }
    }
    if (profile != nullptr && profile->AllowsNamespace(job->ns)) {
      if (!job->profile.empty() && job->profile != profile->name) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the libraries name two toolchain profiles (\"", job->profile, "\" and \"",
            profile->name, "\"): a kernel uses one"));
      }
      job->profile = profile->name;
      continue;
    }
    if (listed) continue;
    if (profile != nullptr) {
      return absl::PermissionDeniedError(absl::StrCat(
          "library \"", lib, "\" belongs to the toolchain profile \"", profile->name,
          "\", which namespace \"", Excerpt(job->ns), "\" may not use; ask the operator ",
          "to add the namespace to [toolchains.", profile->name, "] namespaces"));
    }
    if (const std::string known = BuiltinProfileOfLibrary(lib); !known.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "library \"", lib, "\" belongs to the toolchain profile \"", known,
          "\", which this server does not offer (it is not installed here, or [compiler] ",
          "profiles leaves it out); ask the operator to enable it: [compiler] profiles = [\"",
          known, "\"] where its packages are installed (deploy/install-deps.sh)"));
    }
    return absl::PermissionDeniedError(absl::StrCat(
        "library \"", Excerpt(lib), "\" is not on this server's allow-list (",
        allowed.empty() ? "empty" : absl::StrJoin(allowed, ", "),
        "); ask the operator to add it to [compiler] allowed_libraries"));
  }
  return absl::OkStatus();
}

CompileJob JobForImplementation(const registry::OpDef& def, const registry::Implementation& impl) {
  CompileJob job;
  job.target = impl.target;
  job.language = impl.language;
  job.source = impl.source;
  job.files = impl.files;
  // Not the op's name: diagnostics say kernel.<ext> unless the caller names
  // the user's file (the key never depends on it).
  job.entry = impl.entry;
  job.options = impl.compile_options;
  job.libraries = impl.libraries;
  job.label = absl::StrCat(def.ns, "/", def.name);
  job.ns = def.ns;
  if (impl.target == registry::Target::kGpu) {
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

KernelCompiler::KernelCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KernelCompiler::~KernelCompiler() {
  // Finish queued compiles before the members they use go away.
  impl_->pool.reset();
}

absl::StatusOr<std::unique_ptr<KernelCompiler>> KernelCompiler::Create(
    const KernelCompilerOptions& options) {
  OPJIT_ASSIGN_OR_RETURN(BackendSet backends, MakeDefaultBackends(options));
  return Create(options, std::move(backends));
}

absl::StatusOr<std::unique_ptr<KernelCompiler>> KernelCompiler::Create(
    const KernelCompilerOptions& options, BackendSet backends) {
  for (auto it = backends.begin(); it != backends.end();) {
    it = it->second == nullptr ? backends.erase(it) : std::next(it);
  }
  if (backends.empty()) return absl::InvalidArgumentError("the compiler needs a compile backend");
  for (const auto& [target, backend] : backends) {
    if (backend->target() != target) {
      return absl::InvalidArgumentError(
          absl::StrCat("a ", registry::TargetName(backend->target()),
                       " compile backend registered for target ", registry::TargetName(target)));
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->backends = std::move(backends);
  OPJIT_ASSIGN_OR_RETURN(impl->disk, cache::DiskCache::Create(
                                         {.dir = options.cache_dir, .max_bytes = options.disk_bytes}));
  if (!options.remote.url.empty()) {
    OPJIT_ASSIGN_OR_RETURN(impl->remote, cache::RemoteTier::Create(options.remote));
  }
  impl->memory = std::make_unique<cache::LruCache<MemoryEntry>>(options.memory_entries,
                                                                options.memory_bytes);
  impl->digests = std::make_unique<cache::FileDigestCache>(options.header_recheck_ms);
  CompileBackend* main_backend = impl->For(registry::Target::kCpu);
  if (main_backend == nullptr) main_backend = impl->backends.begin()->second.get();
  impl->toolchain_id = main_backend->ToolchainId();
  const auto t_roots = Clock::now();
  impl->roots = IncludeRoots::Create(options.kernel_include_dir, options.extra_include_dirs);
  Logger("compiler")->debug("include roots digested in {:.1f} ms: {} files by content, {} by name",
                            MsSince(t_roots), impl->roots.files_hashed(),
                            impl->roots.files_listed_only());
  impl->watch = std::make_unique<CompileWatch>(std::chrono::milliseconds(options.slow_compile_log_ms),
                                               std::chrono::seconds(30));
  const int threads = options.pool_threads > 0
                          ? options.pool_threads
                          : options.workers + std::max(0, options.long_workers);
  impl->pool = std::make_unique<ThreadPool>(threads, /*max_queue=*/256, "opjit-compile");
  Logger("compiler")->info("compiler ready: {} worker(s), cache {}, toolchain {}", options.workers,
                           options.cache_dir, impl->toolchain_id.substr(0, 80));
  return std::unique_ptr<KernelCompiler>(new KernelCompiler(std::move(impl)));
}

void KernelCompiler::CompileAsync(CompileJob job, Callback done) {
  const auto t0 = Clock::now();
  Impl* impl = impl_.get();
  if (absl::Status s = SelectProfile(impl->options, &job); !s.ok()) {
    done(std::move(s));
    return;
  }
  // One key per source: the compile sees kernel.<ext>; the caller's file
  // name comes back in the diagnostics.
  const std::string canonical = CanonicalFileName(job.language);
  std::string display = std::filesystem::path(job.file_name).filename().string();
  if (display.empty() || display == "." || display == "..") display = canonical;
  job.file_name = canonical;
  if (job.label.empty()) job.label = display;
  done = [done = std::move(done), canonical, display](absl::StatusOr<CompileOutcome> r) {
    if (!r.ok()) {
      done(display == canonical ? r.status() : RenameFile(r.status(), canonical, display));
      return;
    }
    r->diagnostics = display == canonical ? r->kernel->diagnostics
                                          : RenameFile(r->kernel->diagnostics, canonical, display);
    done(std::move(r));
  };
  CompileBackend* backend = impl->For(job.target);
  if (backend == nullptr) {
    done(absl::InvalidArgumentError(absl::StrCat("no compile backend for target ",
                                                 registry::TargetName(job.target))));
    return;
  }
  auto identity = backend->Identity(job);
  if (!identity.ok()) {
    done(identity.status());
    return;
  }
  const std::string request_key = RequestKey(job, *identity, impl->roots.Identity());

  // Checks the entry symbol of a kernel against this job and answers.
  auto finish = [t0, entry = job.entry, done](std::shared_ptr<const MemoryEntry> e,
                                              CacheTier hit) {
    const CompiledKernel& k = *e->kernel;
    const CpuObject* cpu = k.target == registry::Target::kCpu ? k.cpu_object() : nullptr;
    if (!entry.empty() && cpu != nullptr &&
        !std::binary_search(cpu->entry_points.begin(), cpu->entry_points.end(), entry)) {
      const auto& syms = cpu->defined_symbols;
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
    done(CompileOutcome{e->kernel, hit, MsSince(t0)});
  };

  if (auto hit = impl->memory->Get(request_key)) {
    if (impl->DependenciesUnchanged(hit->deps, false)) {
      finish(std::move(hit), CacheTier::kMemory);
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
      impl->memory->Put(request_key, result->entry, result->entry->kernel->binary_bytes());
    }
    Writes persist;
    const bool share = result.ok() && result->share && impl->remote != nullptr;
    if (result.ok()) persist = std::move(result->persist);
    impl->flights.Complete(request_key, result);
    // The remote tier first: Put only queues, and other daemons may be
    // waiting for it. Artifact before manifest there too; if the artifact is
    // not taken (too large, queue full, Redis down), neither is the manifest.
    if (share) {
      for (const auto& [kind, key, bytes] : persist) {
        if (!impl->remote->Put(kind, key, bytes)) break;
      }
    }
    for (const auto& [kind, key, bytes] : persist) {
      if (absl::Status s = impl->disk->Put(kind, key, bytes); !s.ok()) {
        Logger("compiler")->warn("key={} not cached on disk ({}): {}", key.substr(0, 12), kind,
                                 s.ToString());
        break;  // keep the artifact-before-manifest order
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
  if (impl_->remote != nullptr) {
    const auto r = impl_->remote->Stats();
    s.remote_enabled = true;
    s.remote_hits = r.hits;
    s.remote_misses = r.misses;
    s.remote_rejected = r.rejected;
    s.remote_errors = r.errors;
    s.remote_puts = r.puts;
    s.remote_contacted = r.contacted;
    s.remote_consecutive_failures = r.consecutive_failures;
  }
  return s;
}

uint64_t KernelCompiler::Clear(bool memory_only) {
  // The remote tier is left alone: other daemons use it.
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

const std::string& KernelCompiler::IncludeIdentity() const { return impl_->roots.Identity(); }

const registry::TargetRules& KernelCompiler::Rules() const { return impl_->rules; }

}  // namespace opjit::compiler

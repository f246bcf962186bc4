// KernelCompiler: source in, compiled artifact out, through the
// content-addressed cache. The same for every target; what differs lives in
// one compile backend per target (backend.h: cpu_backend.cc, gpu_backend.cc),
// looked up by the job's target in the compiler's BackendSet.
// The path of one compile:
//
//   key1 = SHA-256(ABI version, backend identity, language, options,
//                  libraries, file name, source, extra files)
//   memory LRU[key1] ─hit─▶ artifact (dependencies re-verified by digest)
//   disk manifest[key1] ─▶ dependency digests ─▶ final key ─▶ disk artifact
//   remote manifest[key1] ─▶ the same checks ─▶ remote artifact ─▶ disk
//   miss ─▶ single-flight ─▶ backend compile (a sandboxed process) ─▶
//        backend checks ─▶ remote and disk (artifact, then manifest) ─▶ memory
//
// The remote tier (optional, cache/remote_tier.h) is a Redis shared by the
// daemons of a cluster: what one compiles, the others fetch instead of
// compiling. Its entries are authenticated with the cluster key, and a remote
// hit passes every check a disk hit does (dependency digests, the final key,
// the backend's checks); it is then written to disk, so a restart hits disk.
//
// Nothing here loads or runs user code: an artifact is bytes (an ELF object
// for the CPU, CUBIN/PTX or a shared object for the GPU). Kernel runners
// (server/runner) load them, in sandboxed executor processes by default.
//
// The final key hashes key1 with the name and SHA-256 of every header the
// compile read, so editing a header invalidates what included it. No key
// holds a host path (cache_key.h): daemons installed under different prefixes
// share the remote tier.
//
// A compile still running after slow_compile_log_ms is logged ("compiler"
// logger, naming the op or the user's file name), and so is its end.
//
// Thread-safety: all methods are thread-safe. CompileAsync never blocks its
// caller: work runs on an owned pool, and concurrent requests for one key share
// one compile (single-flight).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "server/cache/remote_tier.h"
#include "server/compiler/toolchain_profile.h"
#include "server/registry/op_def.h"
#include "server/registry/validate.h"

namespace opjit::compiler {

class CompileBackend;  // backend.h
struct KernelCompilerOptions;

// The compile backends of one KernelCompiler, by the target each compiles for
// (backend.h; MakeDefaultBackends builds the built-in set).
using BackendSet = std::map<registry::Target, std::unique_ptr<CompileBackend>>;

// opjit's kernel-ABI version: part of every cache key.
inline constexpr int kKernelAbiVersion = 1;

struct CompileJob {
  registry::Target target = registry::Target::kCpu;
  // "c++" | "c" (CPU), "cuda" (GPU). A name, not an enum: each backend
  // names the languages it compiles (CompileBackend::Languages), and the
  // registry and CompileService check a request's against them once, as it
  // enters, so a new backend brings its own languages without a change here.
  std::string language = "c++";
  std::string source;
  // Extra files the source includes (and, for CPU, extra translation units),
  // seen by the compile in memory under their relative names, for this
  // compile only (registry::SourceFile; registry::ValidateSourceFiles checks
  // them). Part of the request key, names and contents, in order.
  std::vector<registry::SourceFile> files;
  // The name diagnostics give the source (the user's file; a directory part
  // is dropped); default kernel.cc / kernel.c / kernel.cu. Not part of the
  // key: every source compiles as kernel.<ext>, and the answer's diagnostics
  // are renamed, so `opjit compile add.cc` and a registration of the same
  // text share one cache entry.
  std::string file_name;
  std::string entry;      // when set, the kernel must define it
  std::vector<std::string> options;
  std::vector<std::string> libraries;
  // GPU: NVRTC name expressions (lowered names come back), target archs
  // (empty: the server's), or an aot .cu file for nvcc instead of NVRTC
  // (forced here, or chosen for a source with host code: cuda_source.h).
  std::vector<std::string> name_expressions;
  std::vector<std::string> archs;
  bool aot_shared_object = false;
  // What logs call this compile: "namespace/op" for an op's implementation,
  // else the user's file name (default: file_name). Never part of the key.
  std::string label;
  // The namespace that asks: what a backend keeps of a compile for later
  // ones (the CPU backend's preamble PCHs) is kept per namespace. Never part
  // of the key (an object is the same bytes for every namespace).
  std::string ns;
  // The toolchain profile the job uses (toolchain_profile.h): set by
  // KernelCompiler when a library of an offered profile is named and the
  // namespace may use it (a caller's value is ignored). Its name enters the
  // key through the backend's identity.
  std::string profile;
};

// What a GPU compile produced (nothing is loaded: that needs a device).
struct GpuBinary {
  std::map<std::string, std::string> cubins;  // arch -> CUBIN
  std::string ptx, ptx_arch;                  // forward-compatible PTX
  std::map<std::string, std::string> lowered_names;
  std::string shared_object;                  // aot .cu built by nvcc
  std::vector<std::string> archs;
  size_t bytes() const;
};

// KernelCompiler's check of a job's libraries, which also picks its
// toolchain profile (sets job->profile, "" for none): each library must be
// on options.allowed_libraries or belong to an offered profile the job's
// namespace may use (at most one profile per job). Errors:
// PERMISSION_DENIED (off the allow-list, or a profile the namespace may not
// use), FAILED_PRECONDITION (a built-in profile's library where the profile
// is not offered), INVALID_ARGUMENT (two profiles). No host path in them.
absl::Status SelectProfile(const KernelCompilerOptions& options, CompileJob* job);

// The job that compiles an op's implementation; registration and execution
// use the same one, so execution finds what registration compiled.
CompileJob JobForImplementation(const registry::OpDef& def, const registry::Implementation& impl);

// A CPU artifact: a relocatable ELF object for the host, and what the CPU
// backend's checks read from it.
struct CpuObject {
  std::string elf;                     // ELF relocatable object
  std::vector<std::string> libraries;  // allowed libraries it links against
  // The strong global functions and data the object defines, sorted.
  std::vector<std::string> defined_symbols;
  // Every global symbol it defines (weak ones too), sorted: what an entry
  // may name.
  std::vector<std::string> entry_points;
};

// A compiled kernel: the artifact a runner loads. Immutable; shared by the
// cache and in-flight calls. The artifact is one of a CPU object and a GPU
// binary (a backend whose artifact is plain bytes, such as the test's fake,
// uses CpuObject::elf); the CPU backend makes CPU objects, the GPU backend
// GPU binaries.
struct CompiledKernel {
  registry::Target target = registry::Target::kCpu;
  std::string cache_key;  // final content key (hex SHA-256)
  std::variant<CpuObject, GpuBinary> artifact;
  std::string diagnostics;  // warnings from the compile that produced it
  double compile_ms = 0;

  // The artifact as a CPU object or a GPU binary; nullptr when it is the other.
  const CpuObject* cpu_object() const { return std::get_if<CpuObject>(&artifact); }
  CpuObject* cpu_object() { return std::get_if<CpuObject>(&artifact); }
  const GpuBinary* gpu() const { return std::get_if<GpuBinary>(&artifact); }
  GpuBinary* gpu() { return std::get_if<GpuBinary>(&artifact); }

  size_t binary_bytes() const {
    const GpuBinary* g = gpu();
    return g != nullptr ? g->bytes() : std::get<CpuObject>(artifact).elf.size();
  }
};

// Where a compile's answer came from: the memory, disk or remote cache, or a
// compile now (kNone).
enum class CacheTier { kNone, kMemory, kDisk, kRemote };

// Its text in the CompileResponse's cache_hit, logs and metrics labels:
// "", "memory", "disk", "remote".
std::string_view CacheTierName(CacheTier tier);

struct CompileOutcome {
  std::shared_ptr<const CompiledKernel> kernel;
  CacheTier cache_hit = CacheTier::kNone;  // kNone when compiled now
  double total_ms = 0;
  std::string diagnostics;  // the kernel's warnings, naming the job's file_name
};

// The file name every source of `language` compiles under.
std::string CanonicalFileName(const std::string& language);

struct KernelCompilerOptions {
  // Directory of the disk cache. Required.
  std::string cache_dir;
  // Compile worker binary. Default: opjit-compile-worker next to this executable.
  std::string worker_path;
  // Default: 2.
  int workers = 2;
  // Wall-clock limit of one compile. Default: 30000.
  int timeout_ms = 30000;
  // Address-space limit of a compile worker. Default: 2 GiB.
  uint64_t memory_limit_bytes = 2ull << 30;
  // Directory with custom_aot_extra.h and opjit/kernel.h. Required.
  std::string kernel_include_dir;
  // Extra include dirs and libraries kernels may use. Default: none.
  std::vector<std::string> extra_include_dirs;
  std::vector<std::string> allowed_libraries;
  // Toolchain profiles offered (found on this host; toolchain_profile.h). A
  // job that names one of a profile's libraries uses it: its include dirs
  // and its shared PCH (CPU). Refused (PERMISSION_DENIED) when the job's
  // namespace is not on the profile's list and the library is not on
  // allowed_libraries; a library of a built-in profile that is not offered
  // is FAILED_PRECONDITION. Default: none.
  std::vector<ToolchainProfile> profiles;
  // In-memory cache bounds. Default: 512 kernels, 512 MiB of object code.
  size_t memory_entries = 512;
  uint64_t memory_bytes = 512ull << 20;
  // Disk cache bound. Default: 2 GiB.
  uint64_t disk_bytes = 2ull << 30;
  // CPU compile workers are retired after this many compiles or past this
  // address-space size (0: never). Defaults: 256; half the memory limit.
  int recycle_after_compiles = 256;
  uint64_t recycle_memory_bytes = 1ull << 30;
  // The long lane (see CpuCompilerOptions): compiles running past
  // long_after_ms give their slot to others; at most long_workers at once.
  int long_after_ms = 1000;
  int long_workers = 2;
  // In the long lane timeout_ms counts CPU time, bounded by this wall time
  // (CpuCompilerOptions::long_timeout_ms).
  int long_timeout_ms = 120000;
  // A root daemon's compile workers and NVRTC sandboxes run as this uid
  // (and gid), keeping only CAP_DAC_READ_SEARCH ([compiler] uid). <= 0, or
  // a daemon that is not root: the daemon's uid.
  int64_t compile_uid = -1;
  // A daemon that is not root: its compile workers and NVRTC sandboxes run
  // as compile_uid and this gid, subordinate ids of its user, in user
  // namespaces that map its own ids too; with compile_uid <= 0, as its own
  // ids. -1: the gid of compile_uid's number.
  int64_t compile_gid = -1;
  // Threads that drive compiles. Default (0): workers + long_workers, so that
  // compiles in the long lane do not hold every thread.
  int pool_threads = 0;
  // GPU: the CUDA toolkit and the archs compiled when a job names none.
  // Default: /usr/local/cuda; sm_80 and sm_90.
  std::string cuda_root = "/usr/local/cuda";
  // opjit-gpu-sandbox, which runs NVRTC and nvcc confined. Default:
  // next to worker_path. GPU compiles refuse to run without it.
  std::string gpu_sandbox_path;
  // How long a header's digest is trusted without a stat (memory hits then
  // cost no syscalls). Default: 1000 ms; tests use 0.
  int header_recheck_ms = 1000;
  std::vector<std::string> gpu_archs = {"sm_80", "sm_90"};
  // The Redis tier shared with other daemons, behind memory and disk. Off
  // while remote.url is empty. Default: off.
  cache::RemoteTierOptions remote;
  // A compile still running after this long is logged (warn), again every
  // 30 s, and its total time when it ends. 0: never. Default: 5000.
  int slow_compile_log_ms = 5000;
};

struct KernelCacheStats {
  uint64_t memory_entries = 0, memory_bytes = 0, memory_hits = 0, memory_misses = 0;
  uint64_t disk_entries = 0, disk_bytes = 0, disk_hits = 0, disk_misses = 0, disk_corrupt = 0;
  uint64_t compiles = 0, compile_failures = 0, single_flight_joins = 0, evictions = 0;
  double compile_ms_total = 0;
  // The remote tier's counters (all 0 when it is off). A lookup reads the
  // manifest, then the artifact: each read counts as a hit or a miss.
  // rejected: entries that failed authentication (counted in misses too);
  // errors: failed or timed-out Redis connects and commands; puts: entries
  // written.
  uint64_t remote_hits = 0, remote_misses = 0, remote_rejected = 0, remote_errors = 0,
           remote_puts = 0;
  bool remote_enabled = false;  // [cache.remote] is configured
  // The remote tier's reachability as last seen (RemoteTierStats).
  bool remote_contacted = false;
  int remote_consecutive_failures = 0;
};

class KernelCompiler {
 public:
  using Callback = std::function<void(absl::StatusOr<CompileOutcome>)>;

  // Starts the built-in compile backends (MakeDefaultBackends) and opens the
  // disk cache (and the remote tier, which connects lazily). INVALID_ARGUMENT
  // for bad options (a malformed remote url or a short remote key among
  // them); the disk cache's and the CPU backend's errors as they give them.
  static absl::StatusOr<std::unique_ptr<KernelCompiler>> Create(const KernelCompilerOptions& options);
  // The same with the given backends (at least one; the key of each is the
  // target it compiles for): how tests pass a fake backend. A job whose
  // target has no backend fails with INVALID_ARGUMENT.
  static absl::StatusOr<std::unique_ptr<KernelCompiler>> Create(const KernelCompilerOptions& options,
                                                                BackendSet backends);
  ~KernelCompiler();

  // Compiles (or finds) `job` and calls `done` exactly once, on a pool thread
  // or, for a memory hit, on the caller's thread. Errors: INVALID_ARGUMENT
  // (compile error with diagnostics, unknown language, missing entry symbol,
  // compiler crash), DEADLINE_EXCEEDED (compile timeout), RESOURCE_EXHAUSTED
  // (memory limit, or the compile queue is full), PERMISSION_DENIED (a library
  // off the allow-list), UNAVAILABLE (GPU target without NVRTC or nvcc).
  // INVALID_ARGUMENT too for a target without a backend, and, before a
  // compile (not on a cache hit), for an option off the backend's allow-list.
  // GPU jobs compile with NVRTC (or nvcc for aot .cu files) and are cached
  // the same way; their key holds the NVRTC/nvcc identity and the archs.
  void CompileAsync(CompileJob job, Callback done);

  // Blocking form of CompileAsync, for tests and tools. Never call it from a
  // gRPC handler.
  absl::StatusOr<CompileOutcome> Compile(CompileJob job);

  KernelCacheStats Stats() const;
  // Drops the memory cache (and, unless memory_only, the disk cache). Kernels
  // in use stay loaded until their last user lets go. Returns entries removed.
  // Never flushes the remote tier: other daemons share it, and its entries
  // expire on their own (remote.ttl_s); after a full Clear the next lookups
  // may be remote hits.
  uint64_t Clear(bool memory_only);

  // Toolchain identity (compiler version, triple, CPU, features): the CPU
  // backend's, else that of the first backend.
  const std::string& ToolchainId() const;
  // The languages and compile options of this compiler's backends, by target,
  // for registry::ValidateOpDef and ValidateCompileOptions. Lives as long as
  // the compiler.
  const registry::TargetRules& Rules() const;
  // The include roots' labels and tree digest (cache_key.h): part of every
  // request key.
  const std::string& IncludeIdentity() const;

 private:
  struct Impl;
  explicit KernelCompiler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit::compiler

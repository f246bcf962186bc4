// The GPU kernel compiler: CUDA C++ source -> one CUBIN per SM arch plus
// forward-compatible PTX, compiled by NVRTC.
//
// NVRTC (libnvrtc.so) is opened with dlopen by Create(), never linked, so the
// daemon starts on hosts without a CUDA toolkit; no CUDA header is included
// here.
//
// Isolation: with `worker_path` set (the daemon always sets it), compiles
// run in a pool of `opjit-gpu-sandbox --nvrtc-worker` processes
// (nvrtc_pool.h): Landlock (the toolkit's and opjit's headers only, so
// `#include "/etc/shadow"` or "/proc/self/environ" read nothing), seccomp,
// RLIMIT_AS, namespaces, the compile uid, and a wall-clock deadline per
// compile after which the worker is killed (and replaced). A crash, a macro
// bomb or a hang fails that request only. A worker serves many compiles of
// one namespace, with NVRTC loaded and initialised, and keeps NVRTC's
// automatic precompiled headers (PCHs) of that namespace's include blocks in
// a private tmpfs. Without `worker_path` (tests, benchmarks) NVRTC runs in
// the calling process, without PCHs.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace opjit::gpu {

struct NvrtcOptions {
  // The toolkit whose include/ holds cuda_fp16.h etc. Default: /usr/local/cuda.
  std::string cuda_root = "/usr/local/cuda";
  // Real architectures compiled to CUBIN when a request names none, each
  // "sm_NN" (or "sm_NNa"/"sm_NNf"). Default: sm_80, sm_90.
  std::vector<std::string> archs = {"sm_80", "sm_90"};
  // Always on the include path, after <cuda_root>/include (e.g. opjit's
  // kernels/include).
  std::vector<std::string> extra_include_dirs;
  // libnvrtc to dlopen. Default (empty): libnvrtc.so.13, libnvrtc.so, then
  // <cuda_root>/lib64/libnvrtc.so.
  std::string nvrtc_path;
  // The opjit-gpu-sandbox binary whose workers run the compiles; empty:
  // compile in this process (unsafe for untrusted sources).
  std::string worker_path;
  // Wall clock of one compile in a worker, then SIGKILL. Default: 30 s.
  int timeout_ms = 30000;
  // RLIMIT_AS of each worker. Default: 2 GiB.
  uint64_t memory_limit_bytes = 2ull << 30;
  // Workers alive at most (idle or busy). Default: 2.
  int workers = 2;
  // A worker is retired after this many compiles, or once its address space
  // passes recycle_memory_bytes (0: neither bound). Defaults: 256 compiles;
  // half of the memory limit.
  int recycle_after_compiles = 256;
  uint64_t recycle_memory_bytes = 1ull << 30;
  // The size of a worker's private tmpfs for its PCHs (a few MiB each: one
  // per include block, options and arch). 0: no PCHs. They need private
  // namespaces (a root daemon, or user namespaces); without them, none.
  uint64_t pch_bytes = 256ull << 20;
  // Where CompileHere() keeps automatic PCHs; empty: none. The worker sets
  // it to its private tmpfs.
  std::string pch_dir;
  // A root daemon's sandbox runs as this uid (and gid) once NVRTC is
  // loaded, with CAP_DAC_READ_SEARCH alone (the compile uid, as the CPU
  // compile workers'). <= 0, or a daemon that is not root: the daemon's uid.
  int64_t sandbox_uid = -1;
  // With sandbox_uid, on a daemon that is not root: the gid (-1:
  // sandbox_uid's number), as KernelCompilerOptions::compile_gid.
  int64_t sandbox_gid = -1;
};

struct GpuCompileRequest {
  std::string source;
  // Shown in diagnostics ("kernel.cu(3): error: ...").
  std::string file_name = "kernel.cu";
  // User options, already validated by the registry: -D -U --use_fast_math
  // -std= ... Passed to NVRTC as they are.
  std::vector<std::string> options;
  // Kernels to look up by C++ name, e.g. "axpy<float>"; each must name a
  // __global__ function or a __device__/__constant__ variable.
  std::vector<std::string> name_expressions;
  // Real archs to compile for; empty: NvrtcOptions::archs.
  std::vector<std::string> archs;
  // Headers the source includes by these names ("helper.h",
  // "detail/x.h"), given to nvrtcCreateProgram: in memory, for this compile
  // only. (name, content).
  std::vector<std::pair<std::string, std::string>> headers;
  // The namespace that asks: a worker compiles for one namespace only, so
  // nothing one source does to NVRTC's process (or its PCHs) reaches
  // another's compile. Not sent to the worker.
  std::string tenant;
};

struct GpuCompileOutput {
  std::map<std::string, std::string> cubins;  // arch ("sm_90") -> CUBIN ELF bytes
  // PTX for the lowest requested arch's virtual arch (compute_NN); the driver
  // JIT-compiles it for newer GPUs that have no CUBIN here.
  std::string ptx;
  std::string ptx_arch;                              // e.g. "compute_80"
  std::map<std::string, std::string> lowered_names;  // name expression -> mangled name
  std::string diagnostics;  // NVRTC's log of a successful compile (warnings), may be empty
  double compile_ms = 0;    // wall time of all the NVRTC compiles of this request
  // NVRTC compiles (one per target) that loaded a PCH, and that wrote one.
  int pch_used = 0, pch_created = 0;
  // The worker that compiled it (its pid as the daemon sees it); 0: this
  // process. Not part of the artifact.
  int worker_pid = 0;
};

// What the pool did (NvrtcCompiler::GetStats); all 0 without worker_path.
struct NvrtcStats {
  uint64_t compiles = 0;         // requests a worker answered or failed
  uint64_t spawns = 0;           // workers started
  uint64_t timeouts = 0;         // workers killed at the deadline
  uint64_t crashes = 0;          // workers that died or broke the protocol on a request
  uint64_t recycled = 0;         // workers retired (compile count, size, an error)
  uint64_t tenant_switches = 0;  // idle workers ended to serve another namespace
  uint64_t split_compiles = 0;   // compiles whose two archs ran on two workers at once
  uint64_t pch_used = 0;         // NVRTC compiles that loaded a PCH
  uint64_t pch_created = 0;      // PCHs written
};

class NvrtcPool;

// Thread-safe: Compile() may run on many threads at once (each call uses its
// own nvrtcProgram objects, which NVRTC allows). Compile() blocks for the
// whole compile (about 0.1 s per arch for a small kernel).
class NvrtcCompiler {
 public:
  // Opens NVRTC and checks the default archs. Errors: UNAVAILABLE "NVRTC
  // (libnvrtc.so) could not be loaded: ...; install the CUDA toolkit" when no
  // library opens or it lacks entry points; INVALID_ARGUMENT for an arch that
  // is malformed or that this NVRTC does not support.
  static absl::StatusOr<std::unique_ptr<NvrtcCompiler>> Create(const NvrtcOptions& options);
  ~NvrtcCompiler();
  NvrtcCompiler(const NvrtcCompiler&) = delete;
  NvrtcCompiler& operator=(const NvrtcCompiler&) = delete;

  // Compiles `request` once per arch (CUBIN) and takes the PTX from the
  // lowest arch's compile (or one more compute_NN compile when that arch has
  // an "a"/"f" suffix, whose PTX is not forward-compatible). Adds
  // -I<cuda_root>/include, the extra include dirs, and --std=c++17 unless the
  // request gives -std=/--std=. Errors:
  //   INVALID_ARGUMENT "compile failed:\n" + NVRTC's log (lines such as
  //                    "kernel.cu(3): error: ..."); a bad arch or option; a
  //                    name expression that names nothing;
  //   RESOURCE_EXHAUSTED NVRTC ran out of memory;
  //   INTERNAL         any other NVRTC failure.
  //   DEADLINE_EXCEEDED the compile ran past timeout_ms (sandboxed);
  //   UNAVAILABLE      the sandbox could not be started.
  // In the pool, two archs (the lower one plain, as the defaults) run on two
  // workers of the namespace at once when a second one is idle and ready:
  // the same output, in about half the time.
  absl::StatusOr<GpuCompileOutput> Compile(const GpuCompileRequest& request) const;

  // Compile() in this process, whatever worker_path says. For the sandbox.
  // With options().pch_dir and a request without in-memory headers, NVRTC's
  // automatic PCHs in that directory (its output is the same bytes); a
  // compile that fails on the PCH itself (a full directory) runs again
  // without, and sets *pch_broke.
  absl::StatusOr<GpuCompileOutput> CompileHere(const GpuCompileRequest& request,
                                               bool* pch_broke = nullptr) const;

  // Whether this NVRTC has precompiled headers (12.8+).
  bool HasPch() const;
  NvrtcStats GetStats() const;

  // "nvrtc 13.0".
  std::string Version() const;
  // Everything about the toolchain that changes output bytes apart from the
  // source and the request: NVRTC version, the library path, cuda_root, the
  // extra include dirs and the default archs. For cache keys; stable across
  // runs on one machine.
  const std::string& ToolchainId() const { return toolchain_id_; }
  // The SM versions this NVRTC can target (e.g. 75, 80, ..., 121).
  const std::vector<int>& SupportedArchs() const { return supported_archs_; }
  const NvrtcOptions& options() const { return options_; }

  struct Api;  // the resolved NVRTC entry points (nvrtc_compiler.cc)

 private:
  NvrtcCompiler() = default;
  absl::Status CheckArch(const std::string& arch) const;

  // Constant after Create().
  NvrtcOptions options_;
  std::unique_ptr<Api> api_;
  int major_ = 0, minor_ = 0;
  std::vector<int> supported_archs_;
  std::string library_path_;
  std::string toolchain_id_;

  // The list of arguments a worker starts with.
  std::vector<std::string> WorkerArgs() const;
  // The real archs `request` compiles for: its own or the default ones,
  // lowest first, each once.
  std::vector<std::string> Targets(const GpuCompileRequest& request) const;
  // Compiles `archs` (sorted, unique) of `request`, with the PCH or not.
  absl::StatusOr<GpuCompileOutput> CompileArchs(const GpuCompileRequest& request,
                                                const std::vector<std::string>& archs,
                                                bool pch) const;
  std::unique_ptr<NvrtcPool> pool_;  // with worker_path
};

// How a request and its result cross the sandbox's pipes.
std::string EncodeGpuRequest(const GpuCompileRequest& r);
bool DecodeGpuRequest(std::string_view in, GpuCompileRequest* r);
std::string EncodeGpuResult(const absl::StatusOr<GpuCompileOutput>& r);
absl::StatusOr<GpuCompileOutput> DecodeGpuResult(std::string_view in);

}  // namespace opjit::gpu

// The CPU kernel compiler: C/C++ source -> ELF relocatable object bytes for
// the host, compiled by clang 16 in a pool of sandboxed worker processes
// (`opjit-compile-worker`), so that a compiler crash, hang or memory bomb
// fails only the request that caused it.
//
// No LLVM or clang header is included here; the daemon links this library
// without LLVM. The object is meant for LLVM ORC (see server/loader): static
// constructors are not left in .init_array but gathered into an exported
// `void __opjit_run_ctors(void)` (and `__opjit_run_dtors` for
// __attribute__((destructor))), which every object defines.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/types.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/common/mutex.h"
#include "server/compiler/toolchain_profile.h"

struct rusage;

namespace opjit::compiler {
namespace ipc {
struct WorkerRequest;
struct WorkerResponse;
}  // namespace ipc

enum class Language { kC, kCxx };

struct CpuCompileRequest {
  Language language = Language::kCxx;
  std::string source;
  // Shown in diagnostics. A bare file name; a directory part is dropped.
  std::string file_name = "kernel.cc";
  // User options, already validated by the registry: -D -U -O0..3 -ffast-math
  // -fno-fast-math -std=... -W... -w. Anything else is INVALID_ARGUMENT.
  std::vector<std::string> options;
  // Must be a subset of CpuCompilerOptions::extra_include_dirs, else
  // INVALID_ARGUMENT. Searched after kernel_include_dir, in this order.
  // Empty: every configured one, in the configuration's order.
  std::vector<std::string> extra_include_dirs;
  // Extra files (name, content): headers the source includes and C/C++
  // translation units linked with it (ipc::WorkerRequest::files), served
  // from memory to that compile only. Names are relative, without "..",
  // unique (registry::ValidateSourceFiles; the worker checks again). A PCH
  // of a source with files is keyed by their contents too.
  std::vector<std::pair<std::string, std::string>> files;
  // The namespace that asks. Its preamble PCHs are its own: keyed by it
  // (with the preamble, options, include dirs and toolchain), and no compile
  // of another namespace is given them. Not part of any object key.
  std::string tenant;
  // A toolchain profile of CpuCompilerOptions::profiles ("": none): its
  // include dirs follow the others, and its shared PCH serves the units
  // that begin with its prefix header (see the options).
  std::string profile;
};

struct CpuCompileOutput {
  std::string object;       // ELF relocatable for the host (x86-64, PIC)
  std::string diagnostics;  // warnings, clang's text format, no colours
  // Absolute real paths of every file the compile read (headers, including
  // the PCH's inputs), sorted, unique; without the main source.
  std::vector<std::string> dependencies;
  double compile_ms = 0;  // time inside the worker
};

struct CpuCompilerOptions {
  // The opjit-compile-worker binary. Default: next to /proc/self/exe, else
  // $OPJIT_COMPILE_WORKER.
  std::string worker_path;
  // Worker processes, started lazily (one at Create). Default: 2.
  int num_workers = 2;
  // Wall clock per compile, from the moment a worker takes it; then SIGKILL.
  int timeout_ms = 30000;
  // RLIMIT_AS of each worker. Default: 2 GiB.
  uint64_t memory_limit_bytes = 2ull << 30;
  // opjit's kernel headers (custom_aot_extra.h); always on the include path.
  std::string kernel_include_dir;
  // Extra include directories (from the server config): on every compile's
  // include path unless a request names a subset; read-only to workers.
  std::vector<std::string> extra_include_dirs;
  // Toolchain profiles a request may name (toolchain_profile.h; the
  // KernelCompiler checked the namespace's right to it). A profile with a
  // prefix header has one shared PCH, built from `#include <prefix>` alone
  // with the fixed flags and no user option, in a worker of no namespace,
  // charged to none, kept in <pch_dir>/profiles/ out of the LRU: at Create
  // when pch_at_start, else at the first compile that names the profile
  // (which waits for it, outside its own time limit). A C++ translation
  // unit of such a compile (the source or an extra .cc/.cpp/.cxx file)
  // loads it read-only when it compiles as the PCH was built (no option
  // but warnings, the same include dirs, no extra file that could shadow a
  // header the PCH read) and its first directives reach the prefix header
  // through nothing that could change what it means (StartsWithInclude,
  // preamble.h): as if the header had been included first, which its
  // include guard makes the same.
  std::vector<ToolchainProfile> profiles;
  // Where preamble PCHs are kept (see preamble.h); empty = no PCH. Only this
  // process opens it: a worker gets the one PCH its compile uses as a
  // read-only descriptor, or, to build one, a descriptor of a new empty
  // file that this process publishes (renames into place) once the worker
  // said it is whole; that worker is then retired. At most pch_max_files of
  // them and pch_max_bytes in all; the least recently used go first.
  std::string pch_dir;
  int pch_max_files = 64;
  uint64_t pch_max_bytes = 2ull << 30;
  // A worker is replaced after this many compiles, or once its address space
  // passes recycle_memory_bytes (clang's process grows ~1.5 MB per compile),
  // so that it is retired before the memory limit fails an innocent compile.
  // 0 disables either bound. Defaults: 256 compiles; half of the limit.
  int recycle_after_compiles = 256;
  uint64_t recycle_memory_bytes = 1ull << 30;
  // The long lane. A compile still running after long_after_ms gives its slot
  // back to the pool (a replacement worker may start) and continues at a
  // lower CPU priority, so that template bombs do not stall small compiles.
  // At most long_workers compiles are in the long lane at once; beyond that a
  // long compile keeps its slot. long_after_ms = 0 turns the lane off.
  int long_after_ms = 1000;
  int long_workers = 2;
  // In the long lane, timeout_ms counts the worker's CPU time rather than
  // the wall clock, so a compile that makes progress on a busy machine is
  // not killed for the machine's load; long_timeout_ms bounds its wall time.
  // <= timeout_ms: the wall-clock timeout_ms holds in the lane too.
  int long_timeout_ms = 120000;
  // A root daemon's workers run as this uid (and gid) once clang is loaded,
  // with CAP_DAC_READ_SEARCH alone (they read the include directories,
  // often 0700 root's, no further than Landlock lets them): the compile
  // uid, which no executor has. <= 0, or a daemon that is not root: the
  // daemon's uid.
  int64_t worker_uid = -1;
  // With worker_uid, on a daemon that is not root: the gid (-1: worker_uid's
  // number), as KernelCompilerOptions::compile_gid.
  int64_t worker_gid = -1;
};

// Thread-safe. Compile() blocks the calling thread until a worker is free and
// has answered. Destroy only after every Compile() call has returned.
class CpuCompiler {
 public:
  // Starts one worker (to learn the toolchain). Errors: UNAVAILABLE when no worker
  // starts; INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<CpuCompiler>> Create(const CpuCompilerOptions& options);
  ~CpuCompiler();
  CpuCompiler(const CpuCompiler&) = delete;
  CpuCompiler& operator=(const CpuCompiler&) = delete;

  // Compiles `request`. Errors:
  //   INVALID_ARGUMENT  "compile failed:\n" + clang diagnostics; or the
  //                     compiler crashed on this source; or bad options/dirs;
  //   DEADLINE_EXCEEDED the compile ran past timeout_ms;
  //   RESOURCE_EXHAUSTED the compiler ran out of memory;
  //   UNAVAILABLE       no worker could be started, or the worker was killed
  //                     from outside opjitd (not this source's fault: retry).
  absl::StatusOr<CpuCompileOutput> Compile(const CpuCompileRequest& request);

  // Everything about the toolchain that changes output bytes, for cache keys:
  // clang version, target triple, host CPU name, sorted target features,
  // fixed flags and the object ABI version. No path: the include dirs enter
  // keys by content (server/compiler/cache_key.h). Stable across runs and
  // install prefixes. (PCHs never change output: not part of it.)
  const std::string& ToolchainId() const { return toolchain_id_; }

  struct Stats {
    uint64_t compiles = 0;         // Compile() calls that reached a worker
    uint64_t failures = 0;         // of those, calls that returned an error
    uint64_t crashes = 0;          // workers that died on a request
    uint64_t timeouts = 0;         // workers killed at the deadline
    uint64_t worker_restarts = 0;  // workers started to replace a dead one
    uint64_t recycled = 0;         // healthy workers retired (compile count or size)
    uint64_t killed_outside = 0;   // workers killed by a signal opjitd did not send
    uint64_t long_compiles = 0;    // compiles moved to the long lane
    uint64_t pch_built = 0;        // preamble PCHs built
    uint64_t pch_evicted = 0;      // preamble PCHs removed to stay in bounds
    uint64_t tenant_switches = 0;  // idle workers ended to serve another namespace
    uint64_t profile_pch_built = 0;  // toolchain profiles' shared PCHs built (also in pch_built)
    uint64_t profile_pch_uses = 0;   // compiles that loaded one
  };
  Stats GetStats() const;

 private:
  struct Worker;

  explicit CpuCompiler(const CpuCompilerOptions& options);

  // Takes an idle worker that is fresh or has served only `tenant`, or
  // starts one (at most num_workers live). When every slot is taken by
  // other namespaces' idle workers, one of them is ended and a fresh one
  // started in its slot: a worker process never compiles for two
  // namespaces, so not even a compiler subverted by one namespace's source
  // sees another's sources or PCHs.
  absl::StatusOr<std::unique_ptr<Worker>> Acquire(const std::string& tenant);
  // Returns a healthy worker to the idle pool.
  void Release(std::unique_ptr<Worker> worker);
  // Kills and reaps a worker that is not coming back.
  void Discard(std::unique_ptr<Worker> worker);
  absl::StatusOr<std::unique_ptr<Worker>> StartWorker();
  // Runs one encoded request on `*worker`. On return `*worker` is null when
  // the worker died or was killed (it is then reaped and counted).
  // `allow_long`: the compile may move to the long lane (see the options).
  // `pass_fd` (>= 0) goes with the request (its PCH); `*response_flags`
  // gets the response's PCH flags (kPchBuilt, kPchStale) when not null.
  // `timeout_ms` > 0 replaces options' (a profile's PCH build).
  absl::StatusOr<CpuCompileOutput> Run(std::unique_ptr<Worker>* worker, const std::string& payload,
                                       const std::string& file_name, bool allow_long,
                                       bool* long_lane, int pass_fd = -1,
                                       int* response_flags = nullptr, int timeout_ms = 0);
  // Run's halves: the error for a worker that hung up mid-compile (it died:
  // reaped, counted, and its death explained), and the answer a worker's
  // response gives (a crash or running out of memory reaps it too).
  absl::Status WorkerDied(std::unique_ptr<Worker>* worker, const std::string& file_name);
  // In the long lane: waits for the worker's answer while its CPU time is
  // under timeout_ms and the wall clock under long_timeout_ms, then moves
  // *deadline to the wall-clock bound for the read. False: the CPU time ran
  // out (the caller kills the worker).
  bool WaitInLongLane(const Worker& w, const std::string& file_name, absl::Time* deadline);
  absl::StatusOr<CpuCompileOutput> Answer(std::unique_ptr<Worker>* worker,
                                          ipc::WorkerResponse* resp, const std::string& file_name);
  // Kills the worker if it still runs, reaps it and drops it (`*worker`
  // null); its wait status and usage go to `status` and `usage` when given.
  static void Reap(std::unique_ptr<Worker>* worker, int* status = nullptr,
                   struct rusage* usage = nullptr);
  // Moves a busy worker's slot to the long lane when the lane has room.
  bool EnterLongLane(Worker* worker, const std::string& file_name);
  // Whether a compile runs (or a worker starts) in the regular lane: then
  // long-lane compiles run at nice 10 (WaitInLongLane).
  bool RegularLaneBusy() const;
  // Gives back what a worker held after a compile: the worker (or null when
  // it died), its slot or long-lane place. Recycles healthy workers that are
  // past their compile count or size, and `retire`d ones (a worker that held
  // a writable descriptor).
  void FinishWith(std::unique_ptr<Worker> worker, bool long_lane, bool retire = false);
  // The PCH (and its header) for a namespace's preamble, a request's options
  // and include dirs: <pch_dir>/<key>.pch and <key>.h, keyed by all of them
  // and the toolchain.
  std::string PchKeyFor(const std::string& tenant, const std::string& directives,
                        const std::vector<std::string>& pch_options,
                        const std::vector<std::string>& include_dirs) const;
  // Marks a PCH as used (LRU by mtime) or, when it was just `built`, removes
  // the least recently used ones past the bounds.
  void NotePchUse(const std::string& key, bool existed, bool built);

  // The PCH a compile uses (cpu_compiler.cc).
  struct PchPlan;
  // A profile's shared prefix PCH, as built (or found from an earlier run).
  struct ProfilePch {
    enum class State { kNone, kBuilding, kReady, kFailed };
    State state = State::kNone;
    std::string file;                       // <pch_dir>/profiles/<name>-<key>.pch
    std::vector<std::string> dependencies;  // the headers it read (real paths)
    std::vector<std::string> include_dirs;  // the -I list it was built with
    absl::Time failed_at;
  };
  const ToolchainProfile* FindProfile(const std::string& name) const;
  // The -I list of a request: the kernel dir, `extra` (a subset of the
  // configured ones; empty: all of them), then `profile`'s (when not null).
  absl::StatusOr<std::vector<std::string>> IncludeDirsFor(const std::vector<std::string>& extra,
                                                          const ToolchainProfile* profile) const;
  // The source's preamble PCH (the namespace's own) into *req and *plan.
  void PlanPreamblePch(const CpuCompileRequest& request, ipc::WorkerRequest* req, PchPlan* plan);
  // `profile`'s prefix PCH into *req and *plan when some unit of *req may
  // load it (CpuCompilerOptions::profiles); waits for (or builds) it.
  void PlanProfilePch(const ToolchainProfile& profile, ipc::WorkerRequest* req, PchPlan* plan);
  // The profile's PCH once ready: built now on this thread when no one has,
  // waited for when another thread builds it; nullopt when it failed
  // (tried again after 10 minutes) or the compiler is stopping.
  std::optional<ProfilePch> ProfilePchFor(const ToolchainProfile& profile);
  ProfilePch BuildProfilePch(const ToolchainProfile& profile);
  // Forgets a stale profile PCH (and removes it): the next use builds it.
  void DropProfilePch(const std::string& name);
  // Builds the PCHs of the profiles with pch_at_start, on a thread.
  void StartProfilePchs();

  // Constant after Create().
  CpuCompilerOptions options_;
  std::string kernel_include_dir_;               // normalised
  std::vector<std::string> allowed_extra_dirs_;  // normalised
  std::string worker_path_;
  std::string toolchain_id_;
  std::string pch_dir_;  // normalised; empty: PCH disabled

  mutable Mutex mu_;
  CondVar idle_cv_;  // signalled when a worker goes idle or a slot frees
  std::deque<std::unique_ptr<Worker>> idle_ ABSL_GUARDED_BY(mu_);
  int live_ ABSL_GUARDED_BY(mu_) = 0;  // idle + busy + starting
  int dead_ ABSL_GUARDED_BY(mu_) = 0;  // died, not yet replaced
  int long_ ABSL_GUARDED_BY(mu_) = 0;  // compiles in the long lane (not in live_)
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> warned_pch_ ABSL_GUARDED_BY(mu_);
  Mutex evict_mu_;  // one eviction pass at a time
  std::map<std::string, ProfilePch> profile_pch_ ABSL_GUARDED_BY(mu_);
  CondVar profile_cv_;  // signalled when a profile PCH build ends
  pid_t profile_builder_pid_ ABSL_GUARDED_BY(mu_) = 0;  // the worker building one
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread profile_starter_;  // StartProfilePchs'; joined by the destructor
};

}  // namespace opjit::compiler

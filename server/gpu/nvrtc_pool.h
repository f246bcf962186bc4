// The pool of sandboxed NVRTC workers (`opjit-gpu-sandbox --nvrtc-worker`)
// behind NvrtcCompiler::Compile, and the worker's side of their wire.
//
// A worker loads NVRTC, warms it up with one small compile, confines itself
// (the walls of nvrtc_compiler.h) and then answers compile requests until
// its socket closes, so a compile pays neither a process start nor NVRTC's
// initialisation. The pool mirrors the CPU compile workers'
// (server/compiler/cpu/cpu_compiler.h): at most `workers` processes; a
// worker serves one namespace for its whole life (a fresh one is started
// for another namespace, ending another namespace's idle worker when every
// slot is taken); a compile past the deadline kills its worker; a worker is
// retired after `recycle_after` compiles, past `recycle_memory_bytes` of
// address space, or after an answer other than a compile error. One
// unassigned worker is kept started ahead while a slot is free. A compile
// holds a worker through a Lease; NvrtcCompiler::Compile takes a second one
// when the namespace has one idle and ready (TryAcquire, which may take the
// one started ahead), and compiles one arch on each at once.
//
// PCHs. With a private tmpfs (namespaces) a worker passes NVRTC `-pch`:
// NVRTC precompiles the leading #include block of a source (and its own
// built-in prelude) into that tmpfs, and a later compile with the same
// block, options and arch loads it instead of parsing the headers again.
// The PCHs are the worker's, so its namespace's alone. A request with
// in-memory headers compiles without them (NVRTC would reuse a PCH of
// another content of the same name), and the worker drops its PCHs when a
// header under the extra include dirs changes (NVRTC does not check), or
// when the tmpfs runs short.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/frame_io.h"
#include "server/common/mutex.h"
#include "server/gpu/nvrtc_compiler.h"

namespace opjit::gpu {

// The wire: typed frames (server/common/frame_io.h) on a socketpair, the
// worker's stdin and stdout. The worker sends one kHello when it is ready;
// then it answers each kRequest (EncodeGpuRequest) with one kResult
// (EncodeGpuResult).
namespace nvrtc_wire {
inline constexpr uint32_t kProtocolVersion = 1;
enum Type : uint8_t { kHello = 1, kRequest = 2, kResult = 3 };
// A request: a source (at most 1 MiB, registry/validate.h), its headers and
// options. A result: CUBINs, PTX and the log.
inline constexpr uint32_t kMaxRequestBytes = 64u << 20;
inline constexpr uint32_t kMaxResultBytes = 256u << 20;
// The pool writes kToWorker and reads kFromWorker (a frame that has begun
// must end within 10 s; all workers' frames in flight share a budget).
extern const frame_io::ChannelLimits kToWorker;
extern const frame_io::ChannelLimits kFromWorker;
// Hello: the protocol version, and whether the worker keeps PCHs.
std::string EncodeHello(bool pch);
// False for a malformed hello or another protocol version.
bool DecodeHello(std::string_view body, bool* pch);
}  // namespace nvrtc_wire

struct NvrtcPoolOptions {
  std::string worker_path;
  std::vector<std::string> args;  // the worker's command line after argv[0]
  int workers = 2;
  int timeout_ms = 30000;
  uint64_t memory_limit_bytes = 2ull << 30;  // for messages
  int recycle_after_compiles = 256;
  uint64_t recycle_memory_bytes = 1ull << 30;
  int64_t uid = -1, gid = -1;  // NvrtcOptions::sandbox_uid, sandbox_gid
};

// Thread-safe. Destroy only after every lease has been released.
class NvrtcPool {
 public:
  explicit NvrtcPool(NvrtcPoolOptions options);
  ~NvrtcPool();
  NvrtcPool(const NvrtcPool&) = delete;
  NvrtcPool& operator=(const NvrtcPool&) = delete;

  struct Worker;

  // A worker held for compiles of one namespace, given back (or retired,
  // see above) when the lease ends; then an unassigned worker is started
  // ahead if a slot is free. Empty when default-constructed or moved from.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();
    explicit operator bool() const { return pool_ != nullptr; }
    // One request on this worker: NvrtcCompiler::Compile's errors. After
    // a deadline or the worker's death the lease holds no worker, and a
    // later Compile is UNAVAILABLE.
    absl::StatusOr<GpuCompileOutput> Compile(const GpuCompileRequest& request);

   private:
    friend class NvrtcPool;
    Lease(NvrtcPool* pool, std::unique_ptr<Worker> w);
    void Release();
    NvrtcPool* pool_ = nullptr;
    std::unique_ptr<Worker> w_;
    absl::Status last_;  // the last compile's status
  };

  // Starts the unassigned worker ahead of need (without waiting for it).
  void StartSpare();
  // A worker for `tenant`: an idle one of it, a fresh one, or a new one
  // (waiting for a slot; ending another namespace's idle worker when every
  // slot holds one). UNAVAILABLE when no worker starts.
  absl::StatusOr<Lease> Acquire(const std::string& tenant);
  // A second worker for `tenant` now, or an empty lease: an idle one of it,
  // or a fresh one that has said hello; it neither waits nor starts one.
  Lease TryAcquire(const std::string& tenant);
  NvrtcStats GetStats() const;
  // Counts a compile that ran on two workers at once.
  void CountSplit();

 private:
  // An idle worker of `tenant`, else a fresh one; null when neither.
  std::unique_ptr<Worker> TakeIdleLocked(const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Spawns one (its hello is read at its first use).
  absl::StatusOr<std::unique_ptr<Worker>> Start();
  // Reads the hello of a worker that has not said it yet; for one that
  // has, whether it is still alive (an idle worker that has something to
  // say, or hung up, is dead). Errors: UNAVAILABLE (it is then reaped).
  absl::Status CheckReady(Worker* w);
  // Gives up a slot (a worker that failed to start, or died).
  void FreeSlot();
  // One request on `*w`; `*w` is null afterwards when the worker died or
  // was killed (then reaped and counted).
  absl::StatusOr<GpuCompileOutput> Run(std::unique_ptr<Worker>* w, const std::string& payload);
  // The error for a worker that ended (or broke the protocol) mid-request.
  absl::Status Died(std::unique_ptr<Worker>* w, const absl::Status& why);
  // Returns a worker (or null: it died) after compiles whose last ended with
  // `status`: back to the idle pool, or retired.
  void Finish(std::unique_ptr<Worker> w, const absl::Status& status);
  // Kills and reaps a worker that holds no slot any more.
  static void End(std::unique_ptr<Worker> w);

  const NvrtcPoolOptions options_;
  mutable Mutex mu_;
  CondVar idle_cv_;  // a worker went idle or a slot freed
  std::deque<std::unique_ptr<Worker>> idle_ ABSL_GUARDED_BY(mu_);
  int live_ ABSL_GUARDED_BY(mu_) = 0;  // idle + busy + starting
  NvrtcStats stats_ ABSL_GUARDED_BY(mu_);
};

// The worker's side: answers requests on `fd` with `compiler` (whose
// options().pch_dir is its PCH tmpfs, or empty) until the daemon closes the
// socket. Each compile runs under RLIMIT_CPU of `cpu_seconds` more than the
// worker has used. Returns the process's exit code: 0 at the end of the
// stream, else a broken stream.
int ServeNvrtcWorker(const NvrtcCompiler& compiler, int fd, uint64_t cpu_seconds);

}  // namespace opjit::gpu

// Executor: runs an op's forward. The path of one call:
//
//   registry: the op version  ─▶ checks: input count (optional, dynamic),
//   dtypes against dtype_formats (the match gives the output dtypes), attrs
//   (types, required, defaults) ─▶ compiler: the kernel (a memory-cache hit
//   for registered ops) ─▶ kernel instance (Init once per op version, input
//   shapes/dtypes and attrs; cached) ─▶ output shapes (rule or InferShape)
//   ─▶ tensors: inputs resolved and bounds-checked in their regions, outputs
//   placed ─▶ the kernel runs, inline or on the pool.
//
// Where a kernel runs: calls whose inputs total at most
// Options::inline_max_bytes run on the calling thread (the gRPC handler); a
// hop to a pool thread costs ~30 µs here, more than a small kernel. Bigger
// calls run on the execution pool, whose bounded queue answers
// RESOURCE_EXHAUSTED when full, so a slow kernel never holds a gRPC thread.
//
// Where kernels run is the KernelRunner's business (server/runner): in
// sandboxed executor processes by default, or in this process. The executor
// hands it tensor locations, never raw pointers. Checks live in checks.h,
// tensor placement in placement.h; this file dispatches.
//
// Deadlines: a call whose deadline has passed before its kernel starts fails
// with DEADLINE_EXCEEDED and the kernel never runs. A kernel that runs past
// it is stopped by the process runner (its worker is killed); in-daemon it
// runs to completion and its result is dropped.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "server/runner/aot_kernel.h"
#include "server/registry/op_def.h"

namespace opjit::registry {
class Registry;
}
namespace opjit::compiler {
class KernelCompiler;
}
namespace opjit::tensor {
class RegionManager;
}

namespace opjit::exec {

using runner::DescString;
using runner::HostTensor;
using runner::TensorDesc;

// One input tensor of a call: exactly one of
//   InlineBytes  bytes owned by the caller (alive until `done` runs);
//   ShmRef       at `offset` in the caller's shared-memory region `region`;
//   NullTensor   no data at all.
//
// A null tensor is a slot that keeps its position without data: autograd
// passes forward tensors that were not saved for backward this way, so a
// bprop's params keep MindSpore's positions. It has its dtype, an empty
// shape and no bytes; the kernel gets params[i] == nullptr and ndims[i] == 0.
// It counts as present for the input count and the dtype match, but a shape
// rule cannot take its shape from it. Only the server makes null tensors
// (the RPC layer never does).
struct InlineBytes {
  std::string_view bytes;
};
struct ShmRef {
  std::string region;  // the region's name
  uint64_t offset = 0;
};
using runner::NullTensor;

struct TensorArg {
  TensorDesc desc;
  std::variant<InlineBytes, ShmRef, NullTensor> data;  // default: no inline bytes

  static TensorArg Inline(TensorDesc desc, std::string_view bytes) {
    return {std::move(desc), InlineBytes{bytes}};
  }
  static TensorArg Shm(TensorDesc desc, std::string region, uint64_t offset) {
    return {std::move(desc), ShmRef{std::move(region), offset}};
  }
  // `dtype`, rank 0.
  static TensorArg Null(std::string dtype) { return {{std::move(dtype), {}}, NullTensor{}}; }

  bool is_null() const { return std::holds_alternative<NullTensor>(data); }
  // The alternative it holds, or nullptr.
  const InlineBytes* inline_bytes() const { return std::get_if<InlineBytes>(&data); }
  const ShmRef* shm() const { return std::get_if<ShmRef>(&data); }
};

struct OutputPlacement {
  enum class Kind { kInline, kShm, kAllocIn };
  Kind kind = Kind::kInline;
  std::string region;   // kShm, kAllocIn
  uint64_t offset = 0;  // kShm: exactly here; kAllocIn: at or after here
};

// An attr value from a caller: text parsed by the declared value_type, or a
// typed value checked (and widened, int -> float) against it.
struct AttrArg {
  bool is_text = false;
  std::string text;
  registry::AttrValue value;
};

struct ForwardCall {
  std::string ns = "default";
  // The caller's principal: shm tensors may only name its own regions
  // ("": any region of `ns`, for trusted callers).
  std::string principal;
  // Whom the kernel's crashes in this call count against (fair quarantine:
  // runner::Caller); the rpc layer sets it. Default: the daemon's own.
  runner::Caller quarantine_caller;
  // The caller's principal name, admins' too (`principal` is "" for them):
  // a backward context it leaves is dropped when a config reload revokes
  // that principal's access to `ns`. "": nobody's (internal calls).
  std::string caller;
  std::string op;
  int64_t version = 0;  // 0: latest
  registry::Target target = registry::Target::kCpu;
  std::vector<std::vector<TensorArg>> inputs;  // one entry per declared input
  std::map<std::string, AttrArg> attrs;
  // One per output, one for all outputs, or none (all inline).
  std::vector<OutputPlacement> outputs;
  // Outputs placed in shared memory (regions the caller may name: see
  // `principal`) keep the bytes they hold rather than start zero-filled
  // (ForwardRequest.keep_output_bytes). Inline outputs and workspaces are
  // zeroed regardless.
  bool keep_output_bytes = false;
  // Flush the caches right before the kernel (runner::RunArgs::flush_caches:
  // the host's CPU caches, or the GPU's L2), so it runs cold. A benchmark's
  // hint (the Evaluator's flush_cache); it costs time and changes no result.
  bool flush_caches = false;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  uint64_t request_id = 0;  // for logs
  // For autograd: copy these declared inputs / outputs into the result after
  // the kernel ran (both empty: save nothing).
  std::vector<bool> save_inputs;
  std::vector<bool> save_outputs;
};

// Bytes owned by the struct that holds them.
struct OwnedBytes {
  std::string bytes;
};

// A tensor copied out of a call, owned by whoever keeps it (autograd
// contexts): its bytes, or a placeholder without data (NullTensor: a tensor
// not saved, or a null input; its dtype, rank 0: see TensorArg::Null).
struct SavedTensor {
  TensorDesc desc;
  std::variant<OwnedBytes, NullTensor> data;  // default: no bytes

  static SavedTensor Copy(TensorDesc desc, std::string bytes) {
    return {std::move(desc), OwnedBytes{std::move(bytes)}};
  }
  static SavedTensor Null(std::string dtype) { return {{std::move(dtype), {}}, NullTensor{}}; }

  bool is_null() const { return std::holds_alternative<NullTensor>(data); }
  // Its bytes, or nullptr for a placeholder.
  const OwnedBytes* bytes() const { return std::get_if<OwnedBytes>(&data); }
  OwnedBytes* mutable_bytes() { return std::get_if<OwnedBytes>(&data); }
};

// One output of a call: its bytes (an inline output, owned here) or where in
// the caller's shared memory the kernel wrote it.
struct OutputResult {
  TensorDesc desc;
  std::variant<OwnedBytes, ShmRef> data;  // default: no inline bytes

  // The alternative it holds, or nullptr.
  const OwnedBytes* inline_bytes() const { return std::get_if<OwnedBytes>(&data); }
  OwnedBytes* mutable_inline_bytes() { return std::get_if<OwnedBytes>(&data); }
  const ShmRef* shm() const { return std::get_if<ShmRef>(&data); }
};

struct ForwardResult {
  std::vector<OutputResult> outputs;
  int64_t version = 0;
  double kernel_ms = 0;
  double server_ms = 0;
  // The bytes flushed before the kernel (ForwardCall::flush_caches); 0 when
  // nothing was (not asked, or the executor could not).
  uint64_t flushed_bytes = 0;
  bool ran_inline = false;
  // When save_inputs or save_outputs is set: per declared input (one entry
  // per tensor; none for an absent optional input) and per output, a copy
  // where asked for, else a null placeholder (the tensor's dtype, rank 0, no
  // bytes), so positions are kept. A null input is saved as null.
  std::vector<std::vector<SavedTensor>> saved_inputs;
  std::vector<SavedTensor> saved_outputs;
  // The op version's record, for callers that need its definition.
  std::shared_ptr<const registry::OpRecord> record;
};

// A call shape checked once (Executor::PrepareAsync): what a handle runs.
struct PreparedCall {
  std::shared_ptr<const registry::OpRecord> record;  // the op version it runs
  registry::Target target = registry::Target::kCpu;
  std::vector<TensorDesc> inputs;     // flat, in call order
  std::vector<uint64_t> input_bytes;  // per flat input
  std::vector<TensorDesc> outputs;
  std::vector<uint64_t> output_bytes;
  // The kernel instance's spec with its outputs known, for an executor
  // process that serves a fast channel (server/exec/channels.h).
  runner::InstanceSpec instance;
};

struct ExecutorOptions {
  // Execution pool threads. Default: 2.
  int pool_threads = 2;
  // Calls queued for the pool beyond which RESOURCE_EXHAUSTED. Default: 64.
  size_t max_queue = 64;
  // Calls with at most this many input bytes run inline. Default: 256 KiB.
  uint64_t inline_max_bytes = 256 << 10;
  // Inline output bytes of one call beyond which it is refused before the
  // kernel runs (RESOURCE_EXHAUSTED): the gRPC message limit. Default: 64 MiB.
  uint64_t max_inline_output_bytes = 64ull << 20;
  // Kernel instances kept (each ran Init once). Default: 1024.
  size_t instance_cache_entries = 1024;
};

struct ExecutorStats {
  uint64_t calls = 0, failures = 0, inline_runs = 0, pool_runs = 0, rejected = 0;
  uint64_t instances = 0, instance_hits = 0;
  uint64_t queued = 0;  // calls waiting for the pool now
};

class Executor {
 public:
  using Callback = std::function<void(absl::StatusOr<ForwardResult>)>;

  // None of the pointers is owned; all must outlive the executor.
  static absl::StatusOr<std::unique_ptr<Executor>> Create(const ExecutorOptions& options,
                                                          registry::Registry* registry,
                                                          compiler::KernelCompiler* compiler,
                                                          tensor::RegionManager* regions,
                                                          runner::KernelRunner* runner);
  ~Executor();

  // Runs `call` and calls `done` once, on this thread (inline runs and early
  // errors) or on a pool thread. Errors: NOT_FOUND (op, version, region),
  // INVALID_ARGUMENT (counts, dtypes, attrs, tensor bounds, placement; the
  // kernel read an attr with the wrong type), ABORTED (the kernel returned
  // non-zero, or its worker died), INTERNAL (the kernel threw), UNAVAILABLE
  // (GPU), RESOURCE_EXHAUSTED (queue full, kernel out of memory),
  // DEADLINE_EXCEEDED, FAILED_PRECONDITION (the kernel is quarantined).
  void ForwardAsync(ForwardCall call, Callback done);

  // Blocking form, for tests, tools and benchmarks.
  absl::StatusOr<ForwardResult> Forward(ForwardCall call);

  // Checks `call` as ForwardAsync does (op version, counts, dtypes, attrs,
  // the kernel compiled, its instance created and the output shapes known)
  // without running it; its tensors need only dtype and shape. `done` runs
  // once, as for ForwardAsync; errors are ForwardAsync's before the kernel.
  using PrepareCallback = std::function<void(absl::StatusOr<PreparedCall>)>;
  void PrepareAsync(ForwardCall call, PrepareCallback done);

  ExecutorStats Stats() const;

  // Lifts the quarantine of every version of op `name` of namespace `ns`
  // (the runner forgets its kernels' crash streaks); how many kernels were
  // quarantined.
  int LiftQuarantine(const std::string& ns, const std::string& name);

 private:
  struct Impl;
  explicit Executor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit::exec

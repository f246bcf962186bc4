// The seam between the executor and wherever kernels run.
//
// The executor checks a call, places its tensors and then asks a
// KernelRunner for a KernelInstance (one per op version, input shapes and
// dtypes, and attrs: MindSpore's Init runs once per instance) and runs it on
// tensor locations, never on raw pointers. Two runners implement it:
//
//   InProcessRunner  kernels run inside this process ([exec] isolation =
//                    "in-daemon": fast and unsafe, for a trusted single user)
//   ProcessRunner    kernels run in sandboxed opjit-exec-worker processes,
//                    one pool per namespace ([exec] isolation = "process",
//                    the default); a crash, hang or memory bomb costs a
//                    worker, never the daemon
//
// Both load the same artifacts (compiler::CompiledKernel) through KernelHost.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/registry/attr_value.h"
#include "server/registry/op_def.h"

namespace opjit::compiler {
struct CompiledKernel;
}
namespace opjit::tensor {
class Region;
}

namespace opjit::runner {

// The dtype and shape of one tensor argument.
struct TensorDesc {
  std::string dtype;           // "float32", "int64", ...
  std::vector<int64_t> shape;  // empty: a scalar
  bool operator==(const TensorDesc&) const = default;
};

// "float32[2,3]".
std::string DescString(const TensorDesc& desc);

// A tensor in this process's memory; the caller owns `data`.
struct HostTensor {
  void* data = nullptr;
  TensorDesc desc;
  // A slot without data (a forward tensor not saved for a bprop): `data` is
  // null and `desc` is its dtype with rank 0. The kernel gets params[i] ==
  // nullptr and ndims[i] == 0.
  bool null = false;
  // An output that keeps the bytes its memory holds: not zero-filled before
  // the kernel (AotKernelInstance::Run). Set only for outputs in the
  // caller's own shared memory when its call asked for it
  // (ForwardRequest.keep_output_bytes); see InRegion::keep_bytes.
  bool keep_bytes = false;
};

// One call of a kernel loaded in this process (HostInstance::Run), beyond
// its tensors: what it asks and what the instance measured.
struct HostCall {
  // Flush the caches the kernel's data may sit in before it starts (a
  // benchmark's cold run; RunArgs::flush_caches). CPU: a sweep of the host's
  // caches (server/common/cache_flush.h). GPU: a fill of a device scratch
  // buffer of the L2's size on the kernel's stream. Costs time, changes no
  // result.
  bool flush_caches = false;
  // Out: the kernel's own time in ms: CUDA events around the launch on its
  // stream (GPU), the host clock around the entry after any flush (CPU); -1
  // when the instance could not tell (its caller then times the whole Run).
  double kernel_ms = -1;
  // Out: the bytes flushed before the kernel; 0 when none were.
  uint64_t flushed_bytes = 0;
};

// Where one tensor of a call lives, already checked by the executor: exactly
// one of these (TensorLoc::where).
//
// `nbytes` at `offset` inside `region`, which the caller keeps alive for the
// call. `keep_bytes` (outputs only): the kernel finds the region's bytes as
// they are, rather than zeroed. The executor sets it only for an output in a
// region the caller itself may name (its own, or any of the namespace for an
// admin) when the call asked to keep output bytes: bytes the caller could
// read anyway. Only region outputs can keep bytes: inline outputs (an arena,
// a daemon buffer) are zeroed always.
struct InRegion {
  std::shared_ptr<const tensor::Region> region;  // never null
  uint64_t offset = 0;
  bool keep_bytes = false;
};
// The caller's own buffer (inline tensors: read for inputs, written for
// outputs), `nbytes` long.
struct InMemory {
  char* data = nullptr;
};
// No data at all (inputs only: see HostTensor::null); nbytes is 0.
struct NullTensor {};

struct TensorLoc {
  TensorDesc desc;
  uint64_t nbytes = 0;
  std::variant<InMemory, InRegion, NullTensor> where;

  static TensorLoc Region(const TensorDesc& desc, uint64_t nbytes,
                          std::shared_ptr<const tensor::Region> region, uint64_t offset,
                          bool keep_bytes = false) {
    return {desc, nbytes, InRegion{std::move(region), offset, keep_bytes}};
  }
  static TensorLoc Memory(const TensorDesc& desc, uint64_t nbytes, char* data) {
    return {desc, nbytes, InMemory{data}};
  }
  static TensorLoc Null(const TensorDesc& desc) { return {desc, 0, NullTensor{}}; }

  bool is_null() const { return std::holds_alternative<NullTensor>(where); }
  // The alternative it holds, or nullptr.
  const InRegion* in_region() const { return std::get_if<InRegion>(&where); }
  const InMemory* in_memory() const { return std::get_if<InMemory>(&where); }
};

// What makes one kernel instance.
struct InstanceSpec {
  std::string ns;     // the namespace whose code this is: pools are per namespace
  std::string label;  // "ns/op v3", for messages and logs
  std::shared_ptr<const compiler::CompiledKernel> kernel;
  // GPU: the op's definition (launch spec, names) and which implementation.
  std::shared_ptr<const registry::OpDef> def;
  int impl_index = 0;
  std::string entry;
  std::vector<TensorDesc> inputs;         // flat (dynamic inputs expanded)
  std::vector<std::string> input_names;   // per flat input: its declared input's name
  // Known output descriptors, or empty when the op takes its output shape
  // from the kernel's InferShape (Init then runs at the first Run).
  std::vector<TensorDesc> outputs;
  std::map<std::string, registry::AttrValue> attrs;
};

// Who a call is for, as the quarantine counts crashes: a kernel whose calls
// crash on one caller's inputs or attrs is quarantined for that caller
// alone (ProcessRunnerOptions::quarantine_callers says when for everyone).
// The rpc layer fills it from the authenticated principal.
struct Caller {
  std::string principal;  // "" for the daemon's own calls
  // A reader-role principal: its crashes never quarantine the kernel for
  // anyone but itself.
  bool reader = false;
};

struct RunArgs {
  absl::Span<const TensorLoc> inputs;
  absl::Span<const TensorLoc> outputs;
  // The call's deadline; the runner stops a kernel that runs past it (or past
  // its own kernel time limit) where it can.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // When set, receives the time inside the kernel itself (without starting
  // an executor, loading the kernel or Init), in ms; left alone when the
  // runner cannot tell it apart from the rest of Run.
  double* kernel_ms = nullptr;
  // Flush caches right before the kernel (HostCall::flush_caches): a
  // benchmark's hint, which costs time. Honoured by both runners.
  bool flush_caches = false;
  // When set, receives HostCall::flushed_bytes: what was flushed before the
  // kernel (0 when nothing could be).
  uint64_t* flushed_bytes = nullptr;
  // Whose call it is (fair quarantine).
  Caller caller;
};

// One kernel instance. Thread-safe: Run may be called from many threads
// (an aot kernel with Init is serialised per instance, as MindSpore does).
class KernelInstance {
 public:
  virtual ~KernelInstance() = default;
  // The kernel's InferShape for the instance's inputs: -1 for an unknown
  // dim, {-2} for an unknown rank. FAILED_PRECONDITION when it has none.
  virtual absl::StatusOr<std::vector<int64_t>> InferShape() = 0;
  // InferShape for `caller`'s call: a crash in it counts towards the
  // kernel's quarantine for that caller (Caller).
  virtual absl::StatusOr<std::vector<int64_t>> InferShapeFor(const Caller& caller) {
    (void)caller;
    return InferShape();
  }
  // Runs the kernel. Errors: INVALID_ARGUMENT (mismatched tensors, a wrong
  // attr read, Init failed), ABORTED (non-zero return, or the kernel's
  // process died: the message names the signal), INTERNAL (the kernel
  // threw), RESOURCE_EXHAUSTED (out of memory), DEADLINE_EXCEEDED (stopped at
  // the deadline or the kernel time limit), FAILED_PRECONDITION (the kernel
  // is quarantined), UNAVAILABLE (no GPU, or no worker could be started).
  virtual absl::Status Run(const RunArgs& args) = 0;
};

// A fast channel's executor (fast_channel.h): a sandboxed process that
// serves one client's slot ring directly. It asks the daemon, through these
// resolvers, for what a call names the first time it sees it.
struct HandleBinding {
  InstanceSpec spec;  // outputs known
  std::vector<uint64_t> input_bytes, output_bytes;
  std::string op;  // the op as the handle names it, for metrics
};

struct ChannelSpec {
  std::string ns;
  std::string label;  // for logs
  // Whose channel it is: its calls' crashes count towards a kernel's
  // quarantine for this caller (Caller).
  Caller caller;
  // The ring, shared with the client (a region of the client's).
  std::shared_ptr<const tensor::Region> memory;
  // The executor's spin for its next call before it sleeps.
  int64_t spin_us = 50;
  // A handle the client calls: its binding, or the status the call gets
  // (STALE_HANDLE...).
  std::function<absl::StatusOr<HandleBinding>(uint64_t handle)> resolve_handle;
  // A region id the client names: the region if it is the client's.
  std::function<absl::StatusOr<std::shared_ptr<const tensor::Region>>(uint64_t id)> resolve_region;
  // Call credit: the executor serves a call only while it holds credit and,
  // with none, asks for a batch through this: how many calls it may serve
  // (>= 1), or the status the waiting call answers (QUOTA_EXCEEDED). Unused
  // credit lapses with the channel. Empty: no bound (large batches).
  std::function<absl::StatusOr<uint64_t>()> admit_calls;
  // Counts calls for metrics: `calls` calls of `op` (a handle's, or "" for
  // a handle the channel could not name) that answered `code`, and the
  // seconds their kernels ran. Called from the channel's own thread, at
  // least once a second while calls happen, and when the channel ends.
  // Empty: not counted.
  std::function<void(const std::string& op, absl::StatusCode code, uint64_t calls,
                     double kernel_seconds)>
      record_calls;
};

class Channel {
 public:
  // Closes it (as Close).
  virtual ~Channel() = default;
  virtual int pid() const = 0;
  // False once the executor died or was stopped: the channel takes no calls.
  virtual bool alive() const = 0;
  // The executor forgets its handle bindings (the registry changed) or its
  // region mappings (regions were released) and asks again.
  virtual void InvalidateHandles() = 0;
  virtual void InvalidateRegions() = 0;
  // Stops the executor; calls in flight fail, waiters are woken, and the
  // ring is marked closed.
  virtual void Close() = 0;
};

struct RunnerStats {
  uint64_t workers_live = 0;     // executor processes now
  uint64_t workers_started = 0;  // since start
  uint64_t worker_crashes = 0;   // died while running a call
  uint64_t worker_timeouts = 0;  // killed at a deadline or the kernel time limit
  // Stopped for keeping more than [exec] threads_per_executor threads: when
  // a call ended (pool), or while no call ran in it (idle pool workers and
  // fast channels' executors, counted every ~100 ms); neither is a crash.
  uint64_t thread_cap_stops_after_call = 0;
  uint64_t thread_cap_stops_idle = 0;
  uint64_t quarantined = 0;      // quarantines (a kernel refused to a caller, or to everyone)
};

class KernelRunner {
 public:
  virtual ~KernelRunner() = default;
  // A new instance for `spec`. Init runs here when the outputs are known
  // (in-daemon), or lazily in each worker (process). Errors: those of Run.
  virtual absl::StatusOr<std::shared_ptr<KernelInstance>> Instance(const InstanceSpec& spec) = 0;
  // A fast channel (see ChannelSpec). UNIMPLEMENTED where kernels do not
  // run in executor processes.
  virtual absl::StatusOr<std::shared_ptr<Channel>> OpenChannel(const ChannelSpec& spec) {
    (void)spec;
    return absl::UnimplementedError(
        "fast channels need kernels in executor processes ([exec] isolation = \"process\")");
  }
  // Housekeeping (stopping idle workers); called about once a second.
  virtual void Maintain() {}
  virtual RunnerStats Stats() const = 0;
  // Forgets the crash streaks of every version of op `op` ("ns/name"), in
  // every namespace that calls it, which lifts its quarantine; how many of
  // its kernels were quarantined. Re-registering the op and an admin's
  // ClearQuarantine call it.
  virtual int LiftQuarantine(const std::string& op) {
    (void)op;
    return 0;
  }
  // "in-daemon" or "process".
  virtual const char* mode() const = 0;
};

}  // namespace opjit::runner

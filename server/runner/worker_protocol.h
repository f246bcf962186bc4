// The daemon <-> opjit-exec-worker channel.
//
// Two parts, both set up by the daemon when it starts a worker:
//
//  * a control socket (fd 3 in the worker, a SOCK_STREAM socketpair) that
//    carries length-prefixed frames: kernel artifacts, instance specs,
//    region file descriptors (SCM_RIGHTS), and one-byte doorbells;
//  * an arena (fd 4, a sealed memfd the daemon owns): a call slot at its
//    start and, after it, room for the call's inline tensors.
//
// A call is a fixed-size record written into the slot: the instance id and,
// per tensor, (region serial, offset, bytes) with serial 0 meaning "in the
// arena". No tensor byte crosses the socket: shm regions are mapped by the
// worker from their descriptors, inline tensors are copied into the arena.
//
// Waking. Both ends spin on the slot's state word for a short while before
// they sleep; a sleeper sets its bit in the state word first, and the other
// end then sends one doorbell frame on the socket. A spin-then-sleep hop
// costs ~1-2 us when the other end is awake, a socket wake-up (~20 us) when
// it sleeps. Doorbells are hints: each end re-reads the state word.
//
// Trust. Everything the worker writes (the slot, the arena, its frames) may
// come from a hostile kernel in it. The daemon bounds and checks every field
// it reads, and the arena is sealed against shrinking, so the daemon can
// never fault on it.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/common/codec.h"
#include "server/common/frame_io.h"
#include "server/runner/kernel_runner.h"

namespace opjit::runner::wire {

// 5: SlotHeader::flags; 6: kFlushCaches and SlotHeader::flushed_bytes;
// 7: SlotHeader::fault.
inline constexpr uint32_t kProtocolVersion = 7;

// Frame types.
enum class Msg : uint8_t {
  kHello = 1,        // worker -> daemon, once: u32 version, u32 pid
  kDoorbell = 2,     // either way: the slot changed while you slept
  kLoadKernel = 3,   // daemon -> worker: an artifact (EncodeKernel)
  kNewInstance = 4,  // daemon -> worker: an instance (EncodeInstance)
  kInferShape = 5,   // daemon -> worker: u64 instance id
  kAddRegion = 6,    // daemon -> worker: u64 serial, u64 size, + the fd
  kDropRegion = 7,   // daemon -> worker: u64 serial
  kReply = 8,        // worker -> daemon: i32 code, str message, str payload
  // Fast channels (fast_channel.h). A channel's executor asks the daemon for
  // what a client's call names the first time it sees it, and waits for the
  // kGrant; the daemon answers with control frames (kLoadKernel,
  // kNewInstance, kAddRegion, kBindHandle), each replied to, then kGrant.
  kWantHandle = 9,   // worker -> daemon: u64 handle
  kWantRegion = 10,  // worker -> daemon: u64 region id
  kBindHandle = 11,  // daemon -> worker: u64 handle, u64 instance id, u32 n_in,
                     //   u32 n_out, u64 bytes per tensor; kNeedInstance if absent
  kGrant = 12,       // daemon -> worker: i32 code, str reason, str message (no reply)
  // Call credit ([quota] calls_per_second): a channel's executor serves a
  // call only while it holds credit; with none it asks, naming the handle
  // of the call that waits, and waits for the kCredit.
  kWantCredit = 13,  // worker -> daemon: u64 handle
  kCredit = 14,      // daemon -> worker: u64 calls granted; when 0, i32 code,
                     //   str reason, str message: what the waiting call answers
};

// Slot state word: a phase in the low bits, and who sleeps.
inline constexpr uint32_t kIdle = 0, kRequest = 1, kRunning = 2, kDone = 3;
inline constexpr uint32_t kPhaseMask = 0xf;
inline constexpr uint32_t kWorkerSleeping = 0x10;
inline constexpr uint32_t kDaemonSleeping = 0x20;

// Reply codes beyond absl's: what the worker lacks to run a call.
inline constexpr int32_t kNeedInstance = 101;  // `need` = the instance id
inline constexpr int32_t kNeedRegion = 102;    // `need` = the region serial
inline constexpr int32_t kNeedKernel = 103;    // (kNewInstance) the artifact is not loaded

inline constexpr size_t kMessageBytes = 1024;
inline constexpr size_t kFaultBytes = 512;

// TensorRec::serial of an input without data (HostTensor::null): offset and
// nbytes are 0 and the kernel gets a null pointer.
inline constexpr uint64_t kNullSerial = ~uint64_t{0};

struct TensorRec {
  uint64_t serial;  // 0: in the arena's data area; kNullSerial: no data
  uint64_t offset;  // from the region's first usable byte, or the data area's start
  uint64_t nbytes;
};

struct alignas(64) SlotHeader {
  std::atomic<uint32_t> state;
  uint32_t n_inputs;
  uint32_t n_outputs;
  uint32_t flags;  // kKeepRegionOutputs, kFlushCaches; written by the daemon with each call
  uint64_t instance_id;
  uint64_t seq;
  // Reply.
  int32_t code;
  uint32_t message_len;
  uint64_t need;
  double kernel_ms;
  uint64_t flushed_bytes;  // HostCall::flushed_bytes
  char message[kMessageBytes];
  // Fast channels: bumped by the daemon when handles may have gone stale
  // (the registry changed) or regions were released; the executor then
  // forgets its handle bindings or region mappings and asks again.
  std::atomic<uint64_t> handle_epoch;
  std::atomic<uint64_t> region_epoch;
  // Fast channels: the call the executor runs, for the daemon's watchdog.
  // The executor sets fast_slot and fast_deadline_ns (the client's deadline,
  // read once when the call starts), then fast_call to a new nonzero serial;
  // it stores 0 when the call ends. The daemon times a serial on its own
  // clock from when it first sees it: nothing in the client's ring (seq,
  // deadline, state) can keep a call alive past the kernel time limit.
  std::atomic<uint64_t> fast_call;
  std::atomic<int64_t> fast_deadline_ns;
  std::atomic<uint32_t> fast_slot;
  // Written by the executor's fault handler as it dies of a fault in a
  // kernel (guard_pages.h, DescribeFault): "kernel Foo: SIGSEGV, a write 4
  // bytes past the end of its workspace 0 (16 bytes, ...)". Text for the
  // dying call's message only: the daemon bounds it and decides nothing on
  // it (a kernel can write it too).
  std::atomic<uint32_t> fault_len;
  char fault[kFaultBytes];
};

// SlotHeader::flags. kKeepRegionOutputs: the call's outputs in regions
// (serial != 0) keep their bytes rather than start zeroed; the daemon sets
// it only when each of them is in memory the caller asked to keep
// (InRegion::keep_bytes). Outputs in the arena are zeroed regardless.
inline constexpr uint32_t kKeepRegionOutputs = 1;
// kFlushCaches: flush caches right before the kernel (RunArgs::flush_caches;
// the worker sweeps the CPU's, or fills a GPU scratch buffer of the L2's
// size) and report the bytes in flushed_bytes.
inline constexpr uint32_t kFlushCaches = 2;

// The slot: header then TensorRecs, kSlotBytes in all; the data area follows.
inline constexpr size_t kSlotBytes = 64 << 10;
inline constexpr size_t kMaxTensors = (kSlotBytes - sizeof(SlotHeader)) / sizeof(TensorRec);

inline TensorRec* Records(SlotHeader* slot) {
  return reinterpret_cast<TensorRec*>(reinterpret_cast<char*>(slot) + sizeof(SlotHeader));
}

// Fast channels: what the executor served, for the daemon's metrics. A
// channel's executor takes no calls through the slot, so the table lives in
// the slot's record area. One entry per (handle, status code), counters only
// growing; the executor writes an entry's key before it publishes `used`
// (release), and the daemon reads the table when it likes (the arena is
// sealed against shrinking). The daemon trusts none of it: it counts no
// more calls than it granted credit for, and no more kernel time than the
// channel has been open.
struct CallCount {
  std::atomic<uint64_t> handle;     // 0: calls of handles beyond the table's room
  std::atomic<uint64_t> code;       // an absl status code, 0..16
  std::atomic<uint64_t> calls;
  std::atomic<uint64_t> kernel_ns;  // summed time inside the kernel
};
inline constexpr size_t kCallCounts = 1024;
// Entries kept for handle 0, one per status code, once the table is full.
inline constexpr size_t kCallCountsSpare = 17;
struct CallCounts {
  std::atomic<uint64_t> used;  // entries written, at most kCallCounts
  CallCount entries[kCallCounts];
};
inline constexpr size_t kCallCountsOffset = 4096;
static_assert(sizeof(SlotHeader) <= kCallCountsOffset &&
              kCallCountsOffset + sizeof(CallCounts) <= kSlotBytes);

inline CallCounts* CallCountsOf(SlotHeader* slot) {
  return reinterpret_cast<CallCounts*>(reinterpret_cast<char*>(slot) + kCallCountsOffset);
}

// The payload codec (server/common/codec.h), with tensor descriptors. The
// reader treats every length and count as hostile; any shortfall makes ok()
// false.
class Writer : public codec::Writer {
 public:
  void Desc(const TensorDesc& d);
  void Descs(const std::vector<TensorDesc>& v);
};

class Reader : public codec::Reader {
 public:
  explicit Reader(std::string_view in) : codec::Reader(in, "executor channel") {}
  TensorDesc Desc();
  std::vector<TensorDesc> Descs();
};

// Artifacts and instance specs, as frames carry them.
std::string EncodeKernel(const compiler::CompiledKernel& kernel);
absl::StatusOr<std::shared_ptr<const compiler::CompiledKernel>> DecodeKernel(std::string_view in);
std::string EncodeInstance(uint64_t id, const InstanceSpec& spec);
// The kernel is looked up by the cache key the payload names: `kernels`
// maps keys to artifacts the worker holds. NOT_FOUND (-> kNeedKernel) when
// it holds none.
absl::StatusOr<InstanceSpec> DecodeInstance(
    std::string_view in, uint64_t* id,
    const std::map<std::string, std::shared_ptr<const compiler::CompiledKernel>>& kernels);

// Frames (server/common/frame_io.h): [u32 length of type+payload][u8 type]
// [payload], with at most one descriptor (SCM_RIGHTS). Each direction has
// its limits:
//  * executor -> daemon (replies, doorbells, wants, hello): small records,
//    at most kMaxFromExecutorBytes. A frame that has begun must end within
//    5 s: the executor writes each frame with one call, so a frame that
//    stalls was written by something else (a kernel). All executors'
//    frames in flight share one budget of 64 MiB in the daemon.
//  * daemon -> executor (kernel artifacts, instance specs): at most
//    kMaxToExecutorBytes.
inline constexpr uint32_t kMaxFromExecutorBytes = 64 << 10;
inline constexpr uint32_t kMaxToExecutorBytes = 512u << 20;
extern const frame_io::ChannelLimits kFromExecutor;
extern const frame_io::ChannelLimits kToExecutor;
// Sends one frame, attaching `fd` (>= 0) with SCM_RIGHTS, waiting for room
// until `deadline`. RESOURCE_EXHAUSTED for a frame over kMaxToExecutorBytes
// (nothing sent); DEADLINE_EXCEEDED; UNAVAILABLE when the peer is gone.
absl::Status SendFrame(int sock, Msg type, std::string_view payload, int fd = -1,
                       absl::Time deadline = absl::InfiniteFuture());
// Reads one frame under `limits` (the daemon reads kFromExecutor, the
// executor kToExecutor), waiting until `deadline` (absl::InfiniteFuture() to
// block). OUT_OF_RANGE when the peer closed the socket; DEADLINE_EXCEEDED at
// the deadline; DATA_LOSS when the peer broke the protocol (a frame over the
// limit, cut short or stalled; the message names the executor channel);
// RESOURCE_EXHAUSTED when the budget is spent. A descriptor that arrived
// with the frame is stored in *fd (else -1, and any descriptor is closed);
// the caller owns it.
absl::Status RecvFrame(int sock, Msg* type, std::string* payload, absl::Time deadline,
                       int* fd = nullptr, const frame_io::ChannelLimits& limits = kFromExecutor);

// A kernel's error message for the reply, carrying the status's reason (only
// KERNEL_FAILED crosses the boundary) as a "\x1fREASON\x1f" prefix.
std::string MessageWithReason(const absl::Status& status);
// The daemon's side: the status of a worker reply. Reasons other than
// KERNEL_FAILED are ignored (the worker may be hostile).
absl::Status StatusFromReply(int32_t code, const std::string& message);

}  // namespace opjit::runner::wire

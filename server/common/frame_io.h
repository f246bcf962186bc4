// Framed I/O between opjitd and its child processes: the one reader and
// writer behind the executor channel (server/runner/worker_protocol.h) and
// the compile-worker channel (server/compiler/cpu/ipc.h), plus a bounded
// read-to-EOF for the output of the GPU compiler sandboxes.
//
// A frame is [u32 little-endian length][u8 type][body] on a typed channel,
// where the length counts the type byte and the body, or [u32 length][body]
// on an untyped one. A frame on a socket may carry one descriptor
// (SCM_RIGHTS), sent with its first byte.
//
// Trust. The peer may be hostile (a kernel runs inside the executor and can
// write to its socket). Every read is bounded by its channel's limits:
//  * the length a frame claims is checked against the channel's maximum
//    before anything is allocated, and the buffer then grows only as bytes
//    actually arrive (geometrically, never to the claimed length up front);
//  * a frame that has begun must end within the channel's stall limit;
//  * a peer budget, when given, caps the bytes in flight of all reads that
//    share it;
//  * descriptors the channel does not accept, and any beyond the first, are
//    closed on arrival.
// Errors never quote host paths: they name the channel.
//
// Thread-safety: the functions are thread-safe; one fd must not be read (or
// written) by two threads at once. PeerBudget is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace opjit::frame_io {

// Bytes that several reads (the channels of one peer, or all peers of a
// kind) may hold in flight together. A read charges its buffer as it grows
// and gives the charge back when it returns.
class PeerBudget {
 public:
  explicit PeerBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}
  PeerBudget(const PeerBudget&) = delete;
  PeerBudget& operator=(const PeerBudget&) = delete;

  // Adds `n` bytes unless that would pass the limit; false then (nothing added).
  bool TryCharge(uint64_t n);
  void Release(uint64_t n) { used_.fetch_sub(n, std::memory_order_acq_rel); }
  uint64_t in_flight() const { return used_.load(std::memory_order_acquire); }
  // The most ever in flight at once (for tests and metrics).
  uint64_t peak() const { return peak_.load(std::memory_order_acquire); }
  uint64_t limit() const { return limit_; }

 private:
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> peak_{0};
};

// What one direction of one channel accepts.
struct ChannelLimits {
  // Names the channel in errors ("executor channel"); never a path.
  const char* name = "channel";
  // The largest length a frame may claim (type byte and body). A frame that
  // claims more is refused before any allocation. At most 2^32 - 1.
  uint32_t max_frame_bytes = 64 << 10;
  // Whether a type byte follows the length.
  bool typed = true;
  // A socket (recvmsg/sendmsg, descriptors) or a pipe (read/write).
  bool socket = true;
  // Whether a frame may bring a descriptor to the reader. Otherwise every
  // descriptor that arrives is closed.
  bool accept_fd = false;
  // Once a frame's first byte has arrived, the rest must arrive within this
  // (a peer that starts a frame and goes quiet broke the protocol).
  absl::Duration stall_limit = absl::InfiniteDuration();
  // Charged while a frame arrives; null for none. Not owned.
  PeerBudget* budget = nullptr;
};

struct Frame {
  uint8_t type = 0;  // 0 on an untyped channel
  std::string body;
  int fd = -1;  // a descriptor that came with the frame (accept_fd); the caller owns it
};

// Reads one frame from `fd` into `*out`, waiting at most until `deadline`
// (absl::InfiniteFuture() to block). Handles EINTR and EAGAIN (`fd` may be
// non-blocking).
// Errors:
//  * OUT_OF_RANGE: the peer closed the stream before a frame began;
//  * DEADLINE_EXCEEDED: the deadline passed (before a frame began, or in the
//    middle of one that was not stalled past the stall limit);
//  * DATA_LOSS: the peer broke the protocol: a frame over the channel's
//    maximum, a typed frame of length 0, a frame cut short by EOF, or one
//    stalled past the stall limit;
//  * RESOURCE_EXHAUSTED: the peer budget has no room for the frame;
//  * UNAVAILABLE: an I/O error.
// After any error but a DEADLINE_EXCEEDED before the frame began (then
// nothing was read), the stream is out of step: close the channel.
// On error `*out` holds no descriptor and no buffer.
absl::Status ReadFrame(int fd, const ChannelLimits& limits, absl::Time deadline, Frame* out);

// Writes one frame, attaching `pass_fd` (>= 0; sockets only) to its first
// byte, waiting at most until `deadline` for room. Never raises SIGPIPE on a
// socket.
// Errors: RESOURCE_EXHAUSTED for a frame over `limits.max_frame_bytes` (the
// reader's limit: nothing is sent); DEADLINE_EXCEEDED (the frame may be
// partly sent: close the channel); UNAVAILABLE when the peer is gone.
absl::Status WriteFrame(int fd, const ChannelLimits& limits, uint8_t type, std::string_view body,
                        absl::Time deadline, int pass_fd = -1);

// The bytes of one frame (header and body), for a writer that must not
// allocate when it sends (a worker out of memory pre-encodes its answer).
std::string EncodeFrame(const ChannelLimits& limits, uint8_t type, std::string_view body);

// Reads `fd` (a pipe or socket) until EOF or `deadline`, keeping the first
// `max_bytes` in `*out` (appended) and reading and counting the rest in
// `*dropped` (when not null) so the writer never blocks on a full pipe.
// OK at EOF; DEADLINE_EXCEEDED at the deadline; UNAVAILABLE on an I/O error.
absl::Status ReadStream(int fd, size_t max_bytes, absl::Time deadline, std::string* out,
                        uint64_t* dropped);

}  // namespace opjit::frame_io

// The fast channel: how a same-host client calls a prepared handle without
// gRPC, protobuf or a hop through the daemon.
//
// Setting up (over gRPC, where authentication happens):
//   1. Prepare  -> a handle, with every input and output's dtype, shape and
//                  byte size (the server did every check once);
//   2. OpenChannel -> a region of the client's (shm_key, byte_size) laid out
//                  as below, served by a dedicated, sandboxed executor process
//                  of the namespace.
// Regions are named by RegionInfo.id on this path.
//
// A call: the client picks a free slot, writes the handle, the deadline and
// one TensorRef (region id, offset) per input then per output, publishes
// state = kSubmitted, bumps the header's doorbell and wakes the executor if
// it sleeps. The executor checks the handle (its own table, filled by the
// daemon on first use of a handle; a handle that went stale answers
// FAILED_PRECONDITION / STALE_HANDLE), maps only regions the daemon confirms
// are this client's, bounds-checks every tensor against its region, runs the
// kernel, writes the reply and sets state = kDone, waking the client if it
// sleeps. The client reads the reply and sets the slot back to kFree.
//
// Waiting. Both sides spin on the shared word for a bounded time before they
// sleep on it with FUTEX_WAIT (not FUTEX_PRIVATE: the words are in a shared
// mapping); the other side then FUTEX_WAKEs it. The sleeper announces itself
// first (Header::worker_sleeping, Slot::client_waiting) and re-checks before
// sleeping, so a wake-up is never lost; waiters also use a timeout, so a lost
// wake-up costs latency, never a hang.
//
// Failure. When the executor dies or is killed at a deadline, the daemon
// writes the call's status into each slot in flight (the same status the
// gRPC path answers), sets kDone and Header::closed, and wakes every waiter.
// A crash in an executor that other kernels had run in first is the one
// exception: the daemon sets that slot back to kSubmitted (a call that did
// not run), and the client runs it again on a new channel, once, as the
// pool runs such a call again in a fresh executor. Header::closed is set
// after every slot in flight was answered or handed back, so a client that
// sees it waits no longer. A closed channel takes no more calls: open another. The channel ends with
// its region (lease lapse, ReleaseClient, UnregisterRegion).
//
// Trust. The client and the executor share this memory and each may be
// hostile to the other: the executor bounds every field it reads. The
// daemon times the running call on its own clock, from words the executor
// keeps in its private arena (worker_protocol.h, SlotHeader::fast_call): the
// client's deadline counts as it was when the call started, and rewriting
// seq, deadline or state later changes nothing. The daemon touches this
// memory only through tensor::GuardedCopy, so a client that shrinks it ends
// its own channel, never the daemon.
//
// Byte layout (little-endian, x86-64). This header is the layout's one home,
// a wire contract like the .proto files beside it: the server, the C++
// client and the benchmarks include it from here. The Python client mirrors
// the offsets with struct (client/python/opjit/_fast.py);
// tests/unit/wire/fast_layout_test.cc checks that mirror against this file.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace opjit::fast {

inline constexpr uint32_t kMagic = 0x314A504F;  // "OPJ1"
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kHeaderBytes = 4096;
inline constexpr uint32_t kSlotBytes = 4096;
inline constexpr uint32_t kSlots = 8;
inline constexpr uint32_t kMaxTensors = 64;
inline constexpr uint64_t kChannelBytes = kHeaderBytes + uint64_t{kSlots} * kSlotBytes;
inline constexpr uint32_t kReasonBytes = 40;
inline constexpr uint32_t kMessageBytes = 1024;

// Slot states.
inline constexpr uint32_t kFree = 0;       // the client may take it
inline constexpr uint32_t kSubmitted = 1;  // client -> executor
inline constexpr uint32_t kRunning = 2;    // the executor took it
inline constexpr uint32_t kDone = 3;       // the reply is written

struct Header {
  uint32_t magic;                        // 0
  uint32_t version;                      // 4
  uint32_t n_slots;                      // 8
  uint32_t slot_bytes;                   // 12
  uint32_t max_tensors;                  // 16
  uint32_t worker_pid;                   // 20
  std::atomic<uint32_t> doorbell;        // 24: bumped by the client per submission
  std::atomic<uint32_t> worker_sleeping; // 28: 1 while the executor sleeps on `doorbell`
  std::atomic<uint32_t> closed;          // 32: set by the daemon when the channel is gone
  uint32_t pad0;                         // 36
  int64_t spin_us;                       // 40: the executor's spin before it sleeps
};

// Slot::flags. kKeepOutputBytes: the call's outputs keep the bytes their
// memory holds instead of starting zeroed (ForwardRequest.keep_output_bytes):
// every tensor of a fast call is in the client's own regions, so these are
// bytes the client could read anyway. Workspaces are zeroed regardless.
inline constexpr uint32_t kKeepOutputBytes = 1;

// One tensor of a call. region 0: no data (an input's null slot: the kernel
// gets params[i] == nullptr); otherwise a RegionInfo.id of the client's.
struct TensorRef {
  uint64_t region;
  uint64_t offset;  // from the region's first byte, as ShmRef.offset
};

struct Slot {
  std::atomic<uint32_t> state;           // 0: kFree..kDone
  std::atomic<uint32_t> client_waiting;  // 4: 1 while the client sleeps on `state`
  uint32_t n_tensors;                    // 8: inputs then outputs, as the handle's
  uint32_t flags;                        // 12: kKeepOutputBytes; other bits 0
  uint64_t handle;                       // 16
  uint64_t seq;                          // 24: the client's; echoed untouched
  int64_t deadline_ns;                   // 32: CLOCK_MONOTONIC; 0: none
  // Reply.
  int32_t code;                          // 40: a gRPC status code
  uint32_t message_len;                  // 44
  double kernel_ms;                      // 48
  char reason[kReasonBytes];             // 56: NUL-padded ErrorInfo reason, or empty
  char message[kMessageBytes];           // 96
  char pad1[32];                         // 1120
  TensorRef tensors[kMaxTensors];        // 1152
};

static_assert(sizeof(Header) <= kHeaderBytes);
static_assert(offsetof(Header, doorbell) == 24 && offsetof(Header, closed) == 32 &&
              offsetof(Header, spin_us) == 40);
static_assert(offsetof(Slot, flags) == 12 && offsetof(Slot, handle) == 16 &&
              offsetof(Slot, deadline_ns) == 32 &&
              offsetof(Slot, code) == 40 && offsetof(Slot, kernel_ms) == 48 &&
              offsetof(Slot, reason) == 56 && offsetof(Slot, message) == 96 &&
              offsetof(Slot, tensors) == 1152);
static_assert(sizeof(Slot) <= kSlotBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

inline Header* HeaderOf(void* base) { return static_cast<Header*>(base); }
inline Slot* SlotAt(void* base, uint32_t i) {
  return reinterpret_cast<Slot*>(static_cast<char*>(base) + kHeaderBytes + uint64_t{i} * kSlotBytes);
}

// FUTEX_WAIT on a word of a shared mapping while it holds `expected`, for
// at most `timeout_ns` (< 0: no limit). Returns at a wake-up, a changed
// value, a signal or the timeout; callers re-check the word.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000), static_cast<long>(timeout_ns % 1000000000)};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
            timeout_ns < 0 ? nullptr : &ts, nullptr, 0);
}
inline void FutexWake(std::atomic<uint32_t>* word, int n = 1) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, n, nullptr, nullptr, 0);
}

// Whether process `pid` has exited, by kill(pid, 0) and /proc/<pid>/stat:
// gone (ESRCH, or no /proc entry) or a zombie (exited, not yet reaped by its
// parent). EPERM means another uid's process: alive. A reused pid reads as
// alive; ProcessWatch's pidfd does not have that gap.
inline bool PidGone(int pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

// Whether a process has exited, for a client waiting on a ring: its
// executor (OpenChannelResponse.worker_pid) or the daemon itself
// (daemon_pid). Through a pidfd where the kernel has them (a reused pid is
// never taken for it), else kill(pid, 0) and /proc/<pid>/stat. A zombie
// (exited, not yet reaped) counts as exited. Not part of the layout.
class ProcessWatch {
 public:
  ProcessWatch() = default;
  // Watches `pid` (<= 0: nothing; Exited() stays false). With `comm`, only
  // when /proc/<pid>/comm says so: a pid from another pid namespace names
  // some other process here, and is not watched.
  explicit ProcessWatch(int pid, const char* comm = nullptr) {
    if (pid <= 0) return;
    if (comm != nullptr && !CommIs(pid, comm)) return;
    pid_ = pid;
#ifdef SYS_pidfd_open
    fd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#endif
  }
  ~ProcessWatch() {
    if (fd_ >= 0) ::close(fd_);
  }
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  int pid() const { return pid_; }
  bool Exited() const {
    if (pid_ <= 0) return false;
    if (fd_ >= 0) {
      pollfd p{fd_, POLLIN, 0};
      return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLIN | POLLHUP)) != 0;
    }
    return PidGone(pid_);
  }

 private:
  static bool CommIs(int pid, const char* comm) {
    char path[64], buf[32] = {0};
    std::snprintf(path, sizeof path, "/proc/%d/comm", pid);
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const ssize_t n = ::read(fd, buf, sizeof buf - 1);
    ::close(fd);
    if (n <= 0) return false;
    buf[n] = '\0';
    if (buf[n - 1] == '\n') buf[n - 1] = '\0';
    return std::strcmp(buf, comm) == 0;
  }

  int pid_ = 0;
  int fd_ = -1;
};

// The daemon's process name (/proc/<pid>/comm), for ProcessWatch.
inline constexpr char kDaemonComm[] = "opjitd";

inline int64_t MonotonicNs() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

}  // namespace opjit::fast

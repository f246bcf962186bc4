#include "server/common/frame_io.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace opjit::frame_io {
namespace {

// The first growth step of a frame's buffer; later steps double what arrived.
constexpr size_t kMinChunk = 4096;
// Descriptors one recvmsg takes in; more are discarded by the kernel.
constexpr int kMaxFdsPerRead = 8;

bool PeerBudgetTryCharge(PeerBudget* b, uint64_t n) { return b == nullptr || b->TryCharge(n); }

// Milliseconds for poll() until `deadline` (-1: none), at least 0.
int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

enum class Ready { kYes, kTimeout };

// Waits until `fd` is ready for `events` (or hung up, or in error: the I/O
// call then says which) or `deadline` passes.
absl::Status WaitFd(int fd, short events, absl::Time deadline, Ready* ready) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, PollTimeoutMs(deadline));
    if (r > 0) {
      *ready = Ready::kYes;
      return absl::OkStatus();
    }
    if (r == 0) {
      if (absl::Now() >= deadline) {
        *ready = Ready::kTimeout;
        return absl::OkStatus();
      }
      continue;
    }
    if (errno == EINTR) continue;
    return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
  }
}

void CloseFd(int* fd) {
  if (*fd >= 0) ::close(*fd);
  *fd = -1;
}

// One read of up to `n` bytes, after waiting for data until `deadline`.
// *got = 0 at EOF; kTimeout in *ready when the deadline passed first.
absl::Status ReadSome(int fd, const ChannelLimits& limits, char* buf, size_t n,
                      absl::Time deadline, Frame* out, size_t* got, Ready* ready) {
  for (;;) {
    absl::Status s = WaitFd(fd, POLLIN, deadline, ready);
    if (!s.ok() || *ready == Ready::kTimeout) return s;
    ssize_t r;
    if (limits.socket) {
      iovec iov{buf, n};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      r = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (r >= 0 && msg.msg_controllen > 0) {
        for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
          if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
          const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
            if (limits.accept_fd && out->fd < 0) {
              out->fd = received;
            } else {
              ::close(received);  // not wanted, or not the frame's first
            }
          }
        }
      }
    } else {
      r = ::read(fd, buf, n);
    }
    if (r >= 0) {
      *got = static_cast<size_t>(r);
      *ready = Ready::kYes;
      return absl::OkStatus();
    }
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
    return absl::UnavailableError(
        absl::StrCat("reading the ", limits.name, ": ", std::strerror(errno)));
  }
}

// The state of one frame being read; gives its budget charge back when done.
class FrameRead {
 public:
  FrameRead(int fd, const ChannelLimits& limits, absl::Time deadline, Frame* out)
      : fd_(fd), limits_(limits), deadline_(deadline), out_(out) {}
  ~FrameRead() {
    if (limits_.budget != nullptr && charged_ > 0) limits_.budget->Release(charged_);
  }

  absl::Status Run();

 private:
  // Reads exactly `n` bytes into `buf`.
  absl::Status Fill(char* buf, size_t n);
  // The deadline for the next byte: the caller's, or the stall limit once
  // the frame has begun.
  absl::Time NextDeadline() const {
    if (received_ == 0 || limits_.stall_limit == absl::InfiniteDuration()) return deadline_;
    return std::min(deadline_, begun_ + limits_.stall_limit);
  }
  absl::Status ProtocolError(std::string_view what) const {
    return absl::DataLossError(absl::StrCat("bad frame on the ", limits_.name, ": ",
                                            absl::string_view(what.data(), what.size())));
  }
  // Grows the charge to `bytes` of buffer.
  bool Charge(size_t bytes) {
    if (bytes <= charged_) return true;
    if (!PeerBudgetTryCharge(limits_.budget, bytes - charged_)) return false;
    charged_ = bytes;
    return true;
  }

  const int fd_;
  const ChannelLimits& limits_;
  const absl::Time deadline_;
  Frame* const out_;
  size_t received_ = 0;  // bytes of this frame so far, header included
  size_t claimed_ = 0;   // the frame's whole size, once its header is read
  absl::Time begun_;
  size_t charged_ = 0;
};

absl::Status FrameRead::Fill(char* buf, size_t n) {
  size_t have = 0;
  while (have < n) {
    const absl::Time until = NextDeadline();
    size_t got = 0;
    Ready ready;
    absl::Status s = ReadSome(fd_, limits_, buf + have, n - have, until, out_, &got, &ready);
    if (!s.ok()) return s;
    if (ready == Ready::kTimeout) {
      if (received_ == 0) {
        return absl::DeadlineExceededError(
            absl::StrCat(limits_.name, ": no frame before the deadline"));
      }
      if (until < deadline_) {
        return ProtocolError(absl::StrCat("a frame stalled after ", received_, " of ",
                                          claimed_ > 0 ? absl::StrCat(claimed_) : "its header's",
                                          " bytes for ",
                                          absl::FormatDuration(limits_.stall_limit)));
      }
      return absl::DeadlineExceededError(
          absl::StrCat(limits_.name, ": the deadline passed in the middle of a frame"));
    }
    if (got == 0) {
      if (received_ == 0) {
        return absl::OutOfRangeError(absl::StrCat("the peer closed the ", limits_.name));
      }
      return ProtocolError(absl::StrCat("a frame was cut short after ", received_, " bytes"));
    }
    if (received_ == 0) begun_ = absl::Now();
    have += got;
    received_ += got;
  }
  return absl::OkStatus();
}

absl::Status FrameRead::Run() {
  const size_t header_bytes = limits_.typed ? 5 : 4;
  unsigned char header[5];
  if (absl::Status s = Fill(reinterpret_cast<char*>(header), header_bytes); !s.ok()) return s;
  uint32_t len = 0;
  for (int i = 0; i < 4; ++i) len |= uint32_t{header[i]} << (8 * i);
  // Checked before anything is allocated.
  if (len > limits_.max_frame_bytes) {
    return ProtocolError(absl::StrCat("a frame claims ", len, " bytes; it takes at most ",
                                      limits_.max_frame_bytes));
  }
  if (limits_.typed && len == 0) return ProtocolError("a frame has no type");
  claimed_ = 4 + size_t{len};
  if (limits_.typed) out_->type = header[4];
  const size_t body_len = limits_.typed ? len - 1 : len;
  std::string& body = out_->body;
  while (body.size() < body_len) {
    // Grow by what has arrived (doubling), never by what the frame claims.
    const size_t have = body.size();
    const size_t step = std::min(body_len - have, std::max(kMinChunk, have));
    if (!Charge(have + step)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the ", limits_.name, "'s peer has more than ", limits_.budget->limit(),
          " bytes in flight"));
    }
    body.resize(have + step);
    absl::Status s = Fill(body.data() + have, step);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

bool PeerBudget::TryCharge(uint64_t n) {
  uint64_t used = used_.load(std::memory_order_acquire);
  do {
    if (n > limit_ || used > limit_ - n) return false;
  } while (!used_.compare_exchange_weak(used, used + n, std::memory_order_acq_rel));
  uint64_t peak = peak_.load(std::memory_order_acquire);
  while (used + n > peak &&
         !peak_.compare_exchange_weak(peak, used + n, std::memory_order_acq_rel)) {
  }
  return true;
}

absl::Status ReadFrame(int fd, const ChannelLimits& limits, absl::Time deadline, Frame* out) {
  out->type = 0;
  std::string().swap(out->body);  // no capacity left from an earlier frame
  out->fd = -1;
  absl::Status s = FrameRead(fd, limits, deadline, out).Run();
  if (!s.ok()) {
    std::string().swap(out->body);
    CloseFd(&out->fd);
  }
  return s;
}

std::string EncodeFrame(const ChannelLimits& limits, uint8_t type, std::string_view body) {
  const uint32_t len = static_cast<uint32_t>(body.size() + (limits.typed ? 1 : 0));
  std::string f(limits.typed ? 5 : 4, '\0');
  for (int i = 0; i < 4; ++i) f[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  if (limits.typed) f[4] = static_cast<char>(type);
  f.append(body.data(), body.size());
  return f;
}

absl::Status WriteFrame(int fd, const ChannelLimits& limits, uint8_t type, std::string_view body,
                        absl::Time deadline, int pass_fd) {
  const uint64_t len = uint64_t{body.size()} + (limits.typed ? 1 : 0);
  if (len > limits.max_frame_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("a frame of ", len, " bytes is over the ",
                                                     limits.name, "'s limit of ",
                                                     limits.max_frame_bytes));
  }
  char header[5];
  for (int i = 0; i < 4; ++i) header[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  header[4] = static_cast<char>(type);
  iovec iov[2] = {{header, limits.typed ? size_t{5} : size_t{4}},
                  {const_cast<char*>(body.data()), body.size()}};
  iovec* next = iov;
  int count = body.empty() ? 1 : 2;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  bool fd_pending = pass_fd >= 0 && limits.socket;
  size_t left = iov[0].iov_len + body.size();
  while (left > 0) {
    ssize_t n;
    if (limits.socket) {
      msghdr msg{};
      msg.msg_iov = next;
      msg.msg_iovlen = static_cast<size_t>(count);
      if (fd_pending) {
        std::memset(control, 0, sizeof control);
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(c), &pass_fd, sizeof pass_fd);
      }
      n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    } else {
      n = ::writev(fd, next, count);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        Ready ready;
        absl::Status s = WaitFd(fd, POLLOUT, deadline, &ready);
        if (!s.ok()) return s;
        if (ready == Ready::kTimeout) {
          return absl::DeadlineExceededError(
              absl::StrCat("writing the ", limits.name, ": the peer did not read in time"));
        }
        continue;
      }
      return absl::UnavailableError(
          absl::StrCat("writing the ", limits.name, ": ", std::strerror(errno)));
    }
    // The descriptor went with the first byte sent.
    if (n > 0) fd_pending = false;
    size_t sent = static_cast<size_t>(n);
    left -= sent;
    while (count > 0 && sent >= next->iov_len) {
      sent -= next->iov_len;
      ++next;
      --count;
    }
    if (count > 0) {
      next->iov_base = static_cast<char*>(next->iov_base) + sent;
      next->iov_len -= sent;
    }
  }
  return absl::OkStatus();
}

absl::Status ReadStream(int fd, size_t max_bytes, absl::Time deadline, std::string* out,
                        uint64_t* dropped) {
  char buf[65536];
  ChannelLimits pipe;
  pipe.name = "output stream";
  pipe.socket = false;
  Frame unused;
  for (;;) {
    size_t got = 0;
    Ready ready;
    absl::Status s = ReadSome(fd, pipe, buf, sizeof buf, deadline, &unused, &got, &ready);
    if (!s.ok()) return s;
    if (ready == Ready::kTimeout) {
      return absl::DeadlineExceededError("the output did not end before the deadline");
    }
    if (got == 0) return absl::OkStatus();
    const size_t keep = out->size() < max_bytes ? std::min(got, max_bytes - out->size()) : 0;
    out->append(buf, keep);
    if (dropped != nullptr) *dropped += got - keep;
  }
}

}  // namespace opjit::frame_io

#include "server/compiler/cpu/ipc.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace opjit::compiler::ipc {
namespace {

class Writer {
 public:
  explicit Writer(MessageKind kind) { U8(static_cast<uint8_t>(kind)); }
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void F64(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    U64(bits);
  }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void Strs(const std::vector<std::string>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (const std::string& s : v) Str(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads fields in order; the first failure sticks and every later read fails.
class Reader {
 public:
  Reader(const std::string& in, MessageKind kind) : in_(in) {
    uint8_t k = 0;
    if (!U8(&k) || k != static_cast<uint8_t>(kind)) ok_ = false;
  }
  bool U8(uint8_t* v) {
    if (!Need(1)) return false;
    *v = static_cast<uint8_t>(in_[pos_++]);
    return true;
  }
  bool U32(uint32_t* v) {
    if (!Need(4)) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= uint32_t{static_cast<uint8_t>(in_[pos_++])} << (8 * i);
    return true;
  }
  bool U64(uint64_t* v) {
    if (!Need(8)) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= uint64_t{static_cast<uint8_t>(in_[pos_++])} << (8 * i);
    return true;
  }
  bool F64(double* v) {
    uint64_t bits;
    if (!U64(&bits)) return false;
    std::memcpy(v, &bits, sizeof bits);
    return true;
  }
  bool Str(std::string* s) {
    uint32_t n;
    if (!U32(&n) || !Need(n)) return false;
    s->assign(in_, pos_, n);
    pos_ += n;
    return true;
  }
  bool Strs(std::vector<std::string>* v) {
    uint32_t n;
    if (!U32(&n)) return false;
    // Each string needs at least its 4-byte length: bound n before reserving.
    if (n > (in_.size() - pos_) / 4) return Fail();
    v->clear();
    v->reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      v->emplace_back();
      if (!Str(&v->back())) return false;
    }
    return true;
  }
  absl::Status Finish(const char* what) const {
    if (ok_ && pos_ == in_.size()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("malformed ", what, " message"));
  }

 private:
  bool Need(size_t n) {
    if (!ok_ || in_.size() - pos_ < n) return Fail();
    return true;
  }
  bool Fail() {
    ok_ = false;
    return false;
  }
  const std::string& in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// Waits until `fd` is ready for `events` or `deadline` passes.
absl::Status WaitFd(int fd, short events, absl::Time deadline) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("deadline passed");
      timeout_ms =
          static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))));
      if (timeout_ms <= 0) timeout_ms = 1;
    }
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, timeout_ms);
    if (r > 0) return absl::OkStatus();  // readable, writable, HUP or ERR: the I/O call tells
    if (r == 0) continue;                // re-check the deadline
    if (errno == EINTR) continue;
    return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
  }
}

// Reads exactly n bytes. `*got` counts what arrived (to tell clean EOF apart).
absl::Status ReadAll(int fd, char* buf, size_t n, absl::Time deadline, size_t* got) {
  *got = 0;
  while (*got < n) {
    absl::Status s = WaitFd(fd, POLLIN, deadline);
    if (!s.ok()) return s;
    ssize_t r = ::read(fd, buf + *got, n - *got);
    if (r > 0) {
      *got += static_cast<size_t>(r);
    } else if (r == 0) {
      return absl::OutOfRangeError("end of stream");
    } else if (errno != EINTR && errno != EAGAIN) {
      return absl::UnavailableError(absl::StrCat("read: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string Encode(const Hello& m) {
  Writer w(MessageKind::kHello);
  w.U32(m.protocol_version);
  w.U32(static_cast<uint32_t>(m.pid));
  w.Str(m.clang_version);
  w.Str(m.triple);
  w.Str(m.cpu);
  w.Strs(m.features);
  w.Str(m.fixed_flags);
  return w.Take();
}

std::string Encode(const WorkerRequest& m) {
  Writer w(MessageKind::kRequest);
  w.U8(static_cast<uint8_t>(m.mode));
  w.U8(static_cast<uint8_t>(m.language));
  w.Str(m.source);
  w.Str(m.file_name);
  w.Strs(m.options);
  w.Strs(m.include_dirs);
  w.Str(m.pch_path);
  w.Str(m.prelude_path);
  w.Strs(m.pch_options);
  w.U32(m.preamble_bytes);
  return w.Take();
}

std::string Encode(const WorkerResponse& m) {
  Writer w(MessageKind::kResponse);
  w.U8(static_cast<uint8_t>(m.kind));
  w.Str(m.object);
  w.Str(m.diagnostics);
  w.Strs(m.dependencies);
  w.F64(m.compile_ms);
  w.Str(m.pch_note);
  w.U8(m.pch_used ? 1 : 0);
  return w.Take();
}

absl::StatusOr<Hello> DecodeHello(const std::string& payload) {
  Reader r(payload, MessageKind::kHello);
  Hello m;
  uint32_t pid = 0;
  r.U32(&m.protocol_version);
  r.U32(&pid);
  m.pid = static_cast<int32_t>(pid);
  r.Str(&m.clang_version);
  r.Str(&m.triple);
  r.Str(&m.cpu);
  r.Strs(&m.features);
  r.Str(&m.fixed_flags);
  if (absl::Status s = r.Finish("hello"); !s.ok()) return s;
  return m;
}

absl::StatusOr<WorkerRequest> DecodeRequest(const std::string& payload) {
  Reader r(payload, MessageKind::kRequest);
  WorkerRequest m;
  uint8_t mode = 0, language = 0;
  r.U8(&mode);
  r.U8(&language);
  r.Str(&m.source);
  r.Str(&m.file_name);
  r.Strs(&m.options);
  r.Strs(&m.include_dirs);
  r.Str(&m.pch_path);
  r.Str(&m.prelude_path);
  r.Strs(&m.pch_options);
  r.U32(&m.preamble_bytes);
  if (absl::Status s = r.Finish("request"); !s.ok()) return s;
  if (m.preamble_bytes > m.source.size()) {
    return absl::InvalidArgumentError("preamble_bytes past the end of the source");
  }
  if (mode != static_cast<uint8_t>(RequestMode::kCompile) &&
      mode != static_cast<uint8_t>(RequestMode::kBuildPch)) {
    return absl::InvalidArgumentError("unknown request mode");
  }
  if (language != static_cast<uint8_t>(Language::kC) &&
      language != static_cast<uint8_t>(Language::kCxx)) {
    return absl::InvalidArgumentError("unknown language");
  }
  m.mode = static_cast<RequestMode>(mode);
  m.language = static_cast<Language>(language);
  return m;
}

absl::StatusOr<WorkerResponse> DecodeResponse(const std::string& payload) {
  Reader r(payload, MessageKind::kResponse);
  WorkerResponse m;
  uint8_t kind = 0, pch_used = 0;
  r.U8(&kind);
  r.Str(&m.object);
  r.Str(&m.diagnostics);
  r.Strs(&m.dependencies);
  r.F64(&m.compile_ms);
  r.Str(&m.pch_note);
  r.U8(&pch_used);
  if (absl::Status s = r.Finish("response"); !s.ok()) return s;
  if (kind < static_cast<uint8_t>(ResponseKind::kOk) ||
      kind > static_cast<uint8_t>(ResponseKind::kBadRequest)) {
    return absl::InvalidArgumentError("unknown response kind");
  }
  m.kind = static_cast<ResponseKind>(kind);
  m.pch_used = pch_used != 0;
  return m;
}

uint8_t PeekKind(const std::string& payload) {
  return payload.empty() ? 0 : static_cast<uint8_t>(payload[0]);
}

absl::Status WriteFrame(int fd, const std::string& payload, absl::Time deadline) {
  if (payload.size() > kMaxFrameBytes) {
    return absl::InvalidArgumentError("message too large for one frame");
  }
  char header[4];
  uint32_t n = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) header[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  const char* parts[2] = {header, payload.data()};
  size_t sizes[2] = {sizeof header, payload.size()};
  for (int p = 0; p < 2; ++p) {
    size_t sent = 0;
    while (sent < sizes[p]) {
      absl::Status s = WaitFd(fd, POLLOUT, deadline);
      if (!s.ok()) return s;
      // send() with MSG_NOSIGNAL: a dead peer is an error, not a SIGPIPE.
      ssize_t w = ::send(fd, parts[p] + sent, sizes[p] - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w >= 0) {
        sent += static_cast<size_t>(w);
      } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
        return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReadFrame(int fd, std::string* payload, absl::Time deadline) {
  char header[4];
  size_t got = 0;
  absl::Status s = ReadAll(fd, header, sizeof header, deadline, &got);
  if (!s.ok()) {
    if (absl::IsOutOfRange(s) && got != 0) return absl::UnavailableError("frame cut short");
    return s;
  }
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= uint32_t{static_cast<uint8_t>(header[i])} << (8 * i);
  if (n > kMaxFrameBytes) return absl::UnavailableError("frame too large");
  payload->resize(n);
  s = ReadAll(fd, payload->data(), n, deadline, &got);
  if (absl::IsOutOfRange(s)) return absl::UnavailableError("frame cut short");
  return s;
}

}  // namespace opjit::compiler::ipc

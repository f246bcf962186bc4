#include "server/runner/worker_protocol.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/status_macros.h"
#include "server/compiler/kernel_compiler.h"
#include "server/registry/attr_value.h"
#include "server/registry/canonical.h"

namespace opjit::runner::wire {

void Writer::Desc(const TensorDesc& d) {
  Str(d.dtype);
  U64(d.shape.size());
  for (int64_t x : d.shape) I64(x);
}

void Writer::Descs(const std::vector<TensorDesc>& v) {
  U64(v.size());
  for (const auto& d : v) Desc(d);
}

uint64_t Reader::Count(size_t unit) {
  uint64_t n = U64();
  if (!ok_ || n > in_.size() / std::max<size_t>(unit, 1)) {
    ok_ = false;
    return 0;
  }
  return n;
}

std::string Reader::Str() {
  uint64_t n = Count(1);
  std::string s(in_.substr(0, n));
  in_.remove_prefix(n);
  return s;
}

std::vector<std::string> Reader::Strs() {
  std::vector<std::string> v(Count(8));
  for (auto& s : v) s = Str();
  return v;
}

TensorDesc Reader::Desc() {
  TensorDesc d;
  d.dtype = Str();
  d.shape.resize(Count(8));
  for (auto& x : d.shape) x = I64();
  return d;
}

std::vector<TensorDesc> Reader::Descs() {
  std::vector<TensorDesc> v(Count(16));
  for (auto& d : v) d = Desc();
  return v;
}

std::string EncodeKernel(const compiler::CompiledKernel& k) {
  Writer w;
  w.U8(static_cast<uint8_t>(k.target));
  w.Str(k.cache_key);
  w.Str(k.object);
  w.Strs(k.libraries);
  w.Strs(k.defined_symbols);
  w.U8(k.gpu != nullptr);
  if (k.gpu) {
    const auto& g = *k.gpu;
    w.U64(g.cubins.size());
    for (const auto& [arch, bin] : g.cubins) {
      w.Str(arch);
      w.Str(bin);
    }
    w.Str(g.ptx);
    w.Str(g.ptx_arch);
    w.U64(g.lowered_names.size());
    for (const auto& [expr, name] : g.lowered_names) {
      w.Str(expr);
      w.Str(name);
    }
    w.Str(g.shared_object);
    w.Strs(g.archs);
  }
  return std::move(w.out());
}

absl::StatusOr<std::shared_ptr<const compiler::CompiledKernel>> DecodeKernel(std::string_view in) {
  Reader r(in);
  auto k = std::make_shared<compiler::CompiledKernel>();
  k->target = r.U8() == static_cast<uint8_t>(registry::Target::kGpu) ? registry::Target::kGpu
                                                                      : registry::Target::kCpu;
  k->cache_key = r.Str();
  k->object = r.Str();
  k->libraries = r.Strs();
  k->defined_symbols = r.Strs();
  if (r.U8()) {
    auto g = std::make_shared<compiler::GpuBinary>();
    for (uint64_t i = 0, n = r.U64(); r.ok() && i < n; ++i) {
      std::string arch = r.Str();
      g->cubins[arch] = r.Str();
    }
    g->ptx = r.Str();
    g->ptx_arch = r.Str();
    for (uint64_t i = 0, n = r.U64(); r.ok() && i < n; ++i) {
      std::string expr = r.Str();
      g->lowered_names[expr] = r.Str();
    }
    g->shared_object = r.Str();
    g->archs = r.Strs();
    k->gpu = std::move(g);
  }
  if (!r.done()) return absl::DataLossError("malformed kernel frame");
  return std::shared_ptr<const compiler::CompiledKernel>(std::move(k));
}

std::string EncodeInstance(uint64_t id, const InstanceSpec& spec) {
  Writer w;
  w.U64(id);
  w.Str(spec.kernel->cache_key);
  w.Str(spec.ns);
  w.Str(spec.label);
  w.Str(spec.entry);
  w.Descs(spec.inputs);
  w.Strs(spec.input_names);
  w.Descs(spec.outputs);
  w.U64(spec.attrs.size());
  for (const auto& [name, value] : spec.attrs) {
    w.Str(name);
    w.U8(static_cast<uint8_t>(registry::ValueTypeOf(value)));
    w.Str(registry::FormatAttrValue(value));
  }
  // GPU launches need the op's launch spec and names.
  const bool gpu = spec.kernel->target == registry::Target::kGpu && spec.def != nullptr;
  w.U8(gpu);
  if (gpu) {
    w.Str(registry::ToJson(*spec.def));
    w.U32(static_cast<uint32_t>(spec.impl_index));
  }
  return std::move(w.out());
}

absl::StatusOr<InstanceSpec> DecodeInstance(
    std::string_view in, uint64_t* id,
    const std::map<std::string, std::shared_ptr<const compiler::CompiledKernel>>& kernels) {
  Reader r(in);
  InstanceSpec spec;
  *id = r.U64();
  std::string key = r.Str();
  spec.ns = r.Str();
  spec.label = r.Str();
  spec.entry = r.Str();
  spec.inputs = r.Descs();
  spec.input_names = r.Strs();
  spec.outputs = r.Descs();
  for (uint64_t i = 0, n = r.U64(); r.ok() && i < n; ++i) {
    std::string name = r.Str();
    auto type = static_cast<registry::ValueType>(r.U8());
    std::string text = r.Str();
    if (!r.ok()) break;
    OPJIT_ASSIGN_OR_RETURN(spec.attrs[name], registry::ParseAttrValue(type, text));
  }
  if (r.U8()) {
    std::string json = r.Str();
    spec.impl_index = static_cast<int>(r.U32());
    if (!r.ok()) return absl::DataLossError("malformed instance frame");
    OPJIT_ASSIGN_OR_RETURN(registry::OpDef def, registry::FromJson(json));
    spec.def = std::make_shared<const registry::OpDef>(std::move(def));
  }
  if (!r.done()) return absl::DataLossError("malformed instance frame");
  auto it = kernels.find(key);
  if (it == kernels.end()) return absl::NotFoundError("kernel not loaded");
  spec.kernel = it->second;
  return spec;
}

absl::Status SendFrame(int sock, Msg type, std::string_view payload, int fd) {
  if (payload.size() + 1 > kMaxFrameBytes) {
    return absl::ResourceExhaustedError("frame too large for the executor channel");
  }
  char head[5];
  const uint32_t len = static_cast<uint32_t>(payload.size() + 1);
  std::memcpy(head, &len, 4);
  head[4] = static_cast<char>(type);
  iovec iov[2] = {{head, sizeof head}, {const_cast<char*>(payload.data()), payload.size()}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = payload.empty() ? 1 : 2;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  size_t total = sizeof head + payload.size();
  size_t sent = 0;
  while (sent < total) {
    ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd p{sock, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return absl::UnavailableError(absl::StrCat("executor channel write: ", std::strerror(errno)));
    }
    sent += static_cast<size_t>(n);
    // Advance the iovecs past what was sent; the descriptor went with the
    // first byte.
    msg.msg_control = nullptr;
    msg.msg_controllen = 0;
    size_t skip = static_cast<size_t>(n);
    while (msg.msg_iovlen > 0 && skip >= msg.msg_iov[0].iov_len) {
      skip -= msg.msg_iov[0].iov_len;
      ++msg.msg_iov;
      --msg.msg_iovlen;
    }
    if (msg.msg_iovlen > 0) {
      msg.msg_iov[0].iov_base = static_cast<char*>(msg.msg_iov[0].iov_base) + skip;
      msg.msg_iov[0].iov_len -= skip;
    }
  }
  return absl::OkStatus();
}

namespace {

// Reads exactly n bytes; a descriptor arriving on the way is kept in *fd.
absl::Status ReadFull(int sock, char* out, size_t n, absl::Time deadline, int* fd) {
  size_t got = 0;
  while (got < n) {
    if (deadline != absl::InfiniteFuture()) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0 && got == 0) return absl::DeadlineExceededError("executor channel read timed out");
      pollfd p{sock, POLLIN, 0};
      int pr = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30)));
      if (pr < 0 && errno == EINTR) continue;
      if (pr == 0) return absl::DeadlineExceededError("executor channel read timed out");
    }
    iovec iov{out + got, n - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t r = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(absl::StrCat("executor channel read: ", std::strerror(errno)));
    }
    if (r == 0) return absl::OutOfRangeError("executor channel closed");
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
        if (fd != nullptr && *fd < 0) {
          *fd = received;
        } else {
          ::close(received);  // one descriptor per frame; extras are dropped
        }
      }
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RecvFrame(int sock, Msg* type, std::string* payload, absl::Time deadline, int* fd) {
  if (fd != nullptr) *fd = -1;
  char head[5];
  absl::Status s = ReadFull(sock, head, sizeof head, deadline, fd);
  if (!s.ok()) {
    if (fd != nullptr && *fd >= 0) ::close(*fd), *fd = -1;
    return s;
  }
  uint32_t len;
  std::memcpy(&len, head, 4);
  if (len < 1 || len > kMaxFrameBytes) {
    if (fd != nullptr && *fd >= 0) ::close(*fd), *fd = -1;
    return absl::DataLossError("malformed frame on the executor channel");
  }
  *type = static_cast<Msg>(head[4]);
  payload->resize(len - 1);
  s = ReadFull(sock, payload->data(), len - 1, deadline, fd);
  if (!s.ok() && fd != nullptr && *fd >= 0) ::close(*fd), *fd = -1;
  return s;
}

std::string MessageWithReason(const absl::Status& status) {
  std::optional<ErrorReason> r = GetReason(status);
  if (!r || r->reason != reason::kKernelFailed) return std::string(status.message());
  auto rc = r->metadata.find("return_code");
  return absl::StrCat("\x1f", r->reason, "\x1f", rc == r->metadata.end() ? "" : rc->second,
                      "\x1f", status.message());
}

absl::Status StatusFromReply(int32_t code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > 16) return absl::InternalError("the executor process sent a bad reply");
  const auto c = static_cast<absl::StatusCode>(code);
  const std::string prefix = absl::StrCat("\x1f", reason::kKernelFailed, "\x1f");
  if (message.rfind(prefix, 0) == 0) {
    const size_t end = message.find('\x1f', prefix.size());
    if (end != std::string::npos && end - prefix.size() <= 12) {
      return WithReason(absl::Status(c, message.substr(end + 1)), reason::kKernelFailed,
                        {{"return_code", message.substr(prefix.size(), end - prefix.size())}});
    }
  }
  return absl::Status(c, message);
}

}  // namespace opjit::runner::wire

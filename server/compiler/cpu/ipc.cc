#include "server/compiler/cpu/ipc.h"

#include <unistd.h>

#include <utility>

#include "server/common/codec.h"

namespace opjit::compiler::ipc {
namespace {

constexpr char kChannel[] = "compile worker channel";

// All compile workers' frames in flight in the daemon, together: a few
// workers' largest responses.
frame_io::PeerBudget worker_budget(256u << 20);

frame_io::ChannelLimits FromWorker() {
  frame_io::ChannelLimits l;
  l.name = kChannel;
  l.max_frame_bytes = kMaxResponseBytes;
  l.typed = false;
  l.stall_limit = absl::Seconds(10);
  l.budget = &worker_budget;
  return l;
}

frame_io::ChannelLimits ToWorker() {
  frame_io::ChannelLimits l;
  l.name = kChannel;
  l.max_frame_bytes = kMaxRequestBytes;
  l.typed = false;
  l.accept_fd = true;  // the PCH of a request (PchUse)
  return l;
}

// A payload's writer: its kind byte, then its fields.
class Writer : public codec::Writer {
 public:
  explicit Writer(MessageKind kind) { U8(static_cast<uint8_t>(kind)); }
};

// A payload's reader; fails unless the payload is of `kind`.
class Reader : public codec::Reader {
 public:
  Reader(const std::string& in, MessageKind kind) : codec::Reader(in, kChannel) {
    if (U8() != static_cast<uint8_t>(kind)) Fail();
  }
};

}  // namespace

const frame_io::ChannelLimits kFromWorker = FromWorker();
const frame_io::ChannelLimits kToWorker = ToWorker();

std::string Encode(const Hello& m) {
  Writer w(MessageKind::kHello);
  w.U32(m.protocol_version);
  w.I32(m.pid);
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
  w.U8(static_cast<uint8_t>(m.pch));
  w.Str(m.preamble);
  w.Strs(m.pch_options);
  w.U32(m.preamble_bytes);
  w.U32(static_cast<uint32_t>(m.files.size()));
  for (const File& f : m.files) {
    w.Str(f.name);
    w.Str(f.content);
  }
  w.U8(m.pch_prefix ? 1 : 0);
  w.U8(m.prefix_main ? 1 : 0);
  w.Strs(m.prefix_units);
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
  w.U8(m.pch_built ? 1 : 0);
  w.U8(m.pch_stale ? 1 : 0);
  return w.Take();
}

absl::StatusOr<Hello> DecodeHello(const std::string& payload) {
  Reader r(payload, MessageKind::kHello);
  Hello m;
  m.protocol_version = r.U32();
  m.pid = r.I32();
  m.clang_version = r.Str();
  m.triple = r.Str();
  m.cpu = r.Str();
  m.features = r.Strs();
  m.fixed_flags = r.Str();
  if (absl::Status s = r.Finish("hello"); !s.ok()) return s;
  return m;
}

absl::StatusOr<WorkerRequest> DecodeRequest(const std::string& payload) {
  Reader r(payload, MessageKind::kRequest);
  WorkerRequest m;
  const uint8_t mode = r.U8();
  const uint8_t language = r.U8();
  m.source = r.Str();
  m.file_name = r.Str();
  m.options = r.Strs();
  m.include_dirs = r.Strs();
  const uint8_t pch = r.U8();
  m.preamble = r.Str();
  m.pch_options = r.Strs();
  m.preamble_bytes = r.U32();
  // Each file takes at least 8 bytes (two lengths).
  const uint32_t files = r.Count(8);
  for (uint32_t i = 0; i < files; ++i) {
    File f;
    f.name = r.Str();
    f.content = r.Str();
    m.files.push_back(std::move(f));
  }
  m.pch_prefix = r.U8() != 0;
  m.prefix_main = r.U8() != 0;
  m.prefix_units = r.Strs();
  if (absl::Status s = r.Finish("request"); !s.ok()) return s;
  if (m.preamble_bytes > m.source.size()) {
    return absl::InvalidArgumentError("preamble_bytes past the end of the source");
  }
  if (mode != static_cast<uint8_t>(RequestMode::kCompile)) {
    return absl::InvalidArgumentError("unknown request mode");
  }
  if (pch > static_cast<uint8_t>(PchUse::kBuild)) {
    return absl::InvalidArgumentError("unknown PCH use");
  }
  m.pch = static_cast<PchUse>(pch);
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
  const uint8_t kind = r.U8();
  m.object = r.Str();
  m.diagnostics = r.Str();
  m.dependencies = r.Strs();
  m.compile_ms = r.F64();
  m.pch_note = r.Str();
  const uint8_t pch_used = r.U8();
  m.pch_built = r.U8() != 0;
  m.pch_stale = r.U8() != 0;
  if (absl::Status s = r.Finish("response"); !s.ok()) return s;
  if (kind < static_cast<uint8_t>(ResponseKind::kOk) ||
      kind > static_cast<uint8_t>(ResponseKind::kBadRequest)) {
    return absl::InvalidArgumentError("unknown response kind");
  }
  m.kind = static_cast<ResponseKind>(kind);
  m.pch_used = pch_used != 0;
  return m;
}

absl::Status WriteFrame(int fd, const std::string& payload, absl::Time deadline,
                        const frame_io::ChannelLimits& limits, int pass_fd) {
  return frame_io::WriteFrame(fd, limits, 0, payload, deadline, pass_fd);
}

absl::Status ReadFrame(int fd, std::string* payload, absl::Time deadline,
                       const frame_io::ChannelLimits& limits, int* received_fd) {
  if (received_fd != nullptr) *received_fd = -1;
  frame_io::Frame f;
  absl::Status s = frame_io::ReadFrame(fd, limits, deadline, &f);
  if (s.ok()) *payload = std::move(f.body);
  if (f.fd >= 0) {
    if (received_fd != nullptr) {
      *received_fd = f.fd;
    } else {
      ::close(f.fd);
    }
  }
  return s;
}

std::string EncodeFrame(const std::string& payload) {
  return frame_io::EncodeFrame(kFromWorker, 0, payload);
}

}  // namespace opjit::compiler::ipc

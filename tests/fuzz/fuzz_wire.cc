// The wire layer against a hostile peer (issue 26): arbitrary bytes arrive
// on a socketpair and are read as frames under limits the input picks, and
// payloads are decoded by the codec and the compile-worker messages.
// Invariants:
//  * a frame's claimed length is refused past the channel's maximum before
//    anything is allocated, and a buffer never holds more than about twice
//    what actually arrived (the budget's peak says what was held at once);
//  * refusals are DATA_LOSS / RESOURCE_EXHAUSTED / OUT_OF_RANGE (never a
//    deadline: every byte is there), and the budget is given back;
//  * the codec never returns more elements or bytes than its input holds,
//    and a failure sticks.
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "server/common/codec.h"
#include "server/common/frame_io.h"
#include "server/compiler/cpu/ipc.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using opjit::frame_io::ChannelLimits;
using opjit::frame_io::Frame;
using opjit::frame_io::PeerBudget;

// The buffer's first step (frame_io.cc): a frame may hold this much before
// any of its body has arrived.
constexpr uint64_t kFirstStep = 4096;

void FuzzFrames(FuzzedDataProvider& in) {
  ChannelLimits l;
  l.name = "fuzz channel";
  // Small maxima (the refusal path) and huge ones (the growth path: a 1 GiB
  // claim must not allocate 1 GiB).
  l.max_frame_bytes = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint32_t>(0, 4096)
                                       : in.ConsumeIntegral<uint32_t>();
  l.typed = in.ConsumeBool();
  l.accept_fd = in.ConsumeBool();
  PeerBudget budget(in.ConsumeBool() ? in.ConsumeIntegralInRange<uint64_t>(0, 1 << 16)
                                     : uint64_t{1} << 40);
  l.budget = &budget;
  const std::string stream = in.ConsumeRandomLengthString(1 << 16);

  int sv[2];
  FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  // Room for the whole input, so the writer never waits on the reader.
  int room = static_cast<int>(stream.size() * 2 + 65536);
  ::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &room, sizeof room);
  ::setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &room, sizeof room);
  size_t sent = 0;
  while (sent < stream.size()) {
    const ssize_t n = ::send(sv[0], stream.data() + sent, stream.size() - sent, MSG_DONTWAIT);
    if (n <= 0) break;  // the buffer is full: read what fit
    sent += static_cast<size_t>(n);
  }
  ::close(sv[0]);  // EOF after the bytes

  uint64_t consumed = 0;
  for (int frames = 0; frames < 10000; ++frames) {
    Frame f;
    const absl::Status s = opjit::frame_io::ReadFrame(
        sv[1], l, absl::Now() + absl::Seconds(10), &f);
    FUZZ_CHECK(budget.in_flight() == 0);
    // What was ever held at once: within the channel's maximum, and about
    // twice what arrived (not what a header claimed).
    FUZZ_CHECK(budget.peak() <= l.max_frame_bytes);
    FUZZ_CHECK(budget.peak() <= 2 * uint64_t{sent} + kFirstStep);
    FUZZ_CHECK(f.fd == -1);  // no descriptor was sent
    if (!s.ok()) {
      FUZZ_CHECK(absl::IsDataLoss(s) || absl::IsResourceExhausted(s) || absl::IsOutOfRange(s));
      FUZZ_CHECK(f.body.empty());
      FUZZ_CHECK(s.message().find("fuzz channel") != std::string::npos);
      break;
    }
    const uint64_t frame_bytes = (l.typed ? 5 : 4) + uint64_t{f.body.size()};
    FUZZ_CHECK(f.body.size() + (l.typed ? 1 : 0) <= l.max_frame_bytes);
    FUZZ_CHECK(f.body.capacity() <= 2 * f.body.size() + kFirstStep);
    FUZZ_CHECK(l.typed || f.type == 0);
    consumed += frame_bytes;
    FUZZ_CHECK(consumed <= sent);
  }
  ::close(sv[1]);
}

void FuzzCodec(const std::string& bytes, const std::string& program) {
  opjit::codec::Reader r(bytes, "fuzz channel");
  bool failed = false;
  for (char op : program) {
    const size_t left = r.left();
    switch (static_cast<unsigned char>(op) % 9) {
      case 0: r.U8(); break;
      case 1: r.U32(); break;
      case 2: r.U64(); break;
      case 3: r.F64(); break;
      case 4: FUZZ_CHECK(r.Str().size() <= left); break;
      case 5: FUZZ_CHECK(r.StrView().size() <= left); break;
      case 6: {
        std::vector<std::string> v = r.Strs();
        FUZZ_CHECK(v.size() <= left / 4);
        break;
      }
      case 7: {
        const size_t unit = static_cast<unsigned char>(op) / 9 + 1;
        FUZZ_CHECK(uint64_t{r.Count(unit)} * unit <= left);
        break;
      }
      default: r.I64(); break;
    }
    FUZZ_CHECK(r.left() <= left);
    if (failed) FUZZ_CHECK(!r.ok());
    failed = !r.ok();
  }
  const absl::Status s = r.Finish("payload");
  FUZZ_CHECK(s.ok() == r.done());
  FUZZ_CHECK(s.ok() || absl::IsDataLoss(s));

  // The compile worker's messages (the daemon decodes the responses).
  namespace ipc = opjit::compiler::ipc;
  if (auto m = ipc::DecodeResponse(bytes); m.ok()) {
    FUZZ_CHECK(m->object.size() + m->diagnostics.size() <= bytes.size());
    FUZZ_CHECK(ipc::DecodeResponse(ipc::Encode(*m)).ok());
  }
  if (auto m = ipc::DecodeHello(bytes); m.ok()) FUZZ_CHECK(m->features.size() <= bytes.size() / 4);
  if (auto m = ipc::DecodeRequest(bytes); m.ok()) {
    FUZZ_CHECK(m->preamble_bytes <= m->source.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    FuzzFrames(in);
  } else {
    const std::string program = in.ConsumeRandomLengthString(64);
    FuzzCodec(in.ConsumeRemainingBytesAsString(), program);
  }
  return 0;
}

// The wire layer (server/common/frame_io.h, codec.h): limits checked before
// allocation, buffers that grow only as bytes arrive, descriptors, budgets,
// truncated and stalled frames, deadlines.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/common/codec.h"
#include "server/common/frame_io.h"

namespace opjit {
namespace {

using frame_io::ChannelLimits;
using frame_io::Frame;
using frame_io::PeerBudget;

struct Pair {
  int a = -1, b = -1;
  Pair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    a = sv[0];
    b = sv[1];
  }
  ~Pair() {
    if (a >= 0) ::close(a);
    if (b >= 0) ::close(b);
  }
  void CloseA() {
    ::close(a);
    a = -1;
  }
};

void WriteRaw(int fd, std::string_view bytes) {
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
}

std::string Header(uint32_t len, int type = -1) {
  std::string h(4, '\0');
  for (int i = 0; i < 4; ++i) h[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  if (type >= 0) h.push_back(static_cast<char>(type));
  return h;
}

ChannelLimits Limits(uint32_t max, PeerBudget* budget = nullptr) {
  ChannelLimits l;
  l.name = "test channel";
  l.max_frame_bytes = max;
  l.budget = budget;
  return l;
}

int OpenFds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) >= 0;
  return n;
}

absl::Time In(int ms) { return absl::Now() + absl::Milliseconds(ms); }

TEST(FrameIoTest, TypedAndUntypedFramesRoundTrip) {
  for (bool typed : {true, false}) {
    Pair p;
    ChannelLimits l = Limits(1 << 20);
    l.typed = typed;
    ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 7, "hello", In(1000)).ok());
    ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 9, "", In(1000)).ok());
    Frame f;
    ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
    EXPECT_EQ(f.body, "hello");
    EXPECT_EQ(f.type, typed ? 7 : 0);
    EXPECT_EQ(f.fd, -1);
    ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
    EXPECT_EQ(f.body, "");
    EXPECT_EQ(f.type, typed ? 9 : 0);
    // EncodeFrame writes the same bytes.
    std::string e = frame_io::EncodeFrame(l, 7, "hello");
    WriteRaw(p.a, e);
    ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
    EXPECT_EQ(f.body, "hello");
    p.CloseA();
    EXPECT_TRUE(absl::IsOutOfRange(frame_io::ReadFrame(p.b, l, In(1000), &f)));
  }
}

// The reproduction of issue 26: a 5-byte header claiming 1 GiB. Refused at
// once, before anything is allocated, and the message names the channel.
TEST(FrameIoTest, AClaimedLengthOverTheMaximumIsRefusedWithoutAllocating) {
  Pair p;
  PeerBudget budget(uint64_t{4} << 30);
  ChannelLimits l = Limits(64 << 10, &budget);
  WriteRaw(p.a, Header(1u << 30, 2));
  Frame f;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = frame_io::ReadFrame(p.b, l, In(10000), &f);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("test channel"), std::string::npos) << s;
  EXPECT_NE(s.message().find("1073741824"), std::string::npos) << s;
  EXPECT_EQ(budget.peak(), 0u);
  EXPECT_EQ(f.body.capacity(), std::string().capacity());
}

// A frame within the maximum grows its buffer with what arrives, not with
// what it claims: 1 GiB claimed, 10 bytes sent, at most one small step held.
TEST(FrameIoTest, TheBufferGrowsOnlyAsBytesArrive) {
  Pair p;
  PeerBudget budget(uint64_t{4} << 30);
  ChannelLimits l = Limits(1u << 30, &budget);
  WriteRaw(p.a, Header(1u << 30, 2) + std::string(10, 'x'));
  p.CloseA();
  Frame f;
  absl::Status s = frame_io::ReadFrame(p.b, l, In(10000), &f);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;  // cut short
  EXPECT_NE(s.message().find("cut short"), std::string::npos) << s;
  EXPECT_LE(budget.peak(), 4096u);
  EXPECT_EQ(budget.in_flight(), 0u);
}

TEST(FrameIoTest, LargeFramesArriveWhole) {
  Pair p;
  PeerBudget budget(64u << 20);
  ChannelLimits l = Limits(16u << 20, &budget);
  std::string big(8u << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131);
  std::thread writer([&] { EXPECT_TRUE(frame_io::WriteFrame(p.a, l, 3, big, In(30000)).ok()); });
  Frame f;
  absl::Status s = frame_io::ReadFrame(p.b, l, In(30000), &f);
  writer.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(f.type, 3);
  EXPECT_TRUE(f.body == big);
  // Doubling steps: never more than twice what arrived.
  EXPECT_LE(budget.peak(), 2 * big.size());
  EXPECT_EQ(budget.in_flight(), 0u);
}

TEST(FrameIoTest, FramesArrivingInPiecesOnANonBlockingSocket) {
  Pair p;
  ASSERT_EQ(::fcntl(p.b, F_SETFL, O_NONBLOCK), 0);
  ChannelLimits l = Limits(1 << 20);
  const std::string bytes = frame_io::EncodeFrame(l, 5, std::string(3000, 'z'));
  std::thread writer([&] {
    for (size_t off = 0; off < bytes.size(); off += 700) {
      WriteRaw(p.a, std::string_view(bytes).substr(off, 700));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  Frame f;
  absl::Status s = frame_io::ReadFrame(p.b, l, In(10000), &f);
  writer.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(f.body, std::string(3000, 'z'));
}

TEST(FrameIoTest, TruncatedFrames) {
  ChannelLimits l = Limits(1 << 20);
  for (std::string bytes : {std::string("\x01\x00", 2), Header(10, 1).substr(0, 4),
                            Header(10, 1) + "abc"}) {
    Pair p;
    WriteRaw(p.a, bytes);
    p.CloseA();
    Frame f;
    absl::Status s = frame_io::ReadFrame(p.b, l, In(5000), &f);
    EXPECT_TRUE(absl::IsDataLoss(s)) << bytes.size() << " " << s;
    EXPECT_TRUE(f.body.empty());
  }
  // A typed frame must have its type byte.
  Pair p;
  WriteRaw(p.a, Header(0, 1));
  Frame f;
  EXPECT_TRUE(absl::IsDataLoss(frame_io::ReadFrame(p.b, l, In(5000), &f)));
}

TEST(FrameIoTest, DeadlinesAndStalls) {
  Pair p;
  ChannelLimits l = Limits(1 << 20);
  Frame f;
  // Nothing comes: DEADLINE_EXCEEDED near the deadline, and the stream is
  // still usable.
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(absl::IsDeadlineExceeded(frame_io::ReadFrame(p.b, l, In(200), &f)));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(190));
  ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 1, "ok", In(1000)).ok());
  ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
  EXPECT_EQ(f.body, "ok");

  // A header, then silence: the stall limit ends it long before the deadline.
  l.stall_limit = absl::Milliseconds(300);
  WriteRaw(p.a, Header(100, 2));
  t0 = std::chrono::steady_clock::now();
  absl::Status s = frame_io::ReadFrame(p.b, l, In(60000), &f);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("stalled"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));

  // Without a stall limit the caller's deadline ends a frame left half-sent.
  Pair q;
  ChannelLimits m = Limits(1 << 20);
  WriteRaw(q.a, Header(100, 2) + "abc");
  EXPECT_TRUE(absl::IsDeadlineExceeded(frame_io::ReadFrame(q.b, m, In(200), &f)));
}

TEST(FrameIoTest, TheBudgetBoundsBytesInFlight) {
  Pair p;
  PeerBudget budget(1000);
  ChannelLimits l = Limits(1 << 20, &budget);
  ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 1, std::string(500, 'a'), In(1000)).ok());
  Frame f;
  ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
  EXPECT_EQ(budget.in_flight(), 0u);  // given back once the frame is read
  // Another read holds 800 bytes of the budget: 500 more do not fit.
  ASSERT_TRUE(budget.TryCharge(800));
  ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 1, std::string(500, 'a'), In(1000)).ok());
  absl::Status s = frame_io::ReadFrame(p.b, l, In(1000), &f);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  budget.Release(800);
  EXPECT_EQ(budget.in_flight(), 0u);
  EXPECT_FALSE(budget.TryCharge(1001));
  EXPECT_TRUE(budget.TryCharge(1000));
  EXPECT_FALSE(budget.TryCharge(1));
}

TEST(FrameIoTest, WritesOverTheLimitSendNothing) {
  Pair p;
  ChannelLimits l = Limits(100);
  absl::Status s = frame_io::WriteFrame(p.a, l, 1, std::string(100, 'a'), In(1000));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;  // 100 + the type byte
  pollfd pf{p.b, POLLIN, 0};
  EXPECT_EQ(::poll(&pf, 1, 0), 0);
  EXPECT_TRUE(frame_io::WriteFrame(p.a, l, 1, std::string(99, 'a'), In(1000)).ok());
}

TEST(FrameIoTest, AWriteToAPeerThatDoesNotReadStopsAtTheDeadline) {
  Pair p;
  ChannelLimits l = Limits(64u << 20);
  auto t0 = std::chrono::steady_clock::now();
  absl::Status s = frame_io::WriteFrame(p.a, l, 1, std::string(32u << 20, 'a'), In(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  p.CloseA();
  Pair q;
  q.CloseA();
  EXPECT_TRUE(absl::IsUnavailable(frame_io::WriteFrame(q.b, l, 1, "x", In(1000))));
}

int Memfd(const char* name) {
  int fd = ::memfd_create(name, MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  return fd;
}

ino_t Inode(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  return st.st_ino;
}

TEST(FrameIoTest, DescriptorsPassAndExtrasAreClosed) {
  Pair p;
  ChannelLimits l = Limits(1 << 20);
  l.accept_fd = true;
  const int mine = Memfd("wire-test");
  ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 6, "region", In(1000), mine).ok());
  Frame f;
  ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
  ASSERT_GE(f.fd, 0);
  EXPECT_EQ(Inode(f.fd), Inode(mine));
  EXPECT_TRUE(::fcntl(f.fd, F_GETFD) & FD_CLOEXEC);
  ::close(f.fd);

  // Three descriptors with one frame: the first is kept, the rest closed.
  const int before = OpenFds();
  int fds[3] = {Memfd("a"), Memfd("b"), Memfd("c")};
  const std::string bytes = frame_io::EncodeFrame(l, 6, "x");
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof fds);
  std::memcpy(CMSG_DATA(c), fds, sizeof fds);
  ASSERT_EQ(::sendmsg(p.a, &msg, 0), static_cast<ssize_t>(bytes.size()));
  for (int fd : fds) ::close(fd);
  ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
  ASSERT_GE(f.fd, 0);
  EXPECT_EQ(OpenFds(), before + 1);
  ::close(f.fd);

  // A channel that takes no descriptors closes them all.
  l.accept_fd = false;
  ASSERT_TRUE(frame_io::WriteFrame(p.a, l, 6, "x", In(1000), mine).ok());
  ASSERT_TRUE(frame_io::ReadFrame(p.b, l, In(1000), &f).ok());
  EXPECT_EQ(f.fd, -1);
  EXPECT_EQ(OpenFds(), before);
  ::close(mine);
}

TEST(FrameIoTest, PipesWork) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  ChannelLimits l = Limits(1 << 20);
  l.socket = false;
  ASSERT_TRUE(frame_io::WriteFrame(fds[1], l, 4, "through a pipe", In(1000)).ok());
  Frame f;
  ASSERT_TRUE(frame_io::ReadFrame(fds[0], l, In(1000), &f).ok());
  EXPECT_EQ(f.body, "through a pipe");
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(FrameIoTest, ReadStreamKeepsTheFirstBytesAndCountsTheRest) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  // More than a pipe holds: the reader must drain it for the writer to end.
  const std::string text(200000, 'q');
  std::thread writer([&] {
    for (size_t off = 0; off < text.size();) {
      ssize_t n = ::write(fds[1], text.data() + off, text.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(fds[1]);
  });
  std::string out;
  uint64_t dropped = 0;
  absl::Status s = frame_io::ReadStream(fds[0], 4096, In(10000), &out, &dropped);
  writer.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out.size(), 4096u);
  EXPECT_EQ(dropped, text.size() - 4096);
  ::close(fds[0]);

  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  out.clear();
  EXPECT_TRUE(absl::IsDeadlineExceeded(frame_io::ReadStream(fds[0], 10, In(200), &out, nullptr)));
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(CodecTest, RoundTrip) {
  codec::Writer w;
  w.U8(200);
  w.Bool(true);
  w.U32(0xdeadbeef);
  w.I32(-5);
  w.U64(~uint64_t{0} - 1);
  w.I64(-1234567890123);
  w.F64(0.25);
  w.Str("hello");
  w.Strs({"a", "", "ccc"});
  std::string bytes = w.Take();
  codec::Reader r(bytes, "test channel");
  EXPECT_EQ(r.U8(), 200);
  EXPECT_TRUE(r.Bool());
  EXPECT_EQ(r.U32(), 0xdeadbeefu);
  EXPECT_EQ(r.I32(), -5);
  EXPECT_EQ(r.U64(), ~uint64_t{0} - 1);
  EXPECT_EQ(r.I64(), -1234567890123);
  EXPECT_EQ(r.F64(), 0.25);
  EXPECT_EQ(r.Str(), "hello");
  EXPECT_EQ(r.Strs(), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_TRUE(r.done());
  EXPECT_TRUE(r.Finish("message").ok());
  // Little-endian on the wire, whatever the host.
  EXPECT_EQ(bytes.substr(2, 4), std::string("\xef\xbe\xad\xde", 4));
}

TEST(CodecTest, HostileLengthsAndCountsAreRefusedBeforeAllocating) {
  // A string claiming 4 GiB - 1 in a 6-byte payload.
  const std::string huge_str = std::string("\xff\xff\xff\xff", 4) + "ab";
  codec::Reader r(huge_str, "test channel");
  EXPECT_TRUE(r.Str().empty());
  EXPECT_FALSE(r.ok());
  absl::Status s = r.Finish("greeting");
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(s.message(), "malformed greeting on the test channel");
  // A list claiming 2^32 - 1 strings: refused by its count, nothing reserved.
  codec::Reader l(huge_str, "test channel");
  EXPECT_TRUE(l.Strs().empty());
  EXPECT_FALSE(l.ok());
  // A count is checked against the bytes left and the element's size.
  codec::Writer w;
  w.Count(3);
  w.U64(1);
  w.U64(2);
  std::string bytes = w.Take();
  codec::Reader c(bytes, "test channel");
  EXPECT_EQ(c.Count(8), 0u);  // 3 elements of 8 bytes do not fit in 16
  EXPECT_FALSE(c.ok());
  codec::Reader c2(bytes, "test channel");
  EXPECT_EQ(c2.Count(4), 3u);
  // Reads past the end fail and stick.
  codec::Reader e(std::string_view("\x01", 1));
  EXPECT_EQ(e.U32(), 0u);
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.U8(), 0);  // even though a byte is left
  EXPECT_TRUE(codec::RangeInside(10, 5, 15));
  EXPECT_FALSE(codec::RangeInside(10, 6, 15));
  EXPECT_FALSE(codec::RangeInside(~uint64_t{0}, 2, 15));
  EXPECT_FALSE(codec::RangeInside(2, ~uint64_t{0}, 15));
}

}  // namespace
}  // namespace opjit

// Guard pages (issue 40, item 5): a workspace's end abuts a PROT_NONE page
// with its 64-byte alignment kept, a write into the slack before that page
// is seen after the call, file mappings (the arena, regions) end at a guard
// page, and the fault handler's words name the area and the kernel.
#include "server/runner/guard_pages.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace opjit::runner::guard {
namespace {

std::string Words(uintptr_t addr, bool write = true) {
  char buf[256];
  const size_t n = Describe(addr, /*known=*/true, write, buf, sizeof buf);
  return std::string(buf, n);
}

TEST(GuardPagesTest, AWorkspaceEndsAtAGuardPageAndKeepsItsAlignment) {
  const size_t page = PageSize();
  for (size_t size : {size_t{0}, size_t{1}, size_t{16}, size_t{64}, size_t{100}, page - 1, page,
                      3 * page + 5}) {
    auto m = GuardedMapping::Anonymous(size, 64);
    ASSERT_TRUE(m.ok()) << m.status();
    const auto at = reinterpret_cast<uintptr_t>((*m)->data());
    EXPECT_EQ(at % 64, 0u) << size;
    EXPECT_EQ((*m)->usable(), size == 0 ? 64 : (size + 63) / 64 * 64) << size;
    EXPECT_EQ((at + (*m)->usable()) % page, 0u) << size;  // the guard follows at once
    std::memset((*m)->data(), 0x5a, size);               // its own bytes are writable
    EXPECT_TRUE((*m)->SlackIntact()) << size;
    (*m)->Zero();
    for (size_t i = 0; i < size; ++i) ASSERT_EQ((*m)->data()[i], 0) << size;
  }
}

TEST(GuardPagesTest, WritesPastEitherEndFault) {
  auto m = GuardedMapping::Anonymous(16, 64);
  ASSERT_TRUE(m.ok());
  char* data = (*m)->data();
  const size_t usable = (*m)->usable();
  EXPECT_DEATH(static_cast<volatile char*>(data)[usable] = 1, "");
  EXPECT_DEATH(static_cast<volatile char*>(data)[usable + PageSize() - 1] = 1, "");
  const size_t lead = reinterpret_cast<uintptr_t>(data) % PageSize();
  EXPECT_DEATH(static_cast<volatile char*>(data)[-static_cast<ptrdiff_t>(lead) - 1] = 1, "");
}

TEST(GuardPagesTest, AWriteIntoTheSlackIsSeen) {
  auto m = GuardedMapping::Anonymous(16, 64);
  ASSERT_TRUE(m.ok());
  (*m)->data()[16] = 1;  // past the 16 bytes, short of the guard
  EXPECT_FALSE((*m)->SlackIntact());
  (*m)->Zero();
  EXPECT_TRUE((*m)->SlackIntact());
  (*m)->data()[-1] = 1;  // just before the start
  EXPECT_FALSE((*m)->SlackIntact());
}

TEST(GuardPagesTest, FileMappingsEndAtAGuardPage) {
  const int fd = ::memfd_create("guard-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  const size_t page = PageSize();
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(4 * page)), 0);
  auto m = GuardedMapping::File(fd, page, 2 * page, PROT_READ | PROT_WRITE);
  ::close(fd);
  ASSERT_TRUE(m.ok()) << m.status();
  char* data = (*m)->data();
  data[0] = 1;
  data[2 * page - 1] = 1;
  EXPECT_TRUE((*m)->SlackIntact());
  EXPECT_DEATH(static_cast<volatile char*>(data)[2 * page] = 1, "");
  EXPECT_DEATH(static_cast<volatile char*>(data)[-1] = 1, "");
}

TEST(GuardPagesTest, TheHandlersWordsNameTheAreaAndTheKernel) {
  auto ws = GuardedMapping::Anonymous(16, 64);
  ASSERT_TRUE(ws.ok());
  (*ws)->Describe(Kind::kWorkspace, 1, 0, "AddWithAttr");
  const auto end = reinterpret_cast<uintptr_t>((*ws)->data()) + 16;
  EXPECT_EQ(Words(end + 48),
            "a write 48 bytes past the end of its workspace 1 (16 bytes, as its Init asked with "
            "SetWorkSpace)");
  EXPECT_EQ(Words(reinterpret_cast<uintptr_t>((*ws)->data()) - PageSize() + 8, false)
                .substr(0, 7),
            "a read ");
  EXPECT_EQ(Words(end + 8), "");  // the slack is no guard page

  SetRunning("AddWithAttr");
  char line[512];
  size_t n = DescribeFault(SIGSEGV, end + 48, nullptr, line, sizeof line);
  EXPECT_EQ(std::string(line, n),
            "kernel AddWithAttr: SIGSEGV, an access 48 bytes past the end of its workspace 1 (16 "
            "bytes, as its Init asked with SetWorkSpace)");
  n = DescribeFault(SIGSEGV, 0x10, nullptr, line, sizeof line);
  EXPECT_EQ(std::string(line, n), "kernel AddWithAttr: SIGSEGV at address 0x10");
  SetRunning(nullptr);
  EXPECT_EQ(DescribeFault(SIGSEGV, end + 48, nullptr, line, sizeof line), 0u);

  const int fd = ::memfd_create("guard-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(PageSize())), 0);
  auto region = GuardedMapping::File(fd, 0, 100, PROT_READ | PROT_WRITE);
  ::close(fd);
  ASSERT_TRUE(region.ok());
  (*region)->Describe(Kind::kRegion, 0, 7, nullptr);
  EXPECT_EQ(Words(reinterpret_cast<uintptr_t>((*region)->data()) + PageSize()),
            "a write 3996 bytes past the end of shm region 7 (100 bytes)");
  // Gone with its mapping.
  const auto gone = reinterpret_cast<uintptr_t>((*region)->data()) + PageSize();
  region->reset();
  EXPECT_EQ(Words(gone), "");
}

}  // namespace
}  // namespace opjit::runner::guard

// GuardedCopy against memory that shrinks under it, as a client's shm
// object does when the client ftruncates it. Run in the release build (the
// one that ships), where an optimiser once dropped the guard (issue 26).
#include "server/tensor/guarded_copy.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace opjit::tensor {
namespace {

// A two-page memfd mapping whose object is then cut to nothing: every
// access to the mapping faults with SIGBUS.
class Shrunk {
 public:
  Shrunk() {
    page_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    fd_ = ::memfd_create("opjit-guard-test", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(::ftruncate(fd_, static_cast<off_t>(2 * page_)), 0);
    void* p = ::mmap(nullptr, 2 * page_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    base_ = static_cast<char*>(p);
    std::memset(base_, 7, 2 * page_);
  }
  ~Shrunk() {
    ::munmap(base_, 2 * page_);
    ::close(fd_);
  }
  void Cut(size_t keep) { ASSERT_EQ(::ftruncate(fd_, static_cast<off_t>(keep)), 0); }
  char* base() const { return base_; }
  size_t page() const { return page_; }

 private:
  int fd_ = -1;
  size_t page_ = 0;
  char* base_ = nullptr;
};

TEST(GuardedCopyTest, CopiesWhenNothingShrinks) {
  Shrunk m;
  std::string out(m.page(), '\0');
  ASSERT_TRUE(GuardedCopy(out.data(), m.base(), out.size()).ok());
  EXPECT_EQ(out, std::string(m.page(), '\7'));
  const char word[4] = {1, 2, 3, 4};
  ASSERT_TRUE(GuardedCopy(m.base() + 8, word, 4).ok());
  EXPECT_EQ(std::memcmp(m.base() + 8, word, 4), 0);
}

TEST(GuardedCopyTest, ReadOfShrunkMemoryIsAnError) {
  Shrunk m;
  m.Cut(0);
  uint32_t word = 0;
  for (int i = 0; i < 1000; ++i) {  // many faults, one handler
    absl::Status s = GuardedCopy(&word, m.base() + 4 * (i % 64), 4);
    ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  }
  EXPECT_NE(std::string(GuardedCopy(&word, m.base(), 4).message()).find("shrank"),
            std::string::npos);
}

TEST(GuardedCopyTest, WriteIntoShrunkMemoryIsAnError) {
  Shrunk m;
  m.Cut(0);
  const uint32_t one = 1;
  EXPECT_EQ(GuardedCopy(m.base(), &one, 4).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(GuardedCopyTest, PartlyShrunkCopyFailsAndTheKeptPageStillWorks) {
  Shrunk m;
  m.Cut(m.page());  // the second page is gone
  std::string out(2 * m.page(), '\0');
  EXPECT_EQ(GuardedCopy(out.data(), m.base(), out.size()).code(),
            absl::StatusCode::kFailedPrecondition);
  std::string first(m.page(), '\0');
  ASSERT_TRUE(GuardedCopy(first.data(), m.base(), first.size()).ok());
  EXPECT_EQ(first, std::string(m.page(), '\7'));
}

TEST(GuardedCopyTest, ManyThreadsFaultAtOnce) {
  Shrunk m;
  m.Cut(0);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      uint64_t v = 0;
      for (int i = 0; i < 500; ++i) {
        if (!GuardedCopy(&v, m.base() + 8 * (i % 32), 8).ok()) errors.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 8 * 500);
}

// The guard covers guarded copies only: a fault anywhere else still kills
// the process, as a daemon bug must.
TEST(GuardedCopyDeathTest, UnguardedFaultStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Shrunk m;
        m.Cut(0);
        uint32_t word = 0;
        (void)GuardedCopy(&word, m.base(), 4);  // installs the handler, faults once
        volatile uint32_t* p = reinterpret_cast<volatile uint32_t*>(m.base());
        word = *p;
        std::fprintf(stderr, "read %u\n", word);
      },
      "");
}

}  // namespace
}  // namespace opjit::tensor

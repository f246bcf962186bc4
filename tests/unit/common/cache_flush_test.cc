// The CPU cache sweep: the size sysfs gives (a fake directory here), its
// bounds, a sweep that touches its whole buffer, and none under a tight
// memory limit.
#include "server/common/cache_flush.h"

#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace opjit {
namespace {

// A cache directory as sysfs lays it out: index<i>/size per entry.
std::string FakeCacheDir(const std::vector<std::string>& sizes) {
  char tmpl[] = "/tmp/opjit-cache-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return "";
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string dir = std::string(tmpl) + "/index" + std::to_string(i);
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/size") << sizes[i] << "\n";
  }
  return tmpl;
}

TEST(CacheFlushTest, LastLevelCacheIsTheLargestListed) {
  const std::string dir = FakeCacheDir({"32K", "32K", "1024K", "32M"});
  ASSERT_FALSE(dir.empty());
  EXPECT_EQ(LastLevelCacheBytes(dir), 32ull << 20);
  std::filesystem::remove_all(dir);
  const std::string bytes = FakeCacheDir({"65536"});
  EXPECT_EQ(LastLevelCacheBytes(bytes), 65536u);
  std::filesystem::remove_all(bytes);
  EXPECT_EQ(LastLevelCacheBytes("/nonexistent"), 0u);
}

TEST(CacheFlushTest, FlushBytesAreTwiceTheCacheWithinTheCap) {
  const uint64_t llc = LastLevelCacheBytes();
  const uint64_t want = std::min(2 * (llc ? llc : kDefaultLastLevelCacheBytes), kMaxCacheFlushBytes);
  EXPECT_EQ(CacheFlushBytes(), want);
  EXPECT_LE(CacheFlushBytes(), kMaxCacheFlushBytes);
}

// Resident memory in KiB, from /proc/self/statm.
uint64_t ResidentKiB() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * (static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) / 1024);
}

// The first sweep's buffer is new: its pages show up as resident memory
// (every one written); the next sweep reuses it.
bool SweepTouchesItsBuffer() {
  const uint64_t before = ResidentKiB() * 1024;
  const uint64_t swept = SweepCpuCaches();
  const uint64_t after = ResidentKiB() * 1024;
  return swept == CacheFlushBytes() && after - before >= swept * 9 / 10 &&
         SweepCpuCaches() == swept && ResidentKiB() * 1024 < after + swept / 2;
}

// The buffer would take more than a quarter of the limit: no sweep, and no
// second try.
bool NoSweepUnderLimit() {
  rlimit r{};
  r.rlim_cur = r.rlim_max = CacheFlushBytes() * 3;
  return ::setrlimit(RLIMIT_AS, &r) == 0 && SweepCpuCaches() == 0 && SweepCpuCaches() == 0;
}

// Each in a child of its own (a death test re-runs the binary), where the
// buffer does not exist yet.
TEST(CacheFlushDeathTest, SweepTouchesItsWholeBuffer) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(_exit(SweepTouchesItsBuffer() ? 0 : 1), ::testing::ExitedWithCode(0), "");
}

TEST(CacheFlushDeathTest, NoSweepUnderATightMemoryLimit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(_exit(NoSweepUnderLimit() ? 0 : 1), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace opjit

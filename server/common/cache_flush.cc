#include "server/common/cache_flush.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "server/common/mutex.h"

namespace opjit {
namespace {

// Whether `bytes` more stays within a quarter of the process's memory limits.
bool FitsLimits(uint64_t bytes) {
  for (int resource : {RLIMIT_DATA, RLIMIT_AS}) {
    rlimit r{};
    if (getrlimit(resource, &r) == 0 && r.rlim_cur != RLIM_INFINITY && bytes > r.rlim_cur / 4) {
      return false;
    }
  }
  return true;
}

struct SweepBuffer {
  Mutex mu;
  bool tried ABSL_GUARDED_BY(mu) = false;
  uint8_t* data ABSL_GUARDED_BY(mu) = nullptr;
  uint64_t size ABSL_GUARDED_BY(mu) = 0;
};

}  // namespace

uint64_t LastLevelCacheBytes(const std::string& dir) {
  uint64_t llc = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream f(dir + "/index" + std::to_string(index) + "/size");
    std::string s;
    if (!(f >> s) || s.empty()) continue;
    uint64_t v = std::strtoull(s.c_str(), nullptr, 10);
    if (s.back() == 'K') v <<= 10;
    if (s.back() == 'M') v <<= 20;
    llc = std::max(llc, v);
  }
  return llc;
}

uint64_t CacheFlushBytes() {
  static const uint64_t kBytes = [] {
    const uint64_t llc = LastLevelCacheBytes();
    return std::min(2 * (llc != 0 ? llc : kDefaultLastLevelCacheBytes), kMaxCacheFlushBytes);
  }();
  return kBytes;
}

uint64_t SweepCpuCaches() {
  static SweepBuffer* const buffer = new SweepBuffer;  // kept: sweeps may come until exit
  MutexLock lock(&buffer->mu);
  if (!buffer->tried) {
    buffer->tried = true;
    const uint64_t bytes = CacheFlushBytes();
    if (!FitsLimits(bytes)) return 0;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 0;
    buffer->data = static_cast<uint8_t*>(p);
    buffer->size = bytes;
  }
  // A read and a write of every line: a line the kernel left dirty is
  // written back and replaced, whatever the cache's policy.
  volatile uint8_t* line = buffer->data;
  for (uint64_t i = 0; i < buffer->size; i += 64) line[i] = static_cast<uint8_t>(line[i] + 1);
  return buffer->size;
}

}  // namespace opjit

// Flushing the host's CPU caches before a benchmark's run, so the kernel
// starts cold: a sweep writes one byte in every 64 (every cache line) of a
// buffer twice the size of the largest cache, which evicts what the kernel
// left there. The executor that runs the kernel sweeps (in its own process,
// right before the kernel: runner::HostCall::flush_caches); the evaluator
// reports how many bytes it swept.
#pragma once

#include <cstdint>
#include <string>

namespace opjit {

// The largest buffer a sweep uses.
inline constexpr uint64_t kMaxCacheFlushBytes = 64ull << 20;
// The cache size assumed when sysfs lists none.
inline constexpr uint64_t kDefaultLastLevelCacheBytes = 16ull << 20;

// The largest cache `dir` lists (its index*/size files, "32768K" or "32M"),
// 0 when it lists none.
uint64_t LastLevelCacheBytes(const std::string& dir = "/sys/devices/system/cpu/cpu0/cache");

// The bytes a sweep writes over here: twice LastLevelCacheBytes() (or
// kDefaultLastLevelCacheBytes when sysfs tells nothing), at most
// kMaxCacheFlushBytes. Read on the first call and remembered: a sandboxed
// executor asks before it locks itself in. Thread-safe.
uint64_t CacheFlushBytes();

// Sweeps the CPU caches over a buffer of CacheFlushBytes(), allocated on the
// first call that can have it and kept for the process's life. Returns the
// bytes swept, or 0 with nothing done when the buffer cannot be had: it would
// take more than a quarter of RLIMIT_DATA or RLIMIT_AS (an executor's memory
// limit), or the allocation failed (tried once). Thread-safe: concurrent
// sweeps take turns.
uint64_t SweepCpuCaches();

}  // namespace opjit

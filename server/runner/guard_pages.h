// Guard pages around the memory a kernel is handed: a kernel that writes
// past its workspace, the executor's inline-tensor arena or a mapped shm
// region faults in its own call, instead of corrupting the executor's heap
// for the calls after it (MindSpore's add_with_attr.cc writes N*N floats
// into an N-byte workspace and returns normally).
//
// GuardedMapping reserves [guard page][data pages][guard page], the guards
// PROT_NONE. Anonymous mappings (workspaces) place the data so that its end,
// rounded up to the alignment asked for, abuts the trailing guard: an
// overflow of a byte past the rounding faults, and the few bytes of slack
// before it are checked after the call (SlackIntact). File mappings (the
// arena, regions) start at the data pages' start and end at the page after
// the file range.
//
// The fault handler of an executor (exec_worker_main.cc) turns a fault
// address into words with Describe: which area's guard it hit and whose
// (the kernel's entry, the region's id). Describe is async-signal-safe: it
// reads a fixed table of atomics that Describe'd mappings fill in.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace opjit::runner::guard {

enum class Kind : uint32_t {
  kNone = 0,
  kWorkspace = 1,  // index = the workspace's number, owner = the kernel's entry
  kArena = 2,      // the executor's inline-tensor arena
  kRegion = 3,     // id = the region's serial (pool) or id (fast channel)
};

size_t PageSize();

class GuardedMapping {
 public:
  // `size` bytes of private anonymous memory (zero-filled), `align`-aligned
  // (a power of two <= the page size), whose end rounded up to `align`
  // abuts a guard page; another guard page sits before the first data page.
  // RESOURCE_EXHAUSTED when it cannot be mapped.
  static absl::StatusOr<std::unique_ptr<GuardedMapping>> Anonymous(size_t size, size_t align);
  // `length` bytes of `fd` from `offset` (a page multiple), MAP_SHARED with
  // `prot`, between two guard pages. The error carries strerror.
  static absl::StatusOr<std::unique_ptr<GuardedMapping>> File(int fd, uint64_t offset,
                                                              size_t length, int prot);
  ~GuardedMapping();
  GuardedMapping(const GuardedMapping&) = delete;
  GuardedMapping& operator=(const GuardedMapping&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // data() .. the trailing guard: size() rounded up to the alignment.
  size_t usable() const { return usable_; }

  // Zeroes the usable bytes (the data and the slack after it).
  void Zero() const;
  // Whether the slack after the data (usable() - size() bytes) and the 64
  // bytes before it (when the data does not start a page) still hold zeros:
  // a kernel that wrote a little past either end of an anonymous mapping,
  // short of a guard page. Always true for file mappings.
  bool SlackIntact() const;

  // Tells the fault handler what this area is (see Kind). `owner` must
  // outlive this mapping. A full table (more than kTableSize areas) leaves
  // it undescribed; its guards still fault.
  void Describe(Kind kind, uint32_t index, uint64_t id, const char* owner);

  static constexpr size_t kTableSize = 8192;

 private:
  GuardedMapping() = default;
  char* base_ = nullptr;  // the leading guard
  size_t length_ = 0;     // the whole reservation
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t usable_ = 0;
  bool anonymous_ = false;
  int entry_ = -1;  // in the fault table, or -1
};

// Async-signal-safe. When `addr` lies in a guard page of a described area,
// writes one line into `out` (at most `cap` - 1 bytes and a NUL), such as
// "a write 4 bytes past the end of workspace 0 (16 bytes) of kernel Foo",
// and returns its length; else 0. `write`: the fault was a write (else a
// read, or unknown when `known` is false).
size_t Describe(uintptr_t addr, bool known, bool write, char* out, size_t cap);

// The kernel entry this thread runs now (nullptr: none); `entry` must
// outlive the call. Set by AotKernelInstance::Run around the kernel.
void SetRunning(const char* entry);
const char* Running();

// Async-signal-safe: one line for a fatal signal `sig` at `addr` on this
// thread, such as "kernel Foo: SIGSEGV, a write 4 bytes past the end of its
// workspace 0 (16 bytes, ...)" or "kernel Foo: SIGSEGV at address 0x0";
// `ucontext` (the handler's third argument, or null) tells a write from a
// read on x86-64. Returns its length (0 when no kernel runs).
size_t DescribeFault(int sig, uintptr_t addr, const void* ucontext, char* out, size_t cap);

}  // namespace opjit::runner::guard

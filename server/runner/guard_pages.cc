#include "server/runner/guard_pages.h"

#include <errno.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"

namespace opjit::runner::guard {
namespace {

// What the fault handler knows of one described area. `before` is 0 while
// the entry is free; it is written last when an entry is filled and first
// when it is emptied, so the handler never reads a half-filled entry as
// live (a stale one at worst, which only words a message).
struct Entry {
  std::atomic<uintptr_t> before{0};  // the leading guard page
  std::atomic<uintptr_t> after{0};   // the trailing guard page
  std::atomic<uintptr_t> data{0};
  std::atomic<uint64_t> size{0};
  std::atomic<uint64_t> id{0};
  std::atomic<const char*> owner{nullptr};
  std::atomic<uint32_t> kind{0};
  std::atomic<uint32_t> index{0};
};

Entry g_table[GuardedMapping::kTableSize];
// Taken to claim and free entries (never by the handler, which reads only
// the atomics).
Mutex g_table_mu;
bool g_used[GuardedMapping::kTableSize] ABSL_GUARDED_BY(g_table_mu);
size_t g_next ABSL_GUARDED_BY(g_table_mu) = 0;

int Claim() {
  MutexLock lock(&g_table_mu);
  for (size_t k = 0; k < GuardedMapping::kTableSize; ++k) {
    const size_t i = (g_next + k) % GuardedMapping::kTableSize;
    if (!g_used[i]) {
      g_used[i] = true;
      g_next = i + 1;
      return static_cast<int>(i);
    }
  }
  return -1;
}

void Free(int i) {
  g_table[i].before.store(0, std::memory_order_release);
  MutexLock lock(&g_table_mu);
  g_used[i] = false;
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

bool AllZero(const char* p, size_t n) {
  uint64_t acc = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    acc |= w;
  }
  for (; i < n; ++i) acc |= static_cast<unsigned char>(p[i]);
  return acc == 0;
}

// Async-signal-safe text building.
class Line {
 public:
  Line(char* out, size_t cap) : out_(out), cap_(cap) {}
  Line& S(const char* s) {
    while (s != nullptr && *s != '\0' && n_ + 1 < cap_) out_[n_++] = *s++;
    return *this;
  }
  Line& X(uint64_t v) {
    char digits[20];
    int k = 0;
    do {
      digits[k++] = "0123456789abcdef"[v % 16];
      v /= 16;
    } while (v != 0);
    S("0x");
    while (k > 0 && n_ + 1 < cap_) out_[n_++] = digits[--k];
    return *this;
  }
  size_t n() const { return n_; }
  Line& U(uint64_t v) {
    char digits[24];
    int k = 0;
    do {
      digits[k++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0);
    while (k > 0 && n_ + 1 < cap_) out_[n_++] = digits[--k];
    return *this;
  }
  size_t Done() {
    if (cap_ > 0) out_[n_] = '\0';
    return n_;
  }

 private:
  char* out_;
  size_t cap_;
  size_t n_ = 0;
};

}  // namespace

size_t PageSize() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

absl::StatusOr<std::unique_ptr<GuardedMapping>> GuardedMapping::Anonymous(size_t size,
                                                                          size_t align) {
  const size_t page = PageSize();
  if (align == 0 || (align & (align - 1)) != 0 || align > page) align = 64;
  const size_t usable = RoundUp(size == 0 ? 1 : size, align);
  const size_t data_pages = RoundUp(usable, page);
  if (data_pages < usable) return absl::ResourceExhaustedError("workspace size overflows");
  const size_t length = data_pages + 2 * page;
  void* base = ::mmap(nullptr, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", size, " bytes: ", std::strerror(errno)));
  }
  char* b = static_cast<char*>(base);
  if (::mprotect(b + page, data_pages, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    ::munmap(base, length);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", size, " bytes: ", std::strerror(err)));
  }
  std::unique_ptr<GuardedMapping> m(new GuardedMapping);
  m->base_ = b;
  m->length_ = length;
  m->data_ = b + page + data_pages - usable;
  m->size_ = size;
  m->usable_ = usable;
  m->anonymous_ = true;
  return m;
}

absl::StatusOr<std::unique_ptr<GuardedMapping>> GuardedMapping::File(int fd, uint64_t offset,
                                                                     size_t length, int prot) {
  const size_t page = PageSize();
  const size_t data_pages = RoundUp(length == 0 ? 1 : length, page);
  const size_t total = data_pages + 2 * page;
  void* base = ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
  if (base == MAP_FAILED) return absl::ResourceExhaustedError(std::strerror(errno));
  char* b = static_cast<char*>(base);
  void* got = ::mmap(b + page, length, prot, MAP_SHARED | MAP_FIXED, fd,
                     static_cast<off_t>(offset));
  if (got == MAP_FAILED) {
    const int err = errno;
    ::munmap(base, total);
    return absl::ResourceExhaustedError(std::strerror(err));
  }
  std::unique_ptr<GuardedMapping> m(new GuardedMapping);
  m->base_ = b;
  m->length_ = total;
  m->data_ = b + page;
  m->size_ = length;
  m->usable_ = length;
  return m;
}

GuardedMapping::~GuardedMapping() {
  if (entry_ >= 0) Free(entry_);
  if (base_ != nullptr) ::munmap(base_, length_);
}

void GuardedMapping::Zero() const { std::memset(data_, 0, usable_); }

bool GuardedMapping::SlackIntact() const {
  if (!anonymous_) return true;
  if (!AllZero(data_ + size_, usable_ - size_)) return false;
  const size_t page = PageSize();
  const size_t before = std::min<size_t>(64, static_cast<size_t>(data_ - (base_ + page)));
  return AllZero(data_ - before, before);
}

void GuardedMapping::Describe(Kind kind, uint32_t index, uint64_t id, const char* owner) {
  if (entry_ < 0) entry_ = Claim();
  if (entry_ < 0) return;
  Entry& e = g_table[entry_];
  e.before.store(0, std::memory_order_release);
  e.after.store(reinterpret_cast<uintptr_t>(base_ + length_ - PageSize()),
                std::memory_order_relaxed);
  e.data.store(reinterpret_cast<uintptr_t>(data_), std::memory_order_relaxed);
  e.size.store(size_, std::memory_order_relaxed);
  e.id.store(id, std::memory_order_relaxed);
  e.owner.store(owner, std::memory_order_relaxed);
  e.kind.store(static_cast<uint32_t>(kind), std::memory_order_relaxed);
  e.index.store(index, std::memory_order_relaxed);
  e.before.store(reinterpret_cast<uintptr_t>(base_), std::memory_order_release);
}

size_t Describe(uintptr_t addr, bool known, bool write, char* out, size_t cap) {
  const uintptr_t page = PageSize();
  for (Entry& e : g_table) {
    const uintptr_t before = e.before.load(std::memory_order_acquire);
    if (before == 0) continue;
    const uintptr_t after = e.after.load(std::memory_order_relaxed);
    const bool low = addr >= before && addr < before + page;
    const bool high = addr >= after && addr < after + page;
    if (!low && !high) continue;
    const uintptr_t data = e.data.load(std::memory_order_relaxed);
    const uint64_t size = e.size.load(std::memory_order_relaxed);
    Line l(out, cap);
    l.S(!known ? "an access " : write ? "a write " : "a read ");
    if (high) {
      l.U(addr - (data + size)).S(" bytes past the end of ");
    } else {
      l.U(data - addr).S(" bytes before the start of ");
    }
    switch (static_cast<Kind>(e.kind.load(std::memory_order_relaxed))) {
      case Kind::kWorkspace:
        l.S("its workspace ").U(e.index.load(std::memory_order_relaxed)).S(" (").U(size).S(
            " bytes, as its Init asked with SetWorkSpace)");
        break;
      case Kind::kArena:
        l.S("the executor's inline-tensor arena (").U(size).S(" bytes)");
        break;
      case Kind::kRegion:
        l.S("shm region ").U(e.id.load(std::memory_order_relaxed)).S(" (").U(size).S(" bytes)");
        break;
      default:
        l.S("a guarded area");
    }
    return l.Done();
  }
  return 0;
}

namespace {
thread_local const char* t_running = nullptr;
}  // namespace

void SetRunning(const char* entry) {
  t_running = entry;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

const char* Running() { return t_running; }

size_t DescribeFault(int sig, uintptr_t addr, const void* ucontext, char* out, size_t cap) {
  const char* running = t_running;
  if (running == nullptr || cap == 0) return 0;
  const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "a fatal signal";
  bool known = false, write = false;
#if defined(__x86_64__)
  if (ucontext != nullptr && sig == SIGSEGV) {
    // The page fault's error code: bit 1 is set for a write.
    const auto* uc = static_cast<const ucontext_t*>(ucontext);
    known = true;
    write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
  }
#else
  (void)ucontext;
#endif
  Line l(out, cap);
  l.S("kernel ").S(running).S(": ").S(name);
  char what[256];
  if (Describe(addr, known, write, what, sizeof what) > 0) {
    l.S(", ").S(what);
  } else {
    l.S(known ? (write ? ", a write at address " : ", a read at address ") : " at address ")
        .X(addr);
  }
  return l.Done();
}

}  // namespace opjit::runner::guard

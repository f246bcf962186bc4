// opjit-exec-worker: runs the kernels of one namespace for opjitd, in a
// sandbox. Started by ProcessRunner with the control socket as fd 3 and the
// arena (a sealed memfd) as fd 4; speaks the protocol in worker_protocol.h.
//
// Order of startup: close every other descriptor, die with the daemon
// (PDEATHSIG), map the arena, set up the JIT (loads LLVM), then lock
// itself in (server/common/sandbox): RLIMIT_DATA, no core dumps, an
// unprivileged uid when started as root, no_new_privs, Landlock (read-only
// system libraries, nothing else of the file system), seccomp (no sockets,
// exec, new processes, ptrace, mount, bpf, keyctl, signals to others...).
// Only then does it say hello, and only then does user code arrive.
//
// Flags: --parent-pid P --arena-bytes N --memory-bytes N --uid U --gid G
//        --spin-us N --scratch-dir D --scratch-bytes N --isolate 0/1
//        --namespace NS [--allow-library L]...
//        [--read-only PATH]... [--channel-bytes N] [--instance TAG]
//        [--max-threads N] [--max-processes N]
//
// Threads. --max-processes is RLIMIT_NPROC, set before the uid drop: the
// kernel counts it per uid, so with a uid per namespace it caps all of the
// namespace's executors together (a kernel's pthread_create beyond it gets
// EAGAIN). --max-threads is checked after each pool call (one fstat of
// /proc/self/task, opened before the sandbox): a call that leaves more
// threads answers RESOURCE_EXHAUSTED, and the daemon stops the worker. A
// fast-channel call is not checked here (no syscall on the fast path): the
// daemon's channel thread counts the executor's threads every ~100 ms and
// stops it once it holds more with no call running.
//
// Parent death: PR_SET_PDEATHSIG(SIGKILL) at start and again after the
// sandbox (whose uid change clears it), each time followed by a check that
// the parent is still --parent-pid; both waiting loops also look at the
// parent while they wait. --instance tags the process for a restart's
// sweep of leftovers (server/common/subprocess.h).
//
// With --channel-bytes, the worker serves one client's fast channel
// (fast_channel.h), mapped from fd 5, instead of the daemon's call slot. It
// runs a call only on credit the daemon grants ([quota] calls_per_second,
// kWantCredit), and counts what it served in its arena (wire::CallCounts)
// for the daemon's metrics.

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/container/inlined_vector.h"
#include "server/common/cache_flush.h"
#include "server/common/worker_sanitizer.h"
#include "server/common/sandbox.h"
#include "server/common/subprocess.h"
#include "server/compiler/kernel_compiler.h"
#include "server/common/error_info.h"
#include "proto/opjit/wire/fast_channel.h"
#include "server/runner/guard_pages.h"
#include "server/runner/kernel_host.h"
#include "server/runner/worker_protocol.h"

namespace opjit::runner {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kSock = 3;
constexpr int kArena = 4;
constexpr int kChannel = 5;
constexpr size_t kMaxBindings = 4096;
// Bounds on what a worker keeps; the oldest go first.
constexpr size_t kMaxKernels = 128;
constexpr size_t kMaxInstances = 1024;
constexpr size_t kMaxRegions = 4096;

// A client's region, mapped between guard pages (guard_pages.h).
struct Mapping {
  std::unique_ptr<guard::GuardedMapping> map;
  char* data = nullptr;
  uint64_t size = 0;
};

// The arena's call slot, for the fault handler.
wire::SlotHeader* g_slot = nullptr;

// SIGSEGV and SIGBUS (SA_RESETHAND, on an alternate stack): words the fault
// of the running kernel (which guard page it hit, whose) into the slot's
// `fault` for the daemon's message, then returns: the faulting access runs
// again and ends the process with the signal, as before.
void OnFault(int sig, siginfo_t* info, void* ucontext) {
  if (g_slot == nullptr || info == nullptr || info->si_code <= 0) return;  // sent, not a fault
  char line[wire::kFaultBytes];
  const size_t n = guard::DescribeFault(sig, reinterpret_cast<uintptr_t>(info->si_addr),
                                        ucontext, line, sizeof line);
  if (n == 0) return;
  std::memcpy(g_slot->fault, line, n);
  g_slot->fault_len.store(static_cast<uint32_t>(n), std::memory_order_release);
}

void InstallFaultHandler(wire::SlotHeader* slot) {
  g_slot = slot;
  static constexpr size_t kAltStack = 64 << 10;
  void* stack = ::mmap(nullptr, kAltStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
  if (stack == MAP_FAILED) return;
  stack_t ss{};
  ss.ss_sp = stack;
  ss.ss_size = kAltStack;
  if (::sigaltstack(&ss, nullptr) != 0) return;
  struct sigaction sa {};
  sa.sa_sigaction = OnFault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGSEGV, &sa, nullptr);
  ::sigaction(SIGBUS, &sa, nullptr);
}

struct InstanceEntry {
  std::unique_ptr<HostInstance> inst;
  InstanceSpec spec;
  bool outputs_known = false;
};

// A small LRU map: most recent at the front.
template <typename V>
class Lru {
 public:
  explicit Lru(size_t cap) : cap_(cap) {}
  V* Get(uint64_t key) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }
  V& Put(uint64_t key, V value) {
    Erase(key);
    order_.emplace_front(key, std::move(value));
    index_[key] = order_.begin();
    while (order_.size() > cap_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return order_.front().second;
  }
  void Erase(uint64_t key) {
    auto it = index_.find(key);
    if (it == index_.end()) return;
    order_.erase(it->second);
    index_.erase(it);
  }

 private:
  size_t cap_;
  std::list<std::pair<uint64_t, V>> order_;
  std::map<uint64_t, typename std::list<std::pair<uint64_t, V>>::iterator> index_;
};

struct Flags {
  long parent_pid = 0;
  uint64_t arena_bytes = 0, memory_bytes = 0;
  int64_t uid = -1, gid = -1, spin_us = 50;
  std::string scratch_dir = "/tmp", ns;
  uint64_t scratch_bytes = 0;
  bool isolate = false;
  bool userns = false;         // uid 0 of a user namespace opjitd made (a daemon without root)
  std::vector<std::string> libraries, read_only;
  uint64_t channel_bytes = 0;  // > 0: serve a fast channel
  int64_t max_threads = 0;     // threads a call may leave behind (0: unchecked)
  uint64_t max_processes = 0;  // RLIMIT_NPROC (0: unchanged)
  int task_fd = -1;            // /proc/self/task (O_PATH), opened before the sandbox
};

// A prepared handle this channel's client may call: which instance, and the
// byte size of each tensor (inputs then outputs).
struct Binding {
  uint64_t instance_id = 0;
  uint32_t n_in = 0, n_out = 0;
  std::vector<uint64_t> nbytes;
};

// The status a kGrant or a refused kCredit carries: i32 code, str reason,
// str message.
absl::Status ReadGrantStatus(wire::Reader& r) {
  const int32_t code = r.I32();
  const std::string reason = r.Str();
  const std::string message = r.Str();
  if (!r.ok() || code == 0) return absl::OkStatus();
  if (code < 0 || code > 16) return absl::InternalError("the daemon sent a bad status");
  absl::Status s(static_cast<absl::StatusCode>(code), message);
  return reason.empty() ? s : WithReason(s, reason);
}

class Worker {
 public:
  Worker(Flags flags, std::unique_ptr<KernelHost> host, wire::SlotHeader* slot, char* data)
      : flags_(std::move(flags)), host_(std::move(host)), slot_(slot), data_(data) {}

  int Loop();
  // Serves a fast channel mapped at `channel` until the daemon stops it.
  int ChannelLoop(void* channel);

 private:
  void Reply(int32_t code, uint64_t need, std::string_view message, std::string_view payload = {});
  void ReplyStatus(const absl::Status& s) {
    Reply(static_cast<int32_t>(s.code()), 0, std::string(s.message()));
  }
  void HandleControl(wire::Msg type, const std::string& payload, int fd);
  void HandleCall();
  // The call's reply, in the slot.
  void Answer(int32_t code, uint64_t need, std::string_view message, double kernel_ms,
              uint64_t flushed_bytes = 0);
  // RESOURCE_EXHAUSTED when the process has more threads than
  // --max-threads (the kernel left them running), else OK. Pool calls only.
  absl::Status CheckThreads();

  // Fast channel.
  void ServeSlot(fast::Slot* slot, uint32_t index);
  absl::Status RunSlot(fast::Slot* slot, uint64_t handle, double* kernel_ms);
  // Asks the daemon for a handle's binding or a region, serving its control
  // frames until its grant; the grant's status.
  absl::Status Want(wire::Msg type, uint64_t id);
  // Asks the daemon for call credit for the call on `handle` that waits:
  // OK with credit_ > 0, or the status that call answers (QUOTA_EXCEEDED).
  absl::Status AskCredit(uint64_t handle);
  // Counts a served call in the arena's table (wire::CallCounts).
  void Count(uint64_t handle, absl::StatusCode code, double kernel_ms);
  wire::CallCount* CountEntry(uint64_t handle, uint64_t code);
  std::map<uint64_t, Binding> bindings_;
  uint64_t handle_epoch_ = 0, region_epoch_ = 0;
  // Calls this executor may still serve before it asks the daemon again.
  // Nothing else grants it: without credit no call runs.
  uint64_t credit_ = 0;
  uint64_t fast_serial_ = 0;  // the last fast call's serial (SlotHeader::fast_call)
  // Index of the arena's count table, by (handle, code); the entry of the
  // last call, which the next one usually shares.
  std::map<std::pair<uint64_t, uint64_t>, wire::CallCount*> count_index_;
  uint64_t counts_used_ = 0;
  uint64_t last_count_handle_ = 0, last_count_code_ = ~uint64_t{0};
  wire::CallCount* last_count_ = nullptr;

  const Flags flags_;
  std::unique_ptr<KernelHost> host_;
  wire::SlotHeader* const slot_;
  char* const data_;
  std::map<std::string, std::shared_ptr<const compiler::CompiledKernel>> kernels_;
  std::list<std::string> kernel_order_;
  Lru<InstanceEntry> instances_{kMaxInstances};
  Lru<std::shared_ptr<Mapping>> regions_{kMaxRegions};
};

void Worker::Reply(int32_t code, uint64_t need, std::string_view message,
                   std::string_view payload) {
  wire::Writer w;
  w.I32(code);
  w.U64(need);
  w.Str(message.substr(0, wire::kMessageBytes));
  w.Str(payload);
  if (!wire::SendFrame(kSock, wire::Msg::kReply, w.out()).ok()) _exit(0);
}

void Worker::HandleControl(wire::Msg type, const std::string& payload, int fd) {
  switch (type) {
    case wire::Msg::kLoadKernel: {
      auto k = wire::DecodeKernel(payload);
      if (!k.ok()) return ReplyStatus(k.status());
      const std::string key = (*k)->cache_key;
      if (!kernels_.count(key)) {
        kernel_order_.push_back(key);
        if (kernel_order_.size() > kMaxKernels) {
          kernels_.erase(kernel_order_.front());
          kernel_order_.pop_front();
        }
      }
      kernels_[key] = *std::move(k);
      return Reply(0, 0, {});
    }
    case wire::Msg::kNewInstance: {
      uint64_t id = 0;
      auto spec = wire::DecodeInstance(payload, &id, kernels_);
      if (absl::IsNotFound(spec.status())) return Reply(wire::kNeedKernel, 0, {});
      if (!spec.ok()) return ReplyStatus(spec.status());
      auto inst = host_->NewInstance(*spec);  // Init runs here when outputs are known
      if (!inst.ok()) return ReplyStatus(inst.status());
      InstanceEntry e;
      e.outputs_known = !spec->outputs.empty();
      e.spec = *std::move(spec);
      e.inst = *std::move(inst);
      instances_.Put(id, std::move(e));
      return Reply(0, 0, {});
    }
    case wire::Msg::kInferShape: {
      wire::Reader r(payload);
      const uint64_t id = r.U64();
      InstanceEntry* e = instances_.Get(id);
      if (e == nullptr) return Reply(wire::kNeedInstance, id, {});
      auto shape = e->inst->InferShape();
      if (!shape.ok()) return ReplyStatus(shape.status());
      wire::Writer w;
      w.Desc({"", *shape});
      return Reply(0, 0, {}, w.out());
    }
    case wire::Msg::kAddRegion: {
      wire::Reader r(payload);
      const uint64_t serial = r.U64(), offset = r.U64(), size = r.U64();
      if (!r.done() || fd < 0 || size == 0) {
        if (fd >= 0) ::close(fd);
        return ReplyStatus(absl::InvalidArgumentError("bad region frame"));
      }
      const uint64_t page = guard::PageSize();
      const uint64_t map_offset = offset - offset % page;
      // Between guard pages: a kernel that writes past the region's end
      // (beyond its last page) faults in its own call.
      auto map = guard::GuardedMapping::File(fd, map_offset,
                                             static_cast<size_t>(offset - map_offset + size),
                                             PROT_READ | PROT_WRITE);
      ::close(fd);
      if (!map.ok()) {
        return ReplyStatus(absl::ResourceExhaustedError(
            absl::StrCat("the executor could not map a region: ", map.status().message())));
      }
      auto m = std::make_shared<Mapping>();
      m->map = *std::move(map);
      m->map->Describe(guard::Kind::kRegion, 0, serial, nullptr);
      m->data = m->map->data() + (offset - map_offset);
      m->size = size;
      regions_.Put(serial, std::move(m));
      return Reply(0, 0, {});
    }
    case wire::Msg::kBindHandle: {
      wire::Reader r(payload);
      const uint64_t handle = r.U64();
      Binding b;
      b.instance_id = r.U64();
      b.n_in = r.U32();
      b.n_out = r.U32();
      if (!r.ok() || uint64_t{b.n_in} + b.n_out > fast::kMaxTensors) {
        return ReplyStatus(absl::InvalidArgumentError("bad binding frame"));
      }
      for (uint32_t i = 0; i < b.n_in + b.n_out; ++i) b.nbytes.push_back(r.U64());
      if (!r.done()) return ReplyStatus(absl::InvalidArgumentError("bad binding frame"));
      InstanceEntry* e = instances_.Get(b.instance_id);
      if (e == nullptr) return Reply(wire::kNeedInstance, b.instance_id, {});
      if (e->spec.inputs.size() != b.n_in || e->spec.outputs.size() != b.n_out) {
        return ReplyStatus(absl::InvalidArgumentError("the binding does not match its instance"));
      }
      if (bindings_.size() >= kMaxBindings) bindings_.clear();
      bindings_[handle] = std::move(b);
      return Reply(0, 0, {});
    }
    case wire::Msg::kDropRegion: {
      wire::Reader r(payload);
      regions_.Erase(r.U64());
      if (fd >= 0) ::close(fd);
      return Reply(0, 0, {});
    }
    default:
      if (fd >= 0) ::close(fd);
      return ReplyStatus(absl::InvalidArgumentError("unknown frame"));
  }
}

void Worker::Answer(int32_t code, uint64_t need, std::string_view message, double kernel_ms,
                    uint64_t flushed_bytes) {
  slot_->code = code;
  slot_->need = need;
  const size_t n = std::min(message.size(), wire::kMessageBytes);
  if (n > 0) std::memcpy(slot_->message, message.data(), n);  // data() may be null when empty
  slot_->message_len = static_cast<uint32_t>(n);
  slot_->kernel_ms = kernel_ms;
  slot_->flushed_bytes = flushed_bytes;
  const uint32_t prev = slot_->state.exchange(wire::kDone, std::memory_order_acq_rel);
  if (prev & wire::kDaemonSleeping) {
    if (!wire::SendFrame(kSock, wire::Msg::kDoorbell, {}).ok()) _exit(0);
  }
}

absl::Status Worker::CheckThreads() {
  struct stat st;
  if (flags_.max_threads <= 0 || flags_.task_fd < 0 || ::fstat(flags_.task_fd, &st) != 0 ||
      st.st_nlink < 3) {
    return absl::OkStatus();
  }
  const int64_t threads = static_cast<int64_t>(st.st_nlink) - 2;  // the count plus "." and ".."
  if (threads <= flags_.max_threads) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the kernel left ", threads, " threads running (an executor process keeps at most ",
      flags_.max_threads, "); its executor process is replaced, and the next call runs in a "
      "fresh one (Init runs again)"));
}

void Worker::HandleCall() {
  // Take the request (keeping the daemon's sleeping bit, if it is set).
  uint32_t s = slot_->state.load(std::memory_order_acquire);
  while ((s & wire::kPhaseMask) == wire::kRequest &&
         !slot_->state.compare_exchange_weak(s, wire::kRunning | (s & wire::kDaemonSleeping),
                                             std::memory_order_acq_rel)) {
  }
  const uint64_t id = slot_->instance_id;
  const uint32_t n_in = slot_->n_inputs, n_out = slot_->n_outputs;
  InstanceEntry* e = instances_.Get(id);
  if (e == nullptr) return Answer(wire::kNeedInstance, id, {}, 0);
  if (!e->outputs_known) {
    // Created before its outputs were known (for InferShape): make it again
    // with them, so Init runs with the outputs as MindSpore's does.
    instances_.Erase(id);
    return Answer(wire::kNeedInstance, id, {}, 0);
  }
  if (n_in != e->spec.inputs.size() || n_out != e->spec.outputs.size() ||
      n_in + n_out > wire::kMaxTensors) {
    return Answer(static_cast<int32_t>(absl::StatusCode::kInternal), 0,
                  "the call does not match its instance", 0);
  }
  absl::InlinedVector<HostTensor, 8> in, out;
  const uint32_t call_flags = slot_->flags;
  const wire::TensorRec* recs = wire::Records(slot_);
  for (uint32_t i = 0; i < n_in + n_out; ++i) {
    const wire::TensorRec rec = recs[i];
    if (rec.serial == wire::kNullSerial) {
      // An input without data (not saved for a bprop): a null pointer of rank 0.
      if (i >= n_in || rec.offset != 0 || rec.nbytes != 0 || !e->spec.inputs[i].shape.empty()) {
        return Answer(static_cast<int32_t>(absl::StatusCode::kInternal), 0,
                      "a null tensor must be an input of rank 0", 0);
      }
      HostTensor t;
      t.null = true;
      t.desc = e->spec.inputs[i];
      in.push_back(std::move(t));
      continue;
    }
    char* base;
    uint64_t limit;
    if (rec.serial == 0) {
      base = data_;
      limit = flags_.arena_bytes;
    } else {
      std::shared_ptr<Mapping>* m = regions_.Get(rec.serial);
      if (m == nullptr) return Answer(wire::kNeedRegion, rec.serial, {}, 0);
      base = (*m)->data;
      limit = (*m)->size;
    }
    if (rec.offset > limit || rec.nbytes > limit - rec.offset) {
      return Answer(static_cast<int32_t>(absl::StatusCode::kInternal), 0,
                    "a tensor lies outside its region", 0);
    }
    HostTensor t;
    t.data = base + rec.offset;
    t.desc = i < n_in ? e->spec.inputs[i] : e->spec.outputs[i - n_in];
    // The caller's own region, kept as it asked; never the arena.
    t.keep_bytes = i >= n_in && rec.serial != 0 && (call_flags & wire::kKeepRegionOutputs) != 0;
    (i < n_in ? in : out).push_back(std::move(t));
  }
  HostCall call;
  call.flush_caches = (call_flags & wire::kFlushCaches) != 0;
  absl::Status st = RunTimed(*e->inst, in, out, &call);
  if (st.ok()) st = CheckThreads();
  Answer(static_cast<int32_t>(st.code()), 0, wire::MessageWithReason(st), call.kernel_ms,
         call.flushed_bytes);
}

absl::Status Worker::Want(wire::Msg type, uint64_t id) {
  wire::Writer w;
  w.U64(id);
  if (!wire::SendFrame(kSock, type, w.out()).ok()) _exit(0);
  for (;;) {
    wire::Msg got;
    std::string payload;
    int fd = -1;
    if (!wire::RecvFrame(kSock, &got, &payload, absl::InfiniteFuture(), &fd, wire::kToExecutor)
             .ok()) {
      _exit(0);
    }
    if (got != wire::Msg::kGrant) {
      HandleControl(got, payload, fd);
      continue;
    }
    if (fd >= 0) ::close(fd);
    wire::Reader r(payload);
    absl::Status s = ReadGrantStatus(r);
    if (!r.done()) _exit(0);
    return s;
  }
}

absl::Status Worker::AskCredit(uint64_t handle) {
  wire::Writer w;
  w.U64(handle);
  if (!wire::SendFrame(kSock, wire::Msg::kWantCredit, w.out()).ok()) _exit(0);
  for (;;) {
    wire::Msg got;
    std::string payload;
    int fd = -1;
    if (!wire::RecvFrame(kSock, &got, &payload, absl::InfiniteFuture(), &fd, wire::kToExecutor)
             .ok()) {
      _exit(0);
    }
    if (got != wire::Msg::kCredit) {
      HandleControl(got, payload, fd);
      continue;
    }
    if (fd >= 0) ::close(fd);
    wire::Reader r(payload);
    const uint64_t granted = r.U64();
    if (granted > 0) {
      if (!r.done()) _exit(0);
      credit_ = granted;
      return absl::OkStatus();
    }
    absl::Status s = ReadGrantStatus(r);
    if (!r.done()) _exit(0);
    return s.ok() ? absl::ResourceExhaustedError("the server granted no call credit") : s;
  }
}

wire::CallCount* Worker::CountEntry(uint64_t handle, uint64_t code) {
  auto it = count_index_.find({handle, code});
  if (it != count_index_.end()) return it->second;
  wire::CallCounts* table = wire::CallCountsOf(slot_);
  // A full table (a client naming many handles) keeps one entry per code
  // for the rest, under handle 0.
  if (counts_used_ >= wire::kCallCounts - wire::kCallCountsSpare && handle != 0) {
    return CountEntry(0, code);
  }
  if (counts_used_ >= wire::kCallCounts) return nullptr;  // not reached: codes are 0..16
  wire::CallCount* e = &table->entries[counts_used_++];
  e->handle.store(handle, std::memory_order_relaxed);
  e->code.store(code, std::memory_order_relaxed);
  e->calls.store(0, std::memory_order_relaxed);
  e->kernel_ns.store(0, std::memory_order_relaxed);
  table->used.store(counts_used_, std::memory_order_release);
  count_index_[{handle, code}] = e;
  return e;
}

void Worker::Count(uint64_t handle, absl::StatusCode code, double kernel_ms) {
  const uint64_t c = static_cast<uint64_t>(code);
  if (last_count_ == nullptr || handle != last_count_handle_ || c != last_count_code_) {
    last_count_ = CountEntry(handle, c);
    last_count_handle_ = handle;
    last_count_code_ = c;
    if (last_count_ == nullptr) return;
  }
  // One writer (this thread): plain load-and-store keeps it a single write
  // the daemon reads whole.
  last_count_->calls.store(last_count_->calls.load(std::memory_order_relaxed) + 1,
                           std::memory_order_relaxed);
  const double ns = kernel_ms > 0 ? kernel_ms * 1e6 : 0;
  last_count_->kernel_ns.store(
      last_count_->kernel_ns.load(std::memory_order_relaxed) + static_cast<uint64_t>(ns),
      std::memory_order_relaxed);
}

// One call of the channel's client. Every field is read once, into locals:
// the client may rewrite the slot while the kernel runs.
absl::Status Worker::RunSlot(fast::Slot* slot, uint64_t handle, double* kernel_ms) {
  auto* epochs = slot_;  // the daemon's words (the private arena)
  if (const uint64_t e = epochs->handle_epoch.load(std::memory_order_acquire); e != handle_epoch_) {
    bindings_.clear();
    handle_epoch_ = e;
  }
  if (const uint64_t e = epochs->region_epoch.load(std::memory_order_acquire); e != region_epoch_) {
    regions_ = Lru<std::shared_ptr<Mapping>>(kMaxRegions);
    region_epoch_ = e;
  }
  const uint32_t n = slot->n_tensors;
  const int64_t deadline_ns = slot->deadline_ns;
  // Every tensor here is in the client's own regions: it may keep its bytes.
  const bool keep_bytes = (slot->flags & fast::kKeepOutputBytes) != 0;
  if (n > fast::kMaxTensors) {
    return absl::InvalidArgumentError(absl::StrCat("a call passes at most ", fast::kMaxTensors,
                                                   " tensors; this one says ", n));
  }
  fast::TensorRef refs[fast::kMaxTensors];
  std::memcpy(refs, slot->tensors, n * sizeof(fast::TensorRef));
  // The binding; the daemon is asked at most twice (a binding whose
  // instance this worker evicted is asked for again).
  Binding* b = nullptr;
  InstanceEntry* e = nullptr;
  for (int attempt = 0; attempt < 2 && e == nullptr; ++attempt) {
    auto it = bindings_.find(handle);
    if (it == bindings_.end()) {
      if (absl::Status s = Want(wire::Msg::kWantHandle, handle); !s.ok()) return s;
      it = bindings_.find(handle);
      if (it == bindings_.end()) return absl::InternalError("the daemon granted no binding");
    }
    b = &it->second;
    e = instances_.Get(b->instance_id);
    if (e == nullptr || !e->outputs_known) {
      e = nullptr;
      bindings_.erase(it);
    }
  }
  if (e == nullptr) return absl::InternalError("the handle's kernel instance is missing");
  if (n != b->n_in + b->n_out) {
    return absl::InvalidArgumentError(absl::StrCat("the call passes ", n, " tensors; handle ",
                                                   handle, " takes ", b->n_in, " inputs and ",
                                                   b->n_out, " outputs"));
  }
  if (deadline_ns != 0 && fast::MonotonicNs() > deadline_ns) {
    return WithReason(absl::DeadlineExceededError("the deadline passed before the kernel started"),
                      reason::kKernelTimeout);
  }
  struct Span {
    uint64_t region, begin, end;
    bool input;
  };
  absl::InlinedVector<HostTensor, 8> in, out;
  absl::InlinedVector<Span, 8> spans;
  for (uint32_t i = 0; i < n; ++i) {
    const bool input = i < b->n_in;
    const uint32_t k = input ? i : i - b->n_in;
    auto what = [&] { return absl::StrCat(input ? "inputs[" : "outputs[", k, "]"); };
    const uint64_t nbytes = b->nbytes[i];
    HostTensor t;
    t.desc = input ? e->spec.inputs[k] : e->spec.outputs[k];
    if (refs[i].region == 0) {
      if (nbytes != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what(), " names no region (id 0), but takes ", nbytes, " bytes"));
      }
      (input ? in : out).push_back(std::move(t));
      continue;
    }
    std::shared_ptr<Mapping>* m = regions_.Get(refs[i].region);
    if (m == nullptr) {
      if (absl::Status s = Want(wire::Msg::kWantRegion, refs[i].region); !s.ok()) {
        return Annotate(s, absl::StrCat(what(), ": "));
      }
      m = regions_.Get(refs[i].region);
      if (m == nullptr) return absl::InternalError("the daemon granted no region");
    }
    const uint64_t size = (*m)->size, off = refs[i].offset;
    if (off > size || nbytes > size - off) {
      return WithReason(absl::InvalidArgumentError(absl::StrCat(
                            what(), ": ", nbytes, " bytes at offset ", off, " do not fit region id ",
                            refs[i].region, " (", size, " bytes)")),
                        reason::kRegionTooSmall, {{"tensor", what()}});
    }
    // Outputs must not overlap an input or each other (as on the gRPC path),
    // except an output that is exactly an input when outputs keep their
    // bytes (an in-place or `out=` op; placement.cc says the same).
    if (!input && nbytes > 0) {
      for (const Span& sp : spans) {
        if (keep_bytes && sp.input && sp.region == refs[i].region && sp.begin == off &&
            sp.end == off + nbytes) {
          continue;
        }
        if (sp.region == refs[i].region && off < sp.end && sp.begin < off + nbytes) {
          return absl::InvalidArgumentError(
              absl::StrCat(what(), " overlaps another tensor of the call in region id ",
                           refs[i].region));
        }
      }
    }
    spans.push_back({refs[i].region, off, off + nbytes, input});
    t.data = (*m)->data + off;
    t.keep_bytes = !input && keep_bytes;
    (input ? in : out).push_back(std::move(t));
  }
  HostCall call;
  absl::Status st = RunTimed(*e->inst, in, out, &call);
  *kernel_ms = call.kernel_ms;
  return st;
}

void Worker::ServeSlot(fast::Slot* slot, uint32_t index) {
  uint32_t expected = fast::kSubmitted;
  if (!slot->state.compare_exchange_strong(expected, fast::kRunning, std::memory_order_acq_rel)) {
    return;
  }
  // The call runs only on credit; the daemon grants it (or refuses it,
  // and counts the refusal itself).
  const uint64_t handle = slot->handle;
  double kernel_ms = 0;
  absl::Status st;
  if (credit_ == 0) st = AskCredit(handle);
  if (st.ok()) {
    --credit_;
    // What the daemon's watchdog times (worker_protocol.h): the slot, the
    // client's deadline as it was now, then the call's serial.
    slot_->fast_slot.store(index, std::memory_order_relaxed);
    slot_->fast_deadline_ns.store(slot->deadline_ns, std::memory_order_relaxed);
    slot_->fast_call.store(++fast_serial_, std::memory_order_release);
    st = RunSlot(slot, handle, &kernel_ms);
    // No thread count here: the daemon's channel thread counts them while
    // no call runs (ProcessRunnerOptions::threads_per_executor).
    slot_->fast_call.store(0, std::memory_order_release);
    Count(handle, st.code(), kernel_ms);
  }
  const auto why = GetReason(st);
  const std::string reason = why ? why->reason : "";
  const absl::string_view message = st.message();
  slot->code = static_cast<int32_t>(st.code());
  std::memset(slot->reason, 0, sizeof slot->reason);
  std::memcpy(slot->reason, reason.data(), std::min(reason.size(), sizeof slot->reason - 1));
  const size_t len = std::min<size_t>(message.size(), fast::kMessageBytes);
  if (len > 0) std::memcpy(slot->message, message.data(), len);
  slot->message_len = static_cast<uint32_t>(len);
  slot->kernel_ms = kernel_ms;
  slot->state.store(fast::kDone, std::memory_order_seq_cst);
  if (slot->client_waiting.load(std::memory_order_seq_cst) != 0) {
    fast::FutexWake(&slot->state, 1 << 30);
  }
}

// Waits until the control socket has something to read (or hung up);
// false once `parent` is no longer this process's parent.
bool AwaitDaemon(pid_t parent) {
  for (;;) {
    pollfd p{kSock, POLLIN, 0};
    const int r = ::poll(&p, 1, 1000);
    if (r > 0 || (r < 0 && errno != EINTR)) return true;  // the read says what happened
    if (!subprocess::ParentIs(parent)) return false;
  }
}

int Worker::ChannelLoop(void* channel) {
  fast::Header* hdr = fast::HeaderOf(channel);
  const uint32_t n_slots = fast::kSlots;
  uint32_t next = 0;
  for (;;) {
    const uint32_t bell = hdr->doorbell.load(std::memory_order_acquire);
    bool served = false;
    for (uint32_t k = 0; k < n_slots; ++k) {
      const uint32_t i = (next + k) % n_slots;
      fast::Slot* slot = fast::SlotAt(channel, i);
      if (slot->state.load(std::memory_order_acquire) == fast::kSubmitted) {
        ServeSlot(slot, i);
        next = i + 1;
        served = true;
        break;
      }
    }
    if (served) continue;
    // Spin for the next call, then sleep on the doorbell (announced first;
    // the client wakes us after it rings). The timeout bounds what a lost
    // wake-up could cost.
    const auto until = Clock::now() + std::chrono::microseconds(flags_.spin_us);
    int n = 0;
    bool rang = false;
    while (flags_.spin_us > 0) {
      if (hdr->doorbell.load(std::memory_order_acquire) != bell) {
        rang = true;
        break;
      }
      ::sched_yield();
      if ((++n & 7) == 0 && Clock::now() > until) break;
    }
    if (rang) continue;
    hdr->worker_sleeping.store(1, std::memory_order_seq_cst);
    if (hdr->doorbell.load(std::memory_order_seq_cst) == bell) {
      fast::FutexWait(&hdr->doorbell, bell, 100'000'000);
    }
    hdr->worker_sleeping.store(0, std::memory_order_seq_cst);
    // This loop never reads the daemon's socket, so only this tells it the
    // daemon died (were the parent-death signal ever lost).
    if (!subprocess::ParentIs(static_cast<pid_t>(flags_.parent_pid))) return 0;
  }
}

int Worker::Loop() {
  for (;;) {
    // Spin a little: the next call of a busy caller often comes at once.
    const auto until = Clock::now() + std::chrono::microseconds(flags_.spin_us);
    int n = 0;
    bool got_call = false;
    while (flags_.spin_us > 0) {
      if ((slot_->state.load(std::memory_order_acquire) & wire::kPhaseMask) == wire::kRequest) {
        got_call = true;
        break;
      }
      // Yield rather than pause: on a machine with few cores the caller's
      // own threads (gRPC, the client) must get the CPU this spin holds.
      ::sched_yield();
      if ((++n & 7) == 0 && Clock::now() > until) break;
    }
    if (got_call) {
      HandleCall();
      continue;
    }
    // Sleep on the socket, saying so first (unless a call came meanwhile).
    uint32_t s = slot_->state.load(std::memory_order_acquire);
    bool call_now = false;
    for (;;) {
      if ((s & wire::kPhaseMask) == wire::kRequest) {
        call_now = true;
        break;
      }
      if (slot_->state.compare_exchange_weak(s, s | wire::kWorkerSleeping,
                                             std::memory_order_acq_rel)) {
        break;
      }
    }
    if (call_now) {
      HandleCall();
      continue;
    }
    // Wait for the daemon, checking every second that it is still the
    // parent (a dead daemon also closes the socket; this does not rely on it).
    if (!AwaitDaemon(static_cast<pid_t>(flags_.parent_pid))) {
      slot_->state.fetch_and(~wire::kWorkerSleeping, std::memory_order_acq_rel);
      return 0;
    }
    wire::Msg type;
    std::string payload;
    int fd = -1;
    absl::Status rs = wire::RecvFrame(kSock, &type, &payload, absl::InfiniteFuture(), &fd,
                                      wire::kToExecutor);
    slot_->state.fetch_and(~wire::kWorkerSleeping, std::memory_order_acq_rel);
    if (!rs.ok()) return 0;  // the daemon closed the channel (or broke it)
    if (type == wire::Msg::kDoorbell) {
      if (fd >= 0) ::close(fd);
      if ((slot_->state.load(std::memory_order_acquire) & wire::kPhaseMask) == wire::kRequest) {
        HandleCall();
      }
      continue;
    }
    HandleControl(type, payload, fd);
  }
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) return false;
    std::string v = argv[++i];
    if (a == subprocess::kParentPidFlag) f->parent_pid = std::atol(v.c_str());
    else if (a == subprocess::kInstanceFlag) {}  // a tag for a restart's sweep (subprocess.h)
    else if (a == "--arena-bytes") f->arena_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--memory-bytes") f->memory_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--uid") f->uid = std::atoll(v.c_str());
    else if (a == "--gid") f->gid = std::atoll(v.c_str());
    else if (a == "--spin-us") f->spin_us = std::atoll(v.c_str());
    else if (a == "--scratch-dir") f->scratch_dir = v;
    else if (a == "--scratch-bytes") f->scratch_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--isolate") f->isolate = v == "1";
    else if (a == "--userns") f->userns = v == "1";
    else if (a == "--namespace") f->ns = v;
    else if (a == "--allow-library") f->libraries.push_back(v);
    else if (a == "--read-only") f->read_only.push_back(v);
    else if (a == "--channel-bytes") f->channel_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--max-threads") f->max_threads = std::atoll(v.c_str());
    else if (a == "--max-processes") f->max_processes = std::strtoull(v.c_str(), nullptr, 10);
    else return false;
  }
  return f->arena_bytes > 0;
}

int Main(int argc, char** argv) {
  // opjitd's health probe: the program loads and starts.
  if (argc == 2 && std::string(argv[1]) == "--probe") return 0;
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    std::fprintf(stderr, "opjit-exec-worker: bad arguments; it is started by opjitd\n");
    return 2;
  }
  // Nothing of the daemon's but the channel, the arena and (fast channels)
  // the client's channel memory.
  ::syscall(SYS_close_range, flags.channel_bytes > 0 ? 6u : 5u, ~0u, 0u);
  // Process 1 of its own PID namespace (--isolate): an abort() is reported
  // as one, and the daemon's socket says whether the daemon lives.
  subprocess::ActAsInit();
  subprocess::SetParentLink(kSock);
  if (!subprocess::DieWithParent(static_cast<pid_t>(flags.parent_pid))) return 3;
  ::signal(SIGPIPE, SIG_IGN);
  // A write past the scratch limit fails with EFBIG instead of killing.
  ::signal(SIGXFSZ, SIG_IGN);
  if (::chdir("/") != 0) return 2;
  // Its own thread count, readable after Landlock shuts /proc (fstat of an
  // fd opened before needs no path).
  flags.task_fd = ::open("/proc/self/task", O_PATH | O_DIRECTORY | O_CLOEXEC);

  // Between guard pages: a kernel that writes past its inline tensors'
  // arena faults in its own call.
  const size_t arena_len = wire::kSlotBytes + flags.arena_bytes;
  auto arena_map = guard::GuardedMapping::File(kArena, 0, arena_len, PROT_READ | PROT_WRITE);
  if (!arena_map.ok()) {
    std::fprintf(stderr, "opjit-exec-worker: cannot map the arena: %s\n",
                 std::string(arena_map.status().message()).c_str());
    return 4;
  }
  (*arena_map)->Describe(guard::Kind::kArena, 0, 0, nullptr);
  void* arena = (*arena_map)->data();
  void* channel = nullptr;
  if (flags.channel_bytes > 0) {
    if (flags.channel_bytes < fast::kChannelBytes) return 2;
    channel = ::mmap(nullptr, fast::kChannelBytes, PROT_READ | PROT_WRITE, MAP_SHARED, kChannel, 0);
    ::close(kChannel);
    if (channel == MAP_FAILED) {
      std::fprintf(stderr, "opjit-exec-worker: cannot map the channel: %s\n", std::strerror(errno));
      return 4;
    }
  }
  // The cache sweep's size (HostCall::flush_caches) comes from sysfs: read
  // now, before the sandbox, and remembered.
  (void)CacheFlushBytes();
  KernelHostOptions hopts;
  hopts.allowed_libraries = flags.libraries;
  hopts.scratch_dir = flags.scratch_dir;
  auto host = KernelHost::Create(hopts);
  if (!host.ok()) {
    std::fprintf(stderr, "opjit-exec-worker: %s\n", host.status().ToString().c_str());
    return 5;
  }

  // After the JIT's set-up (which may install handlers of its own).
  InstallFaultHandler(static_cast<wire::SlotHeader*>(arena));

  sandbox::Policy policy;
  policy.read_only_paths = {"/usr", "/lib", "/lib64", "/etc/ld.so.cache"};
  for (const auto& p : flags.read_only) policy.read_only_paths.push_back(p);
  for (const auto& lib : flags.libraries) {
    if (lib.rfind('/', 0) == 0) policy.read_only_paths.push_back(lib);
  }
  if (!flags.scratch_dir.empty() && ::access(flags.scratch_dir.c_str(), F_OK) == 0) {
    policy.read_write_paths = {flags.scratch_dir};
  }
  // Namespaces of its own (with its PID namespace, which the daemon gave
  // it): its scratch is a private tmpfs of --scratch-bytes. Without them,
  // each file it writes is capped instead.
  policy.private_namespaces = flags.isolate;
  policy.user_namespace_root = flags.userns;
  policy.scratch_dir = flags.scratch_dir;
  policy.scratch_bytes = flags.scratch_bytes;
  if (!flags.isolate) policy.file_size_bytes = flags.scratch_bytes;
  policy.device_paths = {"/dev/null", "/dev/zero", "/dev/urandom"};
  // GPU workers need the driver's device nodes (nothing else of /dev).
  bool gpu = false;
  for (const char* dev : {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0",
                          "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3", "/dev/nvidia4",
                          "/dev/nvidia5", "/dev/nvidia6", "/dev/nvidia7"}) {
    if (::access(dev, F_OK) == 0) {
      policy.device_paths.push_back(dev);
      gpu = true;
    }
  }
  // Memory no rlimit counts (memfd, System V shm, shared anonymous maps):
  // refused where there is no GPU. The CUDA driver's own use of such
  // mappings has not been ruled out on a device, so a GPU host keeps them;
  // there the namespace's memory cgroup, which counts them, is the bound.
  policy.refuse_shared_memory = !gpu;
  for (const char* ro : {"/proc/driver/nvidia", "/sys/devices/system/cpu"}) {
    if (::access(ro, F_OK) == 0) policy.read_only_paths.push_back(ro);
  }
  policy.data_bytes = flags.memory_bytes;
  policy.max_processes = flags.max_processes;
  policy.uid = flags.uid;
  policy.gid = flags.gid;
  policy.allow_exec = false;
  policy.allow_processes = false;
  if (absl::Status s = sandbox::Apply(policy); !s.ok()) {
    std::fprintf(stderr, "opjit-exec-worker: sandbox: %s\n", s.ToString().c_str());
    return 6;
  }
  // Once more: the sandbox's uid change cleared the parent-death signal
  // (Linux does so on every credential change), and without it a channel
  // executor, which never reads the daemon's socket, outlived the daemon.
  if (!subprocess::DieWithParent(static_cast<pid_t>(flags.parent_pid))) return 3;

  wire::Writer hello;
  hello.U32(wire::kProtocolVersion);
  hello.U32(static_cast<uint32_t>(::getpid()));
  if (!wire::SendFrame(kSock, wire::Msg::kHello, hello.out()).ok()) return 7;
  Worker worker(std::move(flags), *std::move(host), static_cast<wire::SlotHeader*>(arena),
                static_cast<char*>(arena) + wire::kSlotBytes);
  return channel != nullptr ? worker.ChannelLoop(channel) : worker.Loop();
}

}  // namespace
}  // namespace opjit::runner

int main(int argc, char** argv) { return opjit::runner::Main(argc, argv); }

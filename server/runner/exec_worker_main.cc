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
//        --spin-us N --scratch-dir D --namespace NS [--allow-library L]...
//        [--read-only PATH]...

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
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
#include "server/common/worker_sanitizer.h"
#include "server/common/sandbox.h"
#include "server/compiler/kernel_compiler.h"
#include "server/runner/kernel_host.h"
#include "server/runner/worker_protocol.h"

namespace opjit::runner {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kSock = 3;
constexpr int kArena = 4;
// Bounds on what a worker keeps; the oldest go first.
constexpr size_t kMaxKernels = 128;
constexpr size_t kMaxInstances = 1024;
constexpr size_t kMaxRegions = 4096;

struct Mapping {
  void* base = nullptr;
  size_t length = 0;
  char* data = nullptr;
  uint64_t size = 0;
  ~Mapping() {
    if (base != nullptr) ::munmap(base, length);
  }
};

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
  std::vector<std::string> libraries, read_only;
};

class Worker {
 public:
  Worker(Flags flags, std::unique_ptr<KernelHost> host, wire::SlotHeader* slot, char* data)
      : flags_(std::move(flags)), host_(std::move(host)), slot_(slot), data_(data) {}

  int Loop();

 private:
  void Reply(int32_t code, uint64_t need, std::string_view message, std::string_view payload = {});
  void ReplyStatus(const absl::Status& s) {
    Reply(static_cast<int32_t>(s.code()), 0, std::string(s.message()));
  }
  void HandleControl(wire::Msg type, const std::string& payload, int fd);
  void HandleCall();
  // The call's reply, in the slot.
  void Answer(int32_t code, uint64_t need, std::string_view message, double kernel_ms);

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
      const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
      const uint64_t map_offset = offset - offset % page;
      auto m = std::make_shared<Mapping>();
      m->length = static_cast<size_t>(offset - map_offset + size);
      m->base = ::mmap(nullptr, m->length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                       static_cast<off_t>(map_offset));
      ::close(fd);
      if (m->base == MAP_FAILED) {
        m->base = nullptr;
        return ReplyStatus(absl::ResourceExhaustedError(
            absl::StrCat("the executor could not map a region: ", std::strerror(errno))));
      }
      m->data = static_cast<char*>(m->base) + (offset - map_offset);
      m->size = size;
      regions_.Put(serial, std::move(m));
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

void Worker::Answer(int32_t code, uint64_t need, std::string_view message, double kernel_ms) {
  slot_->code = code;
  slot_->need = need;
  const size_t n = std::min(message.size(), wire::kMessageBytes);
  if (n > 0) std::memcpy(slot_->message, message.data(), n);  // data() may be null when empty
  slot_->message_len = static_cast<uint32_t>(n);
  slot_->kernel_ms = kernel_ms;
  const uint32_t prev = slot_->state.exchange(wire::kDone, std::memory_order_acq_rel);
  if (prev & wire::kDaemonSleeping) {
    if (!wire::SendFrame(kSock, wire::Msg::kDoorbell, {}).ok()) _exit(0);
  }
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
    (i < n_in ? in : out).push_back(std::move(t));
  }
  const auto t0 = Clock::now();
  absl::Status st = e->inst->Run(in, out);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  Answer(static_cast<int32_t>(st.code()), 0, wire::MessageWithReason(st), ms);
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
    wire::Msg type;
    std::string payload;
    int fd = -1;
    absl::Status rs = wire::RecvFrame(kSock, &type, &payload, absl::InfiniteFuture(), &fd);
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
    if (a == "--parent-pid") f->parent_pid = std::atol(v.c_str());
    else if (a == "--arena-bytes") f->arena_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--memory-bytes") f->memory_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--uid") f->uid = std::atoll(v.c_str());
    else if (a == "--gid") f->gid = std::atoll(v.c_str());
    else if (a == "--spin-us") f->spin_us = std::atoll(v.c_str());
    else if (a == "--scratch-dir") f->scratch_dir = v;
    else if (a == "--namespace") f->ns = v;
    else if (a == "--allow-library") f->libraries.push_back(v);
    else if (a == "--read-only") f->read_only.push_back(v);
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
  // Nothing of the daemon's but the channel and the arena.
  ::syscall(SYS_close_range, 5u, ~0u, 0u);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (flags.parent_pid != 0 && ::getppid() != flags.parent_pid) return 3;
  ::signal(SIGPIPE, SIG_IGN);
  if (::chdir("/") != 0) return 2;

  const size_t arena_len = wire::kSlotBytes + flags.arena_bytes;
  void* arena = ::mmap(nullptr, arena_len, PROT_READ | PROT_WRITE, MAP_SHARED, kArena, 0);
  if (arena == MAP_FAILED) {
    std::fprintf(stderr, "opjit-exec-worker: cannot map the arena: %s\n", std::strerror(errno));
    return 4;
  }
  KernelHostOptions hopts;
  hopts.allowed_libraries = flags.libraries;
  hopts.scratch_dir = flags.scratch_dir;
  auto host = KernelHost::Create(hopts);
  if (!host.ok()) {
    std::fprintf(stderr, "opjit-exec-worker: %s\n", host.status().ToString().c_str());
    return 5;
  }

  sandbox::Policy policy;
  policy.read_only_paths = {"/usr", "/lib", "/lib64", "/etc/ld.so.cache"};
  for (const auto& p : flags.read_only) policy.read_only_paths.push_back(p);
  for (const auto& lib : flags.libraries) {
    if (lib.rfind('/', 0) == 0) policy.read_only_paths.push_back(lib);
  }
  if (!flags.scratch_dir.empty() && ::access(flags.scratch_dir.c_str(), F_OK) == 0) {
    policy.read_write_paths = {flags.scratch_dir};
  }
  policy.device_paths = {"/dev/null", "/dev/zero", "/dev/urandom"};
  // GPU workers need the driver's device nodes (nothing else of /dev).
  for (const char* dev : {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0",
                          "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3", "/dev/nvidia4",
                          "/dev/nvidia5", "/dev/nvidia6", "/dev/nvidia7"}) {
    if (::access(dev, F_OK) == 0) policy.device_paths.push_back(dev);
  }
  for (const char* ro : {"/proc/driver/nvidia", "/sys/devices/system/cpu"}) {
    if (::access(ro, F_OK) == 0) policy.read_only_paths.push_back(ro);
  }
  policy.data_bytes = flags.memory_bytes;
  policy.uid = flags.uid;
  policy.gid = flags.gid;
  policy.allow_exec = false;
  policy.allow_processes = false;
  if (absl::Status s = sandbox::Apply(policy); !s.ok()) {
    std::fprintf(stderr, "opjit-exec-worker: sandbox: %s\n", s.ToString().c_str());
    return 6;
  }

  wire::Writer hello;
  hello.U32(wire::kProtocolVersion);
  hello.U32(static_cast<uint32_t>(::getpid()));
  if (!wire::SendFrame(kSock, wire::Msg::kHello, hello.out()).ok()) return 7;
  Worker worker(std::move(flags), *std::move(host), static_cast<wire::SlotHeader*>(arena),
                static_cast<char*>(arena) + wire::kSlotBytes);
  return worker.Loop();
}

}  // namespace
}  // namespace opjit::runner

int main(int argc, char** argv) { return opjit::runner::Main(argc, argv); }

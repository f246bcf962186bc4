#include "server/gpu/nvrtc_pool.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/codec.h"
#include "server/common/logging.h"
#include "server/common/subprocess.h"

namespace opjit::gpu {
namespace nvrtc_wire {
namespace {

constexpr char kChannel[] = "GPU compiler sandbox's channel";

// All workers' answers in flight in the daemon, together.
frame_io::PeerBudget results_budget(512u << 20);

frame_io::ChannelLimits Limits(uint32_t max_bytes, frame_io::PeerBudget* budget) {
  frame_io::ChannelLimits l;
  l.name = kChannel;
  l.max_frame_bytes = max_bytes;
  l.typed = true;
  l.socket = true;
  if (budget != nullptr) l.stall_limit = absl::Seconds(10);
  l.budget = budget;
  return l;
}

}  // namespace

const frame_io::ChannelLimits kToWorker = Limits(kMaxRequestBytes, nullptr);
const frame_io::ChannelLimits kFromWorker = Limits(kMaxResultBytes, &results_budget);

std::string EncodeHello(bool pch) {
  codec::Writer w;
  w.U32(kProtocolVersion);
  w.Bool(pch);
  return w.Take();
}

bool DecodeHello(std::string_view body, bool* pch) {
  codec::Reader r(body, kChannel);
  const uint32_t version = r.U32();
  *pch = r.Bool();
  return r.done() && version == kProtocolVersion;
}

}  // namespace nvrtc_wire

namespace {

// NVRTC loads and warms up before the hello: seconds on a loaded machine.
constexpr absl::Duration kStartupTimeout = absl::Seconds(20);

#ifdef OPJIT_SANITIZED
// ASan's shadow makes every address space terabytes (and there is no
// RLIMIT_AS to stay under): only the compile count counts.
constexpr bool kRecycleBySize = false;
#else
constexpr bool kRecycleBySize = true;
#endif

}  // namespace

struct NvrtcPool::Worker {
  pid_t pid = -1;
  int fd = -1;
  bool ready = false;     // its hello came
  bool pch = false;       // it keeps PCHs
  int compiles = 0;       // requests answered
  bool assigned = false;  // has served `tenant`, and will serve no other namespace
  std::string tenant;
  ~Worker() {
    if (fd >= 0) ::close(fd);
  }
};

NvrtcPool::NvrtcPool(NvrtcPoolOptions options) : options_(std::move(options)) {}

NvrtcPool::~NvrtcPool() {
  std::deque<std::unique_ptr<Worker>> idle;
  {
    MutexLock lock(&mu_);
    idle.swap(idle_);
  }
  for (auto& w : idle) End(std::move(w));
}

void NvrtcPool::End(std::unique_ptr<Worker> w) {
  if (w == nullptr) return;
  (void)subprocess::Reap(w->pid, absl::ZeroDuration(), /*kill_group=*/true);
}

NvrtcStats NvrtcPool::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

absl::StatusOr<std::unique_ptr<NvrtcPool::Worker>> NvrtcPool::Start() {
  // The socket as its stdin and stdout, stderr to /dev/null; namespaces of
  // its own where the daemon can make them, and the compile uid, like the
  // CPU compile workers'.
  subprocess::SpawnOptions spawn;
  spawn.path = options_.worker_path;
  spawn.args = options_.args;
  absl::StatusOr<subprocess::HelperChannel> started =
      subprocess::SpawnCompileHelper(std::move(spawn), {0, 1}, options_.uid, options_.gid);
  if (!started.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot start the NVRTC sandbox: ", started.status().message()));
  }
  auto w = std::make_unique<Worker>();
  w->pid = started->pid;
  w->fd = started->fd;
  MutexLock lock(&mu_);
  ++stats_.spawns;
  return w;
}

absl::Status NvrtcPool::CheckReady(Worker* w) {
  absl::Status s;
  if (!w->ready) {
    frame_io::Frame f;
    s = frame_io::ReadFrame(w->fd, nvrtc_wire::kFromWorker, absl::Now() + kStartupTimeout, &f);
    if (s.ok() && (f.type != nvrtc_wire::kHello || !nvrtc_wire::DecodeHello(f.body, &w->pch))) {
      s = absl::DataLossError("a malformed hello");
    }
    w->ready = s.ok();
  } else if (pollfd p{w->fd, POLLIN, 0}; ::poll(&p, 1, 0) != 0) {
    s = absl::UnavailableError("it died while idle");
  }
  if (s.ok()) return s;
  absl::StatusOr<subprocess::Exit> e = subprocess::Reap(w->pid, absl::ZeroDuration(), true);
  Logger("gpu")->warn("NVRTC worker {}: {} ({})", w->pid, s.ToString(),
                      e.ok() ? e->Describe() : "not reaped");
  w->pid = -1;
  return absl::UnavailableError(absl::StrCat(
      "the NVRTC sandbox did not start (it ", e.ok() ? e->Describe() : "could not be reaped", ")"));
}

void NvrtcPool::FreeSlot() {
  {
    MutexLock lock(&mu_);
    --live_;
  }
  idle_cv_.Signal();
}

std::unique_ptr<NvrtcPool::Worker> NvrtcPool::TakeIdleLocked(const std::string& tenant) {
  // A worker of this namespace first, then a fresh one.
  auto mine = std::find_if(idle_.begin(), idle_.end(),
                           [&](const auto& i) { return i->assigned && i->tenant == tenant; });
  if (mine == idle_.end()) {
    mine = std::find_if(idle_.begin(), idle_.end(), [](const auto& i) { return !i->assigned; });
  }
  if (mine == idle_.end()) return nullptr;
  std::unique_ptr<Worker> w = std::move(*mine);
  idle_.erase(mine);
  return w;
}

absl::StatusOr<NvrtcPool::Lease> NvrtcPool::Acquire(const std::string& tenant) {
  for (;;) {
    std::unique_ptr<Worker> w, other;  // other: another namespace's idle one, to end
    bool start = false;
    {
      MutexLock lock(&mu_);
      while (idle_.empty() && live_ >= options_.workers) idle_cv_.Wait(&mu_);
      w = TakeIdleLocked(tenant);
      if (w == nullptr && live_ < options_.workers) {
        ++live_;
        start = true;
      } else if (w == nullptr) {
        other = std::move(idle_.front());  // its slot, for a fresh worker
        idle_.pop_front();
        ++stats_.tenant_switches;
        start = true;
      }
    }
    End(std::move(other));
    absl::Status ready;
    if (start) {
      absl::StatusOr<std::unique_ptr<Worker>> started = Start();
      if (started.ok()) w = *std::move(started);
      ready = started.status();
    }
    if (ready.ok()) ready = CheckReady(w.get());
    if (ready.ok()) {
      w->assigned = true;
      w->tenant = tenant;
      return Lease(this, std::move(w));
    }
    FreeSlot();
    if (start) return ready;  // a fresh worker failed: say so
  }
}

NvrtcPool::Lease NvrtcPool::TryAcquire(const std::string& tenant) {
  std::unique_ptr<Worker> w;
  {
    MutexLock lock(&mu_);
    w = TakeIdleLocked(tenant);
  }
  if (w == nullptr) return Lease();
  if (pollfd p{w->fd, POLLIN, 0}; !w->ready && ::poll(&p, 1, 0) == 0) {
    {
      MutexLock lock(&mu_);  // still starting: not waited for
      idle_.push_back(std::move(w));
    }
    idle_cv_.Signal();
    return Lease();
  }
  if (!CheckReady(w.get()).ok()) {
    FreeSlot();
    return Lease();
  }
  w->assigned = true;
  w->tenant = tenant;
  return Lease(this, std::move(w));
}

void NvrtcPool::StartSpare() {
  {
    MutexLock lock(&mu_);
    if (live_ >= options_.workers ||
        std::any_of(idle_.begin(), idle_.end(), [](const auto& i) { return !i->assigned; })) {
      return;
    }
    ++live_;
  }
  absl::StatusOr<std::unique_ptr<Worker>> w = Start();
  {
    MutexLock lock(&mu_);
    if (w.ok()) {
      idle_.push_back(*std::move(w));
    } else {
      --live_;
    }
  }
  idle_cv_.Signal();
}

void NvrtcPool::CountSplit() {
  MutexLock lock(&mu_);
  ++stats_.split_compiles;
}

NvrtcPool::Lease::Lease(NvrtcPool* pool, std::unique_ptr<Worker> w)
    : pool_(pool), w_(std::move(w)) {}

NvrtcPool::Lease::Lease(Lease&& other) noexcept { *this = std::move(other); }

NvrtcPool::Lease& NvrtcPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    w_ = std::move(other.w_);
    last_ = std::move(other.last_);
  }
  return *this;
}

NvrtcPool::Lease::~Lease() { Release(); }

void NvrtcPool::Lease::Release() {
  if (pool_ == nullptr) return;
  NvrtcPool* pool = std::exchange(pool_, nullptr);
  pool->Finish(std::move(w_), last_);
  pool->StartSpare();
}

absl::StatusOr<GpuCompileOutput> NvrtcPool::Lease::Compile(const GpuCompileRequest& request) {
  if (w_ == nullptr) return absl::UnavailableError("the NVRTC worker is gone");
  const std::string payload = EncodeGpuRequest(request);
  if (payload.size() >= nvrtc_wire::kMaxRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the GPU compile request is over ",
                                                   nvrtc_wire::kMaxRequestBytes >> 20, " MiB"));
  }
  const pid_t pid = w_->pid;
  absl::StatusOr<GpuCompileOutput> out = pool_->Run(&w_, payload);
  last_ = out.status();
  if (w_ != nullptr) ++w_->compiles;
  if (out.ok()) out->worker_pid = pid;
  return out;
}

absl::StatusOr<GpuCompileOutput> NvrtcPool::Run(std::unique_ptr<Worker>* w,
                                                const std::string& payload) {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.timeout_ms);
  absl::Status s = frame_io::WriteFrame((*w)->fd, nvrtc_wire::kToWorker, nvrtc_wire::kRequest,
                                        payload, deadline);
  frame_io::Frame f;
  if (s.ok()) s = frame_io::ReadFrame((*w)->fd, nvrtc_wire::kFromWorker, deadline, &f);
  if (absl::IsDeadlineExceeded(s)) {
    End(std::move(*w));
    MutexLock lock(&mu_);
    ++stats_.compiles;
    ++stats_.timeouts;
    return absl::DeadlineExceededError(absl::StrCat(
        "the GPU compile ran past ", options_.timeout_ms, " ms and was stopped"));
  }
  if (s.ok() && f.type != nvrtc_wire::kResult) s = absl::DataLossError("not a result");
  if (!s.ok()) return Died(w, s);
  absl::StatusOr<GpuCompileOutput> out = DecodeGpuResult(f.body);
  MutexLock lock(&mu_);
  ++stats_.compiles;
  if (out.ok()) {
    stats_.pch_used += out->pch_used;
    stats_.pch_created += out->pch_created;
  }
  return out;
}

absl::Status NvrtcPool::Died(std::unique_ptr<Worker>* w, const absl::Status& why) {
  // Cut short (it ended) or out of step (it broke the protocol: killed now).
  // An exit that had already begun keeps its own status.
  absl::StatusOr<subprocess::Exit> e =
      subprocess::Reap((*w)->pid, absl::ZeroDuration(), /*kill_group=*/true);
  w->reset();
  {
    MutexLock lock(&mu_);
    ++stats_.compiles;
    ++stats_.crashes;
  }
  const int status = e.ok() ? e->wait_status : 0;
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  if (absl::IsDataLoss(why) || absl::IsResourceExhausted(why)) {
    Logger("gpu")->warn("an NVRTC worker broke its protocol: {}; killed", why.ToString());
    return absl::InternalError("the NVRTC sandbox sent a malformed answer and was stopped");
  }
  if (sig == SIGKILL || sig == SIGSEGV || sig == SIGABRT || sig == SIGBUS) {
    // NVRTC under RLIMIT_AS dies in many ways when memory runs out (SIGBUS:
    // a file it maps in the full PCH tmpfs).
    return absl::ResourceExhaustedError(absl::StrCat(
        "the GPU compiler died (signal ", sig, "), most likely out of memory (limit ",
        options_.memory_limit_bytes >> 20, " MiB)"));
  }
  return absl::InternalError(absl::StrCat("the GPU compiler's sandbox ended without an answer (",
                                          WIFEXITED(status) ? "exit " : "signal ",
                                          WIFEXITED(status) ? WEXITSTATUS(status) : sig, ")"));
}

void NvrtcPool::Finish(std::unique_ptr<Worker> w, const absl::Status& status) {
  const char* why = nullptr;
  uint64_t size = 0;
  if (w != nullptr) {
    if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) {
      why = "an error";  // out of memory, or NVRTC's own failure: not kept
    } else if (options_.recycle_after_compiles > 0 &&
               w->compiles >= options_.recycle_after_compiles) {
      why = "compiles";
    } else if (kRecycleBySize && options_.recycle_memory_bytes > 0 &&
               (size = subprocess::AddressSpaceBytes(w->pid)) >= options_.recycle_memory_bytes) {
      why = "size";
    }
  }
  if (w != nullptr && why == nullptr) {
    {
      MutexLock lock(&mu_);
      idle_.push_back(std::move(w));
    }
    idle_cv_.Signal();
    return;
  }
  if (w != nullptr) {
    Logger("gpu")->debug("recycling NVRTC worker {} after {} compiles ({} MiB, by {})", w->pid,
                         w->compiles, size >> 20, why);
    End(std::move(w));
  }
  {
    MutexLock lock(&mu_);
    --live_;
    if (why != nullptr) ++stats_.recycled;
  }
  idle_cv_.Signal();
}

}  // namespace opjit::gpu

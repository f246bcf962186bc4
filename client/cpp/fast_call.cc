#include "client/cpp/fast_call.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"

namespace opjit::client {
namespace {

using fast::Header;
using fast::Slot;

// How long a sleeping client waits on its slot before it looks at the
// channel's health (closed flag, executor alive).
constexpr int64_t kWaitSliceNs = 50'000'000;
// After the executor is seen dead, how long the daemon gets to write the
// call's status and close the channel before the client gives up on it.
constexpr int64_t kDeathGraceNs = 3'000'000'000;
// Past the call's deadline, how long the client waits for the daemon to
// stop the executor and answer DEADLINE_EXCEEDED itself.
constexpr int64_t kDeadlineGraceNs = 5'000'000'000;
// Most cached call shapes per client; past it the cache starts over.
constexpr size_t kMaxCachedHandles = 1024;

// Spinning pays only while the executor has a core to run on: with more
// waiters spinning than spare cores, the spinners take the executor's CPU
// and every call waits for a time slice. At most this many threads of the
// process spin at once (half the cores, at least one); the others sleep on
// the futex at once.
std::atomic<int> g_spinners{0};
int MaxSpinners() {
  static const int n = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2);
  return n;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

std::string NsKey(const std::string& ns) { return ns.empty() ? "default" : ns; }

void AppendField(std::string* key, std::string_view field) {
  absl::StrAppend(key, field.size(), ":", absl::string_view(field.data(), field.size()), ";");
}

// A call shape, as the server's call-shape cache keys it: everything that
// Prepare checks. Fields are length-prefixed, so no two shapes collide.
std::string ShapeKey(const v1::ForwardRequest& req) {
  std::string key;
  AppendField(&key, NsKey(req.namespace_()));
  AppendField(&key, req.op());
  AppendField(&key, absl::StrCat(req.version()));
  AppendField(&key, absl::AsciiStrToUpper(req.target()));
  for (const auto& arg : req.inputs()) {
    absl::StrAppend(&key, "[", arg.tensors_size());
    for (const auto& t : arg.tensors()) {
      AppendField(&key, t.dtype());
      for (int64_t d : t.shape()) absl::StrAppend(&key, d, ",");
    }
    key += "]";
  }
  // Attrs sorted by name; an AttrValue has no map fields, so its encoding
  // is deterministic.
  std::map<std::string, const v1::AttrValue*> attrs;
  for (const auto& [name, value] : req.attrs()) attrs[name] = &value;
  for (const auto& [name, value] : attrs) {
    AppendField(&key, name);
    AppendField(&key, value->SerializeAsString());
  }
  return key;
}

uint64_t Align64(uint64_t x) { return (x + 63) & ~uint64_t{63}; }

bool IsReason(const absl::Status& s, absl::StatusCode code, std::string_view reason) {
  if (s.code() != code) return false;
  auto r = GetReason(s);
  return r.has_value() && r->reason == reason;
}

}  // namespace

absl::StatusOr<FastMode> ParseFastMode(const std::string& text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t.empty() || t == "auto") return FastMode::kAuto;
  if (t == "on" || t == "1" || t == "true" || t == "yes") return FastMode::kOn;
  if (t == "off" || t == "0" || t == "false" || t == "no") return FastMode::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("fast mode \"", text, "\": expected auto, on (1) or off (0)"));
}

// ---------------------------------------------------------------------------
// FastChannel

absl::StatusOr<std::unique_ptr<FastChannel>> FastChannel::Map(
    const v1::OpenChannelResponse& info) {
  if (info.byte_size() < fast::kHeaderBytes) {
    return absl::InternalError(absl::StrCat("fast channel of ", info.byte_size(),
                                            " bytes is smaller than its header"));
  }
  const std::string path = "/dev/shm" + info.shm_key();
  if (info.shm_key().empty() || info.shm_key()[0] != '/' ||
      info.shm_key().find('/', 1) != std::string::npos) {
    return absl::InternalError(absl::StrCat("bad fast channel key \"", info.shm_key(), "\""));
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open fast channel ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < info.byte_size()) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("fast channel ", path, " is smaller than ",
                                            info.byte_size(), " bytes"));
  }
  void* base = mmap(nullptr, info.byte_size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat("cannot map fast channel ", path, ": ",
                                               std::strerror(errno)));
  }
  const Header* h = fast::HeaderOf(base);
  // The layout is fixed by fast_channel.h; refuse anything else rather than
  // guess at offsets.
  const uint32_t slots = std::min(info.slots(), h->n_slots);
  const uint32_t max_tensors = std::min(info.max_tensors(), h->max_tensors);
  if (h->magic != fast::kMagic || h->version != fast::kVersion ||
      h->slot_bytes != fast::kSlotBytes || slots == 0 || max_tensors == 0 ||
      max_tensors > fast::kMaxTensors ||
      fast::kHeaderBytes + uint64_t{slots} * fast::kSlotBytes > info.byte_size()) {
    munmap(base, info.byte_size());
    return absl::FailedPreconditionError(absl::StrCat(
        "fast channel ", info.shm_key(), " has an unknown layout (magic ", h->magic, ", version ",
        h->version, ", ", h->n_slots, " slots of ", h->slot_bytes, " bytes)"));
  }
  return std::unique_ptr<FastChannel>(new FastChannel(info, base, slots, max_tensors));
}

FastChannel::FastChannel(v1::OpenChannelResponse info, void* base, uint32_t slots,
                         uint32_t max_tensors)
    : info_(std::move(info)),
      base_(base),
      slots_(slots),
      max_tensors_(max_tensors),
      spin_ns_(std::max<int64_t>(0, info_.spin_us()) * 1000),
      daemon_(info_.daemon_pid(), fast::kDaemonComm) {
  for (int i = static_cast<int>(slots_) - 1; i >= 0; --i) free_.push_back(i);
}

FastChannel::~FastChannel() { munmap(base_, info_.byte_size()); }

bool FastChannel::closed() const {
  return broken_.load() || fast::HeaderOf(base_)->closed.load(std::memory_order_acquire) != 0;
}

int FastChannel::TakeSlot() {
  MutexLock lock(&mu_);
  while (free_.empty()) slot_freed_.Wait(&mu_);
  const int slot = free_.back();
  free_.pop_back();
  return slot;
}

void FastChannel::GiveSlot(int slot) {
  {
    MutexLock lock(&mu_);
    free_.push_back(slot);
  }
  slot_freed_.Signal();
}

bool FastChannel::WorkerGone() const {
  // Exited, or not yet reaped by its parent: a zombie serves nothing.
  return fast::PidGone(static_cast<int>(info_.worker_pid()));
}

FastChannel::Result FastChannel::Call(uint64_t handle, std::span<const FastTensorRef> tensors,
                                      int64_t deadline_ns, uint32_t flags) {
  Result out;
  if (tensors.size() > max_tensors_) {
    out.status = absl::InvalidArgumentError(absl::StrCat(
        "a fast call takes at most ", max_tensors_, " tensors; got ", tensors.size()));
    return out;
  }
  if (closed()) {
    out.status = absl::UnavailableError("the fast channel is closed");
    out.not_run = true;
    return out;
  }
  Header* h = fast::HeaderOf(base_);
  const int index = TakeSlot();
  Slot* s = fast::SlotAt(base_, static_cast<uint32_t>(index));
  uint64_t seq;
  {
    MutexLock lock(&mu_);
    seq = next_seq_++;
  }
  // The slot is ours (client-local bookkeeping); a slot the executor still
  // holds would be a protocol break: never reuse it.
  if (s->state.load() != fast::kFree) {
    broken_ = true;
    out.status = absl::UnavailableError(
        absl::StrCat("fast channel slot ", index, " is not free (state ", s->state.load(), ")"));
    out.not_run = true;
    return out;
  }
  s->handle = handle;
  s->seq = seq;
  s->deadline_ns = deadline_ns;
  s->n_tensors = static_cast<uint32_t>(tensors.size());
  s->flags = flags;
  for (size_t i = 0; i < tensors.size(); ++i) {
    s->tensors[i].region = tensors[i].region;
    s->tensors[i].offset = tensors[i].offset;
  }
  s->client_waiting.store(0, std::memory_order_relaxed);
  s->state.store(fast::kSubmitted, std::memory_order_seq_cst);
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->worker_sleeping.load(std::memory_order_seq_cst) != 0) fast::FutexWake(&h->doorbell);

  // Spin first: a wake-up costs far more than a short kernel.
  uint32_t state = s->state.load(std::memory_order_acquire);
  if (state != fast::kDone && spin_ns_ > 0) {
    if (g_spinners.fetch_add(1, std::memory_order_relaxed) < MaxSpinners()) {
      const int64_t spin_end = fast::MonotonicNs() + spin_ns_;
      for (int i = 0; (state = s->state.load(std::memory_order_acquire)) != fast::kDone; ++i) {
        CpuRelax();
        if ((i & 63) == 63 && fast::MonotonicNs() > spin_end) break;
      }
    }
    g_spinners.fetch_sub(1, std::memory_order_relaxed);
  }
  // Then sleep on the slot's state, announced by client_waiting.
  int64_t dead_since = 0;
  while (state != fast::kDone) {
    s->client_waiting.store(1, std::memory_order_seq_cst);
    state = s->state.load(std::memory_order_seq_cst);
    if (state == fast::kDone) break;
    const bool is_closed = h->closed.load(std::memory_order_seq_cst) != 0;
    if (is_closed || dead_since != 0) {
      // The daemon answers calls in flight when it closes a channel; a call
      // still waiting to be taken never ran: take it back.
      uint32_t expected = fast::kSubmitted;
      if (state == fast::kSubmitted &&
          s->state.compare_exchange_strong(expected, fast::kFree, std::memory_order_seq_cst)) {
        s->client_waiting.store(0);
        GiveSlot(index);
        if (!is_closed) broken_ = true;
        out.status = absl::UnavailableError("the fast channel closed before the call ran");
        out.not_run = true;
        return out;
      }
      state = expected == fast::kSubmitted ? s->state.load() : expected;
      if (state == fast::kDone) break;
    }
    const int64_t now = fast::MonotonicNs();
    if (dead_since != 0 && now - dead_since > kDeathGraceNs) {
      // Nobody will answer; the slot may still be written: retire the channel.
      broken_ = true;
      out.status = WithReason(
          absl::UnavailableError(absl::StrCat("the fast channel's executor (pid ", worker_pid(),
                                              ") died and the daemon did not answer the call")),
          reason::kWorkerUnavailable);
      return out;
    }
    if (deadline_ns != 0 && now > deadline_ns + kDeadlineGraceNs) {
      broken_ = true;
      out.status = absl::DeadlineExceededError(
          "the fast call's deadline passed and the executor did not answer");
      return out;
    }
    fast::FutexWait(&s->state, state, kWaitSliceNs);
    state = s->state.load(std::memory_order_seq_cst);
    if (state != fast::kDone && daemon_.Exited() &&
        (state = s->state.load(std::memory_order_seq_cst)) != fast::kDone) {
      // Nobody is left to answer (its executors die with it): say so now,
      // not after the executor's grace. The slot is never used again.
      broken_ = true;
      out.status = WithReason(
          absl::UnavailableError(absl::StrCat("opjitd (pid ", daemon_.pid(),
                                              ") exited; the call was not answered")),
          reason::kDaemonExited);
      return out;
    }
    if (state != fast::kDone && dead_since == 0 && (is_closed || WorkerGone())) {
      dead_since = fast::MonotonicNs();
    }
  }

  // The reply.
  const int32_t code = s->code;
  const double kernel_ms = s->kernel_ms;
  const uint64_t echoed = s->seq;
  const uint32_t message_len = std::min<uint32_t>(s->message_len, fast::kMessageBytes);
  std::string message(s->message, message_len);
  std::string reason(s->reason, strnlen(s->reason, fast::kReasonBytes));
  s->client_waiting.store(0, std::memory_order_relaxed);
  s->state.store(fast::kFree, std::memory_order_seq_cst);
  GiveSlot(index);

  if (echoed != seq) {
    broken_ = true;
    out.status = absl::InternalError(
        absl::StrCat("fast channel reply for call ", echoed, " in the slot of call ", seq));
    return out;
  }
  if (code < 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    out.status = absl::InternalError(absl::StrCat("fast channel reply with code ", code, ": ", message));
    return out;
  }
  if (code != 0) {
    out.status = absl::Status(static_cast<absl::StatusCode>(code), message);
    if (!reason.empty()) out.status = WithReason(out.status, reason);
    return out;
  }
  out.kernel_ms = kernel_ms;
  return out;
}

// ---------------------------------------------------------------------------
// Client: the fast path.

namespace {

// The open channel of `ns`, opened (or reopened, when the last one closed)
// on demand.
absl::StatusOr<std::shared_ptr<FastChannel>> GetChannel(Client& client, FastState& st,
                                                        const std::string& ns) {
  const std::string key = NsKey(ns);
  {
    MutexLock lock(&st.mu);
    auto it = st.channels.find(key);
    if (it != st.channels.end() && !it->second->closed()) return it->second;
    auto refused = st.no_channel.find(key);
    if (refused != st.no_channel.end()) return refused->second;
  }
  MutexLock opening(&st.open_mu);
  std::shared_ptr<FastChannel> old;
  {
    MutexLock lock(&st.mu);
    auto it = st.channels.find(key);
    if (it != st.channels.end()) {
      if (!it->second->closed()) return it->second;  // another thread reopened it
      old = it->second;
      st.channels.erase(it);
    }
  }
  // A closed channel's region goes with it (the daemon may have dropped it
  // already: NOT_FOUND is fine).
  if (old != nullptr) (void)client.UnregisterRegion(ns, old->region());
  auto info = client.OpenChannel(ns);
  if (!info.ok()) {
    // Kernels run in the daemon: this server has no fast path; stay on gRPC.
    if (info.status().code() == absl::StatusCode::kUnimplemented) {
      MutexLock lock(&st.mu);
      st.no_channel[key] = info.status();
    }
    return info.status();
  }
  auto channel = FastChannel::Map(*info);
  if (!channel.ok()) {
    (void)client.UnregisterRegion(ns, info->region());
    return channel.status();
  }
  std::shared_ptr<FastChannel> shared = *std::move(channel);
  MutexLock lock(&st.mu);
  st.channels[key] = shared;
  return shared;
}

void DropChannel(FastState& st, const std::string& ns, const FastChannel* ch) {
  MutexLock lock(&st.mu);
  auto it = st.channels.find(NsKey(ns));
  if (it != st.channels.end() && it->second.get() == ch) st.channels.erase(it);
}

// The outcome of RunOnChannel.
struct ChannelCall {
  absl::Status status;
  double kernel_ms = 0;
  // No channel could be opened, so the call never ran (gRPC may serve it).
  bool no_channel = false;
  // More tensors than a slot of this channel holds: the call never ran.
  bool too_many = false;
};

// Runs one call on the channel of `ns`; a call that never ran because the
// channel closed goes once more on a freshly opened channel.
ChannelCall RunOnChannel(Client& client, FastState& st, const std::string& ns, uint64_t handle,
                         std::span<const FastTensorRef> tensors, int64_t deadline_ns,
                         uint32_t flags) {
  ChannelCall out;
  for (int attempt = 0;; ++attempt) {
    auto channel = GetChannel(client, st, ns);
    if (!channel.ok()) {
      out.status = channel.status();
      out.no_channel = true;
      return out;
    }
    if (tensors.size() > (*channel)->max_tensors()) {
      out.status = absl::InvalidArgumentError(absl::StrCat(
          "a fast call takes at most ", (*channel)->max_tensors(), " tensors; got ", tensors.size()));
      out.too_many = true;
      return out;
    }
    FastChannel::Result r = (*channel)->Call(handle, tensors, deadline_ns, flags);
    if (r.not_run && attempt == 0) continue;  // GetChannel reopens the closed channel
    out.status = r.status;
    out.kernel_ms = r.kernel_ms;
    return out;
  }
}

}  // namespace

bool Client::fast_enabled() const { return fast_->mode != FastMode::kOff && fast_->unix_socket; }

absl::StatusOr<PreparedCall> Client::PrepareHandle(const v1::PrepareRequest& request) {
  auto r = Prepare(request);
  if (!r.ok()) return r.status();
  PreparedCall call;
  call.ns = request.namespace_();
  call.handle = r->handle();
  call.version = r->version();
  call.inputs.assign(r->inputs().begin(), r->inputs().end());
  call.outputs.assign(r->outputs().begin(), r->outputs().end());
  call.fast = r->fast();
  return call;
}

absl::StatusOr<double> Client::CallPrepared(const PreparedCall& call,
                                            std::span<const FastTensorRef> tensors,
                                            std::chrono::nanoseconds deadline,
                                            bool keep_output_bytes) {
  if (!fast_enabled()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the fast path is off for this client (", address_,
        fast_->unix_socket ? ", fast = off)" : ": not a unix socket)"));
  }
  if (!call.fast) {
    return absl::FailedPreconditionError(
        "this handle cannot run on a fast channel (not a CPU kernel in an executor process)");
  }
  const int64_t budget = deadline.count() > 0
                             ? deadline.count()
                             : std::chrono::duration_cast<std::chrono::nanoseconds>(timeout_).count();
  ChannelCall r = RunOnChannel(*this, *fast_, call.ns, call.handle, tensors,
                               fast::MonotonicNs() + budget,
                               keep_output_bytes ? fast::kKeepOutputBytes : 0);
  if (!r.status.ok()) return r.status;
  return r.kernel_ms;
}

absl::StatusOr<uint64_t> Client::RegionId(const std::string& ns, const std::string& name) {
  const std::string key = NsKey(ns);
  {
    MutexLock lock(&fast_->mu);
    auto& ids = fast_->region_ids[key];
    if (auto it = ids.find(name); it != ids.end()) return it->second;
  }
  auto list = ListRegions(ns);
  if (!list.ok()) return list.status();
  MutexLock lock(&fast_->mu);
  auto& ids = fast_->region_ids[key];
  auto& foreign = fast_->foreign_regions[key];
  for (const auto& r : *list) {
    if (r.id() == 0) continue;  // a server without region ids
    if (r.client_id() == client_id_) {
      ids[r.name()] = r.id();
      foreign.erase(r.name());
    } else {
      foreign[r.name()] = true;
    }
  }
  if (auto it = ids.find(name); it != ids.end()) return it->second;
  if (foreign.count(name)) {
    return absl::PermissionDeniedError(
        absl::StrCat("region \"", name, "\" belongs to another client: not on the fast path"));
  }
  return WithReason(absl::NotFoundError(absl::StrCat("no region \"", name, "\" in namespace ", key)),
                    reason::kRegionNotRegistered);
}

std::optional<absl::StatusOr<v1::ForwardResponse>> Client::ForwardFast(
    const v1::ForwardRequest& req) {
  if (!fast_enabled() || req.handle() != 0) return std::nullopt;
  for (bool rg : req.requires_grad()) {
    if (rg) return std::nullopt;  // autograd contexts live on the gRPC path
  }
  if (!req.target().empty() && absl::AsciiStrToUpper(req.target()) != "CPU") return std::nullopt;
  if (req.outputs_size() == 0) return std::nullopt;  // inline outputs
  for (const auto& arg : req.inputs()) {
    for (const auto& t : arg.tensors()) {
      if (!t.has_shm()) return std::nullopt;
    }
  }
  for (const auto& o : req.outputs()) {
    if (!o.has_shm() && !o.has_alloc_in()) return std::nullopt;
  }
  const std::string ns = req.namespace_();
  const std::string key = ShapeKey(req);

  // The handle of this call shape, prepared on first use. Whatever Prepare
  // refuses goes over gRPC, which answers with the canonical error.
  auto prepared = [&](bool fresh) -> std::shared_ptr<const PreparedCall> {
    if (!fresh) {
      MutexLock lock(&fast_->mu);
      auto it = fast_->handles.find(key);
      if (it != fast_->handles.end()) return it->second;
    }
    v1::PrepareRequest p;
    p.set_namespace_(ns);
    p.set_op(req.op());
    p.set_version(req.version());
    p.set_target(req.target());
    for (const auto& arg : req.inputs()) {
      auto* in = p.add_inputs();
      for (const auto& t : arg.tensors()) {
        auto* spec = in->add_tensors();
        spec->set_dtype(t.dtype());
        *spec->mutable_shape() = t.shape();
      }
    }
    *p.mutable_attrs() = req.attrs();
    auto call = PrepareHandle(p);
    if (!call.ok()) return nullptr;
    auto shared = std::make_shared<const PreparedCall>(*std::move(call));
    MutexLock lock(&fast_->mu);
    if (fast_->handles.size() >= kMaxCachedHandles) fast_->handles.clear();
    fast_->handles[key] = shared;
    return shared;
  };
  auto forget = [&](const PreparedCall* stale) {
    MutexLock lock(&fast_->mu);
    auto it = fast_->handles.find(key);
    if (it != fast_->handles.end() && it->second.get() == stale) fast_->handles.erase(it);
  };

  std::shared_ptr<const PreparedCall> call = prepared(false);
  for (int attempt = 0;; ++attempt) {
    if (call == nullptr || !call->fast) return std::nullopt;
    const size_t n_out = call->outputs.size();
    if (!(static_cast<size_t>(req.outputs_size()) == n_out ||
          (req.outputs_size() == 1 && (n_out == 1 || req.outputs(0).has_alloc_in())))) {
      return std::nullopt;  // gRPC explains what is wrong with the placements
    }

    // The tensors: inputs in call order (with null slots where Prepare
    // counts an absent optional input), then outputs where the server would
    // put them.
    std::vector<FastTensorRef> refs;
    refs.reserve(call->inputs.size() + n_out);
    int flat = 0, absent = 0;
    for (const auto& arg : req.inputs()) {
      flat += arg.tensors_size();
      absent += arg.tensors_size() == 0 ? 1 : 0;
    }
    const bool null_slots = static_cast<int>(call->inputs.size()) == flat + absent && absent > 0;
    if (!null_slots && static_cast<int>(call->inputs.size()) != flat) return std::nullopt;
    for (const auto& arg : req.inputs()) {
      if (arg.tensors_size() == 0 && null_slots) refs.push_back({0, 0});
      for (const auto& t : arg.tensors()) {
        auto id = RegionId(ns, t.shm().region());
        if (!id.ok()) return std::nullopt;
        refs.push_back({*id, t.shm().offset()});
      }
    }
    std::vector<std::pair<std::string, uint64_t>> placed(n_out);
    std::string alloc_region;
    bool alloc_started = false;
    uint64_t cursor = 0;
    for (size_t j = 0; j < n_out; ++j) {
      const v1::OutputPlacement& o = req.outputs(req.outputs_size() == 1 ? 0 : static_cast<int>(j));
      const v1::ShmRef& where = o.has_shm() ? o.shm() : o.alloc_in();
      uint64_t offset = where.offset();
      if (o.has_alloc_in()) {
        // As the server does: 64-byte aligned after `offset`, one after
        // another while the outputs stay in one region.
        if (!alloc_started || alloc_region != where.region()) {
          alloc_started = true;
          alloc_region = where.region();
          cursor = Align64(where.offset());
        }
        offset = cursor;
        cursor = Align64(cursor + call->outputs[j].byte_size());
      }
      auto id = RegionId(ns, where.region());
      if (!id.ok()) return std::nullopt;
      refs.push_back({*id, offset});
      placed[j] = {where.region(), offset};
    }

    const auto t0 = std::chrono::steady_clock::now();
    const int64_t deadline_ns =
        fast::MonotonicNs() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout_).count();
    ChannelCall r = RunOnChannel(*this, *fast_, ns, call->handle, refs, deadline_ns,
                                 req.keep_output_bytes() ? fast::kKeepOutputBytes : 0);
    // More tensors than a slot holds (many dynamic inputs): gRPC serves it.
    if (r.too_many) return std::nullopt;
    if (r.no_channel) {
      // auto: this server or namespace offers no channel now; gRPC serves
      // the call. on: the fast path was required.
      if (fast_->mode != FastMode::kOn) return std::nullopt;
      return absl::StatusOr<v1::ForwardResponse>(
          Annotate(r.status, "the fast path is required (fast = on) but no channel opened: "));
    }
    if (!r.status.ok()) {
      if (IsReason(r.status, absl::StatusCode::kFailedPrecondition, reason::kStaleHandle) &&
          attempt == 0) {
        // The op changed in the registry: prepare the shape again, once.
        forget(call.get());
        call = prepared(true);
        continue;
      }
      if (IsReason(r.status, absl::StatusCode::kNotFound, reason::kRegionNotRegistered)) {
        // Our region ids are out of date (a lease lapsed, a region was made
        // again) and no kernel ran: forget them; gRPC answers by name.
        MutexLock lock(&fast_->mu);
        fast_->region_ids.erase(NsKey(ns));
        fast_->foreign_regions.erase(NsKey(ns));
        return std::nullopt;
      }
      return absl::StatusOr<v1::ForwardResponse>(r.status);
    }
    v1::ForwardResponse out;
    for (size_t j = 0; j < n_out; ++j) {
      v1::Tensor* t = out.add_outputs();
      t->set_dtype(call->outputs[j].dtype());
      *t->mutable_shape() = call->outputs[j].shape();
      t->mutable_shm()->set_region(placed[j].first);
      t->mutable_shm()->set_offset(placed[j].second);
    }
    out.set_kernel_ms(r.kernel_ms);
    out.set_server_ms(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    out.set_version(call->version);
    return absl::StatusOr<v1::ForwardResponse>(std::move(out));
  }
}

}  // namespace opjit::client

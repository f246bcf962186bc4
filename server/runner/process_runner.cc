#include "server/runner/process_runner.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/mutex.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/common/subprocess.h"
#include "server/compiler/kernel_compiler.h"
#include "proto/opjit/wire/fast_channel.h"
#include "server/runner/memory_cgroups.h"
#include "server/runner/worker_protocol.h"
#include "server/tensor/guarded_copy.h"
#include "server/tensor/region.h"


namespace opjit::runner {
namespace {

using Clock = std::chrono::steady_clock;

absl::Time ToAbsl(Clock::time_point t) {
  if (t == Clock::time_point::max()) return absl::InfiniteFuture();
  return absl::Now() + absl::FromChrono(t - Clock::now());
}

uint64_t Align64(uint64_t x) { return (x + 63) & ~uint64_t{63}; }

// Spinning yields the CPU to any other runnable thread (on a 2-core host the
// gRPC threads and the worker need it more than the spinner).
inline void CpuRelax() { ::sched_yield(); }

// The key crash streaks are kept under: namespace, label (op and version)
// and the kernel's content.
std::string QuarantineKey(const InstanceSpec& spec) {
  return absl::StrCat(spec.ns, "\x1f", spec.label, "\x1f", spec.kernel->cache_key);
}

// A short hash of an instance's attrs, naming the attr set a caller's
// crashing calls used (fair quarantine) without quoting the values.
std::string AttrsHash(const std::map<std::string, registry::AttrValue>& attrs) {
  std::string canon;
  for (const auto& [name, value] : attrs) {
    absl::StrAppend(&canon, name, "\x1f", registry::FormatAttrValue(value), "\x1e");
  }
  return Sha256Hex(canon).substr(0, 16);
}

// One executor process and its channel. Owned by exactly one thread at a
// time (the pool hands it out), so its members need no lock.
struct Worker {
  pid_t pid = -1;
  int sock = -1;
  int arena_fd = -1;
  void* map = nullptr;
  size_t map_bytes = 0;
  wire::SlotHeader* slot = nullptr;
  char* data = nullptr;  // the arena's data area
  uint64_t data_bytes = 0;
  uint64_t calls = 0;
  uint64_t arena_high = 0;  // bytes of the data area touched since last trimmed
  // /proc/<pid>/task, opened at spawn: its link count is 2 + the process's
  // threads (one fstat, no directory walk). -1 when /proc could not be read.
  int task_fd = -1;
  Clock::time_point last_used = Clock::now();
  // Why it died, once known ("" while alive).
  std::string death;
  bool killed_by_us = false;
  uint64_t peak_rss_bytes = 0;  // once reaped
  int term_signal = 0;          // once reaped: the signal that ended it, or 0
  // The instance whose code it ran first (Init, InferShape, calls), and
  // whether it has run any other since: a crash in an executor that ran
  // only the crashing kernel is that kernel's; one in an executor shared
  // with other kernels may be a neighbour's doing (fair quarantine).
  uint64_t first_instance = 0;
  bool shared = false;
  // Its scratch directory on the host ("" for none).
  std::string scratch;

  ~Worker() {
    RemoveScratch();
    if (map != nullptr) ::munmap(map, map_bytes);
    if (sock >= 0) ::close(sock);
    if (arena_fd >= 0) ::close(arena_fd);
    if (task_fd >= 0) ::close(task_fd);
  }

  // Its threads now; -1 when unknown.
  int Threads() const {
    struct stat st;
    if (task_fd < 0 || ::fstat(task_fd, &st) != 0 || st.st_nlink < 3) return -1;
    return static_cast<int>(st.st_nlink - 2);
  }

  // Reaps the process and records how it ended. With `kill` it is killed
  // at once; otherwise it gets `grace_ms` to finish dying (a closed channel
  // usually means it is), then it is killed anyway.
  void Reap(bool kill, int grace_ms = 0) {
    if (pid <= 0) return;
    absl::StatusOr<subprocess::Exit> e =
        subprocess::Reap(pid, kill ? absl::ZeroDuration() : absl::Milliseconds(grace_ms));
    if (e.ok()) {
      killed_by_us = e->killed;
      peak_rss_bytes = e->peak_rss_bytes();
      term_signal = e->signal();
      if (death.empty()) death = e->Describe();
    }
    pid = -1;
    RemoveScratch();
  }

  // Its scratch directory, with whatever it left there (nothing, with
  // namespaces: its tmpfs went with it).
  void RemoveScratch() {
    if (scratch.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(scratch, ec);
    scratch.clear();
  }
};

struct Pool {
  Mutex mu;
  CondVar cv;
  std::deque<std::unique_ptr<Worker>> idle ABSL_GUARDED_BY(mu);
  int live ABSL_GUARDED_BY(mu) = 0;  // idle + busy + starting
};

// What a worker said to a control request or a call.
struct Reply {
  int32_t code = 0;
  uint64_t need = 0;
  double kernel_ms = -1;  // calls only: the worker's measure
  uint64_t flushed_bytes = 0;  // calls only: what the worker flushed first
  std::string message;
  std::string payload;
};

// The most flushed bytes a worker's reply may claim (RunArgs::flushed_bytes).
constexpr uint64_t kMaxFlushReport = 1ull << 30;

// What the executor's fault handler wrote as it died (SlotHeader::fault),
// bounded and made printable; "" for nothing, or when it did not die of a
// fault. Only words for the message: a kernel can write the field too.
std::string FaultNote(const Worker& w) {
  if (w.slot == nullptr || (w.term_signal != SIGSEGV && w.term_signal != SIGBUS)) return "";
  const uint32_t n =
      std::min<uint32_t>(w.slot->fault_len.load(std::memory_order_acquire), wire::kFaultBytes);
  std::string note(w.slot->fault, n);
  for (char& c : note) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return note;
}

// Whether a call's region outputs keep their bytes (RunArgs; the worker's
// kKeepRegionOutputs): such a call is not run again after a crash.
bool KeepsOutputBytes(const RunArgs* args) {
  if (args == nullptr) return false;
  bool keep = false, zero = false;
  for (const TensorLoc& t : args->outputs) {
    if (const InRegion* in = t.in_region()) (in->keep_bytes ? keep : zero) = true;
  }
  return keep && !zero;
}

// `crash` (a DeathStatus), saying that it counted against no kernel: other
// kernels had run in its executor first, and the call did not run again.
absl::Status NotCounted(const absl::Status& crash) {
  const auto why = GetReason(crash);
  return WithReason(
      WithMessage(crash, absl::StrCat(crash.message(),
                                      ". The crash was not counted towards the kernel's "
                                      "quarantine: other kernels had run in its executor before "
                                      "it, and one of them may have corrupted it")),
      why ? why->reason : reason::kKernelCrashed,
      {{"cause", why && why->metadata.count("cause") ? why->metadata.at("cause") : "crash"},
       {"counted", "false"}});
}

// A frame to an executor could not be sent: it had died before (nothing it
// was sent since ran). Only Control and Call's sends say this.
constexpr char kNotReached[] = "the executor process is gone";
absl::Status NotReached() { return absl::UnavailableError(kNotReached); }
bool IsNotReached(const absl::Status& s) {
  return absl::IsUnavailable(s) && s.message() == kNotReached;
}

absl::Status StatusOf(const Reply& r) {
  if (r.code == 0) return absl::OkStatus();
  return wire::StatusFromReply(r.code, r.message);
}

}  // namespace

struct ProcessRunner::Impl : std::enable_shared_from_this<Impl> {
  ProcessRunnerOptions options;
  Mutex mu;
  std::map<std::string, std::unique_ptr<Pool>> pools ABSL_GUARDED_BY(mu);  // by namespace
  // With options.uid_first: each namespace's uid, taken on its first
  // worker (the lowest free), never given back.
  std::map<std::string, uint32_t> ns_uids ABSL_GUARDED_BY(mu);

  // The uid (and gid) of `ns`'s workers; RESOURCE_EXHAUSTED when every uid
  // of the range is taken. With no range: options.uid/gid.
  absl::StatusOr<std::pair<int64_t, int64_t>> IdsFor(const std::string& ns) {
    if (options.uid_first == 0) return std::pair<int64_t, int64_t>{options.uid, options.gid};
    MutexLock lock(&mu);
    auto it = ns_uids.find(ns);
    if (it == ns_uids.end() && options.claim_uid) {
      // The lowest uid of the range that neither a namespace here nor
      // another daemon on the host holds (UidClaims), held from now on.
      absl::StatusOr<uint32_t> claimed = options.claim_uid(options.uid_first, options.uid_last);
      if (!claimed.ok()) {
        Logger("runner")->error("namespace {}: no executor uid: {}", ns,
                                claimed.status().ToString());
        return WithReason(
            absl::Status(claimed.status().code(),
                         absl::StrCat("no executor uid is left for a new namespace: ",
                                      claimed.status().message())),
            reason::kWorkerUnavailable);
      }
      Logger("runner")->info("namespace {}: executors run as uid {} (claimed on this host)", ns,
                             *claimed);
      it = ns_uids.emplace(ns, *claimed).first;
    }
    if (it == ns_uids.end()) {
      // Never given back, so the lowest free is the next one.
      const uint64_t next = uint64_t{options.uid_first} + ns_uids.size();
      if (next > options.uid_last) {
        return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                              "no executor uid is left for a new namespace: all ",
                              ns_uids.size(), " of the server's range are taken")),
                          reason::kWorkerUnavailable);
      }
      it = ns_uids.emplace(ns, static_cast<uint32_t>(next)).first;
    }
    const int64_t gid = options.gid_first == 0
                            ? int64_t{it->second}
                            : int64_t{options.gid_first} + (it->second - options.uid_first);
    return std::pair<int64_t, int64_t>{it->second, gid};
  }
  // Fair quarantine: crashes in a row, per kernel (QuarantineKey) and per
  // caller principal. A caller that reaches options.quarantine_after has
  // the kernel quarantined for itself alone; once options.quarantine_callers
  // callers that are not readers have, it is quarantined for everyone.
  struct CallerCrashes {
    int streak = 0;
    bool quarantined = false;
    bool reader = false;
    std::string attrs;  // AttrsHash of its last crashing call
  };
  struct KernelCrashes {
    std::map<std::string, CallerCrashes> callers;  // by principal
    bool everyone = false;
  };
  std::map<std::string, KernelCrashes> crash_streak ABSL_GUARDED_BY(mu);  // by quarantine key
  // Each namespace's memory cap over all of its executors; null: none.
  std::unique_ptr<MemoryCgroups> cgroups;
  std::map<std::string, uint64_t> oom_kills_seen ABSL_GUARDED_BY(mu);  // by namespace
  std::atomic<uint64_t> next_instance_id{1};
  // Where workers without namespaces get their scratch directories: this
  // runner's own directory under options.host.scratch_dir (never anything
  // else there: that may be a shared directory such as /tmp).
  std::string scratch_root;
  std::atomic<uint64_t> scratch_serial{0};  // names workers' scratch directories
  std::atomic<uint64_t> started{0}, crashes{0}, timeouts{0}, quarantined{0}, live{0};
  // Executors stopped for keeping more than options.threads_per_executor
  // threads: a pool worker when its call ended (Release), or one that no
  // call ran in (the watcher, or a fast channel's own thread).
  std::atomic<uint64_t> thread_cap_stops_after_call{0}, thread_cap_stops_idle{0};

  // The thread watcher: every options.thread_watch_ms, counts the threads
  // of every idle pool worker (one fstat each, under its pool's lock, never
  // on a call's path) and stops those over the cap. Started by Create when
  // the cap is on; stopped by ~ProcessRunner.
  std::thread watcher;
  Mutex watch_mu;
  CondVar watch_cv;
  bool watch_stop ABSL_GUARDED_BY(watch_mu) = false;
  void WatchThreads() {
    MutexLock lock(&watch_mu);
    while (!watch_stop) {
      const auto next =
          std::chrono::steady_clock::now() + std::chrono::milliseconds(options.thread_watch_ms);
      while (!watch_stop && watch_cv.WaitUntil(&watch_mu, next)) {
      }
      if (watch_stop) return;
      lock.Unlock();
      StopIdleOverThreads();
      lock.Lock();
    }
  }
  // One round of the watcher; how many idle workers it stopped.
  int StopIdleOverThreads();

  Pool* PoolFor(const std::string& ns) {
    MutexLock lock(&mu);
    auto& p = pools[ns];
    if (!p) p = std::make_unique<Pool>();
    return p.get();
  }

  // A new worker of `ns`; with `channel`, one that serves that fast
  // channel's ring (mapped from fd 5) instead of the daemon's slot.
  absl::StatusOr<std::unique_ptr<Worker>> Spawn(const std::string& ns,
                                                const tensor::Region* channel = nullptr,
                                                int64_t channel_spin_us = 0);
  // Spawn's parts: the worker's arena, and how its process is started.
  absl::Status MapArena(Worker& w);
  subprocess::SpawnOptions ExecutorSpawnOptions(const std::string& ns,
                                                const tensor::Region* channel,
                                                int64_t channel_spin_us,
                                                const std::string& scratch, int64_t uid,
                                                int64_t gid, bool isolated, bool userns,
                                                bool own_pids, int child_sock, int arena_fd) const;
  // How a worker that stopped answering ended, as the status of the call it
  // ran (ABORTED or RESOURCE_EXHAUSTED, reason KERNEL_CRASHED); reaps it.
  absl::Status DeathStatus(Worker& w, const absl::Status& s, const std::string& label,
                           const std::string& ns);
  // A call stopped at its deadline (`by_call`) or the kernel time limit.
  absl::Status TimeoutStatus(bool by_call) const {
    return WithReason(absl::DeadlineExceededError(absl::StrCat(
                          "the kernel ran past ",
                          by_call ? std::string("the call's deadline")
                                  : absl::StrCat("the server's kernel time limit (",
                                                 options.kernel_timeout_ms, " ms)"),
                          "; its executor process was stopped")),
                      reason::kKernelTimeout);
  }
  // An idle worker of `ns`, or a new one; waits for one until `deadline`.
  // With `fresh`, always a newly started one (an idle worker is stopped to
  // make room when the pool is full).
  absl::StatusOr<std::unique_ptr<Worker>> Acquire(const std::string& ns, Clock::time_point deadline,
                                                  bool fresh = false);
  void Release(const std::string& ns, std::unique_ptr<Worker> w);
  // A worker that is not coming back: reaped (killed first if `kill`).
  void Discard(const std::string& ns, std::unique_ptr<Worker>& w, bool kill);

  // Sends a control frame and waits for the reply. On a channel failure the
  // worker is reaped and the status says how it ended.
  absl::StatusOr<Reply> Control(Worker& w, wire::Msg type, const std::string& payload,
                                Clock::time_point deadline, int fd = -1);
  // Posts the call in the slot and waits for it.
  absl::StatusOr<Reply> Call(Worker& w, Clock::time_point deadline, int64_t spin_us);

  // OK unless the kernel is quarantined for `caller` or for everyone.
  absl::Status QuarantineCheck(const std::string& key, const Caller& caller) {
    MutexLock lock(&mu);
    auto it = crash_streak.find(key);
    if (it == crash_streak.end()) return absl::OkStatus();
    if (it->second.everyone) {
      return WithReason(absl::FailedPreconditionError(absl::StrCat(
                            "the kernel is quarantined for every caller: it crashed its executor "
                            "process ", options.quarantine_after, " times in a row on the calls "
                            "of each of ", options.quarantine_callers, " or more principals; fix "
                            "it and register the op again (or an admin lifts it: opjit "
                            "unquarantine OP)")),
                        reason::kKernelQuarantined, {{"scope", "everyone"}});
    }
    auto c = it->second.callers.find(caller.principal);
    if (c == it->second.callers.end() || !c->second.quarantined) return absl::OkStatus();
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "the kernel is quarantined for you (principal \"", caller.principal,
            "\"): your calls crashed its executor process ", c->second.streak,
            " times in a row (attrs sha256 ", c->second.attrs,
            "); other callers still run it. Check the inputs and attrs you pass; the quarantine "
            "lifts when the op is registered again, or when an admin runs: opjit unquarantine "
            "OP")),
        reason::kKernelQuarantined,
        {{"scope", "caller"}, {"principal", caller.principal}, {"attrs_sha256", c->second.attrs}});
  }
  // One crash of the kernel on `caller`'s call, whose instance has attrs
  // `attrs` (AttrsHash).
  void NoteCrash(const std::string& key, const std::string& label, const std::string& ns,
                 const Caller& caller, const std::string& attrs) {
    MutexLock lock(&mu);
    KernelCrashes& k = crash_streak[key];
    CallerCrashes& c = k.callers[caller.principal];
    c.reader = caller.reader;
    c.attrs = attrs;
    if (++c.streak < options.quarantine_after || c.quarantined) return;
    c.quarantined = true;
    quarantined.fetch_add(1);
    // The op's owner reads this (the log, opjit_quarantined_kernels_total).
    Logger("runner")->warn("{} (namespace {}): quarantined for caller \"{}\"{} after {} crashes "
                           "in a row of its calls (attrs sha256 {}); other callers still run it",
                           label, ns, caller.principal, caller.reader ? " (a reader)" : "",
                           c.streak, attrs);
    if (k.everyone) return;
    int writers = 0;
    for (const auto& [who, cc] : k.callers) writers += cc.quarantined && !cc.reader;
    if (writers < options.quarantine_callers) return;
    k.everyone = true;
    quarantined.fetch_add(1);
    Logger("runner")->warn("{} (namespace {}): quarantined for every caller: its calls crashed "
                           "{} times in a row for each of {} principals that are not readers",
                           label, ns, options.quarantine_after, writers);
  }
  // Forgets the crash streaks of every version of `op` ("ns/name"), in
  // every namespace that calls it; how many kernels were quarantined.
  int LiftQuarantine(const std::string& op) {
    const std::string prefix = absl::StrCat("\x1f", op, " v");
    MutexLock lock(&mu);
    int lifted = 0;
    for (auto it = crash_streak.begin(); it != crash_streak.end();) {
      const size_t at = it->first.find('\x1f');
      if (at != std::string::npos && it->first.compare(at, prefix.size(), prefix) == 0) {
        bool any = it->second.everyone;
        for (const auto& [who, c] : it->second.callers) any = any || c.quarantined;
        lifted += any;
        it = crash_streak.erase(it);
      } else {
        ++it;
      }
    }
    return lifted;
  }
  // A call of `caller` succeeded: its streak starts again.
  void NoteSuccess(const std::string& key, const Caller& caller) {
    MutexLock lock(&mu);
    auto it = crash_streak.find(key);
    if (it == crash_streak.end()) return;
    auto c = it->second.callers.find(caller.principal);
    if (c == it->second.callers.end() || c->second.quarantined) return;
    it->second.callers.erase(c);
    if (it->second.callers.empty() && !it->second.everyone) crash_streak.erase(it);
  }
  // Whether idle worker `w` of `ns` died since its last call (killed from
  // outside, the OOM killer): its channel hung up before a call was sent.
  // Then it is reaped and discarded, counted against no kernel.
  bool DiedIdle(const std::string& ns, std::unique_ptr<Worker>& w) {
    pollfd p{w->sock, POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) <= 0 || !(p.revents & (POLLHUP | POLLRDHUP | POLLERR))) return false;
    (void)IdleDeath(ns, w);
    return true;
  }
  // `w` died between calls (before this call reached it): reaped, logged
  // and discarded; no crash is counted. The status a call gets if it
  // cannot run elsewhere.
  absl::Status IdleDeath(const std::string& ns, std::unique_ptr<Worker>& w) {
    const pid_t pid = w->pid;
    w->Reap(/*kill=*/false, /*grace_ms=*/200);
    Logger("runner")->warn("namespace {}: idle executor process {} {} before a call reached it "
                           "(killed from outside?); the call runs in a fresh one, and no crash is "
                           "counted against any kernel",
                           ns, pid, w->death.empty() ? "died" : w->death);
    Discard(ns, w, /*kill=*/true);
    return WithReason(absl::UnavailableError(
                          "the executor process died while idle, before the call reached it "
                          "(killed from outside opjitd); nothing was counted against the kernel; "
                          "call again"),
                      reason::kWorkerUnavailable, {{"cause", "idle"}});
  }
};

// Its arena: a sealed memfd of the slot and options.arena_bytes, mapped.
absl::Status ProcessRunner::Impl::MapArena(Worker& w) {
  w.arena_fd = ::memfd_create("opjit-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (w.arena_fd < 0) {
    return absl::UnavailableError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  w.map_bytes = wire::kSlotBytes + options.arena_bytes;
  // Sealed: the worker (and any kernel in it) can neither shrink nor grow
  // it, so the daemon's reads of it never fault.
  if (::ftruncate(w.arena_fd, static_cast<off_t>(w.map_bytes)) != 0 ||
      ::fcntl(w.arena_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::UnavailableError(absl::StrCat("arena: ", std::strerror(errno)));
  }
  w.map = ::mmap(nullptr, w.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, w.arena_fd, 0);
  if (w.map == MAP_FAILED) {
    w.map = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("arena mmap: ", std::strerror(errno)));
  }
  w.slot = static_cast<wire::SlotHeader*>(w.map);
  new (w.slot) wire::SlotHeader();
  w.data = static_cast<char*>(w.map) + wire::kSlotBytes;
  w.data_bytes = options.arena_bytes;
  return absl::OkStatus();
}

// How an executor of `ns` is started: its flags, environment and
// descriptors (`child_sock` on 3, `arena_fd` on 4, the channel's on 5).
subprocess::SpawnOptions ProcessRunner::Impl::ExecutorSpawnOptions(
    const std::string& ns, const tensor::Region* channel, int64_t channel_spin_us,
    const std::string& scratch, int64_t uid, int64_t gid, bool isolated, bool userns,
    bool own_pids, int child_sock, int arena_fd) const {
  std::vector<std::string> args = {
      subprocess::kParentPidFlag, std::to_string(::getpid()),
      "--arena-bytes", std::to_string(options.arena_bytes),
      "--memory-bytes", std::to_string(options.memory_bytes),
      // In a user namespace it already is who it runs as (the spawn chose).
      "--uid", std::to_string(userns ? -1 : uid),
      "--gid", std::to_string(userns ? -1 : gid),
      "--userns", userns ? "1" : "0",
      "--max-threads", std::to_string(options.threads_per_executor),
      // RLIMIT_NPROC counts per uid: a cap for the namespace only when the
      // uid is the namespace's alone.
      // In a user namespace of its own it counts that namespace's, i.e. its
      // own threads: a cap per executor.
      "--max-processes",
      std::to_string(options.uid_first != 0 || userns ? options.threads_per_namespace : 0),
      "--spin-us", std::to_string(channel != nullptr ? channel_spin_us : options.spin_us),
      "--scratch-dir", scratch,
      "--scratch-bytes", std::to_string(options.scratch_bytes),
      "--isolate", isolated ? "1" : "0",
      "--namespace", ns,
  };
  if (channel != nullptr) {
    args.push_back("--channel-bytes");
    args.push_back(std::to_string(channel->size()));
  }
  for (const auto& lib : options.host.allowed_libraries) {
    args.push_back("--allow-library");
    args.push_back(lib);
  }
  for (const auto& p : options.read_only_paths) {
    args.push_back("--read-only");
    args.push_back(p);
  }
  // A clean environment: nothing of the daemon's reaches a kernel, but for
  // the operator's choice of CUDA driver library (readable in the sandbox).
  std::vector<std::string> env = {"PATH=/usr/bin:/bin"};
  // Its scratch space, where tmpfile() and mkstemp() look.
  if (!scratch.empty()) env.push_back("TMPDIR=" + scratch);
  if (const char* driver = std::getenv("OPJIT_CUDA_DRIVER"); driver != nullptr && *driver) {
    env.push_back(absl::StrCat("OPJIT_CUDA_DRIVER=", driver));
    args.push_back("--read-only");
    args.push_back(driver);
  }
  if (const char* v = std::getenv(kNoZeroFillEnv); v != nullptr) {
    env.push_back(absl::StrCat(kNoZeroFillEnv, "=", v));  // bench/zero_bench.cc only
  }
  // Its own process group (a signal to the daemon's group spares it; the
  // daemon decides when it ends), started from the spawn thread (its
  // PDEATHSIG means the daemon died), tagged with this daemon's state dir.
  // Its stderr is the daemon's: what it says before its hello is logged.
  subprocess::SpawnOptions spawn;
  spawn.path = options.worker_path;
  spawn.args = std::move(args);
  spawn.env = std::move(env);
  spawn.fds = {{2, 2}, {3, child_sock}, {4, arena_fd}};
  if (channel != nullptr) spawn.fds.push_back({5, channel->fd()});
  spawn.tag_instance = true;
  spawn.new_pid_namespace = own_pids;
  if (userns) {
    spawn.user_namespace = subprocess::SpawnOptions::UserNamespace{
        static_cast<uint32_t>(uid >= 0 ? uid : ::geteuid()),
        static_cast<uint32_t>(gid >= 0 ? gid : ::getegid())};
  }
  return spawn;
}

absl::StatusOr<std::unique_ptr<Worker>> ProcessRunner::Impl::Spawn(const std::string& ns,
                                                                   const tensor::Region* channel,
                                                                   int64_t channel_spin_us) {
  auto w = std::make_unique<Worker>();
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::UnavailableError(absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  w->sock = sv[0];
  const int child_sock = sv[1];
  if (absl::Status arena = MapArena(*w); !arena.ok()) {
    ::close(child_sock);
    return arena;
  }

  // Who it runs as: its namespace's own uid (a root daemon with a range),
  // else options.uid/gid.
  absl::StatusOr<std::pair<int64_t, int64_t>> ids = IdsFor(ns);
  if (!ids.ok()) {
    ::close(child_sock);
    return ids.status();
  }
  const auto [uid, gid] = *ids;
  // The only directory a worker may write (aot GPU objects are written
  // there to be loaded): one per namespace, so no kernel can plant a file
  // another namespace's executor would load.
  // Its scratch space. With namespaces: a private tmpfs over its own
  // /dev/shm (mounted by the worker in its mount namespace; nothing on the
  // host). Not /tmp: that would hide what the executor reads there (a
  // driver or an allowed library under /tmp); /dev/shm it never reads.
  // Without: a host directory of its own under its namespace's, removed
  // when it is reaped. A PID namespace needs root; the others need root or
  // unprivileged user namespaces.
  std::string scratch;
  const bool isolated = options.private_namespaces && subprocess::PrivateNamespaces();
  // Without root: a user namespace of its own, made by the spawn, whose
  // uid 0 is the namespace's subordinate uid (or the daemon's own uid,
  // without subordinate ids), and a PID namespace that one owns.
  const bool userns = isolated && ::geteuid() != 0 && subprocess::UserNamespaces();
  const bool own_pids = isolated && (userns || subprocess::PidNamespaces());
  if (isolated) {
    scratch = "/dev/shm";
  } else if (!options.host.scratch_dir.empty()) {
    scratch = absl::StrCat(scratch_root, "/", Sha256Hex(ns).substr(0, 16), "/e",
                           scratch_serial.fetch_add(1));
    std::error_code ec;
    std::filesystem::create_directories(scratch, ec);
    // Only the executors' user may use it.
    if (!ec && uid >= 0 &&
        ::chown(scratch.c_str(), static_cast<uid_t>(uid),
                static_cast<gid_t>(gid >= 0 ? gid : uid)) != 0) {
      scratch.clear();  // no scratch dir: aot GPU objects cannot load, nothing else breaks
    }
    if (!scratch.empty()) ::chmod(scratch.c_str(), 0700);
  }
  subprocess::SpawnOptions spawn = ExecutorSpawnOptions(ns, channel, channel_spin_us, scratch, uid,
                                                        gid, isolated, userns, own_pids,
                                                        child_sock, w->arena_fd);
  absl::StatusOr<pid_t> pid = options.spawn(spawn);  // subprocess::Spawn but in tests
  ::close(child_sock);
  if (!isolated) w->scratch = scratch;
  if (!pid.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot start an executor process: ", pid.status().message()));
  }
  w->pid = *pid;
  w->last_used = options.clock->Now();
  started.fetch_add(1);
  live.fetch_add(1);
  // Under its namespace's memory cap before any user code runs (that comes
  // after the hello).
  if (cgroups != nullptr) {
    if (absl::Status placed = cgroups->Place(ns, w->pid); !placed.ok()) {
      w->Reap(/*kill=*/true);
      live.fetch_sub(1);
      Logger("runner")->error("executor process for namespace {}: {}", ns, placed.ToString());
      return absl::UnavailableError(
          "an executor process could not be put under its namespace's memory cap; the server "
          "log says why");
    }
  }
  w->task_fd = ::open(absl::StrCat("/proc/", w->pid, "/task").c_str(),
                      O_PATH | O_DIRECTORY | O_CLOEXEC);
  // The hello says the sandbox is in place.
  wire::Msg type;
  std::string payload;
  absl::Status s = wire::RecvFrame(w->sock, &type, &payload, absl::Now() + absl::Seconds(30));
  wire::Reader r(payload);
  const uint32_t version = r.U32();
  if (!s.ok() || type != wire::Msg::kHello || !r.ok() || version != wire::kProtocolVersion) {
    w->Reap(/*kill=*/true);
    live.fetch_sub(1);
    Logger("runner")->error("executor process for namespace {} failed to start: {}{}", ns,
                            s.ok() ? "bad hello" : s.ToString(),
                            w->death.empty() ? "" : absl::StrCat(" (", w->death, ")"));
    return absl::UnavailableError(
        "an executor process could not be started; the server log says why");
  }
  Logger("runner")->debug("executor process {} started for namespace {} (uid {})", w->pid, ns,
                          uid >= 0 ? uid : static_cast<int64_t>(::getuid()));
  return w;
}

absl::StatusOr<std::unique_ptr<Worker>> ProcessRunner::Impl::Acquire(const std::string& ns,
                                                                     Clock::time_point deadline,
                                                                     bool fresh) {
  Pool* pool = PoolFor(ns);
  MutexLock lock(&pool->mu);
  for (;;) {
    if (fresh && !pool->idle.empty() && pool->live >= options.workers_per_namespace) {
      // Room for a new one: the least recently used idle worker goes.
      std::unique_ptr<Worker> old = std::move(pool->idle.front());
      pool->idle.pop_front();
      --pool->live;
      lock.Unlock();
      old->Reap(/*kill=*/true);
      live.fetch_sub(1);
      old.reset();
      lock.Lock();
      continue;
    }
    if (!fresh && !pool->idle.empty()) {
      auto w = std::move(pool->idle.back());  // the most recently used: warm caches
      pool->idle.pop_back();
      return w;
    }
    if (pool->live < options.workers_per_namespace) {
      ++pool->live;
      lock.Unlock();
      auto w = Spawn(ns);
      if (!w.ok()) {
        lock.Lock();
        --pool->live;
        pool->cv.Signal();
        return w;
      }
      return w;
    }
    if (!pool->cv.WaitUntil(&pool->mu, deadline) && pool->idle.empty()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "all ", options.workers_per_namespace, " executor processes of namespace \"", ns,
          "\" stayed busy until the deadline"));
    }
  }
}

void ProcessRunner::Impl::Release(const std::string& ns, std::unique_ptr<Worker> w) {
  // A worker whose kernel left more threads than it may keep does not go
  // back (its call answered RESOURCE_EXHAUSTED, unless the kernel silenced
  // the worker's own check). One fstat.
  if (options.threads_per_executor > 0) {
    if (const int threads = w->Threads(); threads > options.threads_per_executor) {
      Logger("runner")->warn("namespace {}: executor process {} kept {} threads (at most {}); "
                             "stopped",
                             ns, w->pid, threads, options.threads_per_executor);
      thread_cap_stops_after_call.fetch_add(1);
      Discard(ns, w, /*kill=*/true);
      return;
    }
  }
  Pool* pool = PoolFor(ns);
  w->last_used = options.clock->Now();
  MutexLock lock(&pool->mu);
  pool->idle.push_back(std::move(w));
  pool->cv.Signal();
}

void ProcessRunner::Impl::Discard(const std::string& ns, std::unique_ptr<Worker>& w, bool kill) {
  w->Reap(kill);
  w.reset();
  live.fetch_sub(1);
  Pool* pool = PoolFor(ns);
  MutexLock lock(&pool->mu);
  --pool->live;
  pool->cv.Signal();
}

int ProcessRunner::Impl::StopIdleOverThreads() {
  const int cap = options.threads_per_executor;
  if (cap <= 0) return 0;
  // Pools are never removed, so their pointers outlive the runner's lock.
  std::vector<std::pair<std::string, Pool*>> all;
  {
    MutexLock lock(&mu);
    all.reserve(pools.size());
    for (auto& [ns, pool] : pools) all.emplace_back(ns, pool.get());
  }
  int stopped = 0;
  for (auto& [ns, pool] : all) {
    std::vector<std::pair<std::unique_ptr<Worker>, int>> over;
    {
      MutexLock lock(&pool->mu);
      for (auto it = pool->idle.begin(); it != pool->idle.end();) {
        // Threads a kernel left that went on starting threads after its
        // call (the worker's own check, at the call's end, saw few).
        if (const int threads = (*it)->Threads(); threads > cap) {
          over.emplace_back(std::move(*it), threads);
          it = pool->idle.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& [w, threads] : over) {
      // No call runs in it, so none fails, and no kernel is charged: the
      // next call of the namespace starts a fresh executor (Init runs again).
      Logger("runner")->warn("namespace {}: idle executor process {} has {} threads (at most {} "
                             "while no call runs); stopped, charged to no kernel",
                             ns, w->pid, threads, cap);
      thread_cap_stops_idle.fetch_add(1);
      Discard(ns, w, /*kill=*/true);
      ++stopped;
    }
  }
  return stopped;
}

absl::StatusOr<Reply> ProcessRunner::Impl::Control(Worker& w, wire::Msg type,
                                                   const std::string& payload,
                                                   Clock::time_point deadline, int fd) {
  absl::Status s = wire::SendFrame(w.sock, type, payload, fd, ToAbsl(deadline));
  if (absl::IsDeadlineExceeded(s)) return s;  // it does not read: killed as a timeout
  if (!s.ok()) return NotReached();
  for (;;) {
    wire::Msg got;
    std::string body;
    s = wire::RecvFrame(w.sock, &got, &body, ToAbsl(deadline));
    if (!s.ok()) return s;
    if (got == wire::Msg::kDoorbell && body.empty()) continue;  // a stale wake-up hint
    if (got != wire::Msg::kReply) {
      return absl::DataLossError("the executor channel carried an unexpected frame");
    }
    wire::Reader r(body);
    Reply reply;
    reply.code = r.I32();
    reply.need = r.U64();
    reply.message = r.Str();
    reply.payload = r.Str();
    OPJIT_RETURN_IF_ERROR(r.Finish("reply"));
    if (reply.message.size() > wire::kMessageBytes) reply.message.resize(wire::kMessageBytes);
    return reply;
  }
}

absl::StatusOr<Reply> ProcessRunner::Impl::Call(Worker& w, Clock::time_point deadline,
                                                int64_t spin_us) {
  wire::SlotHeader* slot = w.slot;
  slot->seq = ++w.calls;
  const uint32_t prev = slot->state.exchange(wire::kRequest, std::memory_order_acq_rel);
  if (prev & wire::kWorkerSleeping) {
    if (!wire::SendFrame(w.sock, wire::Msg::kDoorbell, {}).ok()) return NotReached();
  }
  // Spin first: a small kernel finishes within it, and a wake-up costs more.
  if (spin_us > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    int n = 0;
    for (;;) {
      if ((slot->state.load(std::memory_order_acquire) & wire::kPhaseMask) == wire::kDone) break;
      CpuRelax();
      if ((++n & 7) == 0 && Clock::now() > until) break;
    }
  }
  for (;;) {
    uint32_t s = slot->state.load(std::memory_order_acquire);
    if ((s & wire::kPhaseMask) == wire::kDone) break;
    if (!(s & wire::kDaemonSleeping) &&
        !slot->state.compare_exchange_weak(s, s | wire::kDaemonSleeping,
                                           std::memory_order_acq_rel)) {
      continue;
    }
    // Sleep until the worker's wake frame, its death (EOF), or the deadline.
    wire::Msg got;
    std::string body;
    absl::Status st = wire::RecvFrame(w.sock, &got, &body, ToAbsl(deadline));
    if (!st.ok()) return st;
    if (got != wire::Msg::kDoorbell || !body.empty()) {
      return absl::DataLossError("the executor channel carried an unexpected frame");
    }
  }
  // Nothing else may wait on the socket now: the executor sends a doorbell
  // only to a sleeper, which read it above. Bytes there were written by
  // something else in the process (its kernel), and fail this call rather
  // than the next one. One poll(2), no wait.
  pollfd quiet{w.sock, POLLIN, 0};
  if (::poll(&quiet, 1, 0) > 0 && (quiet.revents & POLLIN)) {
    wire::Msg got;
    std::string body;
    absl::Status st =
        wire::RecvFrame(w.sock, &got, &body, absl::Now() + absl::Milliseconds(100));
    // OUT_OF_RANGE: it closed the channel after it answered; the next call
    // sees that. Anything but a whole doorbell broke the protocol (a frame
    // begun and left unfinished too, which is not a time-out).
    if (absl::IsDataLoss(st) || absl::IsResourceExhausted(st)) return st;
    if (!st.ok() && !absl::IsOutOfRange(st)) {
      return absl::DataLossError("the executor channel carried a frame that did not end");
    }
    if (st.ok() && (got != wire::Msg::kDoorbell || !body.empty())) {
      return absl::DataLossError("the executor channel carried an unexpected frame");
    }
  }
  Reply reply;
  reply.code = slot->code;
  reply.need = slot->need;
  reply.kernel_ms = slot->kernel_ms;
  reply.flushed_bytes = slot->flushed_bytes;
  const uint32_t len = std::min<uint32_t>(slot->message_len, wire::kMessageBytes);
  reply.message.assign(slot->message, len);
  // Idle again; keep the worker's sleeping bit, which only it clears.
  uint32_t s = slot->state.load(std::memory_order_acquire);
  while (!slot->state.compare_exchange_weak(s, wire::kIdle | (s & wire::kWorkerSleeping),
                                            std::memory_order_acq_rel)) {
  }
  return reply;
}

absl::Status ProcessRunner::Impl::DeathStatus(Worker& w, const absl::Status& s,
                                              const std::string& label, const std::string& ns) {
  const pid_t pid = w.pid;
  auto log = Logger("runner");
  // A closed channel: the process is dying; one that broke the protocol is
  // killed.
  w.Reap(/*kill=*/!absl::IsOutOfRange(s) && !absl::IsUnavailable(s), /*grace_ms=*/500);
  const std::string how =
      w.death.empty() || (w.killed_by_us && !absl::IsOutOfRange(s)) ? "broke the executor protocol"
                                                                    : w.death;
  // The executor's own words on the fault (its handler names the kernel
  // and the guard page it hit), first in the answer a client acts on.
  const std::string fault = FaultNote(w);
  log->error("{} (namespace {}): executor process {} {} ({}){}{}", label, ns, pid, how,
             s.ToString(), fault.empty() ? "" : ": ", fault);
  if (!w.killed_by_us && w.death.find("SIGKILL") != std::string::npos) {
    // Not opjitd's SIGKILL. Near its memory limit it was the OOM killer
    // reacting to this kernel; otherwise someone else sent it (an operator,
    // or the OOM killer on a machine short of memory).
    if (cgroups != nullptr) {
      // The namespace's cap: its cgroup counted an OOM kill since the last
      // death looked at.
      const uint64_t kills = cgroups->OomKills(ns);
      bool cap = false;
      {
        MutexLock lock(&mu);
        uint64_t& seen = oom_kills_seen[ns];
        cap = kills > seen;
        seen = kills;
      }
      if (cap) {
        return WithReason(
            absl::ResourceExhaustedError(absl::StrCat(
                "the kernel's executor process was killed (SIGKILL) when namespace \"", ns,
                "\"'s executors together reached their memory cap of ", cgroups->bytes() >> 20,
                " MiB ([exec] namespace_memory_mb; this one held ", w.peak_rss_bytes >> 20,
                " MiB at its peak)")),
            reason::kKernelCrashed, {{"cause", "namespace_memory"}});
      }
    }
    const uint64_t limit = options.memory_bytes;
    if (limit != 0 && w.peak_rss_bytes >= limit / 2) {
      return WithReason(absl::ResourceExhaustedError(absl::StrCat(
                            "the kernel's executor process was killed (SIGKILL) after using ",
                            w.peak_rss_bytes >> 20, " MiB, near its ", limit >> 20, " MiB limit")),
                        reason::kKernelCrashed, {{"cause", "memory"}});
    }
    return WithReason(absl::AbortedError(absl::StrCat(
        "the kernel's executor process was killed (SIGKILL) from outside opjitd at ",
        w.peak_rss_bytes >> 20,
        " MiB, far below its memory limit (an operator, or the kernel's OOM killer on a machine "
        "short of memory); only this call failed")),
                      reason::kKernelCrashed, {{"cause", "killed"}});
  }
  if (w.killed_by_us && (absl::IsDataLoss(s) || absl::IsResourceExhausted(s))) {
    // Frames over the channel's limits, cut short, stalled or out of turn:
    // written by the kernel (the executor's own code does not), so the
    // process was ended at once, before the kernel time limit.
    return WithReason(
        absl::AbortedError(absl::StrCat(
            "the kernel's executor process broke the executor protocol (",
            s.message(),
            ") and was stopped; only this call failed, and the next one runs in a fresh "
            "process (Init runs again)")),
        reason::kKernelCrashed, {{"cause", "protocol"}});
  }
  return WithReason(
      absl::AbortedError(absl::StrCat(fault, fault.empty() ? "" : ". ",
                                      fault.empty() ? "the" : "The", " kernel's executor process ",
                                      how,
                                      "; only this call failed, and the next one runs in a fresh "
                                      "process (Init runs again)")),
      reason::kKernelCrashed, {{"cause", "crash"}});
}


namespace {

// An instance whose code lives in the namespace's workers. Each worker
// creates it on first use (Init runs there); the daemon keeps only the spec.
class RemoteInstance : public KernelInstance {
 public:
  RemoteInstance(std::shared_ptr<ProcessRunner::Impl> runner, InstanceSpec spec, uint64_t id)
      : runner_(std::move(runner)),
        spec_(std::move(spec)),
        id_(id),
        quarantine_key_(QuarantineKey(spec_)),
        attrs_hash_(AttrsHash(spec_.attrs)) {}

  absl::StatusOr<std::vector<int64_t>> InferShape() override { return InferShapeFor({}); }
  absl::StatusOr<std::vector<int64_t>> InferShapeFor(const Caller& caller) override;
  absl::Status Run(const RunArgs& args) override;

 private:
  // Runs `op` on a worker of the namespace, creating the instance, loading
  // the kernel and mapping regions there as the worker asks. `op` returns
  // the worker's reply.
  template <typename Op>
  absl::StatusOr<Reply> OnWorker(Clock::time_point deadline, const RunArgs* args,
                                 const Caller& caller, Op op);
  // One try of OnWorker, on a newly started worker with `fresh`. Sets
  // `*retry` when the worker died in it after serving other instances and
  // the call deserves a second try in a fresh one before anyone is blamed.
  template <typename Op>
  absl::StatusOr<Reply> TryOnWorker(Clock::time_point deadline, const RunArgs* args,
                                    const Caller& caller, Op& op, bool fresh, bool* retry);
  // The instance's spec as a worker needs it now (outputs once known).
  std::string EncodedSpec() {
    MutexLock lock(&mu_);
    return wire::EncodeInstance(id_, spec_);
  }
  absl::Status Failure(Worker& w, const absl::Status& s, bool timed_out,
                       Clock::time_point call_deadline, const RunArgs* args,
                       const Caller& caller, bool may_retry, bool* retry);
  // After a SIGBUS: the call's shm tensor whose memory its client shrank
  // (the object is now shorter than the worker's mapping of it), as the
  // status the call gets; nullopt when every region is whole.
  std::optional<absl::Status> ClientMemoryFault(const RunArgs* args) const;

  const std::shared_ptr<ProcessRunner::Impl> runner_;
  Mutex mu_;
  // Its outputs are filled in under mu_ once (the rest never changes); no
  // ABSL_GUARDED_BY, as the analysis cannot guard one field of a member.
  InstanceSpec spec_;
  const uint64_t id_;
  const std::string quarantine_key_;
  const std::string attrs_hash_;  // AttrsHash(spec_.attrs)
  std::atomic<double> ewma_us_{0};  // recent kernel time, for the spin budget
};

std::optional<absl::Status> RemoteInstance::ClientMemoryFault(const RunArgs* args) const {
  if (args == nullptr) return std::nullopt;
  size_t i = 0;
  for (auto span : {args->inputs, args->outputs}) {
    const bool inputs = span.data() == args->inputs.data();
    for (size_t j = 0; j < span.size(); ++j, ++i) {
      const InRegion* in = span[j].in_region();
      if (in == nullptr) continue;
      const tensor::Region* region = in->region.get();
      struct stat st {};
      if (::fstat(region->fd(), &st) != 0) continue;
      const uint64_t have = st.st_size < 0 ? 0 : static_cast<uint64_t>(st.st_size);
      const uint64_t mapped = region->info().offset + region->size();
      if (have >= mapped) continue;
      const std::string tensor =
          inputs ? (j < spec_.input_names.size() && !spec_.input_names[j].empty()
                        ? absl::StrCat("input \"", spec_.input_names[j], "\"")
                        : absl::StrCat("input ", j))
                 : absl::StrCat("output ", j);
      return WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "region \"", region->name(), "\" (", tensor, ") shrank to ",
              have > region->info().offset ? have - region->info().offset : 0,
              " bytes while the call used it (registered with ", region->size(),
              "); the kernel faulted on the missing memory. The client's memory is at fault, not "
              "the kernel: this does not count towards its quarantine")),
          reason::kRegionTooSmall, {{"region", region->name()}, {"cause", "client_memory"}});
    }
  }
  return std::nullopt;
}

absl::Status RemoteInstance::Failure(Worker& w, const absl::Status& s, bool timed_out,
                                     Clock::time_point call_deadline, const RunArgs* args,
                                     const Caller& caller, bool may_retry, bool* retry) {
  auto log = Logger("runner");
  const pid_t pid = w.pid;
  if (timed_out) {
    runner_->timeouts.fetch_add(1);
    const bool by_call = call_deadline != Clock::time_point::max() &&
                         call_deadline <= Clock::now() + std::chrono::milliseconds(1);
    log->warn("{} (namespace {}): kernel stopped at {}; executor process {} killed", spec_.label,
              spec_.ns, by_call ? "the call's deadline" : "the kernel time limit", pid);
    return runner_->TimeoutStatus(by_call);
  }
  runner_->crashes.fetch_add(1);
  absl::Status death = runner_->DeathStatus(w, s, spec_.label, spec_.ns);  // reaps it
  if (w.term_signal == SIGBUS) {
    // A fault in a client's memory (a region it truncated) is the client's.
    if (std::optional<absl::Status> fault = ClientMemoryFault(args)) {
      log->warn("{} (namespace {}): executor process {} faulted on a client's shrunk region; not "
                "counted against the kernel", spec_.label, spec_.ns, pid);
      return *fault;
    }
  }
  // Killed from outside (an operator, the OOM killer) is no corruption:
  // running the call again would undo the operator's kill or double the
  // memory a hog takes.
  const bool killed_from_outside = w.term_signal == SIGKILL && !w.killed_by_us;
  if (may_retry && !killed_from_outside && KeepsOutputBytes(args)) {
    // Its outputs keep their bytes (one may lie over an input, written in
    // place): a run that died part-way may have changed them, so the call
    // does not run again, and nobody is blamed.
    log->warn("{} (namespace {}): executor process {} had served other kernels; the call keeps "
              "its output bytes, so it does not run again, and the crash is counted against no "
              "kernel", spec_.label, spec_.ns, pid);
    return NotCounted(death);
  }
  if (may_retry && !killed_from_outside) {
    // It ran other kernels before: one of them may have corrupted it (a
    // heap overflow that returned OK). Blame nobody yet; the call runs
    // again in a fresh executor, where only its own kernel runs.
    log->warn("{} (namespace {}): executor process {} had served other kernels; the call runs "
              "again in a fresh executor before the crash counts against the kernel",
              spec_.label, spec_.ns, pid);
    *retry = true;
    return death;
  }
  runner_->NoteCrash(quarantine_key_, spec_.label, spec_.ns, caller, attrs_hash_);
  return death;
}

template <typename Op>
absl::StatusOr<Reply> RemoteInstance::OnWorker(Clock::time_point call_deadline,
                                               const RunArgs* args, const Caller& caller, Op op) {
  OPJIT_RETURN_IF_ERROR(runner_->QuarantineCheck(quarantine_key_, caller));
  bool retry = false;
  absl::StatusOr<Reply> first =
      TryOnWorker(call_deadline, args, caller, op, /*fresh=*/false, &retry);
  if (!retry) return first;
  // The retry runs the kernel again from the start: inline inputs are
  // copied into the new executor's arena again (the caller's copy is
  // intact); outputs the first try wrote in part are written again in
  // full by a kernel that succeeds.
  absl::StatusOr<Reply> second =
      TryOnWorker(call_deadline, args, caller, op, /*fresh=*/true, &retry);
  const auto why = GetReason(first.status());
  if (second.ok() && why && why->metadata.count("cause") && why->metadata.at("cause") == "idle") {
    return second;  // its executor had died while idle (IdleDeath said so)
  }
  if (second.ok()) {
    Logger("runner")->warn("{} (namespace {}): the call succeeded in a fresh executor after its "
                           "first executor (shared with other kernels) died; the crash is "
                           "counted against no kernel", spec_.label, spec_.ns);
  }
  return second;
}

template <typename Op>
absl::StatusOr<Reply> RemoteInstance::TryOnWorker(Clock::time_point call_deadline,
                                                  const RunArgs* args, const Caller& caller,
                                                  Op& op, bool fresh, bool* retry) {
  *retry = false;
  const auto limit = Clock::now() + std::chrono::milliseconds(runner_->options.kernel_timeout_ms);
  const Clock::time_point deadline = std::min(call_deadline, limit);
  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<Worker> w, runner_->Acquire(spec_.ns, deadline, fresh));
  // An idle worker that died since its last call (killed from outside, the
  // OOM killer) is nobody's crash: the call takes another.
  for (int dead = 0; runner_->DiedIdle(spec_.ns, w); ++dead) {
    if (dead >= runner_->options.workers_per_namespace) fresh = true;  // all dead: start one
    OPJIT_ASSIGN_OR_RETURN(w, runner_->Acquire(spec_.ns, deadline, fresh));
  }
  // Whether it ran another instance's code before this call.
  const bool served_others = w->shared || (w->first_instance != 0 && w->first_instance != id_);
  if (w->first_instance == 0) w->first_instance = id_;
  if (w->first_instance != id_) w->shared = true;
  auto fail = [&](const absl::Status& s, bool first_send = false) -> absl::Status {
    if (first_send && IsNotReached(s) && !fresh) {
      // Its first frame could not be sent: it died before this call reached
      // it (killed while idle, after the check above); no kernel of this
      // call ran there. Nobody's crash; the call runs in a fresh one.
      *retry = true;
      return runner_->IdleDeath(spec_.ns, w);
    }
    const bool timed_out = absl::IsDeadlineExceeded(s);
    absl::Status out = Failure(*w, s, timed_out, call_deadline, args, caller,
                               /*may_retry=*/served_others && !fresh, retry);
    runner_->Discard(spec_.ns, w, /*kill=*/true);  // reaped already unless it timed out
    return out;
  };
  // Each round supplies one missing piece; a call has at most this many.
  const size_t max_rounds = 4 + (args ? args->inputs.size() + args->outputs.size() : 0);
  for (size_t round = 0; round < max_rounds; ++round) {
    absl::StatusOr<Reply> reply = op(*w, deadline);
    if (!reply.ok()) return fail(reply.status(), /*first_send=*/round == 0);
    if (reply->code == wire::kNeedInstance) {
      auto created = runner_->Control(*w, wire::Msg::kNewInstance, EncodedSpec(), deadline);
      if (!created.ok()) return fail(created.status());
      if (created->code == wire::kNeedKernel) {
        auto loaded = runner_->Control(*w, wire::Msg::kLoadKernel, wire::EncodeKernel(*spec_.kernel),
                                       deadline);
        if (!loaded.ok()) return fail(loaded.status());
        if (loaded->code != 0) {
          runner_->Release(spec_.ns, std::move(w));
          return StatusOf(*loaded);
        }
        created = runner_->Control(*w, wire::Msg::kNewInstance, EncodedSpec(), deadline);
        if (!created.ok()) return fail(created.status());
      }
      if (created->code != 0) {
        runner_->Release(spec_.ns, std::move(w));
        return StatusOf(*created);
      }
      continue;
    }
    if (reply->code == wire::kNeedRegion && args != nullptr) {
      const tensor::Region* region = nullptr;
      for (auto span : {args->inputs, args->outputs}) {
        for (const TensorLoc& t : span) {
          const InRegion* in = t.in_region();
          if (in != nullptr && in->region->serial() == reply->need) region = in->region.get();
        }
      }
      if (region == nullptr) return fail(absl::DataLossError("asked for a region not in the call"));
      wire::Writer wr;
      wr.U64(region->serial());
      wr.U64(region->info().offset);
      wr.U64(region->size());
      auto added = runner_->Control(*w, wire::Msg::kAddRegion, wr.out(), deadline, region->fd());
      if (!added.ok()) return fail(added.status());
      if (added->code != 0) {
        runner_->Release(spec_.ns, std::move(w));
        return StatusOf(*added);
      }
      continue;
    }
    runner_->Release(spec_.ns, std::move(w));
    runner_->NoteSuccess(quarantine_key_, caller);
    return reply;
  }
  return fail(absl::DataLossError("the executor process kept asking for more"));
}

absl::StatusOr<std::vector<int64_t>> RemoteInstance::InferShapeFor(const Caller& caller) {
  OPJIT_ASSIGN_OR_RETURN(Reply reply, OnWorker(Clock::time_point::max(), nullptr, caller,
                                               [&](Worker& w, Clock::time_point deadline) {
                                                 wire::Writer wr;
                                                 wr.U64(id_);
                                                 return runner_->Control(w, wire::Msg::kInferShape,
                                                                         wr.out(), deadline);
                                               }));
  OPJIT_RETURN_IF_ERROR(StatusOf(reply));
  wire::Reader r(reply.payload);
  TensorDesc d = r.Desc();
  if (!r.done() || d.shape.size() > 64) return absl::InternalError("malformed InferShape reply");
  return d.shape;
}

absl::Status RemoteInstance::Run(const RunArgs& args) {
  const size_t n = args.inputs.size() + args.outputs.size();
  if (n > wire::kMaxTensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("a call may pass at most ", wire::kMaxTensors, " tensors; this one has ", n));
  }
  {
    // Outputs are fixed per instance: the first run tells workers that
    // create the instance later (Init then runs with them).
    MutexLock lock(&mu_);
    if (spec_.outputs.empty() && !args.outputs.empty()) {
      for (const TensorLoc& t : args.outputs) spec_.outputs.push_back(t.desc);
    }
  }
  // Inline tensors: inputs, then outputs, in the arena's data area.
  uint64_t arena_need = 0;
  for (auto span : {args.inputs, args.outputs}) {
    for (const TensorLoc& t : span) {
      if (t.in_memory() != nullptr) arena_need = Align64(arena_need + t.nbytes);
    }
  }
  if (arena_need > runner_->options.arena_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the call's inline tensors need ", arena_need, " bytes; an executor process takes at most ",
        runner_->options.arena_bytes, " inline; pass big tensors in shared memory"));
  }
  const double ewma = ewma_us_.load(std::memory_order_relaxed);
  const int64_t spin =
      ewma > 4.0 * runner_->options.wait_spin_us ? 0 : runner_->options.wait_spin_us;
  const auto t0 = Clock::now();
  OPJIT_ASSIGN_OR_RETURN(
      Reply reply,
      OnWorker(args.deadline, &args, args.caller, [&](Worker& w, Clock::time_point deadline) -> absl::StatusOr<Reply> {
        wire::SlotHeader* slot = w.slot;
        wire::TensorRec* recs = wire::Records(slot);
        slot->instance_id = id_;
        slot->n_inputs = static_cast<uint32_t>(args.inputs.size());
        slot->n_outputs = static_cast<uint32_t>(args.outputs.size());
        // Region outputs keep their bytes only when every one of them may
        // (InRegion::keep_bytes); arena outputs are zeroed regardless.
        bool keep = false, zero = false;
        for (const TensorLoc& t : args.outputs) {
          if (const InRegion* in = t.in_region()) (in->keep_bytes ? keep : zero) = true;
        }
        slot->flags = (keep && !zero ? wire::kKeepRegionOutputs : 0) |
                      (args.flush_caches ? wire::kFlushCaches : 0);
        uint64_t cursor = 0;
        size_t i = 0;
        // Where each inline output lands, kept here: the slot is writable
        // by the worker, so nothing is read back from it but the reply.
        std::vector<uint64_t> out_offsets;
        out_offsets.reserve(args.outputs.size());
        for (auto span : {args.inputs, args.outputs}) {
          const bool inputs = span.data() == args.inputs.data();
          for (const TensorLoc& t : span) {
            if (t.is_null()) {
              recs[i++] = {wire::kNullSerial, 0, 0};
            } else if (const InRegion* in = t.in_region()) {
              recs[i++] = {in->region->serial(), in->offset, t.nbytes};
            } else {
              if (inputs && t.nbytes) std::memcpy(w.data + cursor, t.in_memory()->data, t.nbytes);
              recs[i++] = {0, cursor, t.nbytes};
              if (!inputs) out_offsets.push_back(cursor);
              cursor = Align64(cursor + t.nbytes);
            }
          }
        }
        absl::StatusOr<Reply> r = runner_->Call(w, deadline, spin);
        if (r.ok() && r->code == 0) {
          // Inline outputs back to the caller, while the worker (and its
          // arena) is still this call's.
          size_t k = 0;
          for (const TensorLoc& t : args.outputs) {
            const InMemory* mem = t.in_memory();
            if (mem == nullptr) continue;
            if (t.nbytes) std::memcpy(mem->data, w.data + out_offsets[k], t.nbytes);
            ++k;
          }
        }
        // Nothing of this call stays in the arena for a later call's kernel
        // (another principal's, in the namespace's executor) to find: its
        // inline bytes are cleared once the outputs are out.
        static const bool scrub = std::getenv(kNoZeroFillEnv) == nullptr;  // bench only
        if (scrub && cursor != 0) std::memset(w.data, 0, cursor);
        // The arena keeps its pages while calls come (faulting fresh pages
        // in costs more than copying into warm ones); Maintain() gives big
        // ones back once the worker idles.
        w.arena_high = std::max(w.arena_high, cursor);
        return r;
      }));
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  ewma_us_.store(ewma == 0 ? us : 0.8 * ewma + 0.2 * us, std::memory_order_relaxed);
  OPJIT_RETURN_IF_ERROR(StatusOf(reply));
  // The worker's own measure of the kernel, if it is plausible (the worker
  // may lie; it can only lie about its own call's timing).
  const double total_ms = us / 1000.0;
  if (args.kernel_ms != nullptr && reply.kernel_ms >= 0 && reply.kernel_ms <= total_ms) {
    *args.kernel_ms = reply.kernel_ms;
  }
  // Likewise what it flushed, bounded: a sweep is at most 64 MiB, a GPU's
  // L2 far below kMaxFlushReport.
  if (args.flushed_bytes != nullptr) {
    *args.flushed_bytes = reply.flushed_bytes <= kMaxFlushReport ? reply.flushed_bytes : 0;
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// Call credit granted at once when the channel has no admit_calls (no
// bound): large, so the executor rarely asks.
constexpr uint64_t kUnboundedCredit = 4096;
// How often the channel's thread reads the executor's call counts.
constexpr int64_t kCountEveryNs = 250'000'000;
// How often, at most, it looks at the running call (the watchdog): reading
// the ring costs a few syscalls (GuardedCopy saves the signal mask), and
// credit requests can come thousands of times a second.
constexpr int64_t kWatchEveryNs = 10'000'000;

// The daemon's side of a fast channel: the executor process serving the
// client's ring, and a thread that answers what the executor asks for
// (kWantHandle, kWantRegion, kWantCredit), watches the running call's
// deadline and the kernel time limit, notices the executor's death, and
// hands the executor's call counts to spec.record_calls. The daemon reads
// nothing of the ring but running slots' state, seq, deadline and handle,
// and only through GuardedCopy (the client may shrink the object).
class ChannelImpl : public Channel {
 public:
  ChannelImpl(std::shared_ptr<ProcessRunner::Impl> runner, ChannelSpec spec,
              std::unique_ptr<Worker> w)
      : runner_(std::move(runner)),
        spec_(std::move(spec)),
        w_(std::move(w)),
        pid_(w_->pid),
        opened_ns_(fast::MonotonicNs()) {
    thread_ = std::thread([this] { Serve(); });
  }
  ~ChannelImpl() override { Close(); }

  int pid() const override { return pid_; }
  bool alive() const override { return alive_.load(); }
  void InvalidateHandles() override {
    w_->slot->handle_epoch.fetch_add(1, std::memory_order_acq_rel);
  }
  void InvalidateRegions() override {
    w_->slot->region_epoch.fetch_add(1, std::memory_order_acq_rel);
  }
  void Close() override {
    MutexLock lock(&close_mu_);
    if (closed_) return;
    closed_ = true;
    stop_.store(true);
    // Unblocks the thread if it waits on the executor (an Init that hangs).
    if (alive_.load()) ::kill(pid_, SIGKILL);
    if (thread_.joinable()) thread_.join();
    if (w_->pid > 0) {
      w_->Reap(/*kill=*/true);
      runner_->live.fetch_sub(1);
    }
    alive_.store(false);
    MarkClosed();
    TakeCounts();  // what the executor served since the thread last looked
  }

 private:
  void Serve();
  // Answers kWantHandle: the binding, creating the instance (and loading the
  // kernel) in the executor as it asks. The outer status is a broken
  // channel; the inner one is what the client's call gets.
  absl::StatusOr<absl::Status> Bind(uint64_t handle, Clock::time_point deadline);
  absl::StatusOr<absl::Status> AddRegion(uint64_t id, Clock::time_point deadline);
  // Answers kWantCredit for the call on `handle`: a batch of credit, or the
  // refusal (counted here, as the executor does not count it).
  absl::Status GrantCredit(uint64_t handle);
  // Reads the executor's count table (wire::CallCounts) and records what
  // grew since the last read, trusting it no further than the credit
  // granted and the time the channel has been open. The channel's thread
  // only, or Close() after that thread ended.
  void TakeCounts();
  // The op a handle names, for metrics: from its binding, else asked of
  // the daemon once; "" when unknown.
  const std::string& OpOf(uint64_t handle);
  void Record(uint64_t handle, absl::StatusCode code, uint64_t calls, double kernel_seconds) {
    if (spec_.record_calls && calls > 0) spec_.record_calls(OpOf(handle), code, calls, kernel_seconds);
  }
  // The executor died (`s`: how the channel broke) or was stopped at a
  // deadline (`timeout`): answers the running call, closes the ring.
  void Ended(const absl::Status& s, std::optional<absl::Status> timeout, int running_slot);
  // Reads slot i's state, seq and deadline; false if the ring shrank.
  bool ReadSlot(uint32_t i, uint32_t* state, uint64_t* seq, int64_t* deadline_ns) const;
  // Writes a reply into slot i and wakes its client.
  void PostReply(uint32_t i, const absl::Status& status);
  // Whether slot i's call keeps its output bytes (fast::kKeepOutputBytes;
  // true when the ring cannot be read): such a call is not handed back.
  bool SlotKeepsOutputBytes(uint32_t i) const;
  // Sets slot i back to kSubmitted (a call that did not run, to be run
  // again on another channel) and wakes its client.
  void HandBack(uint32_t i);
  // Sets the ring's closed flag and wakes every waiter.
  void MarkClosed();
  // The executor holds `threads`, more than threads_per_executor, with no
  // call running (or past the call that ran when it was first seen over):
  // stopped, charged to no kernel, and the ring closed; a call that had
  // just begun goes back to its client to run on a new channel.
  void StopOverThreads(int threads);

  char* base() const { return reinterpret_cast<char*>(spec_.memory->data()); }
  char* SlotBase(uint32_t i) const {
    return base() + fast::kHeaderBytes + uint64_t{i} * fast::kSlotBytes;
  }

  const std::shared_ptr<ProcessRunner::Impl> runner_;
  const ChannelSpec spec_;
  std::unique_ptr<Worker> w_;  // used by the thread only, until it ends
  const int pid_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> alive_{true};
  Mutex close_mu_;
  bool closed_ ABSL_GUARDED_BY(close_mu_) = false;
  std::map<uint64_t, uint64_t> instance_ids_;  // handle -> instance id (thread only)
  // handle -> its kernel's quarantine key, as the pool uses (thread only):
  // a kernel that crashes channel executors is quarantined like one that
  // crashes pool workers.
  std::map<uint64_t, std::string> quarantine_keys_;
  std::map<uint64_t, std::string> attrs_hashes_;  // handle -> AttrsHash (thread only)
  // The quarantine keys of every kernel bound in this executor since it
  // started (thread only): its Init, and then its calls, ran there. Kept by
  // the daemon as it answers kWantHandle, never read from the executor's
  // count table (a kernel can write that). A crash counts against the
  // running kernel only when it is the one key here: a fast channel's call
  // cannot be run again in a fresh executor, and another kernel may have
  // corrupted this one (a heap overflow that returned OK).
  std::set<std::string> ran_keys_;
  // The client's regions the executor mapped (thread only): after a SIGBUS,
  // one that shrank under its mapping makes the crash the client's.
  std::map<uint64_t, std::shared_ptr<const tensor::Region>> mapped_;
  // Metrics and credit (the thread, then Close() once it ended).
  struct Seen {
    uint64_t handle = 0, code = 0, calls = 0, kernel_ns = 0;
  };
  const int64_t opened_ns_;
  std::vector<Seen> seen_;                // by count table entry
  std::map<uint64_t, std::string> ops_;  // handle -> op name
  uint64_t granted_ = 0;                  // credit granted, in calls
  uint64_t counted_ = 0;                  // calls counted from the table
  uint64_t kernel_counted_ns_ = 0;
  int64_t last_count_ns_ = 0;
};

bool ChannelImpl::ReadSlot(uint32_t i, uint32_t* state, uint64_t* seq,
                           int64_t* deadline_ns) const {
  const char* slot = SlotBase(i);
  return tensor::GuardedCopy(state, slot + offsetof(fast::Slot, state), 4).ok() &&
         tensor::GuardedCopy(seq, slot + offsetof(fast::Slot, seq), 8).ok() &&
         tensor::GuardedCopy(deadline_ns, slot + offsetof(fast::Slot, deadline_ns), 8).ok();
}

void ChannelImpl::PostReply(uint32_t i, const absl::Status& status) {
  char* slot = SlotBase(i);
  const int32_t code = static_cast<int32_t>(status.code());
  const auto why = GetReason(status);
  char reason[fast::kReasonBytes] = {};
  if (why) std::memcpy(reason, why->reason.data(), std::min(why->reason.size(), sizeof reason - 1));
  const absl::string_view message = status.message().substr(0, fast::kMessageBytes);
  const uint32_t len = static_cast<uint32_t>(message.size());
  const double kernel_ms = 0;
  const uint32_t done = fast::kDone;
  if (!tensor::GuardedCopy(slot + offsetof(fast::Slot, code), &code, 4).ok() ||
      !tensor::GuardedCopy(slot + offsetof(fast::Slot, reason), reason, sizeof reason).ok() ||
      !tensor::GuardedCopy(slot + offsetof(fast::Slot, message), message.data(), len).ok() ||
      !tensor::GuardedCopy(slot + offsetof(fast::Slot, message_len), &len, 4).ok() ||
      !tensor::GuardedCopy(slot + offsetof(fast::Slot, kernel_ms), &kernel_ms, 8).ok()) {
    return;
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!tensor::GuardedCopy(slot + offsetof(fast::Slot, state), &done, 4).ok()) return;
  fast::FutexWake(reinterpret_cast<std::atomic<uint32_t>*>(slot + offsetof(fast::Slot, state)),
                  1 << 30);
}

bool ChannelImpl::SlotKeepsOutputBytes(uint32_t i) const {
  uint32_t flags = 0;
  if (!tensor::GuardedCopy(&flags, SlotBase(i) + offsetof(fast::Slot, flags), 4).ok()) return true;
  return (flags & fast::kKeepOutputBytes) != 0;
}

void ChannelImpl::HandBack(uint32_t i) {
  const uint32_t submitted = fast::kSubmitted;
  char* slot = SlotBase(i);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!tensor::GuardedCopy(slot + offsetof(fast::Slot, state), &submitted, 4).ok()) return;
  fast::FutexWake(reinterpret_cast<std::atomic<uint32_t>*>(slot + offsetof(fast::Slot, state)),
                  1 << 30);
}

void ChannelImpl::MarkClosed() {
  const uint32_t one = 1;
  char* hdr = base();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!tensor::GuardedCopy(hdr + offsetof(fast::Header, closed), &one, 4).ok()) return;
  for (uint32_t i = 0; i < fast::kSlots; ++i) {
    char* slot = SlotBase(i);
    fast::FutexWake(reinterpret_cast<std::atomic<uint32_t>*>(slot + offsetof(fast::Slot, state)),
                    1 << 30);
  }
}

void ChannelImpl::StopOverThreads(int threads) {
  Logger("runner")->warn("{} (namespace {}): fast-channel executor process {} has {} threads (at "
                         "most {} while no call runs); stopped, charged to no kernel; the "
                         "client's next call opens a new channel",
                         spec_.label, spec_.ns, pid_, threads,
                         runner_->options.threads_per_executor);
  w_->Reap(/*kill=*/true);
  runner_->live.fetch_sub(1);
  runner_->thread_cap_stops_idle.fetch_add(1);
  alive_.store(false);
  // A call that began after the threads were counted is nobody's fault:
  // it goes back to its client as one that never ran (kSubmitted on the
  // closed ring), which runs it once on a new channel, as after a crash in
  // a shared executor; one whose outputs keep their bytes (one may lie
  // over an input) fails instead, counted against no kernel.
  for (uint32_t i = 0; i < fast::kSlots; ++i) {
    uint32_t state = 0;
    uint64_t seq = 0, handle = 0;
    int64_t deadline_ns = 0;
    if (!ReadSlot(i, &state, &seq, &deadline_ns)) break;
    if (state != fast::kRunning) continue;
    if (!SlotKeepsOutputBytes(i)) {
      HandBack(i);
      continue;
    }
    const bool named =
        tensor::GuardedCopy(&handle, SlotBase(i) + offsetof(fast::Slot, handle), 8).ok();
    const absl::Status reply = WithReason(
        absl::AbortedError(absl::StrCat(
            "the fast channel's executor process was stopped as the call began: it held ",
            threads, " threads, more than the ", runner_->options.threads_per_executor,
            " an executor keeps between calls ([exec] threads_per_executor), left by a kernel "
            "that ran there before. The call keeps its output bytes, so it does not run again; "
            "nothing was counted against its kernel; call again")),
        reason::kWorkerUnavailable, {{"cause", "threads"}, {"counted", "false"}});
    PostReply(i, reply);
    Record(named ? handle : 0, reply.code(), 1, 0);
  }
  MarkClosed();
  TakeCounts();
}

absl::StatusOr<absl::Status> ChannelImpl::Bind(uint64_t handle, Clock::time_point deadline) {
  absl::StatusOr<HandleBinding> b = spec_.resolve_handle(handle);
  if (!b.ok()) return b.status();
  if (b->input_bytes.size() != b->spec.inputs.size() ||
      b->output_bytes.size() != b->spec.outputs.size() ||
      b->input_bytes.size() + b->output_bytes.size() > fast::kMaxTensors) {
    return absl::InvalidArgumentError(absl::StrCat("the handle's call passes more than ",
                                                   fast::kMaxTensors,
                                                   " tensors, too many for a fast channel"));
  }
  const std::string qkey = QuarantineKey(b->spec);
  ops_[handle] = b->op;
  if (absl::Status q = runner_->QuarantineCheck(qkey, spec_.caller); !q.ok()) return q;
  quarantine_keys_[handle] = qkey;
  attrs_hashes_[handle] = AttrsHash(b->spec.attrs);
  ran_keys_.insert(qkey);
  uint64_t& iid = instance_ids_[handle];
  if (iid == 0) iid = runner_->next_instance_id.fetch_add(1);
  wire::Writer bind;
  bind.U64(handle);
  bind.U64(iid);
  bind.U32(static_cast<uint32_t>(b->input_bytes.size()));
  bind.U32(static_cast<uint32_t>(b->output_bytes.size()));
  for (uint64_t n : b->input_bytes) bind.U64(n);
  for (uint64_t n : b->output_bytes) bind.U64(n);
  for (int round = 0; round < 3; ++round) {
    OPJIT_ASSIGN_OR_RETURN(Reply r, runner_->Control(*w_, wire::Msg::kBindHandle, bind.out(), deadline));
    if (r.code != wire::kNeedInstance) return StatusOf(r);
    OPJIT_ASSIGN_OR_RETURN(Reply made, runner_->Control(*w_, wire::Msg::kNewInstance,
                                                        wire::EncodeInstance(iid, b->spec), deadline));
    if (made.code == wire::kNeedKernel) {
      OPJIT_ASSIGN_OR_RETURN(Reply loaded,
                             runner_->Control(*w_, wire::Msg::kLoadKernel,
                                              wire::EncodeKernel(*b->spec.kernel), deadline));
      if (loaded.code != 0) return StatusOf(loaded);
      OPJIT_ASSIGN_OR_RETURN(made, runner_->Control(*w_, wire::Msg::kNewInstance,
                                                    wire::EncodeInstance(iid, b->spec), deadline));
    }
    if (made.code != 0) return StatusOf(made);
  }
  return absl::DataLossError("the executor process kept asking for the instance");
}

absl::StatusOr<absl::Status> ChannelImpl::AddRegion(uint64_t id, Clock::time_point deadline) {
  auto region = spec_.resolve_region(id);
  if (!region.ok()) return region.status();
  wire::Writer wr;
  wr.U64(id);
  wr.U64((*region)->info().offset);
  wr.U64((*region)->size());
  OPJIT_ASSIGN_OR_RETURN(Reply r, runner_->Control(*w_, wire::Msg::kAddRegion, wr.out(), deadline,
                                                   (*region)->fd()));
  if (r.code == 0) {
    if (mapped_.size() >= 4096) mapped_.clear();  // only ever a hint
    mapped_[id] = *region;
  }
  return StatusOf(r);
}

void ChannelImpl::Ended(const absl::Status& s, std::optional<absl::Status> timeout,
                        int running_slot) {
  absl::Status answer;
  bool client_fault = false;
  // Whether a call was running: an executor that died with none (killed
  // from outside while idle) is no crash; its client's next call opens a
  // new channel.
  bool running = running_slot >= 0;
  for (uint32_t i = 0; i < fast::kSlots && !running; ++i) {
    uint32_t state = 0;
    uint64_t seq = 0;
    int64_t deadline_ns = 0;
    if (!ReadSlot(i, &state, &seq, &deadline_ns)) break;
    running = state == fast::kRunning;
  }
  if (timeout) {
    w_->Reap(/*kill=*/true);
    runner_->timeouts.fetch_add(1);
    answer = *timeout;
  } else if (!running && (absl::IsOutOfRange(s) || absl::IsUnavailable(s))) {
    w_->Reap(/*kill=*/false, /*grace_ms=*/200);
    Logger("runner")->warn("{} (namespace {}): fast-channel executor process {} {} while idle "
                           "(killed from outside?); no crash is counted, and the client's next "
                           "call opens a new channel",
                           spec_.label, spec_.ns, pid_, w_->death.empty() ? "died" : w_->death);
  } else {
    runner_->crashes.fetch_add(1);
    answer = runner_->DeathStatus(*w_, s, spec_.label, spec_.ns);
    if (w_->term_signal == SIGBUS) {
      // A region the client shrank under the executor's mapping: the
      // client's fault, counted against no kernel.
      for (const auto& [id, region] : mapped_) {
        struct stat st {};
        if (::fstat(region->fd(), &st) != 0) continue;
        const uint64_t have = st.st_size < 0 ? 0 : static_cast<uint64_t>(st.st_size);
        if (have >= region->info().offset + region->size()) continue;
        client_fault = true;
        Logger("runner")->warn("{} (namespace {}): executor process {} faulted on a shrunk region "
                               "of its client; not counted against the kernel",
                               spec_.label, spec_.ns, pid_);
        answer = WithReason(
            absl::FailedPreconditionError(absl::StrCat(
                "region \"", region->name(), "\" shrank to ",
                have > region->info().offset ? have - region->info().offset : 0,
                " bytes while a call used it (registered with ", region->size(),
                "); the kernel faulted on the missing memory. The client's memory is at fault, "
                "not the kernel: this does not count towards its quarantine")),
            reason::kRegionTooSmall, {{"region", region->name()}, {"cause", "client_memory"}});
        break;
      }
    }
  }
  runner_->live.fetch_sub(1);
  alive_.store(false);
  // The call that ran gets the status (and, for a crash, its kernel counts
  // one towards its quarantine); calls still waiting to start never ran, and
  // their clients see the ring closed.
  for (uint32_t i = 0; i < fast::kSlots; ++i) {
    uint32_t state = 0;
    uint64_t seq = 0, handle = 0;
    int64_t deadline_ns = 0;
    if (!ReadSlot(i, &state, &seq, &deadline_ns)) break;
    if (state != fast::kRunning && static_cast<int>(i) != running_slot) continue;
    const bool named =
        tensor::GuardedCopy(&handle, SlotBase(i) + offsetof(fast::Slot, handle), 8).ok();
    absl::Status reply = answer;
    bool run_again = false;
    if (!timeout && !client_fault && named) {
      if (auto k = quarantine_keys_.find(handle); k != quarantine_keys_.end()) {
        if (ran_keys_.size() == 1 && ran_keys_.count(k->second) == 1) {
          runner_->NoteCrash(k->second, spec_.label, spec_.ns, spec_.caller,
                             attrs_hashes_[handle]);
        } else if (!(w_->term_signal == SIGKILL && !w_->killed_by_us) &&
                   !SlotKeepsOutputBytes(i)) {
          // Other kernels ran in this executor first; one of them may have
          // corrupted it. As the pool runs such a call again in a fresh
          // executor, the ring hands it back to its client as a call that
          // never ran (kSubmitted on a closed ring): every client then
          // opens a new channel, with a fresh executor, and submits it
          // there once (inputs are the client's own memory; outputs are
          // written again in full). Nobody is blamed here; a crash there
          // counts against the kernel.
          Logger("runner")->warn(
              "{} (namespace {}): fast-channel executor process {} had run {} other kernel(s) "
              "since it started; the crash is not counted against the running kernel, and "
              "the call goes back to its client to run again in a fresh executor",
              spec_.label, spec_.ns, pid_, ran_keys_.size() - ran_keys_.count(k->second));
          run_again = true;
        } else {
          // Killed from outside (an operator, the OOM killer), or a call
          // whose outputs keep their bytes (one may lie over an input): not
          // run again, as on the pool; nobody is blamed either.
          Logger("runner")->warn(
              "{} (namespace {}): fast-channel executor process {} had run {} other kernel(s) "
              "since it started; the crash is not counted against the running kernel",
              spec_.label, spec_.ns, pid_, ran_keys_.size() - ran_keys_.count(k->second));
          reply = NotCounted(answer);
        }
      }
    }
    if (run_again) {
      HandBack(i);
    } else {
      PostReply(i, reply);
    }
    // The executor never counted this call (it died in it); the daemon
    // answered it, so the daemon counts it.
    Record(named ? handle : 0, reply.code(), 1, 0);
  }
  MarkClosed();
  TakeCounts();
}

absl::Status ChannelImpl::GrantCredit(uint64_t handle) {
  absl::StatusOr<uint64_t> granted = kUnboundedCredit;
  if (spec_.admit_calls) granted = spec_.admit_calls();
  if (granted.ok() && *granted == 0) {
    granted = absl::ResourceExhaustedError("the server granted no call credit");
  }
  wire::Writer w;
  if (granted.ok()) {
    granted_ += *granted;
    w.U64(*granted);
  } else {
    w.U64(0);
    w.I32(static_cast<int32_t>(granted.status().code()));
    const auto why = GetReason(granted.status());
    w.Str(why ? why->reason : "");
    w.Str(std::string(granted.status().message()));
    Record(handle, granted.status().code(), 1, 0);
  }
  return wire::SendFrame(w_->sock, wire::Msg::kCredit, w.out());
}

const std::string& ChannelImpl::OpOf(uint64_t handle) {
  if (auto it = ops_.find(handle); it != ops_.end()) return it->second;
  if (ops_.size() >= 4096) ops_.clear();  // handles the client made up
  std::string op;
  if (handle != 0) {
    if (auto b = spec_.resolve_handle(handle); b.ok()) op = b->op;
  }
  return ops_[handle] = std::move(op);
}

void ChannelImpl::TakeCounts() {
  last_count_ns_ = fast::MonotonicNs();
  if (!spec_.record_calls) return;
  wire::CallCounts* table = wire::CallCountsOf(w_->slot);
  const uint64_t used =
      std::min<uint64_t>(table->used.load(std::memory_order_acquire), wire::kCallCounts);
  if (seen_.size() < used) seen_.resize(used);
  const uint64_t open_ns = static_cast<uint64_t>(std::max<int64_t>(last_count_ns_ - opened_ns_, 0));
  for (uint64_t i = 0; i < used; ++i) {
    const wire::CallCount& e = table->entries[i];
    const uint64_t handle = e.handle.load(std::memory_order_relaxed);
    const uint64_t code = e.code.load(std::memory_order_relaxed);
    const uint64_t calls = e.calls.load(std::memory_order_relaxed);
    const uint64_t kernel_ns = e.kernel_ns.load(std::memory_order_relaxed);
    Seen& seen = seen_[i];
    if (seen.handle != handle || seen.code != code) seen = Seen{handle, code, 0, 0};
    uint64_t dc = calls > seen.calls ? calls - seen.calls : 0;
    uint64_t dk = kernel_ns > seen.kernel_ns ? kernel_ns - seen.kernel_ns : 0;
    seen.calls = calls;
    seen.kernel_ns = kernel_ns;
    if (code > 16) continue;  // not a status code: a kernel wrote here
    dc = std::min(dc, granted_ - counted_);
    dk = std::min(dk, open_ns > kernel_counted_ns_ ? open_ns - kernel_counted_ns_ : 0);
    counted_ += dc;
    kernel_counted_ns_ += dk;
    if (dc > 0) Record(handle, static_cast<absl::StatusCode>(code), dc, dk / 1e9);
  }
}

void ChannelImpl::Serve() {
  const int64_t limit_ns = runner_->options.kernel_timeout_ms * 1000000;
  // The running call the watchdog follows: its serial in the executor's
  // arena (never the client's ring), and when this thread first saw it, on
  // its own clock.
  uint64_t watched = 0;
  uint32_t watched_slot = 0;
  int64_t watched_since = 0;
  int64_t watched_deadline = 0;
  int64_t last_watch_ns = 0;
  // The thread cap while no call runs: the executor's threads, counted
  // every thread_watch_ms (one fstat), and the call that ran when they were
  // first seen over the cap (0: none), with whether they were.
  const int thread_cap = runner_->options.threads_per_executor;
  const int64_t threads_every_ns = runner_->options.thread_watch_ms * 1000000;
  int64_t last_threads_ns = 0;
  uint64_t over_call = 0;
  bool over_seen = false;
  while (!stop_.load()) {
    pollfd p{w_->sock, POLLIN, 0};
    const int r = ::poll(&p, 1, 20);
    if (stop_.load()) return;
    if (r > 0) {
      wire::Msg type;
      std::string payload;
      int fd = -1;
      absl::Status got = wire::RecvFrame(w_->sock, &type, &payload, absl::Now() + absl::Seconds(5), &fd);
      if (fd >= 0) ::close(fd);
      if (!got.ok()) return Ended(got, std::nullopt, -1);
      wire::Reader rd(payload);
      const uint64_t id = rd.U64();
      if (!rd.done() || (type != wire::Msg::kWantHandle && type != wire::Msg::kWantRegion &&
                         type != wire::Msg::kWantCredit)) {
        return Ended(absl::DataLossError("unexpected frame"), std::nullopt, -1);
      }
      if (type == wire::Msg::kWantCredit) {
        if (!GrantCredit(id).ok()) {
          return Ended(absl::UnavailableError("the executor process is gone"), std::nullopt, -1);
        }
      } else {
        const auto deadline = Clock::now() + std::chrono::milliseconds(runner_->options.kernel_timeout_ms);
        absl::StatusOr<absl::Status> grant =
            type == wire::Msg::kWantHandle ? Bind(id, deadline) : AddRegion(id, deadline);
        if (!grant.ok()) {
          if (stop_.load()) return;
          if (absl::IsDeadlineExceeded(grant.status())) {
            return Ended(grant.status(), runner_->TimeoutStatus(false), -1);
          }
          return Ended(grant.status(), std::nullopt, -1);
        }
        wire::Writer w;
        w.I32(static_cast<int32_t>(grant->code()));
        const auto why = GetReason(*grant);
        w.Str(why ? why->reason : "");
        w.Str(std::string(grant->message()));
        if (!wire::SendFrame(w_->sock, wire::Msg::kGrant, w.out()).ok()) {
          return Ended(absl::UnavailableError("the executor process is gone"), std::nullopt, -1);
        }
      }
    } else if (r < 0 && errno != EINTR) {
      return Ended(absl::InternalError("poll failed"), std::nullopt, -1);
    }
    // Watchdog: the running call's deadline, and the kernel time limit.
    const int64_t now = fast::MonotonicNs();
    if (r > 0 && now - last_watch_ns < kWatchEveryNs) continue;
    last_watch_ns = now;
    if (now - last_count_ns_ >= kCountEveryNs) TakeCounts();
    // A shrunk ring ends the channel (the executor would fault on it next).
    uint32_t magic = 0;
    if (!tensor::GuardedCopy(&magic, base() + offsetof(fast::Header, magic), 4).ok()) {
      return Ended(absl::FailedPreconditionError("the client shrank its channel"),
                   absl::FailedPreconditionError("the channel's memory shrank"), -1);
    }
    const uint64_t call = w_->slot->fast_call.load(std::memory_order_acquire);
    // Threads past the cap are allowed while a call runs (its kernel's), not
    // once no call does, nor past the end of the call they were first seen
    // in (a later call is another serial).
    if (thread_cap > 0 && threads_every_ns > 0 && now - last_threads_ns >= threads_every_ns) {
      last_threads_ns = now;
      const int threads = w_->Threads();
      if (threads <= thread_cap) {
        over_seen = false;
      } else if (call == 0 || (over_seen && over_call != call)) {
        return StopOverThreads(threads);
      } else if (!over_seen) {
        over_seen = true;
        over_call = call;
      }
    }
    if (call == 0) {
      watched = 0;
      continue;
    }
    if (call != watched) {
      watched = call;
      watched_since = now;
      watched_slot = w_->slot->fast_slot.load(std::memory_order_relaxed);
      // The client's deadline as the executor read it when the call began:
      // rewriting the ring later changes nothing.
      watched_deadline = w_->slot->fast_deadline_ns.load(std::memory_order_relaxed);
    }
    const bool by_call = watched_deadline > 0 && now > watched_deadline;
    if (by_call || now - watched_since > limit_ns) {
      Logger("runner")->warn("{} (namespace {}): fast-channel kernel stopped at {}; executor "
                             "process {} killed", spec_.label, spec_.ns,
                             by_call ? "the call's deadline" : "the kernel time limit", pid_);
      return Ended(absl::DeadlineExceededError("stopped"), runner_->TimeoutStatus(by_call),
                   watched_slot < fast::kSlots ? static_cast<int>(watched_slot) : -1);
    }
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<Channel>> ProcessRunner::OpenChannel(const ChannelSpec& spec) {
  if (spec.memory == nullptr || spec.memory->size() < fast::kChannelBytes || !spec.resolve_handle ||
      !spec.resolve_region) {
    return absl::InvalidArgumentError("bad channel spec");
  }
  // The ring's header, before the client (or the executor) sees it.
  fast::Header h{};
  h.magic = fast::kMagic;
  h.version = fast::kVersion;
  h.n_slots = fast::kSlots;
  h.slot_bytes = fast::kSlotBytes;
  h.max_tensors = fast::kMaxTensors;
  h.spin_us = spec.spin_us;
  // Written before the executor starts: once it has said hello it may
  // already sleep on the doorbell with worker_sleeping set, and a header
  // written after that cleared the flag, so the client's first call did not
  // wake it (~100 ms late, measured by bench/isolation_bench). Afterwards,
  // only the pid.
  OPJIT_RETURN_IF_ERROR(tensor::GuardedCopy(spec.memory->data(), &h, sizeof h));
  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<Worker> w, impl_->Spawn(spec.ns, spec.memory.get(), spec.spin_us));
  const uint32_t pid = static_cast<uint32_t>(w->pid);
  OPJIT_RETURN_IF_ERROR(tensor::GuardedCopy(
      spec.memory->data() + offsetof(fast::Header, worker_pid), &pid, sizeof pid));
  return std::shared_ptr<Channel>(new ChannelImpl(impl_, spec, std::move(w)));
}

absl::StatusOr<std::unique_ptr<ProcessRunner>> ProcessRunner::Create(
    const ProcessRunnerOptions& options) {
  if (options.worker_path.empty() || ::access(options.worker_path.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("the executor binary ", options.worker_path,
                                            " is missing; build opjit-exec-worker"));
  }
  if (options.workers_per_namespace < 1 || options.kernel_timeout_ms < 1 ||
      options.quarantine_after < 1 || options.quarantine_callers < 1 ||
      options.threads_per_executor < 0 ||
      options.threads_per_namespace < 0 ||
      (options.uid_first != 0 && options.uid_last < options.uid_first)) {
    return absl::InvalidArgumentError("bad process runner options");
  }
  auto impl = std::make_shared<Impl>();
  impl->options = options;
  if (!impl->options.spawn) impl->options.spawn = subprocess::Spawn;
  if (impl->options.clock == nullptr) impl->options.clock = SteadyClock();
  ::signal(SIGPIPE, SIG_IGN);
  impl->cgroups = MemoryCgroups::Open(subprocess::InstanceTag().empty()
                                          ? std::to_string(::getpid())
                                          : subprocess::InstanceTag(),
                                      options.namespace_memory_bytes);
  if (impl->cgroups != nullptr) {
    Logger("runner")->info("each namespace's executors share a memory cap of {} MiB ({} under {})",
                           options.namespace_memory_bytes >> 20, impl->cgroups->mode(),
                           impl->cgroups->dir());
    // Without root, RLIMIT_NPROC cannot cap a namespace (each executor's
    // user namespace counts its own); a delegated pids controller can.
    if (::geteuid() != 0 &&
        impl->cgroups->CapTasks(static_cast<uint64_t>(options.threads_per_namespace))) {
      Logger("runner")->info("each namespace's executors share a cap of {} threads (pids.max)",
                             options.threads_per_namespace);
    }
  } else if (options.namespace_memory_bytes != 0) {
    Logger("runner")->warn(
        "WARNING: no writable cgroup with a memory controller (cgroup v2 needs a delegated "
        "cgroup, e.g. Delegate=yes in the unit; v1 needs root): [exec] namespace_memory_mb is "
        "not enforced, and a namespace's executors are bounded one by one (worker_memory_mb, "
        "scratch_mb)");
  }
  // The scratch directories of workers without namespaces live in a
  // directory named by this daemon's instance (its state dir), so a restart
  // removes what a killed predecessor's executors left there, and nothing
  // else of options.host.scratch_dir.
  if (!options.host.scratch_dir.empty()) {
    const std::string tag = subprocess::InstanceTag();
    impl->scratch_root = absl::StrCat(options.host.scratch_dir, "/opjit-exec-",
                                      tag.empty() ? absl::StrCat("p", ::getpid()) : tag);
    std::error_code ec;
    std::filesystem::remove_all(impl->scratch_root, ec);
  }
  // The thread cap while no call runs: idle pool workers (fast channels
  // watch their own executor).
  if (options.threads_per_executor > 0 && options.thread_watch_ms > 0) {
    impl->watcher = std::thread([raw = impl.get()] { raw->WatchThreads(); });
  }
  return std::unique_ptr<ProcessRunner>(new ProcessRunner(std::move(impl)));
}

ProcessRunner::~ProcessRunner() {
  if (impl_->watcher.joinable()) {
    {
      MutexLock stop(&impl_->watch_mu);
      impl_->watch_stop = true;
    }
    impl_->watch_cv.SignalAll();
    impl_->watcher.join();
  }
  MutexLock lock(&impl_->mu);
  for (auto& [ns, pool] : impl_->pools) {
    MutexLock plock(&pool->mu);
    for (auto& w : pool->idle) w->Reap(/*kill=*/true);
    pool->idle.clear();
  }
  // The scratch root, where empty (a worker still running keeps its own).
  if (!impl_->scratch_root.empty()) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(impl_->scratch_root, ec)) {
      std::error_code rec;
      std::filesystem::remove(entry.path(), rec);
    }
    std::filesystem::remove(impl_->scratch_root, ec);
  }
}

absl::StatusOr<std::shared_ptr<KernelInstance>> ProcessRunner::Instance(const InstanceSpec& spec) {
  if (spec.kernel == nullptr) return absl::InternalError("no kernel given");
  return std::shared_ptr<KernelInstance>(
      new RemoteInstance(impl_, spec, impl_->next_instance_id.fetch_add(1)));
}

void ProcessRunner::Maintain() {
  const auto now = impl_->options.clock->Now();
  const auto cutoff = now - std::chrono::milliseconds(impl_->options.idle_ms);
  std::vector<std::unique_ptr<Worker>> stale;
  {
    MutexLock lock(&impl_->mu);
    for (auto& [ns, pool] : impl_->pools) {
      MutexLock plock(&pool->mu);
      for (auto& w : pool->idle) {
        // Idle for a while after big inline calls: give the arena's pages
        // back. Not sooner: faulting fresh pages in costs ~3 ms per MiB on
        // these VMs, 50x a copy into warm ones.
        if (w->arena_high > (8u << 20) && w->last_used < now - std::chrono::seconds(10)) {
          ::fallocate(w->arena_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(wire::kSlotBytes), static_cast<off_t>(w->arena_high));
          w->arena_high = 0;
        }
      }
      for (auto it = pool->idle.begin(); it != pool->idle.end();) {
        if ((*it)->last_used < cutoff) {
          stale.push_back(std::move(*it));
          it = pool->idle.erase(it);
          --pool->live;
        } else {
          ++it;
        }
      }
    }
  }
  for (auto& w : stale) {
    // Closing the socket ends it; SIGKILL in case a kernel ignores that.
    w->Reap(/*kill=*/true);
    impl_->live.fetch_sub(1);
  }
  if (!stale.empty()) Logger("runner")->debug("stopped {} idle executor process(es)", stale.size());
}

int ProcessRunner::LiftQuarantine(const std::string& op) { return impl_->LiftQuarantine(op); }

RunnerStats ProcessRunner::Stats() const {
  RunnerStats s;
  s.workers_live = impl_->live.load();
  s.workers_started = impl_->started.load();
  s.worker_crashes = impl_->crashes.load();
  s.worker_timeouts = impl_->timeouts.load();
  s.quarantined = impl_->quarantined.load();
  s.thread_cap_stops_after_call = impl_->thread_cap_stops_after_call.load();
  s.thread_cap_stops_idle = impl_->thread_cap_stops_idle.load();
  return s;
}

}  // namespace opjit::runner

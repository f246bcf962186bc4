#include "server/compiler/cpu/cpu_compiler.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/paths.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/common/subprocess.h"
#include "server/compiler/compile_options.h"
#include "server/compiler/cpu/ipc.h"
#include "server/compiler/cpu/preamble.h"


namespace opjit::compiler {
namespace {

namespace fs = std::filesystem;

// Bumped when the worker changes the object it produces for the same
// toolchain (flags, ctor lowering, ...). Part of ToolchainId.
// 2: exact preambles, no prelude; 3: math calls vectorize to glibc's libmvec.
constexpr char kObjectAbi[] = "opjit-cpu-object-3";

constexpr absl::Duration kStartupTimeout = absl::Seconds(20);

std::string Normalize(const std::string& dir) {
  if (dir.empty()) return dir;
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(dir), ec);
  if (ec) p = fs::path(dir);
  std::string s = p.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

// The options a PCH must be built with to be loadable by a compile with
// `options`. Warnings do not matter (a PCH's own warnings are not shown).
// Every macro does: the preamble is the user's own, and may test them.
std::vector<std::string> PchOptions(const std::vector<std::string>& options) {
  std::vector<std::string> out;
  for (const std::string& o : options) {
    if (o == "-w" || absl::StartsWith(o, "-W")) continue;
    out.push_back(o);
  }
  return out;
}

std::string DefaultWorkerPath() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path candidate = self.parent_path() / "opjit-compile-worker";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  if (const char* env = std::getenv("OPJIT_COMPILE_WORKER"); env != nullptr && *env != '\0') {
    return env;
  }
  return "";
}

// Writes `content` to `path` unless it already holds exactly that (keeping
// its timestamp, which a PCH built from it records). Temp file + rename.
absl::Status WriteFileIfChanged(const fs::path& path, const std::string& content) {
  {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      if (ss.str() == content) return absl::OkStatus();
    }
  }
  fs::path tmp = path;
  tmp += absl::StrCat(".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << content;
    if (!out.flush()) return absl::UnavailableError(absl::StrCat("cannot write ", tmp.string()));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename to ", path.string()));
  }
  return absl::OkStatus();
}

#ifdef OPJIT_SANITIZED
// ASan's shadow makes every worker's address space terabytes, and there is
// no RLIMIT_AS to stay under (see sandbox.h): only the compile count counts.
constexpr bool kRecycleBySize = false;
#else
constexpr bool kRecycleBySize = true;
#endif

// The CPU time (user + system) a process has used, in ms; -1 when unknown.
int64_t CpuTimeMs(pid_t pid) {
  const std::string stat = ReadSmallFile(absl::StrCat("/proc/", pid, "/stat"));
  // The command name (field 2) may hold spaces and parentheses: fields
  // start after its last ')'. utime and stime are fields 14 and 15.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 1));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int k = 3; k <= 15 && (in >> field); ++k) {
    if (k == 14 || k == 15) {
      uint64_t v = 0;
      if (!absl::SimpleAtoi(field, &v)) return -1;
      (k == 14 ? utime : stime) = v;
    }
  }
  if (!in) return -1;
  const long hz = ::sysconf(_SC_CLK_TCK);
  if (hz <= 0) return -1;
  return static_cast<int64_t>((utime + stime) * 1000 / static_cast<uint64_t>(hz));
}

// Waits until `fd` has something to read or `until` passes; true if readable
// (or hung up).
bool WaitReadable(int fd, absl::Time until) {
  for (;;) {
    int64_t ms = absl::ToInt64Milliseconds(until - absl::Now());
    if (ms < 0) ms = 0;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return true;  // let the read report it
  }
}

using subprocess::DescribeExit;
using subprocess::SignalName;

// Signals that mean the compiler itself crashed on the source (as opposed to
// a signal someone sent the worker).
bool IsCrashSignal(int sig) {
  return sig == SIGSEGV || sig == SIGBUS || sig == SIGILL || sig == SIGFPE || sig == SIGABRT ||
         sig == SIGTRAP || sig == SIGSYS;
}

// Kills a worker (unless it already ended) and reaps it.
void KillAndReap(pid_t pid) { (void)subprocess::Reap(pid); }

// Response flags Run() reports (CpuCompiler::Run's `response_flags`).
constexpr int kPchBuilt = 1;
constexpr int kPchStale = 2;

// A descriptor closed when it goes out of scope.
struct OwnedFd {
  int fd = -1;
  OwnedFd() = default;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd() { Reset(); }
  void Reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

}  // namespace

struct CpuCompiler::Worker {
  pid_t pid = -1;
  int fd = -1;
  int compiles = 0;  // requests answered
  bool assigned = false;  // has served `tenant` (and will serve no other namespace)
  std::string tenant;
  ipc::Hello hello;
  ~Worker() {
    if (fd >= 0) ::close(fd);
  }
};

CpuCompiler::CpuCompiler(const CpuCompilerOptions& options) : options_(options) {}

CpuCompiler::~CpuCompiler() {
  // A profile PCH built at start is no one's to wait for: its worker is
  // ended (the build then fails, and the thread returns).
  pid_t builder = 0;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    builder = profile_builder_pid_;
  }
  profile_cv_.SignalAll();
  if (builder > 0 && profile_starter_.joinable()) ::kill(builder, SIGKILL);
  if (profile_starter_.joinable()) profile_starter_.join();
  std::deque<std::unique_ptr<Worker>> idle;
  {
    MutexLock lock(&mu_);
    idle.swap(idle_);
  }
  for (auto& w : idle) KillAndReap(w->pid);
}

absl::StatusOr<std::unique_ptr<CpuCompiler>> CpuCompiler::Create(
    const CpuCompilerOptions& options) {
  if (options.num_workers < 1) return absl::InvalidArgumentError("num_workers must be >= 1");
  if (options.timeout_ms < 1) return absl::InvalidArgumentError("timeout_ms must be >= 1");
  auto c = absl::WrapUnique(new CpuCompiler(options));
  auto log = Logger("compiler");
  c->worker_path_ = options.worker_path.empty() ? DefaultWorkerPath() : options.worker_path;
  if (c->worker_path_.empty()) {
    return absl::UnavailableError(
        "opjit-compile-worker not found next to this executable and $OPJIT_COMPILE_WORKER is "
        "not set");
  }
  c->kernel_include_dir_ = Normalize(options.kernel_include_dir);
  for (const std::string& d : options.extra_include_dirs) {
    c->allowed_extra_dirs_.push_back(Normalize(d));
  }

  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, c->StartWorker());
  {
    MutexLock lock(&c->mu_);
    c->live_ = 1;
  }
  const ipc::Hello& h = worker->hello;
  c->toolchain_id_ = absl::StrCat(
      "clang=", h.clang_version, "; triple=", h.triple, "; cpu=", h.cpu,
      "; features=", absl::StrJoin(h.features, ","), "; flags=", h.fixed_flags,
      "; abi=", kObjectAbi);
  if (!options.pch_dir.empty()) {
    // This process's alone: workers never see it (they get descriptors).
    std::error_code ec;
    fs::create_directories(options.pch_dir, ec);
    if (!ec) {
      ::chmod(options.pch_dir.c_str(), 0700);
      // Builds a killed daemon left unfinished, an hour old or more (a
      // daemon sharing the cache directory may be building one now).
      const auto old = fs::file_time_type::clock::now() - std::chrono::hours(1);
      for (const auto& e : fs::directory_iterator(options.pch_dir, ec)) {
        std::error_code rm;
        if (e.path().filename().string().find(".pch.tmp.") != std::string::npos &&
            e.last_write_time(rm) < old && !rm) {
          fs::remove(e.path(), rm);
        }
      }
      ec.clear();
    }
    if (ec) {
      log->warn("compiling without PCHs: cannot create the PCH directory: {}", ec.message());
    } else {
      c->pch_dir_ = Normalize(options.pch_dir);
    }
  }
  c->Release(std::move(worker));
  log->info("CPU compiler ready: {} workers max, worker {}, preamble PCHs {}",
            options.num_workers, c->worker_path_, c->pch_dir_.empty() ? "off" : c->pch_dir_);
  c->StartProfilePchs();
  return c;
}

std::string CpuCompiler::PchKeyFor(const std::string& tenant, const std::string& directives,
                                   const std::vector<std::string>& pch_options,
                                   const std::vector<std::string>& include_dirs) const {
  return Sha256Hex(absl::StrCat("namespace=", tenant.size(), ":", tenant, "\n", toolchain_id_,
                                "\n", absl::StrJoin(include_dirs, "\x1f"), "\n",
                                absl::StrJoin(pch_options, "\x1f"), "\n", directives))
      .substr(0, 32);
}

void CpuCompiler::NotePchUse(const std::string& key, bool existed, bool built) {
  const fs::path dir(pch_dir_);
  std::error_code ec;
  if (existed) {
    // Least recently used goes first: a use is a new mtime.
    fs::last_write_time(dir / (key + ".pch"), fs::file_time_type::clock::now(), ec);
    return;
  }
  if (!built) return;  // not built (a failing preamble)
  {
    MutexLock lock(&mu_);
    ++stats_.pch_built;
  }
  MutexLock lock(&evict_mu_);
  struct Entry {
    fs::file_time_type mtime;
    uint64_t bytes;
    fs::path path;
  };
  std::vector<Entry> pchs;
  uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".pch") continue;
    std::error_code e1, e2;
    Entry en{e.last_write_time(e1), e.file_size(e2), e.path()};
    if (e1 || e2) continue;
    total += en.bytes;
    pchs.push_back(std::move(en));
  }
  std::sort(pchs.begin(), pchs.end(),
            [](const Entry& a, const Entry& b) { return a.mtime < b.mtime; });
  size_t count = pchs.size();
  uint64_t evicted = 0;
  for (const Entry& e : pchs) {
    if (count <= static_cast<size_t>(std::max(1, options_.pch_max_files)) &&
        total <= options_.pch_max_bytes) {
      break;
    }
    if (e.path.stem() == key) continue;  // the one just built stays
    // A worker that has it open keeps reading it; one that finds it gone
    // builds it again.
    fs::remove(e.path, ec);
    fs::path header = e.path;
    fs::remove(header.replace_extension(".h"), ec);
    --count;
    total -= e.bytes;
    ++evicted;
  }
  if (evicted > 0) {
    MutexLock lock(&mu_);
    stats_.pch_evicted += evicted;
    Logger("compiler")->debug("evicted {} preamble PCHs ({} left, {} MiB)", evicted, count,
                              total >> 20);
  }
}

absl::StatusOr<std::unique_ptr<CpuCompiler::Worker>> CpuCompiler::StartWorker() {
  const std::string parent = std::to_string(::getpid());
  std::vector<std::string> args = {"--fd", "3", subprocess::kParentPidFlag, parent};
  if (options_.memory_limit_bytes != 0) {
    args.insert(args.end(), {"--memory-limit", std::to_string(options_.memory_limit_bytes)});
  }
  // What the worker's Landlock lets it read (besides the system's headers
  // and libraries) and write (the PCH directory).
  // Nothing to write: a PCH comes and goes as a descriptor.
  args.insert(args.end(), {"--read-only", kernel_include_dir_});
  for (const auto& d : allowed_extra_dirs_) args.insert(args.end(), {"--read-only", d});
  // A profile's dirs: a compile reads them only when its request names the
  // profile (the worker's file system allows a request's dirs alone).
  for (const ToolchainProfile& p : options_.profiles) {
    for (const auto& d : p.include_dirs) args.insert(args.end(), {"--read-only", Normalize(d)});
  }
  // The socket as fd 3, its stderr the daemon's. Namespaces of its own
  // where the daemon can make them: it sees no other process, has no
  // network, and its mounts are its own. Root: the compile uid, never
  // root's (the worker drops to it).
  subprocess::SpawnOptions spawn;
  spawn.path = worker_path_;
  spawn.args = std::move(args);
  spawn.fds = {{2, 2}};
  absl::StatusOr<subprocess::HelperChannel> started = subprocess::SpawnCompileHelper(
      std::move(spawn), {3}, options_.worker_uid, options_.worker_gid);
  if (!started.ok()) {
    Logger("compiler")->error("cannot start {}: {}", worker_path_, started.status().ToString());
    return absl::UnavailableError(
        absl::StrCat("cannot start a compile worker: ", started.status().message()));
  }
  auto w = std::make_unique<Worker>();
  w->pid = started->pid;
  w->fd = started->fd;
  std::string frame;
  absl::Status s = ipc::ReadFrame(w->fd, &frame, absl::Now() + kStartupTimeout);
  absl::StatusOr<ipc::Hello> hello =
      s.ok() ? ipc::DecodeHello(frame) : absl::StatusOr<ipc::Hello>(s);
  if (hello.ok() && hello->protocol_version != ipc::kProtocolVersion) {
    hello = absl::FailedPreconditionError("protocol version mismatch");
  }
  if (!hello.ok()) {
    absl::StatusOr<subprocess::Exit> e = subprocess::Reap(w->pid);
    return absl::UnavailableError(absl::StrCat("the compile worker did not start (it ",
                                               e.ok() ? e->Describe() : "could not be reaped",
                                               "): ", hello.status().ToString()));
  }
  w->hello = *std::move(hello);
  Logger("compiler")->debug("compile worker {} started", w->pid);
  return w;
}

absl::StatusOr<std::unique_ptr<CpuCompiler::Worker>> CpuCompiler::Acquire(
    const std::string& tenant) {
  for (;;) {
    std::unique_ptr<Worker> w;
    std::unique_ptr<Worker> other;  // another namespace's, to end
    bool start = false;
    {
      MutexLock lock(&mu_);
      while (idle_.empty() && live_ >= options_.num_workers) idle_cv_.Wait(&mu_);
      auto mine = std::find_if(idle_.begin(), idle_.end(), [&](const auto& i) {
        return !i->assigned || i->tenant == tenant;
      });
      if (mine != idle_.end()) {
        w = std::move(*mine);
        idle_.erase(mine);
      } else if (live_ < options_.num_workers) {
        ++live_;
        start = true;
      } else {
        // Its slot, for a fresh worker.
        other = std::move(idle_.front());
        idle_.pop_front();
        ++stats_.tenant_switches;
        start = true;
      }
    }
    if (other != nullptr) KillAndReap(other->pid);
    if (start) {
      absl::StatusOr<std::unique_ptr<Worker>> started = StartWorker();
      MutexLock lock(&mu_);
      if (!started.ok()) {
        --live_;
        idle_cv_.Signal();
        return started.status();
      }
      if (dead_ > 0) {
        --dead_;
        ++stats_.worker_restarts;
      }
      return started;
    }
    // An idle worker that has something to say, or hung up, is dead.
    pollfd p{w->fd, POLLIN, 0};
    if (::poll(&p, 1, 0) == 0) return w;
    Logger("compiler")->warn("compile worker {} died while idle", w->pid);
    Discard(std::move(w));
  }
}

void CpuCompiler::Release(std::unique_ptr<Worker> worker) {
  {
    MutexLock lock(&mu_);
    idle_.push_back(std::move(worker));
  }
  idle_cv_.Signal();
}

void CpuCompiler::Discard(std::unique_ptr<Worker> worker) {
  KillAndReap(worker->pid);
  worker.reset();
  {
    MutexLock lock(&mu_);
    --live_;
    ++dead_;
  }
  idle_cv_.Signal();
}

bool CpuCompiler::RegularLaneBusy() const {
  MutexLock lock(&mu_);
  return live_ > static_cast<int>(idle_.size());
}

bool CpuCompiler::EnterLongLane(Worker* worker, const std::string& file_name) {
  int in_lane = 0;
  {
    MutexLock lock(&mu_);
    if (long_ >= options_.long_workers) return false;
    ++long_;
    --live_;
    ++stats_.long_compiles;
    in_lane = long_;
  }
  idle_cv_.Signal();
  // Small compiles that start meanwhile get the CPU first. Best effort.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(worker->pid), 10);
  Logger("compiler")->info(
      "compile of {} still running after {} ms: moved to the long lane ({} of {}), "
      "its slot goes to other compiles",
      file_name, options_.long_after_ms, in_lane, options_.long_workers);
  return true;
}

void CpuCompiler::FinishWith(std::unique_ptr<Worker> worker, bool long_lane, bool retire) {
  const bool died = worker == nullptr;
  if (!died && !long_lane) {
    ++worker->compiles;
    const char* why = nullptr;
    uint64_t size = 0;
    if (retire) {
      why = "a PCH build (it held a writable file)";
    } else if (options_.recycle_after_compiles > 0 &&
        worker->compiles >= options_.recycle_after_compiles) {
      why = "compiles";
    } else if (kRecycleBySize && options_.recycle_memory_bytes > 0 &&
               (size = subprocess::AddressSpaceBytes(worker->pid)) >= options_.recycle_memory_bytes) {
      why = "size";
    }
    if (why == nullptr) {
      Release(std::move(worker));
      return;
    }
    Logger("compiler")->debug("recycling compile worker {} after {} compiles ({} MiB, by {})",
                              worker->pid, worker->compiles, size >> 20, why);
  }
  // A worker that spent its compile in the long lane has grown with it, and
  // its slot was already given away: it goes too.
  if (!died) {
    KillAndReap(worker->pid);
    worker.reset();
  }
  {
    MutexLock lock(&mu_);
    if (long_lane) {
      --long_;
    } else {
      --live_;
      if (died) {
        ++dead_;
      } else {
        ++stats_.recycled;
      }
    }
  }
  idle_cv_.SignalAll();
}

void CpuCompiler::Reap(std::unique_ptr<Worker>* worker, int* status, struct rusage* usage) {
  if (absl::StatusOr<subprocess::Exit> e = subprocess::Reap((*worker)->pid); e.ok()) {
    if (status != nullptr) *status = e->wait_status;
    if (usage != nullptr) *usage = e->usage;
  }
  worker->reset();
}

absl::StatusOr<CpuCompileOutput> CpuCompiler::Run(std::unique_ptr<Worker>* worker,
                                                  const std::string& payload,
                                                  const std::string& file_name, bool allow_long,
                                                  bool* long_lane, int pass_fd,
                                                  int* response_flags, int timeout_ms) {
  Worker& w = **worker;
  auto log = Logger("compiler");
  if (response_flags != nullptr) *response_flags = 0;
  if (timeout_ms <= 0) timeout_ms = options_.timeout_ms;
  absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  absl::Status s = ipc::WriteFrame(w.fd, payload, deadline, ipc::kToWorker, pass_fd);
  const bool sent = s.ok();
  *long_lane = false;
  if (s.ok() && allow_long && options_.long_after_ms > 0 && options_.long_workers > 0) {
    absl::Time switch_at = std::min(deadline, absl::Now() + absl::Milliseconds(options_.long_after_ms));
    // Only a compile that still has time left moves (timeout_ms <= long_after_ms:
    // no lane), so the lane's CPU-time limit never replaces a plain deadline.
    if (!WaitReadable(w.fd, switch_at) && switch_at < deadline) {
      *long_lane = EnterLongLane(&w, file_name);
    }
  }
  if (s.ok() && *long_lane && !WaitInLongLane(w, file_name, &deadline)) {
    Reap(worker);
    MutexLock lock(&mu_);
    ++stats_.timeouts;
    return absl::DeadlineExceededError(absl::StrCat(
        "compile exceeded the ", options_.timeout_ms, " ms limit (CPU time, in the long lane)"));
  }
  std::string frame;
  if (s.ok()) s = ipc::ReadFrame(w.fd, &frame, deadline);

  if (absl::IsDeadlineExceeded(s)) {
    log->debug("compile worker {} killed at the {} ms deadline", w.pid, options_.timeout_ms);
    Reap(worker);
    MutexLock lock(&mu_);
    ++stats_.timeouts;
    return absl::DeadlineExceededError(absl::StrCat(
        "compile exceeded the ",
        *long_lane && options_.long_timeout_ms > options_.timeout_ms ? options_.long_timeout_ms
                                                                     : options_.timeout_ms,
        " ms limit", *long_lane ? " (wall time, in the long lane)" : ""));
  }
  if (sent && (absl::IsDataLoss(s) || absl::IsResourceExhausted(s))) {
    // A frame over the channel's limits, cut short or stalled: the worker
    // (or what runs in it) broke the protocol. It is ended; the status says
    // so rather than blaming a crash or an outside signal.
    log->warn("compile worker {} broke the protocol while compiling {}: {}; killed", w.pid,
              file_name, s.ToString());
    Reap(worker);
    {
      MutexLock lock(&mu_);
      ++stats_.crashes;
    }
    return absl::InternalError(absl::StrCat(
        "the compile worker broke its protocol while compiling ", file_name, " (",
        s.message(), ") and was stopped"));
  }
  if (!s.ok()) return WorkerDied(worker, file_name);

  absl::StatusOr<ipc::WorkerResponse> resp = ipc::DecodeResponse(frame);
  if (!resp.ok()) {
    Reap(worker);
    return absl::InternalError(
        absl::StrCat("bad response from the compile worker: ", resp.status().ToString()));
  }
  if (response_flags != nullptr) {
    *response_flags = (resp->pch_built ? kPchBuilt : 0) | (resp->pch_stale ? kPchStale : 0);
  }
  return Answer(worker, &*resp, file_name);
}

bool CpuCompiler::WaitInLongLane(const Worker& w, const std::string& file_name,
                                 absl::Time* deadline) {
  // In the long lane timeout_ms counts the worker's CPU time, not the wall
  // clock: a compile slowed by a busy machine (or by its own nice 10) goes
  // on while it makes progress, up to long_timeout_ms of wall time.
  if (options_.long_timeout_ms <= options_.timeout_ms) return true;
  const absl::Time wall_deadline =
      *deadline + absl::Milliseconds(options_.long_timeout_ms - options_.timeout_ms);
  bool niced = true;  // EnterLongLane's nice 10
  for (;;) {
    // Nice 10 only while compiles run in the regular lane: it lets small
    // compiles go first, and does not starve the compile behind the rest
    // of the machine's load (a build beside the daemon) when none does.
    // Back to 0 needs CAP_SYS_NICE (a root daemon's); else it stays at 10.
    if (const bool others = RegularLaneBusy(); others != niced) {
      if (::setpriority(PRIO_PROCESS, static_cast<id_t>(w.pid), others ? 10 : 0) == 0) {
        niced = others;
      }
    }
    const absl::Time now = absl::Now();
    if (WaitReadable(w.fd, std::min(wall_deadline, now + absl::Milliseconds(200)))) break;
    if (absl::Now() >= wall_deadline) break;  // ReadFrame times out at once
    const int64_t cpu_ms = CpuTimeMs(w.pid);
    if (cpu_ms < 0) {
      // Without the CPU clock the wall-clock limit holds, as outside the lane.
      if (absl::Now() >= *deadline) break;
      continue;
    }
    if (cpu_ms >= options_.timeout_ms) {
      Logger("compiler")->debug("compile of {} used {} ms of CPU time: killed", file_name, cpu_ms);
      return false;
    }
  }
  *deadline = wall_deadline;
  return true;
}

absl::Status CpuCompiler::WorkerDied(std::unique_ptr<Worker>* worker,
                                     const std::string& file_name) {
  // The worker hung up: it died. An exit after the process had already
  // begun to exit keeps its own status, so killing first is safe.
  auto log = Logger("compiler");
  const pid_t pid = (*worker)->pid;
  int status = 0;
  rusage usage{};
  Reap(worker, &status, &usage);
  uint64_t maxrss = static_cast<uint64_t>(usage.ru_maxrss) * 1024;
  bool near_limit = options_.memory_limit_bytes != 0 &&
                    maxrss + options_.memory_limit_bytes / 4 >= options_.memory_limit_bytes;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 71) near_limit = true;
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  if (sig != 0 && !IsCrashSignal(sig) && !near_limit) {
    // Not the source's doing: an operator, a supervisor or the kernel's
    // OOM killer (the machine, not this worker, ran short) sent it.
    {
      MutexLock lock(&mu_);
      ++stats_.killed_outside;
    }
    log->warn("compile worker {} was killed by signal {} ({}) from outside opjitd while "
              "compiling {}",
              pid, sig, SignalName(sig), file_name);
    return absl::UnavailableError(absl::StrCat(
        "the compile worker was killed by signal ", sig, " (", SignalName(sig),
        ") from outside opjitd while compiling ", file_name,
        "; the source was not at fault, retry the request"));
  }
  {
    MutexLock lock(&mu_);
    ++stats_.crashes;
  }
  log->warn("compile worker died ({}) while compiling {}", DescribeExit(status), file_name);
  if (near_limit) {
    return absl::ResourceExhaustedError(absl::StrCat("the compiler ran out of memory (limit ",
                                                     options_.memory_limit_bytes >> 20,
                                                     " MiB) while compiling ", file_name));
  }
  if (sig != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the compiler crashed (signal ", sig, ") while compiling ", file_name,
                     "; the source triggers a compiler bug or exhausts its stack"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the compiler died (", DescribeExit(status), ") while compiling ", file_name,
                   "; the source triggers a compiler bug or exhausts its stack"));
}

absl::StatusOr<CpuCompileOutput> CpuCompiler::Answer(std::unique_ptr<Worker>* worker,
                                                     ipc::WorkerResponse* resp,
                                                     const std::string& file_name) {
  switch (resp->kind) {
    case ipc::ResponseKind::kOk: {
      if (!resp->pch_note.empty()) {
        MutexLock lock(&mu_);
        if (warned_pch_.size() < 16) {
          warned_pch_.push_back(resp->pch_note);
          Logger("compiler")->warn("compiled {} without its PCH: {}", file_name, resp->pch_note);
        }
      }
      CpuCompileOutput out;
      out.object = std::move(resp->object);
      out.diagnostics = std::move(resp->diagnostics);
      out.dependencies = std::move(resp->dependencies);
      out.compile_ms = resp->compile_ms;
      return out;
    }
    case ipc::ResponseKind::kCompileError:
      return WithReason(
          absl::InvalidArgumentError(absl::StrCat("compile failed:\n", resp->diagnostics)),
          reason::kCompileFailed);
    case ipc::ResponseKind::kBadRequest:
      return absl::InvalidArgumentError(resp->diagnostics);
    case ipc::ResponseKind::kFatalError: {
      Reap(worker);
      MutexLock lock(&mu_);
      ++stats_.crashes;
      return absl::InvalidArgumentError(absl::StrCat(
          "the compiler crashed (LLVM fatal error: ", resp->diagnostics, ") while compiling ",
          file_name, "; the source triggers a compiler bug or exhausts its stack"));
    }
    case ipc::ResponseKind::kOutOfMemory: {
      Reap(worker);
      MutexLock lock(&mu_);
      ++stats_.crashes;
      return absl::ResourceExhaustedError(absl::StrCat("the compiler ran out of memory (limit ",
                                                       options_.memory_limit_bytes >> 20,
                                                       " MiB) while compiling ", file_name));
    }
  }
  return absl::InternalError("unreachable");
}

// What a compile's PCH is: the descriptor the worker gets, and what the
// daemon does with it afterwards.
struct CpuCompiler::PchPlan {
  OwnedFd fd;
  std::string key;        // the preamble PCH's key ("": none)
  fs::path file, tmp;     // the preamble PCH, and the file a build writes
  std::string profile;    // a profile's prefix PCH is used ("": none)
};

const ToolchainProfile* CpuCompiler::FindProfile(const std::string& name) const {
  for (const ToolchainProfile& p : options_.profiles) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

absl::StatusOr<std::vector<std::string>> CpuCompiler::IncludeDirsFor(
    const std::vector<std::string>& extra, const ToolchainProfile* profile) const {
  std::vector<std::string> dirs;
  if (!kernel_include_dir_.empty()) dirs.push_back(kernel_include_dir_);
  for (const std::string& d : extra) {
    std::string n = Normalize(d);
    if (std::find(allowed_extra_dirs_.begin(), allowed_extra_dirs_.end(), n) ==
        allowed_extra_dirs_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("include directory '", d, "' is not allowed by the server configuration"));
    }
    dirs.push_back(n);
  }
  if (extra.empty()) dirs.insert(dirs.end(), allowed_extra_dirs_.begin(), allowed_extra_dirs_.end());
  if (profile != nullptr) {
    for (const std::string& d : profile->include_dirs) dirs.push_back(Normalize(d));
  }
  return dirs;
}

void CpuCompiler::PlanPreamblePch(const CpuCompileRequest& request, ipc::WorkerRequest* req,
                                  PchPlan* plan) {
  // The source's own leading #include block, precompiled once per content and
  // namespace. The worker gets the PCH as a read-only descriptor, or a new
  // empty file to build it into (published here once whole); never a path.
  Preamble preamble = ComputePreamble(request.source);
  if (!preamble.has_include) return;
  req->pch_options = PchOptions(request.options);
  // The extra files are on the PCH's search path (first), and the
  // preamble may include them: their names and contents key it too.
  std::string keyed = preamble.directives;
  if (!req->files.empty()) {
    Sha256 files;
    for (const ipc::File& f : req->files) {
      files.UpdateField(f.name);
      files.UpdateField(f.content);
    }
    absl::StrAppend(&keyed, "\nfiles=", files.HexDigest());
  }
  plan->key = PchKeyFor(request.tenant, keyed, req->pch_options, req->include_dirs);
  plan->file = fs::path(pch_dir_) / (plan->key + ".pch");
  // The directives, beside their PCH, for whoever looks (the worker gets
  // them in the request).
  if (absl::Status w = WriteFileIfChanged(fs::path(pch_dir_) / (plan->key + ".h"),
                                          preamble.directives);
      !w.ok()) {
    Logger("compiler")->debug("cannot keep a preamble's text: {}", w.ToString());
  }
  plan->fd.fd = ::open(plan->file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (plan->fd.fd >= 0) {
    req->pch = ipc::PchUse::kLoad;
  } else {
    static std::atomic<uint64_t> counter{0};
    plan->tmp = plan->file;
    plan->tmp += absl::StrCat(".tmp.", ::getpid(), ".", counter.fetch_add(1));
    plan->fd.fd = ::open(plan->tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                         0600);
    if (plan->fd.fd >= 0) {
      req->pch = ipc::PchUse::kBuild;
    } else {
      Logger("compiler")->warn("compiling without a PCH: cannot create one: {}",
                               std::strerror(errno));
      plan->tmp.clear();
      plan->key.clear();
    }
  }
  if (req->pch != ipc::PchUse::kNone) {
    req->preamble = preamble.directives;
    req->preamble_bytes = static_cast<uint32_t>(preamble.bytes);
  }
}

absl::StatusOr<CpuCompileOutput> CpuCompiler::Compile(const CpuCompileRequest& request) {
  // The registry's rule (compile_options.h); the worker checks again.
  const char* language = request.language == Language::kC ? "c" : "c++";
  for (const std::string& o : request.options) {
    if (!CpuOptionRefusal(language, o).empty()) {
      return absl::InvalidArgumentError(absl::StrCat("compile option '", o, "' is not allowed"));
    }
  }
  const ToolchainProfile* profile = nullptr;
  if (!request.profile.empty() && (profile = FindProfile(request.profile)) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("toolchain profile \"", request.profile, "\" is not offered here"));
  }
  ipc::WorkerRequest req;
  req.mode = ipc::RequestMode::kCompile;
  req.language = request.language == Language::kC ? ipc::Language::kC : ipc::Language::kCxx;
  req.source = request.source;
  req.file_name = fs::path(request.file_name).filename().string();
  if (req.file_name.empty() || req.file_name == "." || req.file_name == "..") {
    req.file_name = request.language == Language::kC ? "kernel.c" : "kernel.cc";
  }
  req.options = request.options;
  for (const auto& [name, content] : request.files) req.files.push_back({name, content});
  OPJIT_ASSIGN_OR_RETURN(req.include_dirs, IncludeDirsFor(request.extra_include_dirs, profile));
  PchPlan plan;
  if (!pch_dir_.empty()) {
    // A profile's shared prefix PCH where it serves; else the preamble's.
    if (profile != nullptr) PlanProfilePch(*profile, &req, &plan);
    if (plan.profile.empty() && request.language == Language::kCxx) {
      PlanPreamblePch(request, &req, &plan);
    }
  }
  std::string payload = ipc::Encode(req);

  absl::StatusOr<std::unique_ptr<Worker>> acquired = Acquire(request.tenant);
  if (!acquired.ok()) {
    if (!plan.tmp.empty()) ::unlink(plan.tmp.c_str());
    return acquired.status();
  }
  std::unique_ptr<Worker> worker = *std::move(acquired);
  worker->assigned = true;
  worker->tenant = request.tenant;
  bool long_lane = false;
  int flags = 0;
  absl::StatusOr<CpuCompileOutput> out = Run(&worker, payload, req.file_name, /*allow_long=*/true,
                                             &long_lane, plan.fd.fd, &flags);
  plan.fd.Reset();
  // A worker that was given a file to write goes: it could still hold it.
  FinishWith(std::move(worker), long_lane, /*retire=*/req.pch == ipc::PchUse::kBuild);
  bool built = false;
  if (!plan.tmp.empty()) {
    // Whole, as the (now retired) worker said: publish it. Otherwise drop it.
    built = (flags & kPchBuilt) != 0 && ::rename(plan.tmp.c_str(), plan.file.c_str()) == 0;
    if (!built) ::unlink(plan.tmp.c_str());
  }
  if (req.pch == ipc::PchUse::kLoad && (flags & kPchStale) != 0) {
    // Stale (a header changed) or broken: the next compile builds it again.
    if (!plan.profile.empty()) {
      DropProfilePch(plan.profile);
    } else {
      std::error_code ec;
      fs::remove(plan.file, ec);
    }
  }
  if (!plan.key.empty()) NotePchUse(plan.key, req.pch == ipc::PchUse::kLoad, built);
  {
    MutexLock lock(&mu_);
    ++stats_.compiles;
    if (!out.ok()) ++stats_.failures;
    if (!plan.profile.empty()) ++stats_.profile_pch_uses;
  }
  if (out.ok()) {
    Logger("compiler")
        ->debug("compiled {} in {:.1f} ms ({} bytes{})", req.file_name, out->compile_ms,
                out->object.size(), plan.profile.empty() ? "" : ", with the profile's PCH");
  }
  return out;
}

// ---- Toolchain profiles' shared prefix PCHs ------------------------------

namespace {

// The namespace no tenant has: a profile's PCH is built in a fresh worker
// that serves nobody else (and is retired after).
constexpr char kProfileTenant[] = "\x01profile";

// A profile PCH build may take minutes on a busy machine; it is no tenant's.
constexpr int kProfilePchTimeoutMs = 600000;

// A failed build is tried again after this long.
constexpr absl::Duration kProfileRetryAfter = absl::Minutes(10);

std::string PrefixDirectives(const ToolchainProfile& p) {
  return absl::StrCat("#include <", p.prefix_header, ">\n");
}

// A header's stat stamp as clang checks it when it loads a PCH: size and
// modification time ("" when it cannot be read).
std::string StatStamp(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_size, " ", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

// `pch` + ".deps": each header the PCH read, with its stamp then.
std::string DependencyStamps(const std::vector<std::string>& deps) {
  std::string text;
  for (const std::string& d : deps) absl::StrAppend(&text, StatStamp(d), "\t", d, "\n");
  return text;
}

// The headers a profile PCH read, when every one still has the stamp it had
// when the PCH was built (an earlier run's PCH is reused; a package upgrade,
// whatever mtimes it restores, has it built again rather than found stale by
// a tenant's compile). False when one changed or the list is missing.
bool ReadFreshDependencies(const std::string& pch, std::vector<std::string>* deps) {
  std::ifstream in(pch + ".deps");
  std::error_code ec;
  if (!in || !fs::exists(pch, ec)) return false;
  deps->clear();
  for (std::string line; std::getline(in, line);) {
    const size_t tab = line.find('\t');
    if (tab == std::string::npos || tab == 0) return false;
    const std::string path = line.substr(tab + 1);
    if (StatStamp(path) != line.substr(0, tab)) return false;
    deps->push_back(path);
  }
  return !deps->empty();
}

}  // namespace

void CpuCompiler::PlanProfilePch(const ToolchainProfile& profile, ipc::WorkerRequest* req,
                                 PchPlan* plan) {
  if (profile.prefix_header.empty() || !PchOptions(req->options).empty()) return;
  // Which units begin with the prefix header (reading through extra files).
  auto file = [&](std::string_view name) -> const std::string* {
    for (const ipc::File& f : req->files) {
      if (f.name == name) return &f.content;
    }
    return nullptr;
  };
  const bool main = req->language == ipc::Language::kCxx &&
                    StartsWithInclude(req->source, profile.prefix_header, file);
  std::vector<std::string> units;
  for (const ipc::File& f : req->files) {
    const std::string& n = f.name;
    const bool cxx_unit = absl::EndsWith(n, ".cc") || absl::EndsWith(n, ".cpp") ||
                          absl::EndsWith(n, ".cxx");
    if (cxx_unit && StartsWithInclude(f.content, profile.prefix_header, file)) {
      units.push_back(f.name);
    }
  }
  if (!main && units.empty()) return;
  std::optional<ProfilePch> ready = ProfilePchFor(profile);
  if (!ready.has_value() || ready->include_dirs != req->include_dirs) return;
  // An extra file searched first could shadow a header the PCH read.
  for (const ipc::File& f : req->files) {
    const std::string tail = "/" + f.name;
    for (const std::string& d : ready->dependencies) {
      if (absl::EndsWith(d, tail)) return;
    }
  }
  plan->fd.fd = ::open(ready->file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (plan->fd.fd < 0) {
    DropProfilePch(profile.name);
    return;
  }
  plan->profile = profile.name;
  req->pch = ipc::PchUse::kLoad;
  req->pch_prefix = true;
  // The PCH's own input, which clang checks as it loads it (not compiled).
  req->preamble = PrefixDirectives(profile);
  req->prefix_main = main;
  req->prefix_units = std::move(units);
}

std::optional<CpuCompiler::ProfilePch> CpuCompiler::ProfilePchFor(const ToolchainProfile& profile) {
  {
    MutexLock lock(&mu_);
    for (;;) {
      ProfilePch& p = profile_pch_[profile.name];
      if (p.state == ProfilePch::State::kReady) return p;
      if (p.state == ProfilePch::State::kFailed && absl::Now() < p.failed_at + kProfileRetryAfter) {
        return std::nullopt;
      }
      if (stopping_) return std::nullopt;
      if (p.state != ProfilePch::State::kBuilding) {
        p.state = ProfilePch::State::kBuilding;
        break;  // this thread builds it
      }
      profile_cv_.Wait(&mu_);
    }
  }
  ProfilePch built = BuildProfilePch(profile);
  MutexLock lock(&mu_);
  profile_pch_[profile.name] = built;
  profile_cv_.SignalAll();
  if (built.state != ProfilePch::State::kReady) return std::nullopt;
  return built;
}

void CpuCompiler::DropProfilePch(const std::string& name) {
  std::string file;
  {
    MutexLock lock(&mu_);
    auto it = profile_pch_.find(name);
    if (it == profile_pch_.end() || it->second.state != ProfilePch::State::kReady) return;
    file = it->second.file;
  }
  // A compile worker (a tenant's) said it could not load it: believed only
  // when a header it read changed, so that no tenant can make the daemon
  // rebuild it at will (a PCH broken otherwise goes unused until a restart
  // finds the same; compiles stay right, only slower).
  std::vector<std::string> unchanged;
  if (ReadFreshDependencies(file, &unchanged)) {
    Logger("compiler")->debug("toolchain profile {}: a compile could not load its PCH, whose "
                             "headers did not change; kept", name);
    return;
  }
  {
    MutexLock lock(&mu_);
    auto it = profile_pch_.find(name);
    if (it == profile_pch_.end() || it->second.file != file) return;
    profile_pch_.erase(it);
  }
  Logger("compiler")->info("toolchain profile {}: its PCH is stale; it is built again", name);
  std::error_code ec;
  fs::remove(file, ec);
  fs::remove(file + ".deps", ec);
}

CpuCompiler::ProfilePch CpuCompiler::BuildProfilePch(const ToolchainProfile& profile) {
  auto log = Logger("compiler");
  ProfilePch out;
  out.state = ProfilePch::State::kFailed;
  out.failed_at = absl::Now();
  absl::StatusOr<std::vector<std::string>> dirs = IncludeDirsFor({}, &profile);
  if (!dirs.ok()) return out;
  out.include_dirs = *dirs;
  const std::string directives = PrefixDirectives(profile);
  // Built from the operator's profile alone: its header, the fixed flags,
  // no option, no file of any tenant.
  const std::string key = PchKeyFor(kProfileTenant, directives, {}, out.include_dirs);
  const fs::path dir = fs::path(pch_dir_) / "profiles";
  std::error_code ec;
  fs::create_directories(dir, ec);
  out.file = (dir / absl::StrCat(profile.name, "-", key, ".pch")).string();
  if (ReadFreshDependencies(out.file, &out.dependencies)) {
    out.state = ProfilePch::State::kReady;  // built by an earlier run
    return out;
  }
  ipc::WorkerRequest req;
  req.language = ipc::Language::kCxx;
  req.source = directives;
  req.file_name = absl::StrCat("profile-", profile.name, ".cc");
  req.include_dirs = out.include_dirs;
  req.pch = ipc::PchUse::kBuild;
  req.preamble = directives;
  req.preamble_bytes = static_cast<uint32_t>(directives.size());
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(out.file, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  OwnedFd fd;
  fd.fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd.fd < 0) {
    log->warn("toolchain profile {}: cannot create its PCH: {}", profile.name, std::strerror(errno));
    return out;
  }
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<Worker>> worker = Acquire(kProfileTenant);
  absl::StatusOr<CpuCompileOutput> result =
      worker.ok() ? absl::InternalError("not run") : worker.status();
  int flags = 0;
  if (worker.ok()) {
    (*worker)->assigned = true;
    (*worker)->tenant = kProfileTenant;
    {
      MutexLock lock(&mu_);
      profile_builder_pid_ = (*worker)->pid;
    }
    bool long_lane = false;
    // An operator who raised the limits (a slow, sanitized build) raised this one too.
    const int timeout_ms =
        std::max({kProfilePchTimeoutMs, options_.timeout_ms, options_.long_timeout_ms});
    result = Run(&*worker, ipc::Encode(req), req.file_name, /*allow_long=*/false, &long_lane,
                 fd.fd, &flags, timeout_ms);
    {
      MutexLock lock(&mu_);
      profile_builder_pid_ = 0;
    }
    fd.Reset();
    FinishWith(*std::move(worker), long_lane, /*retire=*/true);
  }
  if (!result.ok() || (flags & kPchBuilt) == 0 || ::rename(tmp.c_str(), out.file.c_str()) != 0) {
    ::unlink(tmp.c_str());
    log->warn("toolchain profile {}: building its PCH failed ({}); its compiles go without",
              profile.name, result.ok() ? "no PCH came back" : result.status().ToString());
    return out;
  }
  out.dependencies = result->dependencies;
  (void)WriteFileIfChanged(out.file + ".deps", DependencyStamps(out.dependencies));
  {
    MutexLock lock(&mu_);
    ++stats_.pch_built;
    ++stats_.profile_pch_built;
  }
  log->info("toolchain profile {}: shared PCH of <{}> built in {:.1f} s ({} headers)", profile.name,
            profile.prefix_header, absl::ToDoubleSeconds(absl::Now() - t0),
            out.dependencies.size());
  out.state = ProfilePch::State::kReady;
  return out;
}

void CpuCompiler::StartProfilePchs() {
  std::vector<const ToolchainProfile*> now;
  for (const ToolchainProfile& p : options_.profiles) {
    if (p.pch_at_start && !p.prefix_header.empty()) now.push_back(&p);
  }
  if (now.empty() || pch_dir_.empty()) return;
  profile_starter_ = std::thread([this, now] {
    for (const ToolchainProfile* p : now) (void)ProfilePchFor(*p);
  });
}

CpuCompiler::Stats CpuCompiler::GetStats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace opjit::compiler

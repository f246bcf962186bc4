#include "server/compiler/cpu/cpu_compiler.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/compiler/cpu/ipc.h"

extern char** environ;

namespace opjit::compiler {
namespace {

namespace fs = std::filesystem;

// Bumped when the worker changes the object it produces for the same
// toolchain (flags, ctor lowering, ...). Part of ToolchainId.
constexpr char kObjectAbi[] = "opjit-cpu-object-1";

// The headers precompiled for C++ compiles, two preludes. Measured (worker
// time, cold compile, 2 busy cores): a <cmath> kernel takes ~34 ms with the
// small prelude and ~70 ms with the large one (every header in a PCH costs
// each compile that loads it), while a kernel that includes
// custom_aot_extra.h (<string>, <vector>) takes ~180 ms with the small one and
// ~85 ms with the large one. So each compile gets the small prelude unless
// its source includes anything beyond the small set.
constexpr const char* kPreludes[] = {
    "#include <cmath>\n#include <cstdint>\n",
    "#include <cmath>\n#include <cstdint>\n#include <cstring>\n#include <string>\n"
    "#include <vector>\n#include <algorithm>\n#include <utility>\n#include <type_traits>\n",
};

// Whether `source` includes something the small prelude does not cover.
// A textual scan of the main file's #include lines; a wrong guess costs time,
// never correctness.
bool NeedsLargePrelude(const std::string& source) {
  static const char* const kSmall[] = {"cmath",    "cstdint", "math.h",  "stdint.h", "cstddef",
                                       "stddef.h", "cfloat",  "float.h", "climits",  "limits.h"};
  size_t pos = 0;
  while (pos < source.size()) {
    size_t end = source.find('\n', pos);
    if (end == std::string::npos) end = source.size();
    std::string_view line(source.data() + pos, end - pos);
    pos = end + 1;
    size_t i = line.find_first_not_of(" \t");
    if (i == std::string_view::npos || line[i] != '#') continue;
    i = line.find_first_not_of(" \t", i + 1);
    if (i == std::string_view::npos || line.substr(i, 7) != "include") continue;
    size_t open = line.find_first_of("<\"", i + 7);
    if (open == std::string_view::npos) return true;  // a macro include: be safe
    size_t close = line.find_first_of(">\"", open + 1);
    std::string_view name = line.substr(
        open + 1, close == std::string_view::npos ? std::string_view::npos : close - open - 1);
    bool small = false;
    for (const char* k : kSmall) small |= name == k;
    if (!small) return true;
  }
  return false;
}

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

bool IsIdentStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }

// Mirrors the registry's rule; the worker checks again.
bool IsOptionAllowed(const std::string& o) {
  if (absl::StartsWith(o, "-D") || absl::StartsWith(o, "-U")) {
    return o.size() > 2 && IsIdentStart(o[2]);
  }
  if (o == "-O0" || o == "-O1" || o == "-O2" || o == "-O3" || o == "-ffast-math" ||
      o == "-fno-fast-math" || o == "-w") {
    return true;
  }
  if (absl::StartsWith(o, "-std=")) return true;
  if (absl::StartsWith(o, "-W") && o.size() > 2) {
    for (char c : o.substr(2)) {
      bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '-' || c == '=' || c == '+';
      if (!ok) return false;  // -Wl, -Wp, -Wa pass arguments to other tools
    }
    return true;
  }
  return false;
}

// The options a PCH must be built with to be loadable by a compile with
// `options`. Warnings do not matter; neither do macros outside the
// implementation's reserved namespace, which no standard header reacts to
// (clang appends them after the PCH, like the command line does).
std::vector<std::string> PchOptions(const std::vector<std::string>& options) {
  std::vector<std::string> out;
  for (const std::string& o : options) {
    if (o == "-w" || absl::StartsWith(o, "-W")) continue;
    if ((absl::StartsWith(o, "-D") || absl::StartsWith(o, "-U")) && o.size() > 2 && o[2] != '_') {
      continue;
    }
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

// A worker's address space (what RLIMIT_AS bounds), 0 when unknown.
uint64_t AddressSpaceBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/statm"));
  uint64_t pages = 0;
  if (!(in >> pages)) return 0;
  return pages * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
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

std::string SignalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : "an unknown signal";
}

// Signals that mean the compiler itself crashed on the source (as opposed to
// a signal someone sent the worker).
bool IsCrashSignal(int sig) {
  return sig == SIGSEGV || sig == SIGBUS || sig == SIGILL || sig == SIGFPE || sig == SIGABRT ||
         sig == SIGTRAP || sig == SIGSYS;
}

std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  if (WIFEXITED(status)) return absl::StrCat("exit status ", WEXITSTATUS(status));
  return absl::StrCat("wait status ", status);
}

}  // namespace

struct CpuCompiler::Worker {
  pid_t pid = -1;
  int fd = -1;
  int compiles = 0;  // requests answered
  ipc::Hello hello;
  ~Worker() {
    if (fd >= 0) ::close(fd);
  }
};

CpuCompiler::CpuCompiler(const CpuCompilerOptions& options) : options_(options) {}

CpuCompiler::~CpuCompiler() {
  std::deque<std::unique_ptr<Worker>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle.swap(idle_);
  }
  for (auto& w : idle) {
    ::kill(w->pid, SIGKILL);
    int status;
    while (::waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
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
  c->spawner_ = std::make_unique<SpawnThread>();
  if (!options.pch_dir.empty()) {
    // Before any worker starts: Landlock grants access only to directories
    // that exist when a worker locks itself in.
    std::error_code ec;
    fs::create_directories(options.pch_dir, ec);
  }

  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, c->StartWorker());
  {
    std::lock_guard<std::mutex> lock(c->mu_);
    c->live_ = 1;
  }
  const ipc::Hello& h = worker->hello;
  c->base_id_ = absl::StrCat("clang=", h.clang_version, "; triple=", h.triple, "; cpu=", h.cpu,
                             "; features=", absl::StrJoin(h.features, ","),
                             "; flags=", h.fixed_flags, "; abi=", kObjectAbi);
  std::string prelude_hash = "none";

  if (!options.pch_dir.empty()) {
    absl::Status s;
    std::error_code ec;
    fs::create_directories(options.pch_dir, ec);
    std::string preludes_sha = Sha256Hex(absl::StrCat(kPreludes[0], "\n--\n", kPreludes[1]));
    if (ec) {
      s = absl::UnavailableError(
          absl::StrCat("cannot create ", options.pch_dir, ": ", ec.message()));
    }
    for (int k = 0; k < 2 && s.ok(); ++k) {
      fs::path prelude = fs::path(Normalize(options.pch_dir)) /
                         absl::StrCat("prelude-", Sha256Hex(kPreludes[k]).substr(0, 16), ".h");
      s = WriteFileIfChanged(prelude, kPreludes[k]);
      if (!s.ok()) break;
      c->prelude_paths_[k] = prelude.string();
      std::string pch = c->PchPathFor(k, {});
      if (fs::exists(pch)) continue;
      absl::Time start = absl::Now();
      ipc::WorkerRequest req;
      req.mode = ipc::RequestMode::kBuildPch;
      req.file_name = "prelude.h";
      if (!c->kernel_include_dir_.empty()) req.include_dirs.push_back(c->kernel_include_dir_);
      req.pch_path = pch;
      req.prelude_path = c->prelude_paths_[k];
      bool long_lane = false;
      absl::StatusOr<CpuCompileOutput> built =
          c->Run(&worker, ipc::Encode(req), "the PCH prelude", /*allow_long=*/false, &long_lane);
      if (built.ok()) {
        log->info("built the prelude PCH {} in {:.0f} ms", pch,
                  absl::ToDoubleMilliseconds(absl::Now() - start));
      } else {
        s = built.status();
      }
      if (worker == nullptr) {
        {
          std::lock_guard<std::mutex> lock(c->mu_);
          --c->live_;
          ++c->dead_;
        }
        if (s.ok()) {
          OPJIT_ASSIGN_OR_RETURN(worker, c->Acquire());
        }
      }
    }
    if (s.ok()) prelude_hash = preludes_sha;
    if (!s.ok()) {
      log->warn("compiling without a PCH: {}", s.ToString());
      c->prelude_paths_[0].clear();
      c->prelude_paths_[1].clear();
      prelude_hash = "none";
    }
  }
  c->toolchain_id_ = absl::StrCat(c->base_id_, "; prelude=", prelude_hash);
  if (worker != nullptr) c->Release(std::move(worker));
  log->info("CPU compiler ready: {} workers max, worker {}, PCH {}", options.num_workers,
            c->worker_path_, c->prelude_paths_[0].empty() ? "off" : options.pch_dir);
  return c;
}

std::string CpuCompiler::PchPathFor(int prelude,
                                    const std::vector<std::string>& pch_options) const {
  std::string key = Sha256Hex(
      absl::StrCat(base_id_, "\n", kPreludes[prelude], "\n", absl::StrJoin(pch_options, "\n")));
  return (fs::path(Normalize(options_.pch_dir)) / absl::StrCat(key.substr(0, 32), ".pch")).string();
}

absl::StatusOr<std::unique_ptr<CpuCompiler::Worker>> CpuCompiler::StartWorker() {
  struct Spawned {
    pid_t pid = -1;
    int fd = -1;
    int error = 0;
  };
  std::string path = worker_path_;
  uint64_t limit = options_.memory_limit_bytes;
  // What the worker's Landlock lets it read (besides the system's headers
  // and libraries) and write (the PCH directory).
  std::vector<std::string> sandbox_args = {"--read-only", kernel_include_dir_};
  for (const auto& d : allowed_extra_dirs_) sandbox_args.insert(sandbox_args.end(), {"--read-only", d});
  if (!options_.pch_dir.empty()) {
    sandbox_args.insert(sandbox_args.end(), {"--read-write", Normalize(options_.pch_dir)});
  }
  Spawned sp = spawner_->Call<Spawned>([path, limit, sandbox_args]() {
    Spawned r;
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      r.error = errno;
      return r;
    }
    // dup2(3, 3) would keep FD_CLOEXEC: move the child's end off fd 3 first.
    if (sv[1] == 3) {
      int moved = ::fcntl(sv[1], F_DUPFD_CLOEXEC, 10);
      ::close(sv[1]);
      sv[1] = moved;
    }
    std::string parent = std::to_string(::getpid());
    std::string mem = std::to_string(limit);
    std::vector<std::string> args = {path, "--fd", "3", "--parent-pid", parent};
    if (limit != 0) args.insert(args.end(), {"--memory-limit", mem});
    args.insert(args.end(), sandbox_args.begin(), sandbox_args.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, sv[1], 3);
    // Nothing else of the daemon's leaks into the worker, CLOEXEC or not.
    posix_spawn_file_actions_addclosefrom_np(&fa, 4);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    sigdelset(&all, SIGKILL);
    sigdelset(&all, SIGSTOP);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    int rc = ::posix_spawn(&r.pid, path.c_str(), &fa, &attr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    ::close(sv[1]);
    if (rc != 0) {
      ::close(sv[0]);
      r.error = rc;
      r.pid = -1;
      return r;
    }
    r.fd = sv[0];
    return r;
  });
  if (sp.pid < 0) {
    return absl::UnavailableError(absl::StrCat("cannot start the compile worker ", worker_path_,
                                               ": ", std::strerror(sp.error)));
  }
  auto w = std::make_unique<Worker>();
  w->pid = sp.pid;
  w->fd = sp.fd;
  std::string frame;
  absl::Status s = ipc::ReadFrame(w->fd, &frame, absl::Now() + kStartupTimeout);
  absl::StatusOr<ipc::Hello> hello =
      s.ok() ? ipc::DecodeHello(frame) : absl::StatusOr<ipc::Hello>(s);
  if (hello.ok() && hello->protocol_version != ipc::kProtocolVersion) {
    hello = absl::FailedPreconditionError("protocol version mismatch");
  }
  if (!hello.ok()) {
    ::kill(w->pid, SIGKILL);
    int status = 0;
    while (::waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
    }
    return absl::UnavailableError(absl::StrCat("the compile worker ", worker_path_,
                                               " did not start (", DescribeExit(status),
                                               "): ", hello.status().ToString()));
  }
  w->hello = *std::move(hello);
  Logger("compiler")->debug("compile worker {} started", w->pid);
  return w;
}

absl::StatusOr<std::unique_ptr<CpuCompiler::Worker>> CpuCompiler::Acquire() {
  for (;;) {
    std::unique_ptr<Worker> w;
    bool start = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait(lock, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !idle_.empty() || live_ < options_.num_workers;
      });
      if (!idle_.empty()) {
        w = std::move(idle_.front());
        idle_.pop_front();
      } else {
        ++live_;
        start = true;
      }
    }
    if (start) {
      absl::StatusOr<std::unique_ptr<Worker>> started = StartWorker();
      std::lock_guard<std::mutex> lock(mu_);
      if (!started.ok()) {
        --live_;
        idle_cv_.notify_one();
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
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(worker));
  }
  idle_cv_.notify_one();
}

void CpuCompiler::Discard(std::unique_ptr<Worker> worker) {
  ::kill(worker->pid, SIGKILL);
  int status;
  while (::waitpid(worker->pid, &status, 0) < 0 && errno == EINTR) {
  }
  worker.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    --live_;
    ++dead_;
  }
  idle_cv_.notify_one();
}

bool CpuCompiler::EnterLongLane(Worker* worker, const std::string& file_name) {
  int in_lane = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (long_ >= options_.long_workers) return false;
    ++long_;
    --live_;
    ++stats_.long_compiles;
    in_lane = long_;
  }
  idle_cv_.notify_one();
  // Small compiles that start meanwhile get the CPU first. Best effort.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(worker->pid), 10);
  Logger("compiler")->info(
      "compile of {} still running after {} ms: moved to the long lane ({} of {}), "
      "its slot goes to other compiles",
      file_name, options_.long_after_ms, in_lane, options_.long_workers);
  return true;
}

void CpuCompiler::FinishWith(std::unique_ptr<Worker> worker, bool long_lane) {
  const bool died = worker == nullptr;
  if (!died && !long_lane) {
    ++worker->compiles;
    const char* why = nullptr;
    uint64_t size = 0;
    if (options_.recycle_after_compiles > 0 &&
        worker->compiles >= options_.recycle_after_compiles) {
      why = "compiles";
    } else if (kRecycleBySize && options_.recycle_memory_bytes > 0 &&
               (size = AddressSpaceBytes(worker->pid)) >= options_.recycle_memory_bytes) {
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
    ::kill(worker->pid, SIGKILL);
    int status;
    while (::waitpid(worker->pid, &status, 0) < 0 && errno == EINTR) {
    }
    worker.reset();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  idle_cv_.notify_all();
}

absl::StatusOr<CpuCompileOutput> CpuCompiler::Run(std::unique_ptr<Worker>* worker,
                                                  const std::string& payload,
                                                  const std::string& file_name, bool allow_long,
                                                  bool* long_lane) {
  Worker& w = **worker;
  auto log = Logger("compiler");
  absl::Time deadline = absl::Now() + absl::Milliseconds(options_.timeout_ms);
  absl::Status s = ipc::WriteFrame(w.fd, payload, deadline);
  *long_lane = false;
  if (s.ok() && allow_long && options_.long_after_ms > 0 && options_.long_workers > 0) {
    absl::Time switch_at = std::min(deadline, absl::Now() + absl::Milliseconds(options_.long_after_ms));
    if (!WaitReadable(w.fd, switch_at) && absl::Now() < deadline) {
      *long_lane = EnterLongLane(&w, file_name);
    }
  }
  std::string frame;
  if (s.ok()) s = ipc::ReadFrame(w.fd, &frame, deadline);

  // Reaps the worker (killing it first if it still runs) and drops it.
  auto reap = [&](int* status, rusage* usage) {
    ::kill(w.pid, SIGKILL);
    while (::wait4(w.pid, status, 0, usage) < 0 && errno == EINTR) {
    }
    worker->reset();
  };
  int status = 0;
  rusage usage{};
  const uint64_t limit_mib = options_.memory_limit_bytes >> 20;

  if (absl::IsDeadlineExceeded(s)) {
    log->debug("compile worker {} killed at the {} ms deadline", w.pid, options_.timeout_ms);
    reap(&status, &usage);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.timeouts;
    return absl::DeadlineExceededError(
        absl::StrCat("compile exceeded the ", options_.timeout_ms, " ms limit"));
  }
  if (!s.ok()) {
    // The worker hung up: it died. An exit after the process had already
    // begun to exit keeps its own status, so killing first is safe.
    const pid_t pid = w.pid;
    reap(&status, &usage);
    uint64_t maxrss = static_cast<uint64_t>(usage.ru_maxrss) * 1024;
    bool near_limit = options_.memory_limit_bytes != 0 &&
                      maxrss + options_.memory_limit_bytes / 4 >= options_.memory_limit_bytes;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 71) near_limit = true;
    const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (sig != 0 && !IsCrashSignal(sig) && !near_limit) {
      // Not the source's doing: an operator, a supervisor or the kernel's
      // OOM killer (the machine, not this worker, ran short) sent it.
      {
        std::lock_guard<std::mutex> lock(mu_);
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
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.crashes;
    }
    log->warn("compile worker died ({}) while compiling {}", DescribeExit(status), file_name);
    if (near_limit) {
      return absl::ResourceExhaustedError(absl::StrCat("the compiler ran out of memory (limit ",
                                                       limit_mib, " MiB) while compiling ",
                                                       file_name));
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

  absl::StatusOr<ipc::WorkerResponse> resp = ipc::DecodeResponse(frame);
  if (!resp.ok()) {
    reap(&status, &usage);
    return absl::InternalError(
        absl::StrCat("bad response from the compile worker: ", resp.status().ToString()));
  }
  switch (resp->kind) {
    case ipc::ResponseKind::kOk: {
      if (!resp->pch_note.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (warned_pch_.size() < 16) {
          warned_pch_.push_back(resp->pch_note);
          log->warn("compiled {} without its PCH: {}", file_name, resp->pch_note);
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
      reap(&status, &usage);
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.crashes;
      return absl::InvalidArgumentError(absl::StrCat(
          "the compiler crashed (LLVM fatal error: ", resp->diagnostics, ") while compiling ",
          file_name, "; the source triggers a compiler bug or exhausts its stack"));
    }
    case ipc::ResponseKind::kOutOfMemory: {
      reap(&status, &usage);
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.crashes;
      return absl::ResourceExhaustedError(absl::StrCat("the compiler ran out of memory (limit ",
                                                       limit_mib, " MiB) while compiling ",
                                                       file_name));
    }
  }
  return absl::InternalError("unreachable");
}

absl::StatusOr<CpuCompileOutput> CpuCompiler::Compile(const CpuCompileRequest& request) {
  for (const std::string& o : request.options) {
    if (!IsOptionAllowed(o)) {
      return absl::InvalidArgumentError(absl::StrCat("compile option '", o, "' is not allowed"));
    }
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
  if (!kernel_include_dir_.empty()) req.include_dirs.push_back(kernel_include_dir_);
  for (const std::string& d : request.extra_include_dirs) {
    std::string n = Normalize(d);
    if (std::find(allowed_extra_dirs_.begin(), allowed_extra_dirs_.end(), n) ==
        allowed_extra_dirs_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("include directory '", d, "' is not allowed by the server configuration"));
    }
    req.include_dirs.push_back(n);
  }
  if (request.language == Language::kCxx && !prelude_paths_[0].empty()) {
    int prelude = NeedsLargePrelude(request.source) ? 1 : 0;
    req.pch_options = PchOptions(request.options);
    req.pch_path = PchPathFor(prelude, req.pch_options);
    req.prelude_path = prelude_paths_[prelude];
  }
  std::string payload = ipc::Encode(req);

  OPJIT_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Acquire());
  bool long_lane = false;
  absl::StatusOr<CpuCompileOutput> out =
      Run(&worker, payload, req.file_name, /*allow_long=*/true, &long_lane);
  FinishWith(std::move(worker), long_lane);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.compiles;
    if (!out.ok()) ++stats_.failures;
  }
  if (out.ok()) {
    Logger("compiler")
        ->debug("compiled {} in {:.1f} ms ({} bytes)", req.file_name, out->compile_ms,
                out->object.size());
  }
  return out;
}

CpuCompiler::Stats CpuCompiler::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace opjit::compiler

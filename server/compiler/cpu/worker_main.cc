// opjit-compile-worker: compiles kernel sources for opjitd, one request at a
// time, in a process the daemon can kill. Started by CpuCompiler with a
// socketpair end as fd 3 (or --fd N); speaks the protocol in ipc.h.
//
// Flags:
//   --fd N               the socket (default 3)
//   --parent-pid P       exit at once if the parent is not P (PDEATHSIG race),
//                        and once it is no longer P while waiting
//   --instance TAG       the daemon's tag, for a restart's sweep (ignored here)
//   --memory-limit BYTES RLIMIT_AS for this process (default: unchanged)
//   --clang PATH         the clang binary the driver pretends to be
//   --read-only PATH     a directory the compiler may read (repeatable): opjit's
//                        kernel headers and the allowed include directories
//   --uid N              started as root: run as uid and gid N, keeping only
//                        CAP_DAC_READ_SEARCH (to read the --read-only
//                        directories, often root's and 0700; Landlock still
//                        limits reads to the paths above)
//
// Limits are set after the LLVM and clang libraries are loaded and before the
// first request is read (server/common/sandbox): RLIMIT_AS, RLIMIT_CORE = 0,
// RLIMIT_FSIZE (a PCH it writes), PR_SET_PDEATHSIG(SIGKILL), no_new_privs,
// Landlock (read-only: the toolchain's tree, the system include directories
// and GCC installation the driver found, opjit's kernel headers and the
// allowed include directories, /dev/null; nothing else: no /etc, no /proc,
// no state directory, no PCH directory), and seccomp (no sockets, exec, new
// processes, ptrace, signals to other processes...). The PCH of a request
// comes as a descriptor with it (ipc::PchUse). Code generation runs on a
// thread with no file access at all (clang_frontend.cc), so the integrated
// assembler's .incbin and .include reach no file, not even a header.

#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "server/common/worker_sanitizer.h"
#include "server/common/sandbox.h"
#include "server/common/subprocess.h"
#include "server/compiler/cpu/clang_frontend.h"
#include "server/compiler/cpu/ipc.h"

#ifndef OPJIT_CLANG_PATH
#define OPJIT_CLANG_PATH "/usr/lib/llvm-16/bin/clang"
#endif

namespace opjit::compiler {
namespace {

int g_fd = 3;
// The out-of-memory response, encoded at startup: when memory is gone there
// may be none left to encode it.
std::string* g_oom_frame = nullptr;

// Best-effort blocking write of a whole buffer; used on the way out.
void WriteRaw(const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(g_fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    data += w;
    n -= static_cast<size_t>(w);
  }
}

[[noreturn]] void DieOutOfMemory() {
  if (g_oom_frame != nullptr) WriteRaw(g_oom_frame->data(), g_oom_frame->size());
  _exit(71);
}

void OnNewFailure() { DieOutOfMemory(); }

void OnFatal(const char* message, bool out_of_memory) {
  if (out_of_memory) DieOutOfMemory();
  static bool in_fatal = false;  // a fatal error while reporting one
  if (!in_fatal) {
    in_fatal = true;
    ipc::WorkerResponse r;
    r.kind = ipc::ResponseKind::kFatalError;
    r.diagnostics = message;
    std::string f = ipc::EncodeFrame(ipc::Encode(r));
    WriteRaw(f.data(), f.size());
  }
  _exit(70);
}

// The command line (see the top of this file).
struct Flags {
  long parent_pid = 0;
  unsigned long long memory_limit = 0;
  std::string clang_path = OPJIT_CLANG_PATH;
  std::vector<std::string> read_only;
  bool isolate = false;  // namespaces of its own
  bool userns = false;   // uid 0 of a user namespace the daemon made (a daemon without root)
  long long uid = -1;    // the compile uid (a root daemon)
};

// Fills `f` (and g_fd); 0, or the exit code for a bad command line.
int ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--fd" && v) {
      g_fd = std::atoi(v);
      ++i;
    } else if (a == subprocess::kParentPidFlag && v) {
      f->parent_pid = std::atol(v);
      ++i;
    } else if (a == subprocess::kInstanceFlag && v) {
      ++i;  // a tag for a restart's sweep of leftovers (subprocess.h)
    } else if (a == "--memory-limit" && v) {
      f->memory_limit = std::strtoull(v, nullptr, 10);
      ++i;
    } else if (a == "--clang" && v) {
      f->clang_path = v;
      ++i;
    } else if (a == "--read-only" && v) {
      f->read_only.push_back(v);
      ++i;
    } else if (a == "--isolate" && v) {
      f->isolate = std::string(v) == "1";
      ++i;
    } else if (a == "--userns" && v) {
      f->userns = std::string(v) == "1";
      ++i;
    } else if (a == "--uid" && v) {
      char* end = nullptr;
      f->uid = std::strtoll(v, &end, 10);
      if (*v == '\0' || *end != '\0' || f->uid <= 0 || f->uid >= 0xFFFFFFFFll) {
        std::fprintf(stderr, "opjit-compile-worker: bad --uid %s\n", v);
        return 2;
      }
      ++i;
    } else {
      std::fprintf(stderr, "opjit-compile-worker: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  return 0;
}

// Answers requests until the daemon closes the socket (0) or is gone (0),
// or the socket fails (7, 8).
int Serve(ClangFrontend* frontend, pid_t parent_pid) {
  for (;;) {
    // Wait for the next request, checking every second that the daemon is
    // still the parent.
    for (;;) {
      pollfd p{g_fd, POLLIN, 0};
      const int r = ::poll(&p, 1, 1000);
      if (r > 0 || (r < 0 && errno != EINTR)) break;  // the read says what happened
      if (!subprocess::ParentIs(parent_pid)) return 0;
    }
    std::string payload;
    int pch_fd = -1;
    absl::Status s =
        ipc::ReadFrame(g_fd, &payload, absl::InfiniteFuture(), ipc::kToWorker, &pch_fd);
    if (absl::IsOutOfRange(s)) return 0;  // the daemon closed the socket
    if (!s.ok()) return 7;
    auto start = std::chrono::steady_clock::now();
    ipc::WorkerResponse resp;
    absl::StatusOr<ipc::WorkerRequest> req = ipc::DecodeRequest(payload);
    if (!req.ok()) {
      if (pch_fd >= 0) ::close(pch_fd);
      resp.kind = ipc::ResponseKind::kBadRequest;
      resp.diagnostics = req.status().ToString();
    } else {
      resp = frontend->Handle(*req, pch_fd);  // closes pch_fd
    }
    resp.compile_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::string out = ipc::Encode(resp);
    if (out.size() > ipc::kMaxResponseBytes) {
      // Over what the daemon reads: say so instead of the object.
      ipc::WorkerResponse big;
      big.kind = ipc::ResponseKind::kCompileError;
      big.diagnostics = "error: the compiled object (" + std::to_string(resp.object.size() >> 20) +
                        " MiB) and its diagnostics (" +
                        std::to_string(resp.diagnostics.size() >> 20) + " MiB) are over the " +
                        std::to_string(ipc::kMaxResponseBytes >> 20) + " MiB a compile may return";
      big.compile_ms = resp.compile_ms;
      out = ipc::Encode(big);
    }
    if (!ipc::WriteFrame(g_fd, out, absl::InfiniteFuture(), ipc::kFromWorker).ok()) return 8;
  }
}

int Main(int argc, char** argv) {
  // opjitd's health probe: the program loads and starts.
  if (argc == 2 && std::string(argv[1]) == "--probe") return 0;
  Flags flags;
  if (int bad = ParseFlags(argc, argv, &flags); bad != 0) return bad;
  const long parent_pid = flags.parent_pid;
  const unsigned long long memory_limit = flags.memory_limit;
  const long long uid = flags.uid;
  if (::fcntl(g_fd, F_GETFD) < 0) {
    std::fprintf(stderr, "opjit-compile-worker: fd %d is not open; start it from opjitd\n", g_fd);
    return 2;
  }
  ::fcntl(g_fd, F_SETFD, FD_CLOEXEC);
  // Process 1 of its own PID namespace (--isolate): a clang abort is
  // reported as one, and the daemon's socket says whether the daemon lives.
  subprocess::ActAsInit();
  subprocess::SetParentLink(g_fd);
  // Die with the daemon. The parent check closes the race with its exit.
  if (!subprocess::DieWithParent(static_cast<pid_t>(parent_pid))) return 3;
  ::signal(SIGPIPE, SIG_IGN);
  if (::chdir("/") != 0) return 2;

  g_oom_frame = new std::string([] {
    ipc::WorkerResponse r;
    r.kind = ipc::ResponseKind::kOutOfMemory;
    r.diagnostics = "out of memory";
    return ipc::EncodeFrame(ipc::Encode(r));
  }());
  std::set_new_handler(OnNewFailure);
  InitializeLlvm(OnFatal);
  std::string error;
  std::unique_ptr<ClangFrontend> frontend = ClangFrontend::Create(flags.clang_path, &error);
  if (frontend == nullptr) {
    std::fprintf(stderr, "opjit-compile-worker: %s\n", error.c_str());
    return 4;
  }

  sandbox::Policy policy;
  // The toolchain, the system headers and the request's include directories;
  // the libraries are loaded already, and the driver read the distribution's
  // name (it keeps it) when the frontend started.
  policy.read_only_paths = frontend->ReadPaths();
  policy.read_only_paths.insert(policy.read_only_paths.end(), flags.read_only.begin(),
                               flags.read_only.end());
  policy.device_paths = {"/dev/null"};
  policy.address_space_bytes = memory_limit;
  // No network, no IPC and mounts of its own; memory only where
  // RLIMIT_AS counts it.
  policy.private_namespaces = flags.isolate;
  policy.user_namespace_root = flags.userns;
  policy.refuse_shared_memory = true;
  // Never root (a root daemon's compile uid, which no executor has): only
  // CAP_DAC_READ_SEARCH stays, to read the include directories. In the
  // user namespace a non-root daemon made: the same, over the daemon's
  // files (that namespace maps its ids too).
  policy.uid = uid;
  policy.gid = uid;
  policy.keep_read_search = uid > 0 || flags.userns;
  // A PCH is written to the descriptor the daemon passes: never more than
  // the memory it was built in. EFBIG rather than SIGXFSZ past that.
  {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlim_t fsize = memory_limit != 0 ? memory_limit : (4ull << 30);
    rlimit lim{fsize, fsize};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 5;
  }
  if (absl::Status s = sandbox::Apply(policy); !s.ok()) {
    std::fprintf(stderr, "opjit-compile-worker: %s\n", s.ToString().c_str());
    return 5;
  }
  // Once more after the sandbox: a credential change clears it.
  if (!subprocess::DieWithParent(static_cast<pid_t>(parent_pid))) return 3;

  ipc::Hello hello = frontend->Describe();
  hello.pid = static_cast<int32_t>(::getpid());
  if (!ipc::WriteFrame(g_fd, ipc::Encode(hello), absl::InfiniteFuture(), ipc::kFromWorker).ok()) {
    return 6;
  }

  return Serve(frontend.get(), static_cast<pid_t>(parent_pid));
}

}  // namespace
}  // namespace opjit::compiler

int main(int argc, char** argv) { return opjit::compiler::Main(argc, argv); }

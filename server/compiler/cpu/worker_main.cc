// opjit-compile-worker: compiles kernel sources for opjitd, one request at a
// time, in a process the daemon can kill. Started by CpuCompiler with a
// socketpair end as fd 3 (or --fd N); speaks the protocol in ipc.h.
//
// Flags:
//   --fd N               the socket (default 3)
//   --parent-pid P       exit at once if the parent is not P (PDEATHSIG race)
//   --memory-limit BYTES RLIMIT_AS for this process (default: unchanged)
//   --clang PATH         the clang binary the driver pretends to be
//
// Limits are set after the LLVM and clang libraries are loaded and before the
// first request is read: RLIMIT_AS, RLIMIT_CORE = 0, PR_SET_PDEATHSIG(SIGKILL),
// PR_SET_NO_NEW_PRIVS, and a seccomp filter that refuses socket creation,
// exec, ptrace and kill.

#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
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

std::string Frame(const std::string& payload) {
  std::string f(4, '\0');
  uint32_t n = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) f[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return f + payload;
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
    std::string f = Frame(ipc::Encode(r));
    WriteRaw(f.data(), f.size());
  }
  _exit(70);
}

void InstallSeccompDenyList() {
  // Refuse (EPERM) the calls a compiler never needs and an attacker wants.
  // Anything not listed is allowed: this is a second wall, the file-system
  // allow-list inside clang is the first.
  static const int kDenied[] = {
      SYS_socket, SYS_connect,  SYS_bind,   SYS_listen, SYS_accept,           SYS_accept4,
      SYS_execve, SYS_execveat, SYS_ptrace, SYS_kill,   SYS_process_vm_readv, SYS_process_vm_writev,
      SYS_fork,   SYS_vfork,
  };
  constexpr size_t kN = sizeof(kDenied) / sizeof(kDenied[0]);
  sock_filter filter[6 + 2 * kN + 1];
  size_t i = 0;
  filter[i++] = BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch));
  filter[i++] = BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0);
  filter[i++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
  filter[i++] = BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr));
  // x32 system calls (bit 30 set) would bypass the numbers below.
  filter[i++] = BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1);
  filter[i++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
  for (int nr : kDenied) {
    filter[i++] = BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1);
    filter[i++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
  }
  filter[i++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  sock_fprog prog{static_cast<unsigned short>(i), filter};
  if (::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    std::fprintf(stderr, "opjit-compile-worker: seccomp filter not installed: %s\n",
                 std::strerror(errno));
  }
}

int Main(int argc, char** argv) {
  long parent_pid = 0;
  unsigned long long memory_limit = 0;
  std::string clang_path = OPJIT_CLANG_PATH;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--fd" && v) {
      g_fd = std::atoi(v);
      ++i;
    } else if (a == "--parent-pid" && v) {
      parent_pid = std::atol(v);
      ++i;
    } else if (a == "--memory-limit" && v) {
      memory_limit = std::strtoull(v, nullptr, 10);
      ++i;
    } else if (a == "--clang" && v) {
      clang_path = v;
      ++i;
    } else {
      std::fprintf(stderr, "opjit-compile-worker: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (::fcntl(g_fd, F_GETFD) < 0) {
    std::fprintf(stderr, "opjit-compile-worker: fd %d is not open; start it from opjitd\n", g_fd);
    return 2;
  }
  ::fcntl(g_fd, F_SETFD, FD_CLOEXEC);
  // Die with the daemon. The parent check closes the race with its exit.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (parent_pid != 0 && ::getppid() != parent_pid) return 3;
  ::signal(SIGPIPE, SIG_IGN);
  if (::chdir("/") != 0) return 2;

  g_oom_frame = new std::string([] {
    ipc::WorkerResponse r;
    r.kind = ipc::ResponseKind::kOutOfMemory;
    r.diagnostics = "out of memory";
    return Frame(ipc::Encode(r));
  }());
  std::set_new_handler(OnNewFailure);
  InitializeLlvm(OnFatal);
  std::string error;
  std::unique_ptr<ClangFrontend> frontend = ClangFrontend::Create(clang_path, &error);
  if (frontend == nullptr) {
    std::fprintf(stderr, "opjit-compile-worker: %s\n", error.c_str());
    return 4;
  }

  rlimit core{0, 0};
  ::setrlimit(RLIMIT_CORE, &core);
  if (memory_limit != 0) {
    rlimit as{memory_limit, memory_limit};
    if (::setrlimit(RLIMIT_AS, &as) != 0) {
      std::fprintf(stderr, "opjit-compile-worker: RLIMIT_AS: %s\n", std::strerror(errno));
      return 5;
    }
  }
  ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
  InstallSeccompDenyList();

  ipc::Hello hello = frontend->Describe();
  hello.pid = static_cast<int32_t>(::getpid());
  if (!ipc::WriteFrame(g_fd, ipc::Encode(hello), absl::InfiniteFuture()).ok()) return 6;

  for (;;) {
    std::string payload;
    absl::Status s = ipc::ReadFrame(g_fd, &payload, absl::InfiniteFuture());
    if (absl::IsOutOfRange(s)) return 0;  // the daemon closed the socket
    if (!s.ok()) return 7;
    auto start = std::chrono::steady_clock::now();
    ipc::WorkerResponse resp;
    absl::StatusOr<ipc::WorkerRequest> req = ipc::DecodeRequest(payload);
    if (!req.ok()) {
      resp.kind = ipc::ResponseKind::kBadRequest;
      resp.diagnostics = req.status().ToString();
    } else {
      resp = frontend->Handle(*req);
    }
    resp.compile_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (!ipc::WriteFrame(g_fd, ipc::Encode(resp), absl::InfiniteFuture()).ok()) return 8;
  }
}

}  // namespace
}  // namespace opjit::compiler

int main(int argc, char** argv) { return opjit::compiler::Main(argc, argv); }

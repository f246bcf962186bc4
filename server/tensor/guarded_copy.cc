#include "server/tensor/guarded_copy.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace opjit::tensor {
namespace {

// Set while this thread is inside a guarded copy. Volatile, and fenced
// below: the handler reads it, but the compiler cannot see that. Without
// both, GCC dropped the store before the memcpy as dead (memcpy reads no
// globals), so every guarded copy ran unguarded and a shrunk ring killed
// the daemon (issue 26).
thread_local sigjmp_buf* volatile t_guard = nullptr;

struct sigaction g_old_bus, g_old_segv;

void OnFault(int sig, siginfo_t* info, void* ctx) {
  if (t_guard != nullptr) siglongjmp(*t_guard, sig);
  // Not ours: restore the previous disposition and let the fault happen again.
  sigaction(sig, sig == SIGBUS ? &g_old_bus : &g_old_segv, nullptr);
  (void)info;
  (void)ctx;
}

}  // namespace

void InstallCopyGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnFault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGSEGV, &sa, &g_old_segv);
  });
}

absl::Status GuardedCopy(void* dst, const void* src, size_t n) {
  InstallCopyGuard();
  sigjmp_buf env;
  if (sigsetjmp(env, 1) != 0) {
    t_guard = nullptr;
    return absl::FailedPreconditionError(
        "the shared memory of a tensor shrank while it was read (the client truncated its "
        "shm object); the call was stopped");
  }
  t_guard = &env;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = nullptr;
  return absl::OkStatus();
}

}  // namespace opjit::tensor

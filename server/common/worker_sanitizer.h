// Sanitizer settings of the sandboxed worker processes (compile worker,
// executor, GPU sandbox). Include it from each worker's main.cc only.
#pragma once

#ifdef OPJIT_SANITIZED
// - detect_leaks=0: LeakSanitizer's exit-time scan walks /proc/self/task
//   and stops threads, which Landlock and seccomp refuse inside a sandboxed
//   worker, so a worker would fail at exit for the sandbox's sake. Leak
//   checking stays on in the daemon and in every test binary.
// - handle_*=0: a crash of the (uninstrumented) user kernel or of clang must
//   end the worker with its real signal, as in a regular build, so that the
//   daemon reports "SIGSEGV" and not ASan's "exit status 1".
extern "C" const char* __asan_default_options() {
  return "detect_leaks=0:handle_segv=0:handle_sigbus=0:handle_abort=0:handle_sigfpe=0:"
         "handle_sigill=0";
}
#endif

// Sanitizer settings of the sandboxed worker processes (compile worker,
// executor, GPU sandbox). Include it from each worker's main.cc only.
#pragma once

#ifdef OPJIT_SANITIZED
// LeakSanitizer's exit-time scan walks /proc/self/task and stops threads,
// which Landlock and seccomp refuse inside a sandboxed worker, so a worker
// would fail at exit for the sandbox's sake. Leak checking stays on in the
// daemon and in every test binary.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif

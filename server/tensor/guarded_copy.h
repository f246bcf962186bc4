// Copies out of client shared memory that survive the client shrinking it.
//
// Whoever can open an shm object can ftruncate it smaller after the daemon
// mapped it; touching a page past the new end raises SIGBUS. Kernels touch
// client memory only in executor processes, but the daemon itself still
// copies some tensors (the ones an autograd context saves). GuardedCopy
// turns a SIGBUS (or SIGSEGV) inside such a copy into an error for that
// call instead of the death of the daemon.
#pragma once

#include <cstddef>

#include "absl/status/status.h"

namespace opjit::tensor {

// Installs the process-wide SIGBUS/SIGSEGV handler the guard needs (once;
// later calls do nothing). Faults outside a guarded copy keep their default
// action. Called by GuardedCopy itself; exposed for tests and main().
void InstallCopyGuard();

// memcpy(dst, src, n), except that a fault while reading `src` or writing
// `dst` gives FAILED_PRECONDITION ("the shared memory ... shrank while it was
// read") instead of a signal. Thread-safe; async-signal-safe it is not.
absl::Status GuardedCopy(void* dst, const void* src, size_t n);

}  // namespace opjit::tensor

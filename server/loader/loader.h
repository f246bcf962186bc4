// The CPU kernel loader: links ELF relocatable objects (from opjit's compile
// worker or the disk cache) into the daemon with LLVM ORC (LLJIT + JITLink) and
// hands out callable symbols.
//
// Each loaded object gets its own JITDylib, so kernels that define the same
// names (every aot kernel defines `CustomAdd`...) coexist. A LoadedKernel owns
// its code: destroying the last reference runs the kernel's static destructors
// and frees the code. LLVM stays out of this header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace opjit::loader {

// What the host CPU is, in LLVM's words; part of every CPU cache key.
struct HostTarget {
  std::string triple;    // e.g. "x86_64-pc-linux-gnu"
  std::string cpu;       // e.g. "znver3"
  std::string features;  // enabled features, sorted: "+adx,+aes,+avx,+avx2,..."
};

// Detects the host once per call (cheap: a few cpuid instructions).
HostTarget DetectHostTarget();

struct JitLoaderOptions {
  // Shared libraries a kernel may name in Load's `libraries`: absolute paths or
  // sonames ("libm.so.6", "libopenblas.so.0"), matched exactly.
  // Default: empty (kernels use only what the daemon process already has).
  std::vector<std::string> allowed_libraries;
};

namespace internal {
class LoaderState;  // defined in loader.cc
struct KernelCode;  // defined in loader.cc
}  // namespace internal

// One linked object. Immutable after Load; Find and the accessors are
// thread-safe. Keep a shared_ptr while any of its code may run: the code is
// unloaded when the last reference goes.
class LoadedKernel {
 public:
  LoadedKernel(const LoadedKernel&) = delete;
  LoadedKernel& operator=(const LoadedKernel&) = delete;
  // Runs the destructors the kernel registered with __cxa_atexit/atexit (in
  // reverse order), then `__opjit_run_dtors` if the object defines it, then
  // removes the code. Exceptions escaping those are logged and swallowed.
  ~LoadedKernel();

  // The address of global symbol `symbol` of the object (functions and data,
  // weak definitions included); nullptr if the object does not define it.
  void* Find(std::string_view symbol) const;

  // Typed convenience: Find cast to a function or object pointer type.
  template <typename T>
  T FindAs(std::string_view symbol) const {
    return reinterpret_cast<T>(Find(symbol));
  }

  // The strong (non-weak), default-visibility global function and data
  // symbols the object defines, sorted. What an error message lists.
  const std::vector<std::string>& defined_symbols() const { return defined_symbols_; }

  // Size of the object in bytes, for cache accounting.
  size_t code_bytes() const { return code_bytes_; }

  // The name given to Load.
  const std::string& name() const { return name_; }

 private:
  friend class JitLoader;
  LoadedKernel() = default;

  std::string name_;
  size_t code_bytes_ = 0;
  std::vector<std::string> defined_symbols_;
  std::map<std::string, void*, std::less<>> symbols_;  // every materialised symbol
  // Owns the JITDylib and keeps the loader's LLJIT alive while this lives.
  std::unique_ptr<internal::KernelCode> code_;
};

// Links objects into the daemon. Thread-safe: many Loads may run at once.
// One LLJIT per JitLoader; the JIT stays alive until the JitLoader and every
// LoadedKernel it made are gone.
class JitLoader {
 public:
  // Sets up the JIT for the host. Fails (INTERNAL) only when LLVM cannot.
  static absl::StatusOr<std::unique_ptr<JitLoader>> Create(const JitLoaderOptions& options);
  ~JitLoader();
  JitLoader(const JitLoader&) = delete;
  JitLoader& operator=(const JitLoader&) = delete;

  // Links ELF relocatable object `object` into a fresh JITDylib (`name` is for
  // logs and errors; it need not be unique). Undefined symbols resolve against
  // the daemon process (libc, libm, libstdc++) and against `libraries`, each of
  // which must be on the allow-list; they are dlopen'd once (RTLD_NOW |
  // RTLD_LOCAL) and stay open. All code is linked now, then the object's
  // `__opjit_run_ctors` (if defined) runs.
  //
  // Errors: PERMISSION_DENIED for a library not on the allow-list;
  // FAILED_PRECONDITION for an allowed library that cannot be opened;
  // INVALID_ARGUMENT for a malformed object, an undefined symbol ("undefined
  // symbol 'foo' (not in the process or the allowed libraries: ...)"), a link
  // error, or static initialisation that throws.
  absl::StatusOr<std::shared_ptr<const LoadedKernel>> Load(
      std::string_view object, const std::string& name, const std::vector<std::string>& libraries);

  struct Stats {
    uint64_t loaded = 0;    // successful Loads
    uint64_t unloaded = 0;  // LoadedKernels destroyed
    uint64_t live = 0;      // loaded - unloaded
  };
  Stats GetStats() const;

 private:
  explicit JitLoader(std::shared_ptr<internal::LoaderState> state);
  std::shared_ptr<internal::LoaderState> state_;
};

}  // namespace opjit::loader

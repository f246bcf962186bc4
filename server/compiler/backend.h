// Compile backends: one per target. A backend knows its toolchain and turns a
// CompileJob into an artifact; KernelCompiler (kernel_compiler.h) keeps the
// keys, the memory and disk caches and single-flight, the same for every
// backend. Nothing here loads code: artifacts are bytes that kernel runners
// (server/runner) load, in executor processes.
//
//   CpuBackend  C/C++ through the sandboxed clang worker pool -> ELF object
//   GpuBackend  CUDA through NVRTC (CUBIN + PTX) or nvcc (aot .so), both in
//               opjit-gpu-sandbox processes
//
// A KernelCompiler holds a BackendSet, one backend per target, and looks each
// job's backend up by its target. To add a backend: write one file with a
// CompileBackend subclass and its Make...Backend function, and add it to
// MakeDefaultBackends (backend.cc); a test passes its own set to
// KernelCompiler::Create (tests/unit/compiler/backend_set_test.cc).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/compiler/kernel_compiler.h"

namespace opjit::compiler {

// What one compile produced.
struct BackendOutput {
  std::shared_ptr<CompiledKernel> kernel;  // the artifact; cache_key unset
  // Absolute paths of every file besides the source the output depends on
  // (headers read); their contents go into the final cache key.
  std::vector<std::string> dependencies;
};

// Thread-safe: Compile may run on many threads at once.
class CompileBackend {
 public:
  virtual ~CompileBackend() = default;
  virtual registry::Target target() const = 0;
  // The languages it compiles ("c++", "c"), in the order messages list them.
  virtual std::vector<std::string> Languages() const = 0;
  // Its compile-option allow-list: "" when `option` is allowed for
  // `language`, otherwise why not. The registry asks through
  // KernelCompiler::Rules(); KernelCompiler asks before each compile.
  virtual std::string OptionRefusal(const std::string& language, std::string_view option) const = 0;
  // OK, or INVALID_ARGUMENT "<field>[k]: option "X" is refused: <why>" for
  // the first option OptionRefusal refuses.
  absl::Status ValidateOptions(const std::string& language, const std::vector<std::string>& options,
                               const std::string& field = "compile_options") const;
  // Everything of the toolchain and of `job` beyond the common fields
  // (source, language, options, libraries, file name) that changes the
  // output: part of the request key. INVALID_ARGUMENT for a job this backend
  // cannot compile (language); UNAVAILABLE when its toolchain is missing.
  virtual absl::StatusOr<std::string> Identity(const CompileJob& job) = 0;
  // Compiles. Errors: INVALID_ARGUMENT (diagnostics), DEADLINE_EXCEEDED,
  // RESOURCE_EXHAUSTED, UNAVAILABLE, as KernelCompiler::CompileAsync says.
  virtual absl::StatusOr<BackendOutput> Compile(const CompileJob& job) = 0;
  // Checks an artifact, new or from disk, against `job`, and fills what the
  // checks find (symbols). INVALID_ARGUMENT when it cannot serve the job.
  virtual absl::Status Check(const CompileJob& job, CompiledKernel* kernel) const = 0;
  // The disk form of an artifact, and back (nullptr-free error: malformed).
  virtual std::string DiskKind() const = 0;
  virtual std::string Encode(const CompiledKernel& kernel) const = 0;
  virtual absl::StatusOr<std::shared_ptr<CompiledKernel>> Decode(std::string_view blob) const = 0;
  // A stable identity of the toolchain, for logs and ServerInfo ("" until
  // known).
  virtual std::string ToolchainId() const = 0;
};

// The CPU backend: starts the compile worker pool (and its PCH).
absl::StatusOr<std::unique_ptr<CompileBackend>> MakeCpuBackend(const KernelCompilerOptions& options);
// The GPU backend: NVRTC and nvcc are found on first use, so a host without
// the CUDA toolkit still compiles for the CPU.
std::unique_ptr<CompileBackend> MakeGpuBackend(const KernelCompilerOptions& options);

// The built-in set (CPU and GPU), what KernelCompiler::Create(options) uses:
// the one place backends are registered. Errors: the CPU backend's.
absl::StatusOr<BackendSet> MakeDefaultBackends(const KernelCompilerOptions& options);

}  // namespace opjit::compiler

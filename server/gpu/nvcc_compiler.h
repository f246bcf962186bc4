// Compiles MindSpore `aot` GPU kernels (.cu files with host launchers that use
// <<<...>>>, exporting extern "C" int F(int nparam, void** params, ...)) into
// a shared object with the toolkit's nvcc. NVRTC cannot compile host code, so
// these go through nvcc as a subprocess (posix_spawn with an argv, no shell),
// in its own process group so that a timeout kills nvcc's children too.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace opjit::gpu {

struct NvccRequest {
  std::string source;
  // Shown in diagnostics. A bare name; a directory part is dropped.
  std::string file_name = "kernel.cu";
  // User options, already validated by the registry (-D -U --use_fast_math
  // -std= ...). Passed to nvcc as they are.
  std::vector<std::string> options;
  // Real archs, e.g. {"sm_80", "sm_90"}: one CUBIN each, plus PTX of the
  // lowest for newer GPUs. Must not be empty.
  std::vector<std::string> archs = {"sm_80", "sm_90"};
  // The toolkit; nvcc is <cuda_root>/bin/nvcc.
  std::string cuda_root = "/usr/local/cuda";
  // opjit's kernel headers (custom_aot_extra.h), then extra dirs; each -I.
  std::string kernel_include_dir;
  std::vector<std::string> extra_include_dirs;
  // Extra files (name, content): headers the source includes, written
  // beside it in the temporary directory (which is also an -I dir), under
  // their relative names ("helper.h", "detail/x.h": no "..", no leading
  // '/', as registry::ValidateSourceFiles requires; checked again here).
  std::vector<std::pair<std::string, std::string>> files;
  // Where the temporary directory is made. Default: $TMPDIR or /tmp.
  std::string tmp_dir;
  // Wall clock for the nvcc run; then its process group gets SIGKILL.
  int timeout_ms = 120000;
  // The opjit-gpu-sandbox binary nvcc runs under (Landlock: system files
  // read-only, the temp dir read-write; seccomp: no sockets; RLIMIT_DATA).
  // Empty: nvcc runs unconfined (tools and tests only).
  std::string sandbox_path;
  // RLIMIT_DATA of nvcc and each tool it runs. Default: 2 GiB.
  uint64_t memory_limit_bytes = 2ull << 30;
  // With sandbox_path, nvcc runs as this uid, the compile uid; <= 0: the
  // daemon's. A root daemon switches to it (the gid of the same number;
  // it owns the temp dir). A daemon that is not root maps it, with
  // compile_gid, as uid 0 of a user namespace (with its own ids as 1; the
  // temp dir's ACL grants it), where that file system has POSIX ACLs; else
  // nvcc runs as the daemon's own ids in a user namespace of its own.
  int64_t compile_uid = -1;
  int64_t compile_gid = -1;
};

struct NvccOutput {
  std::string shared_object;  // the .so bytes (ELF, x86-64, PIC)
  std::string diagnostics;    // nvcc's stdout and stderr (warnings)
  double compile_ms = 0;
};

// Compiles `request` into a shared object. Blocks the calling thread for the
// whole nvcc run (seconds). Thread-safe: each call has its own temp dir.
// Errors:
//   INVALID_ARGUMENT   "compile failed:\n" + nvcc's output; bad archs;
//   DEADLINE_EXCEEDED  nvcc ran past timeout_ms (and was killed);
//   UNAVAILABLE        nvcc is missing or could not be started;
//   INTERNAL           temp files could not be written or read.
absl::StatusOr<NvccOutput> CompileAotSharedObject(const NvccRequest& request);

// "nvcc 13.0.88" and the host compiler nvcc uses, for cache keys; runs
// `nvcc --version`. UNAVAILABLE when nvcc is missing.
absl::StatusOr<std::string> NvccToolchainId(const std::string& cuda_root);

}  // namespace opjit::gpu

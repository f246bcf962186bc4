// opjit-gpu-sandbox: runs the GPU compilers on untrusted sources, confined.
//
// Both modes also take --parent-pid P (die with P, exit at once if P is
// already gone) and --instance TAG (a tag for a restart's sweep).
//
//   opjit-gpu-sandbox --nvrtc-worker --cuda-root R --nvrtc-path LIB --memory BYTES
//                     --cpu-seconds N --archs sm_80,sm_90 [--include DIR]...
//                     [--pch-bytes BYTES] [--isolate 1] [--userns 1] [--uid N]
//       A pool worker (nvrtc_pool.h): many NVRTC compiles, framed requests
//       on stdin and results on stdout (a socket), until stdin closes.
//       NVRTC is loaded first; then namespaces (--isolate), RLIMIT_AS,
//       no_new_privs, Landlock (the toolkit's and the include dirs' files
//       only), seccomp (no sockets, exec, processes); then one small compile
//       warms NVRTC up, and the worker says hello. Each compile runs under
//       RLIMIT_CPU of N more seconds. With --isolate and --pch-bytes, a
//       private tmpfs of that size on /dev/shm holds its PCHs. With --uid N
//       (a root daemon): runs as uid and gid N, keeping only
//       CAP_DAC_READ_SEARCH (the include dirs may be root's, 0700).
//
//   opjit-gpu-sandbox --exec --rw DIR [--ro PATH]... --memory BYTES -- PROG ARGS...
//       Confines itself (Landlock: system files read-only, DIR read-write;
//       seccomp: no sockets, ptrace, signals to others; RLIMIT_DATA), sets
//       TMPDIR=DIR, then execs PROG (nvcc and the tools it runs inherit all
//       of it).
//
// Started by opjitd (server/gpu/nvrtc_compiler.cc, nvcc_compiler.cc).

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "server/common/worker_sanitizer.h"
#include "server/common/sandbox.h"
#include "server/common/subprocess.h"
#include "server/gpu/nvrtc_compiler.h"
#include "server/gpu/nvrtc_pool.h"

namespace opjit::gpu {
namespace {

const std::vector<std::string> kSystem = {"/usr", "/lib", "/lib64", "/etc/ld.so.cache",
                                          "/etc/alternatives"};

int Fail(const std::string& what) {
  std::fprintf(stderr, "opjit-gpu-sandbox: %s\n", what.c_str());
  return 2;
}

// The worker's flags (see the comment at the top).
struct Flags {
  pid_t parent = 0;
  std::string cuda_root = "/usr/local/cuda", lib, archs;
  uint64_t memory = 0, cpu_seconds = 0, pch_bytes = 0;
  std::vector<std::string> includes;
  bool isolate = false, userns = false;
  long long uid = -1;
};

// Where a worker's private tmpfs of PCHs is mounted (it hides the host's
// /dev/shm; a path NVRTC never reads headers from).
constexpr char kPchDir[] = "/dev/shm";

sandbox::Policy NvrtcPolicy(const Flags& f, bool pch) {
  sandbox::Policy p;
  p.read_only_paths = kSystem;
  p.read_only_paths.push_back(f.cuda_root);
  p.read_only_paths.insert(p.read_only_paths.end(), f.includes.begin(), f.includes.end());
  p.device_paths = {"/dev/null"};
  p.address_space_bytes = f.memory;
  // No network, no IPC and mounts of its own (--isolate); memory only
  // where RLIMIT_AS counts it, and the PCH tmpfs's size.
  p.private_namespaces = f.isolate;
  p.user_namespace_root = f.userns;
  p.refuse_shared_memory = true;
  if (pch) {
    p.scratch_dir = kPchDir;
    p.scratch_bytes = f.pch_bytes;
    p.read_write_paths = {kPchDir};
  }
  // The compile uid (root daemon), with CAP_DAC_READ_SEARCH alone; in the
  // user namespace a non-root daemon made, the same over its files.
  p.uid = f.uid;
  p.gid = f.uid;
  p.keep_read_search = f.uid > 0 || f.userns;
  return p;
}

int RunNvrtcWorker(const Flags& f) {
  // Dies with the daemon (PDEATHSIG: the daemon starts every child from one
  // long-lived thread, so a worker does not die with the thread that asked
  // for it); a dead daemon also closes its socket (the loop ends).
  subprocess::ActAsInit();  // process 1 of its own PID namespace (root daemon)
  if (!subprocess::DieWithParent(f.parent)) return 3;
  const bool pch = f.isolate && f.pch_bytes > 0 && ::access(kPchDir, F_OK) == 0;
  NvrtcOptions o;
  o.cuda_root = f.cuda_root;
  o.nvrtc_path = f.lib;
  o.extra_include_dirs = f.includes;
  if (!f.archs.empty()) o.archs = absl::StrSplit(f.archs, ',');
  if (pch) {
    o.pch_dir = kPchDir;
    // Where NVRTC writes a PCH's temporary file (else /tmp, shut to it).
    ::setenv("TMPDIR", kPchDir, 1);
  }
  auto compiler = NvrtcCompiler::Create(o);
  if (!compiler.ok()) return Fail(compiler.status().ToString());
  if (absl::Status s = sandbox::Apply(NvrtcPolicy(f, pch)); !s.ok()) return Fail(s.ToString());
  if (!subprocess::DieWithParent(f.parent)) return 3;  // (again, after the sandbox)
  // NVRTC initialises itself (and loads its builtins) on its first compile:
  // that happens here, before the hello, off any caller's clock.
  GpuCompileRequest warm_up;
  warm_up.source = "__global__ void opjit_warm_up() {}\n";
  (void)(*compiler)->CompileHere(warm_up);
  return ServeNvrtcWorker(**compiler, /*fd=*/0, f.cpu_seconds);
}

int Main(int argc, char** argv) {
  bool nvrtc = false, exec = false;
  Flags f;
  std::string rw;
  std::vector<std::string> ro;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--nvrtc-worker") {
      nvrtc = true;
    } else if (a == "--exec") {
      exec = true;
    } else if (a == "--") {
      ++i;
      break;
    } else if (v == nullptr) {
      return Fail("missing value for " + a);
    } else if (a == subprocess::kParentPidFlag) {
      f.parent = static_cast<pid_t>(std::atol(argv[++i]));
    } else if (a == subprocess::kInstanceFlag) {
      ++i;  // a tag for a restart's sweep of leftovers (subprocess.h)
    } else if (a == "--cuda-root") {
      f.cuda_root = argv[++i];
    } else if (a == "--nvrtc-path") {
      f.lib = argv[++i];
    } else if (a == "--archs") {
      f.archs = argv[++i];
    } else if (a == "--memory") {
      f.memory = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--cpu-seconds") {
      f.cpu_seconds = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--pch-bytes") {
      f.pch_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--include") {
      f.includes.push_back(argv[++i]);
    } else if (a == "--ro") {
      ro.push_back(argv[++i]);
    } else if (a == "--rw") {
      rw = argv[++i];
    } else if (a == "--isolate") {
      f.isolate = std::string(argv[++i]) == "1";
    } else if (a == "--userns") {
      f.userns = std::string(argv[++i]) == "1";
    } else if (a == "--uid") {
      char* end = nullptr;
      f.uid = std::strtoll(v, &end, 10);
      if (*v == '\0' || *end != '\0' || f.uid <= 0 || f.uid >= 0xFFFFFFFFll) {
        return Fail(std::string("bad --uid ") + v);
      }
      ++i;
    } else {
      return Fail("unknown argument " + a);
    }
  }
  if (nvrtc) return RunNvrtcWorker(f);
  if (!exec || i >= argc || rw.empty()) return Fail("usage: see the comment in gpu_sandbox_main.cc");
  sandbox::Policy p;
  p.read_only_paths = kSystem;
  p.read_only_paths.insert(p.read_only_paths.end(), ro.begin(), ro.end());
  p.read_write_paths = {rw};
  p.device_paths = {"/dev/null", "/dev/urandom"};
  p.allow_exec = true;
  p.allow_processes = true;
  p.data_bytes = f.memory;
  // As the NVRTC sandbox: namespaces of its own (nvcc is process 1 of its
  // PID namespace, with no network), and a root daemon's compile uid with
  // CAP_DAC_READ_SEARCH alone, passed on to nvcc and its tools (ambient).
  p.private_namespaces = f.isolate;
  p.user_namespace_root = f.userns;
  p.uid = f.uid;
  p.gid = f.uid;
  p.keep_read_search = f.uid > 0 || f.userns;
  if (absl::Status s = sandbox::Apply(p); !s.ok()) return Fail(s.ToString());
  // Kept across the exec (nvcc is no set-uid program): nvcc dies with the
  // daemon too.
  if (!subprocess::DieWithParent(f.parent)) return 3;
  ::setenv("TMPDIR", rw.c_str(), 1);
  // What nvcc writes, the daemon reads back, whichever uid nvcc runs as
  // (others cannot reach the directory).
  ::umask(022);
  ::execv(argv[i], argv + i);
  return Fail(std::string("exec ") + argv[i] + ": " + std::strerror(errno));
}

}  // namespace
}  // namespace opjit::gpu

int main(int argc, char** argv) { return opjit::gpu::Main(argc, argv); }

// opjit-gpu-sandbox: runs the GPU compilers on untrusted sources, confined.
//
// Both modes also take --parent-pid P (die with P, exit at once if P is
// already gone) and --instance TAG (a tag for a restart's sweep).
//
//   opjit-gpu-sandbox --nvrtc --cuda-root R --nvrtc-path LIB --memory BYTES
//                     --archs sm_80,sm_90 [--include DIR]...
//       One NVRTC compile: the request on stdin, the result on stdout
//       (EncodeGpuRequest / EncodeGpuResult), then exit. NVRTC is loaded
//       first; then RLIMIT_AS, no_new_privs, Landlock (the toolkit's and the
//       include dirs' files only), seccomp (no sockets, exec, processes).
//       With --uid N (a root daemon): runs as uid and gid N, keeping only
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
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "server/common/worker_sanitizer.h"
#include "server/common/sandbox.h"
#include "server/common/subprocess.h"
#include "server/gpu/nvrtc_compiler.h"

namespace opjit::gpu {
namespace {

const std::vector<std::string> kSystem = {"/usr", "/lib", "/lib64", "/etc/ld.so.cache",
                                          "/etc/alternatives"};

int Fail(const std::string& what) {
  std::fprintf(stderr, "opjit-gpu-sandbox: %s\n", what.c_str());
  return 2;
}

int RunNvrtc(pid_t parent, const std::string& cuda_root, const std::string& lib,
             uint64_t memory, uint64_t cpu_seconds, const std::string& archs,
             const std::vector<std::string>& includes, bool isolate, bool userns,
             long long uid) {
  // Dies with the daemon (PDEATHSIG: the daemon starts every child from one
  // long-lived thread, so a spare does not die with the thread that asked
  // for it); a dead daemon also closes stdin (an empty request: exit), and
  // RLIMIT_CPU bounds a compile nobody waits for. NVRTC loads and the
  // sandbox closes before the request is read, so the daemon can start one
  // ahead of time and only the compile is on the caller's clock.
  subprocess::ActAsInit();  // process 1 of its own PID namespace (root daemon)
  if (!subprocess::DieWithParent(parent)) return 3;
  NvrtcOptions o;
  o.cuda_root = cuda_root;
  o.nvrtc_path = lib;
  o.extra_include_dirs = includes;
  if (!archs.empty()) o.archs = absl::StrSplit(archs, ',');
  auto compiler = NvrtcCompiler::Create(o);
  absl::StatusOr<GpuCompileOutput> result;
  if (!compiler.ok()) {
    result = compiler.status();
  } else {
    sandbox::Policy p;
    p.read_only_paths = kSystem;
    p.read_only_paths.push_back(cuda_root);
    p.read_only_paths.insert(p.read_only_paths.end(), includes.begin(), includes.end());
    p.device_paths = {"/dev/null"};
    p.address_space_bytes = memory;
    p.cpu_seconds = cpu_seconds;
    // No network, no IPC and mounts of its own (--isolate); memory only
    // where RLIMIT_AS counts it.
    p.private_namespaces = isolate;
    p.user_namespace_root = userns;
    p.refuse_shared_memory = true;
    // The compile uid (root daemon), with CAP_DAC_READ_SEARCH alone; in the
    // user namespace a non-root daemon made, the same over its files.
    p.uid = uid;
    p.gid = uid;
    p.keep_read_search = uid > 0 || userns;
    if (absl::Status s = sandbox::Apply(p); !s.ok()) return Fail(s.ToString());
    if (!subprocess::DieWithParent(parent)) return 3;  // (again, after the sandbox)
    std::string request((std::istreambuf_iterator<char>(std::cin)),
                        std::istreambuf_iterator<char>());
    if (request.empty()) return 0;  // a spare that was never used
    GpuCompileRequest req;
    if (!DecodeGpuRequest(request, &req)) {
      result = absl::InvalidArgumentError("malformed compile request");
    } else {
      result = (*compiler)->CompileHere(req);
    }
  }
  const std::string out = EncodeGpuResult(result);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  return 0;
}

int Main(int argc, char** argv) {
  bool nvrtc = false, exec = false, isolate = false, userns = false;
  std::string cuda_root = "/usr/local/cuda", lib, archs, rw;
  uint64_t memory = 0, cpu_seconds = 0;
  long long uid = -1;
  pid_t parent = 0;
  std::vector<std::string> includes, ro;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--nvrtc") {
      nvrtc = true;
    } else if (a == "--exec") {
      exec = true;
    } else if (a == "--") {
      ++i;
      break;
    } else if (v == nullptr) {
      return Fail("missing value for " + a);
    } else if (a == subprocess::kParentPidFlag) {
      parent = static_cast<pid_t>(std::atol(argv[++i]));
    } else if (a == subprocess::kInstanceFlag) {
      ++i;  // a tag for a restart's sweep of leftovers (subprocess.h)
    } else if (a == "--cuda-root") {
      cuda_root = argv[++i];
    } else if (a == "--nvrtc-path") {
      lib = argv[++i];
    } else if (a == "--archs") {
      archs = argv[++i];
    } else if (a == "--memory") {
      memory = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--cpu-seconds") {
      cpu_seconds = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--include") {
      includes.push_back(argv[++i]);
    } else if (a == "--ro") {
      ro.push_back(argv[++i]);
    } else if (a == "--rw") {
      rw = argv[++i];
    } else if (a == "--isolate") {
      isolate = std::string(argv[++i]) == "1";
    } else if (a == "--userns") {
      userns = std::string(argv[++i]) == "1";
    } else if (a == "--uid") {
      char* end = nullptr;
      uid = std::strtoll(v, &end, 10);
      if (*v == '\0' || *end != '\0' || uid <= 0 || uid >= 0xFFFFFFFFll) {
        return Fail(std::string("bad --uid ") + v);
      }
      ++i;
    } else {
      return Fail("unknown argument " + a);
    }
  }
  if (nvrtc) {
    return RunNvrtc(parent, cuda_root, lib, memory, cpu_seconds, archs, includes, isolate, userns,
                    uid);
  }
  if (!exec || i >= argc || rw.empty()) return Fail("usage: see the comment in gpu_sandbox_main.cc");
  sandbox::Policy p;
  p.read_only_paths = kSystem;
  p.read_only_paths.insert(p.read_only_paths.end(), ro.begin(), ro.end());
  p.read_write_paths = {rw};
  p.device_paths = {"/dev/null", "/dev/urandom"};
  p.allow_exec = true;
  p.allow_processes = true;
  p.data_bytes = memory;
  // As the NVRTC sandbox: namespaces of its own (nvcc is process 1 of its
  // PID namespace, with no network), and a root daemon's compile uid with
  // CAP_DAC_READ_SEARCH alone, passed on to nvcc and its tools (ambient).
  p.private_namespaces = isolate;
  p.user_namespace_root = userns;
  p.uid = uid;
  p.gid = uid;
  p.keep_read_search = uid > 0 || userns;
  if (absl::Status s = sandbox::Apply(p); !s.ok()) return Fail(s.ToString());
  // Kept across the exec (nvcc is no set-uid program): nvcc dies with the
  // daemon too.
  if (!subprocess::DieWithParent(parent)) return 3;
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

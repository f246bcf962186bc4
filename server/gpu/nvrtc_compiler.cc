#include "server/gpu/nvrtc_compiler.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/codec.h"
#include "server/common/error_info.h"
#include "server/common/frame_io.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/common/subprocess.h"

namespace opjit::gpu {

// NVRTC entry points, typed from <nvrtc.h> and resolved with dlsym.
struct NvrtcCompiler::Api {
  void* handle = nullptr;
  decltype(&::nvrtcGetErrorString) GetErrorString = nullptr;
  decltype(&::nvrtcVersion) Version = nullptr;
  decltype(&::nvrtcGetNumSupportedArchs) GetNumSupportedArchs = nullptr;
  decltype(&::nvrtcGetSupportedArchs) GetSupportedArchs = nullptr;
  decltype(&::nvrtcCreateProgram) CreateProgram = nullptr;
  decltype(&::nvrtcDestroyProgram) DestroyProgram = nullptr;
  decltype(&::nvrtcCompileProgram) CompileProgram = nullptr;
  decltype(&::nvrtcGetPTXSize) GetPTXSize = nullptr;
  decltype(&::nvrtcGetPTX) GetPTX = nullptr;
  decltype(&::nvrtcGetCUBINSize) GetCUBINSize = nullptr;
  decltype(&::nvrtcGetCUBIN) GetCUBIN = nullptr;
  decltype(&::nvrtcGetProgramLogSize) GetProgramLogSize = nullptr;
  decltype(&::nvrtcGetProgramLog) GetProgramLog = nullptr;
  decltype(&::nvrtcAddNameExpression) AddNameExpression = nullptr;
  decltype(&::nvrtcGetLoweredName) GetLoweredName = nullptr;
};

namespace {

struct ParsedArch {
  int sm = 0;
  std::string suffix;  // "", "a" or "f"
};

// "sm_90" -> {90, ""}, "sm_90a" -> {90, "a"}.
absl::StatusOr<ParsedArch> ParseArch(const std::string& arch) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid GPU arch '", arch, "': expected sm_NN, e.g. sm_90"));
  };
  if (arch.size() < 5 || arch.compare(0, 3, "sm_") != 0) return bad();
  size_t i = 3;
  ParsedArch p;
  while (i < arch.size() && arch[i] >= '0' && arch[i] <= '9' && i < 7) {
    p.sm = p.sm * 10 + (arch[i] - '0');
    ++i;
  }
  if (i == 3) return bad();
  p.suffix = arch.substr(i);
  if (!p.suffix.empty() && p.suffix != "a" && p.suffix != "f") return bad();
  return p;
}

absl::StatusOr<int> ArchNumber(const std::string& arch) {
  OPJIT_ASSIGN_OR_RETURN(ParsedArch p, ParseArch(arch));
  return p.sm;
}

bool HasStdOption(const std::vector<std::string>& options) {
  for (const std::string& o : options) {
    if (o.rfind("-std", 0) == 0 || o.rfind("--std", 0) == 0) return true;
  }
  return false;
}

std::string Trim(std::string s) {
  while (!s.empty() &&
         (s.back() == '\0' || s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) {
    s.pop_back();
  }
  return s;
}

// Destroys an nvrtcProgram when it goes out of scope.
class ProgramGuard {
 public:
  ProgramGuard(const NvrtcCompiler::Api* api, nvrtcProgram prog) : api_(api), prog_(prog) {}
  ~ProgramGuard() {
    if (prog_ != nullptr) api_->DestroyProgram(&prog_);
  }
  ProgramGuard(const ProgramGuard&) = delete;
  ProgramGuard& operator=(const ProgramGuard&) = delete;

 private:
  const NvrtcCompiler::Api* api_;
  nvrtcProgram prog_;
};

// What one NVRTC compile (one target) produced.
struct CompileResult {
  std::string cubin;  // empty for a compute_NN target
  std::string ptx;
  std::string log;
  std::map<std::string, std::string> lowered_names;
};

}  // namespace

// The library stays loaded for the life of the process: NVRTC keeps
// process-wide state, and dlclose buys nothing for a daemon.

absl::StatusOr<std::unique_ptr<NvrtcCompiler>> NvrtcCompiler::Create(const NvrtcOptions& options) {
  auto log = Logger("gpu");
  std::vector<std::string> candidates;
  if (!options.nvrtc_path.empty()) {
    candidates.push_back(options.nvrtc_path);
  } else {
    // The toolkit's own NVRTC first, so that it matches the headers under
    // cuda_root/include; then whatever the dynamic loader finds.
    candidates = {options.cuda_root + "/lib64/libnvrtc.so.13",
                  options.cuda_root + "/lib64/libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so"};
  }
  void* handle = nullptr;
  std::vector<std::string> errors;
  for (const std::string& c : candidates) {
    handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) break;
    const char* e = dlerror();
    errors.push_back(e != nullptr ? e : c + ": unknown error");
  }
  if (handle == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("NVRTC (libnvrtc.so) could not be loaded: ", absl::StrJoin(errors, "; "),
                     "; install the CUDA toolkit"));
  }

  std::unique_ptr<NvrtcCompiler> c(new NvrtcCompiler());
  c->options_ = options;
  c->api_ = std::make_unique<Api>();
  Api& api = *c->api_;
  api.handle = handle;
  std::vector<std::string> missing;
  auto resolve = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
    if (fn == nullptr) missing.push_back(name);
  };
  resolve(api.GetErrorString, "nvrtcGetErrorString");
  resolve(api.Version, "nvrtcVersion");
  resolve(api.GetNumSupportedArchs, "nvrtcGetNumSupportedArchs");
  resolve(api.GetSupportedArchs, "nvrtcGetSupportedArchs");
  resolve(api.CreateProgram, "nvrtcCreateProgram");
  resolve(api.DestroyProgram, "nvrtcDestroyProgram");
  resolve(api.CompileProgram, "nvrtcCompileProgram");
  resolve(api.GetPTXSize, "nvrtcGetPTXSize");
  resolve(api.GetPTX, "nvrtcGetPTX");
  resolve(api.GetCUBINSize, "nvrtcGetCUBINSize");
  resolve(api.GetCUBIN, "nvrtcGetCUBIN");
  resolve(api.GetProgramLogSize, "nvrtcGetProgramLogSize");
  resolve(api.GetProgramLog, "nvrtcGetProgramLog");
  resolve(api.AddNameExpression, "nvrtcAddNameExpression");
  resolve(api.GetLoweredName, "nvrtcGetLoweredName");
  if (!missing.empty()) {
    return absl::UnavailableError(
        absl::StrCat("NVRTC (libnvrtc.so) could not be loaded: the library lacks ",
                     absl::StrJoin(missing, ", "), " (too old?); install the CUDA toolkit"));
  }

  Dl_info info{};
  c->library_path_ =
      dladdr(reinterpret_cast<void*>(api.CompileProgram), &info) != 0 && info.dli_fname
          ? info.dli_fname
          : candidates.front();
  if (api.Version(&c->major_, &c->minor_) != NVRTC_SUCCESS) {
    return absl::UnavailableError("NVRTC (libnvrtc.so) could not be loaded: nvrtcVersion failed");
  }
  int n = 0;
  if (api.GetNumSupportedArchs(&n) == NVRTC_SUCCESS && n > 0) {
    c->supported_archs_.resize(n);
    if (api.GetSupportedArchs(c->supported_archs_.data()) != NVRTC_SUCCESS)
      c->supported_archs_.clear();
  }
  if (options.archs.empty()) return absl::InvalidArgumentError("NvrtcOptions.archs is empty");
  for (const std::string& a : options.archs) OPJIT_RETURN_IF_ERROR(c->CheckArch(a));

  c->toolchain_id_ =
      absl::StrCat(c->Version(), ";lib=", c->library_path_, ";cuda_root=", options.cuda_root,
                   ";include=", absl::StrJoin(options.extra_include_dirs, ":"),
                   ";archs=", absl::StrJoin(options.archs, ","));
  log->info("NVRTC {}.{} loaded from {}; default archs {}", c->major_, c->minor_, c->library_path_,
            absl::StrJoin(options.archs, ","));
  if (!options.worker_path.empty()) {
    // The first compile's sandbox starts now.
    if (auto spare = c->StartSandbox(); spare.ok()) {
      MutexLock lock(&c->spare_mu_);
      c->spare_ = *spare;
    }
  }
  return c;
}

std::string NvrtcCompiler::Version() const { return absl::StrCat("nvrtc ", major_, ".", minor_); }

absl::Status NvrtcCompiler::CheckArch(const std::string& arch) const {
  OPJIT_ASSIGN_OR_RETURN(ParsedArch p, ParseArch(arch));
  if (!supported_archs_.empty() &&
      std::find(supported_archs_.begin(), supported_archs_.end(), p.sm) == supported_archs_.end()) {
    std::vector<std::string> names;
    for (int s : supported_archs_) names.push_back(absl::StrCat("sm_", s));
    return absl::InvalidArgumentError(
        absl::StrCat("GPU arch ", arch, " is not supported by ", Version(),
                     " (supported: ", absl::StrJoin(names, " "), ")"));
  }
  return absl::OkStatus();
}

namespace {

// Maps a failed NVRTC call to a status naming the call.
absl::Status NvrtcError(const NvrtcCompiler::Api& api, nvrtcResult r, const char* call,
                        const std::string& log) {
  const char* name = api.GetErrorString(r);
  std::string what =
      absl::StrCat(call, " failed: ", name != nullptr ? name : "unknown NVRTC error");
  if (!log.empty()) absl::StrAppend(&what, "\n", log);
  switch (r) {
    case NVRTC_ERROR_COMPILATION:
      // Under the sandbox's RLIMIT_AS, NVRTC may report running out of
      // memory as a compile error of the source ("catastrophic error: out of
      // memory"). That is the limit, not a bug in the kernel: say so.
      if (log.find("catastrophic error: out of memory") != std::string::npos) {
        return absl::ResourceExhaustedError(
            "the GPU compile ran out of memory (the compile sandbox's memory limit); "
            "simplify the source (its macro or template expansion) or ask the "
            "operator to raise [compiler] memory_limit_mb");
      }
      return WithReason(absl::InvalidArgumentError(absl::StrCat("compile failed:\n", log)),
                        reason::kCompileFailed);
    case NVRTC_ERROR_INVALID_OPTION:
    case NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID:
    case NVRTC_ERROR_INVALID_INPUT:
      return absl::InvalidArgumentError(what);
    case NVRTC_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(what);
    default:
      return absl::InternalError(what);
  }
}

absl::StatusOr<CompileResult> CompileOne(const NvrtcCompiler::Api& api,
                                         const GpuCompileRequest& request,
                                         const std::vector<std::string>& options,
                                         const std::string& target, bool want_cubin) {
  nvrtcProgram prog = nullptr;
  std::vector<const char*> header_texts, header_names;
  for (const auto& [name, content] : request.headers) {
    header_names.push_back(name.c_str());
    header_texts.push_back(content.c_str());
  }
  nvrtcResult r = api.CreateProgram(
      &prog, request.source.c_str(), request.file_name.c_str(),
      static_cast<int>(request.headers.size()),
      header_texts.empty() ? nullptr : header_texts.data(),
      header_names.empty() ? nullptr : header_names.data());
  if (r != NVRTC_SUCCESS) return NvrtcError(api, r, "nvrtcCreateProgram", "");
  ProgramGuard guard(&api, prog);
  for (const std::string& e : request.name_expressions) {
    r = api.AddNameExpression(prog, e.c_str());
    if (r != NVRTC_SUCCESS) return NvrtcError(api, r, "nvrtcAddNameExpression", "");
  }
  std::vector<const char*> argv;
  std::string arch_opt = "--gpu-architecture=" + target;
  argv.push_back(arch_opt.c_str());
  for (const std::string& o : options) argv.push_back(o.c_str());
  const nvrtcResult compiled = api.CompileProgram(prog, static_cast<int>(argv.size()), argv.data());

  CompileResult out;
  size_t log_size = 0;
  if (api.GetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    std::string log(log_size, '\0');
    if (api.GetProgramLog(prog, log.data()) == NVRTC_SUCCESS) out.log = Trim(std::move(log));
  }
  if (compiled != NVRTC_SUCCESS) return NvrtcError(api, compiled, "nvrtcCompileProgram", out.log);

  size_t size = 0;
  r = api.GetPTXSize(prog, &size);
  if (r != NVRTC_SUCCESS) return NvrtcError(api, r, "nvrtcGetPTXSize", "");
  out.ptx.assign(size, '\0');
  r = api.GetPTX(prog, out.ptx.data());
  if (r != NVRTC_SUCCESS) return NvrtcError(api, r, "nvrtcGetPTX", "");
  while (!out.ptx.empty() && out.ptx.back() == '\0') out.ptx.pop_back();  // size counts the NUL

  if (want_cubin) {
    r = api.GetCUBINSize(prog, &size);
    if (r != NVRTC_SUCCESS) return NvrtcError(api, r, "nvrtcGetCUBINSize", "");
    if (size == 0) return absl::InternalError(absl::StrCat("NVRTC produced no CUBIN for ", target));
    out.cubin.assign(size, '\0');
    r = api.GetCUBIN(prog, out.cubin.data());
    if (r != NVRTC_SUCCESS) return NvrtcError(api, r, "nvrtcGetCUBIN", "");
  }
  for (const std::string& e : request.name_expressions) {
    const char* lowered = nullptr;
    r = api.GetLoweredName(prog, e.c_str(), &lowered);
    if (r != NVRTC_SUCCESS || lowered == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("name expression '", e, "' names no __global__ function or variable"));
    }
    out.lowered_names[e] = lowered;
  }
  return out;
}

}  // namespace

namespace {

// The sandbox's answer: cubins for each arch, PTX and the log. Anything
// longer is refused (the sandbox broke its protocol or NVRTC went wild).
constexpr size_t kMaxAnswerBytes = 256u << 20;
constexpr char kSandboxChannel[] = "GPU compiler sandbox's answer";

// Reads all of `fd` until EOF or `deadline`, keeping at most kMaxAnswerBytes
// and counting the rest in *dropped. False on timeout.
bool ReadAll(int fd, std::string* out, std::chrono::steady_clock::time_point deadline,
             uint64_t* dropped) {
  const absl::Time until =
      absl::Now() + absl::FromChrono(deadline - std::chrono::steady_clock::now());
  // An I/O error ends the answer like EOF: the decoder then says it is short.
  return !absl::IsDeadlineExceeded(
      frame_io::ReadStream(fd, kMaxAnswerBytes, until, out, dropped));
}

}  // namespace

// Both ends use the common codec (server/common/codec.h).
std::string EncodeGpuRequest(const GpuCompileRequest& r) {
  codec::Writer w;
  w.Str(r.source);
  w.Str(r.file_name);
  w.Strs(r.options);
  w.Strs(r.name_expressions);
  w.Strs(r.archs);
  w.U32(static_cast<uint32_t>(r.headers.size()));
  for (const auto& [name, content] : r.headers) {
    w.Str(name);
    w.Str(content);
  }
  return w.Take();
}

bool DecodeGpuRequest(std::string_view in, GpuCompileRequest* r) {
  codec::Reader rd(in, "GPU compiler sandbox's request");
  r->source = rd.Str();
  r->file_name = rd.Str();
  r->options = rd.Strs();
  r->name_expressions = rd.Strs();
  r->archs = rd.Strs();
  const uint32_t headers = rd.Count(8);
  for (uint32_t i = 0; i < headers && rd.ok(); ++i) {
    std::string name = rd.Str();
    std::string content = rd.Str();
    r->headers.emplace_back(std::move(name), std::move(content));
  }
  return rd.done();
}

std::string EncodeGpuResult(const absl::StatusOr<GpuCompileOutput>& r) {
  codec::Writer w;
  w.I32(static_cast<int32_t>(r.status().code()));
  w.Str(std::string(r.status().message()));
  if (!r.ok()) return w.Take();
  w.Count(r->cubins.size());
  for (const auto& [arch, bin] : r->cubins) {
    w.Str(arch);
    w.Str(bin);
  }
  w.Str(r->ptx);
  w.Str(r->ptx_arch);
  w.Count(r->lowered_names.size());
  for (const auto& [expr, name] : r->lowered_names) {
    w.Str(expr);
    w.Str(name);
  }
  w.Str(r->diagnostics);
  w.F64(r->compile_ms);
  return w.Take();
}

absl::StatusOr<GpuCompileOutput> DecodeGpuResult(std::string_view in) {
  codec::Reader rd(in, kSandboxChannel);
  const int32_t c = rd.I32();
  std::string message = rd.Str();
  if (!rd.ok() || c < 0 || c > 16) {
    return absl::InternalError("the NVRTC sandbox sent a malformed answer");
  }
  if (c != 0) {
    if (!rd.done()) return absl::InternalError("the NVRTC sandbox sent a malformed answer");
    return absl::Status(static_cast<absl::StatusCode>(c), message);
  }
  GpuCompileOutput out;
  // Each pair takes at least its two string lengths.
  for (uint32_t i = 0, n = rd.Count(8); rd.ok() && i < n; ++i) {
    std::string arch = rd.Str();
    out.cubins[arch] = rd.Str();
  }
  out.ptx = rd.Str();
  out.ptx_arch = rd.Str();
  for (uint32_t i = 0, n = rd.Count(8); rd.ok() && i < n; ++i) {
    std::string expr = rd.Str();
    out.lowered_names[expr] = rd.Str();
  }
  out.diagnostics = rd.Str();
  out.compile_ms = rd.F64();
  if (!rd.done()) return absl::InternalError("the NVRTC sandbox sent a malformed answer");
  return out;
}
absl::StatusOr<NvrtcCompiler::Sandbox> NvrtcCompiler::StartSandbox() const {
  std::vector<std::string> args = {subprocess::kParentPidFlag,
                                   std::to_string(::getpid()),
                                   "--nvrtc",
                                   "--cuda-root",
                                   options_.cuda_root,
                                   "--nvrtc-path",
                                   library_path_,
                                   "--memory",
                                   std::to_string(options_.memory_limit_bytes),
                                   "--cpu-seconds",
                                   std::to_string(options_.timeout_ms / 1000 + 2),
                                   "--archs",
                                   absl::StrJoin(options_.archs, ",")};
  for (const auto& d : options_.extra_include_dirs) args.insert(args.end(), {"--include", d});
  int in_pipe[2], out_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0) return absl::UnavailableError("pipe failed");
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    return absl::UnavailableError("pipe failed");
  }
  // The request on stdin, the answer on stdout, stderr to /dev/null; its
  // own group, a clean environment, tagged with this daemon's state dir,
  // from the spawn thread (so a spare's PDEATHSIG means the daemon died).
  subprocess::SpawnOptions spawn;
  spawn.path = options_.worker_path;
  spawn.args = std::move(args);
  spawn.env = subprocess::HelperEnvironment();
  spawn.fds = {{0, in_pipe[0]}, {1, out_pipe[1]}};
  spawn.tag_instance = true;
  // Namespaces of its own where the daemon can make them, like the CPU
  // compile workers'.
  subprocess::IsolateHelper(&spawn,
                            subprocess::CompileIds(options_.sandbox_uid, options_.sandbox_gid));
  // Root: the compile uid, never root's (the sandbox drops to it).
  if (options_.sandbox_uid > 0 && ::geteuid() == 0) {
    spawn.args.insert(spawn.args.end(), {"--uid", std::to_string(options_.sandbox_uid)});
  }
  absl::StatusOr<pid_t> pid = subprocess::Spawn(spawn);
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  if (!pid.ok()) {
    ::close(in_pipe[1]);
    ::close(out_pipe[0]);
    return absl::UnavailableError(
        absl::StrCat("cannot start the NVRTC sandbox: ", pid.status().message()));
  }
  return Sandbox{*pid, in_pipe[1], out_pipe[0]};
}

void NvrtcCompiler::Discard(Sandbox& s) {
  if (s.pid <= 0) return;
  if (s.in >= 0) ::close(s.in);
  if (s.out >= 0) ::close(s.out);
  (void)subprocess::Reap(s.pid, absl::ZeroDuration(), /*kill_group=*/true);
  s = Sandbox{};
}

NvrtcCompiler::~NvrtcCompiler() {
  MutexLock lock(&spare_mu_);
  Discard(spare_);
}

absl::StatusOr<GpuCompileOutput> NvrtcCompiler::Compile(const GpuCompileRequest& request) const {
  if (options_.worker_path.empty()) return CompileHere(request);
  // Arch errors are answered here, without a process.
  for (const std::string& a : request.archs) OPJIT_RETURN_IF_ERROR(CheckArch(a));
  // Every compile gets a fresh process; the spare one was started ahead of
  // time (NVRTC loaded, sandbox closed), and a new spare starts now.
  Sandbox sb;
  {
    MutexLock lock(&spare_mu_);
    std::swap(sb, spare_);
    if (auto next = StartSandbox(); next.ok()) spare_ = *next;
  }
  if (sb.pid <= 0) {
    OPJIT_ASSIGN_OR_RETURN(sb, StartSandbox());
  }
  const std::string payload = EncodeGpuRequest(request);
  // A sandbox that died early gives EPIPE, which the result below reports.
  ::signal(SIGPIPE, SIG_IGN);
  for (size_t off = 0; off < payload.size();) {
    ssize_t n = ::write(sb.in, payload.data() + off, payload.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  ::close(sb.in);
  sb.in = -1;
  std::string answer;
  uint64_t dropped = 0;
  const bool finished = ReadAll(sb.out, &answer,
                                std::chrono::steady_clock::now() +
                                    std::chrono::milliseconds(options_.timeout_ms),
                                &dropped);
  ::close(sb.out);
  sb.out = -1;
  // Stopped at the deadline; one that answered gets a few seconds to exit.
  absl::StatusOr<subprocess::Exit> ended = subprocess::Reap(
      sb.pid, finished ? absl::Seconds(5) : absl::ZeroDuration(), /*kill_group=*/true);
  const int status = ended.ok() ? ended->wait_status : 0;
  if (!finished) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the GPU compile ran past ", options_.timeout_ms, " ms and was stopped"));
  }
  if (WIFSIGNALED(status) || answer.empty()) {
    const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (sig == SIGKILL || sig == SIGSEGV || sig == SIGABRT) {
      // NVRTC under RLIMIT_AS dies in many ways when memory runs out.
      return absl::ResourceExhaustedError(absl::StrCat(
          "the GPU compiler died (signal ", sig, "), most likely out of memory (limit ",
          options_.memory_limit_bytes >> 20, " MiB)"));
    }
    return absl::InternalError(absl::StrCat("the GPU compiler's sandbox ended without an answer (",
                                            WIFEXITED(status) ? "exit " : "signal ",
                                            WIFEXITED(status) ? WEXITSTATUS(status) : sig, ")"));
  }
  if (dropped > 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the GPU compiler's answer was over ", kMaxAnswerBytes >> 20, " MiB (", dropped,
        " bytes more); refused"));
  }
  return DecodeGpuResult(answer);
}

absl::StatusOr<GpuCompileOutput> NvrtcCompiler::CompileHere(const GpuCompileRequest& request) const {
  const auto start = std::chrono::steady_clock::now();
  auto log = Logger("gpu");
  std::vector<std::string> archs = request.archs.empty() ? options_.archs : request.archs;
  for (const std::string& a : archs) OPJIT_RETURN_IF_ERROR(CheckArch(a));
  // Lowest first; the lowest one also gives the PTX.
  std::stable_sort(archs.begin(), archs.end(), [](const std::string& a, const std::string& b) {
    return *ArchNumber(a) < *ArchNumber(b);
  });
  archs.erase(std::unique(archs.begin(), archs.end()), archs.end());

  std::vector<std::string> options;
  options.push_back("-I" + options_.cuda_root + "/include");
  for (const std::string& d : options_.extra_include_dirs) options.push_back("-I" + d);
  if (!HasStdOption(request.options)) options.push_back("--std=c++17");
  options.insert(options.end(), request.options.begin(), request.options.end());

  GpuCompileOutput out;
  std::vector<std::pair<std::string, std::string>> logs;  // target -> log
  for (size_t i = 0; i < archs.size(); ++i) {
    OPJIT_ASSIGN_OR_RETURN(CompileResult r, CompileOne(*api_, request, options, archs[i], true));
    out.cubins[archs[i]] = std::move(r.cubin);
    if (i == 0) {
      out.lowered_names = std::move(r.lowered_names);
      // A plain sm_NN compile emits PTX for .target sm_NN, byte for byte what
      // a compute_NN compile emits (checked with NVRTC 13.0), so it saves a
      // compile. Arch-specific targets (sm_90a) need the generic one.
      if (ParseArch(archs[i])->suffix.empty()) {
        out.ptx = std::move(r.ptx);
        out.ptx_arch = "compute_" + std::to_string(*ArchNumber(archs[i]));
      }
    }
    if (!r.log.empty()) logs.emplace_back(archs[i], std::move(r.log));
  }
  if (out.ptx.empty()) {
    const std::string target = "compute_" + std::to_string(*ArchNumber(archs[0]));
    OPJIT_ASSIGN_OR_RETURN(CompileResult r, CompileOne(*api_, request, options, target, false));
    out.ptx = std::move(r.ptx);
    out.ptx_arch = target;
    if (!r.log.empty()) logs.emplace_back(target, std::move(r.log));
  }
  // Warnings come once per arch and are usually the same: keep each distinct
  // log once, labelled by arch only when they differ.
  bool all_same = true;
  for (const auto& [target, text] : logs) all_same = all_same && text == logs.front().second;
  if (all_same && !logs.empty()) {
    out.diagnostics = logs.front().second;
  } else {
    for (const auto& [target, text] : logs)
      absl::StrAppend(&out.diagnostics, "[", target, "]\n", text, "\n");
  }
  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log->debug("nvrtc compiled {} for {} in {:.1f} ms", request.file_name, absl::StrJoin(archs, ","),
             out.compile_ms);
  if (!out.diagnostics.empty())
    log->trace("nvrtc log for {}:\n{}", request.file_name, out.diagnostics);
  return out;
}

}  // namespace opjit::gpu

#include "server/gpu/nvrtc_compiler.h"

#include <dlfcn.h>
#include <unistd.h>
#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/common/codec.h"
#include "server/common/error_info.h"
#include "server/common/frame_io.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/common/subprocess.h"
#include "server/gpu/nvrtc_pool.h"

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
  bool pch_used = false, pch_created = false;
};

// The options that make NVRTC keep automatic PCHs in `dir`. Its messages
// say when a PCH was made or used (TakePchMessages removes them from the
// log); why one could not be used, and that the PCH heap was too small
// (warning 639), it keeps to itself: a compile's diagnostics stay the same.
std::vector<std::string> PchOptions(const std::string& dir) {
  return {"-pch", "--pch-dir=" + dir, "--pch-verbose=false", "--pch-messages=true",
          "--diag-suppress=639"};
}

// Removes NVRTC's PCH messages ("\"kernel.cu\": using precompiled header
// file \"...\"") from `log`, noting which it saw.
void TakePchMessages(const std::string& file_name, CompileResult* r) {
  const std::string prefix = absl::StrCat("\"", file_name, "\": ");
  std::string kept;
  for (absl::string_view line : absl::StrSplit(r->log, '\n')) {
    if (absl::StartsWith(line, prefix)) {
      const absl::string_view rest = line.substr(prefix.size());
      const bool used = absl::StartsWith(rest, "using precompiled header file \"");
      const bool created = absl::StartsWith(rest, "creating precompiled header file \"");
      r->pch_used |= used;
      r->pch_created |= created;
      if (used || created) continue;
    }
    if (!kept.empty()) kept += '\n';
    kept.append(line.data(), line.size());
  }
  r->log = Trim(std::move(kept));
}

// Whether a failed compile's log may blame the PCH rather than the source:
// an error of the whole compile, with no place in a file ("Catastrophic
// error: error while writing PCH file: No space left on device",
// "Command-line error: invalid PCH directory"), as a source's errors have.
bool PchFailure(absl::string_view message) {
  for (absl::string_view line : absl::StrSplit(message, '\n')) {
    if (absl::StartsWith(line, "Catastrophic error:") ||
        absl::StartsWith(line, "Command-line error:")) {
      return true;
    }
  }
  return false;
}

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
    NvrtcPoolOptions p;
    p.worker_path = options.worker_path;
    p.args = c->WorkerArgs();
    p.workers = std::max(1, options.workers);
    p.timeout_ms = options.timeout_ms;
    p.memory_limit_bytes = options.memory_limit_bytes;
    p.recycle_after_compiles = options.recycle_after_compiles;
    p.recycle_memory_bytes = options.recycle_memory_bytes;
    p.uid = options.sandbox_uid;
    p.gid = options.sandbox_gid;
    c->pool_ = std::make_unique<NvrtcPool>(std::move(p));
    c->pool_->StartSpare();  // the first compile's worker starts now
  }
  return c;
}

NvrtcCompiler::~NvrtcCompiler() = default;

bool NvrtcCompiler::HasPch() const { return major_ > 12 || (major_ == 12 && minor_ >= 8); }

NvrtcStats NvrtcCompiler::GetStats() const { return pool_ ? pool_->GetStats() : NvrtcStats{}; }

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
  TakePchMessages(request.file_name, &out);
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
  w.I32(r->pch_used);
  w.I32(r->pch_created);
  return w.Take();
}

absl::StatusOr<GpuCompileOutput> DecodeGpuResult(std::string_view in) {
  codec::Reader rd(in, "GPU compiler sandbox's answer");
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
  out.pch_used = rd.I32();
  out.pch_created = rd.I32();
  if (!rd.done()) return absl::InternalError("the NVRTC sandbox sent a malformed answer");
  return out;
}

std::vector<std::string> NvrtcCompiler::WorkerArgs() const {
  std::vector<std::string> args = {subprocess::kParentPidFlag,
                                   std::to_string(::getpid()),
                                   "--nvrtc-worker",
                                   "--cuda-root",
                                   options_.cuda_root,
                                   "--nvrtc-path",
                                   library_path_,
                                   "--memory",
                                   std::to_string(options_.memory_limit_bytes),
                                   "--cpu-seconds",
                                   std::to_string(options_.timeout_ms / 1000 + 2),
                                   "--archs",
                                   absl::StrJoin(options_.archs, ","),
                                   "--pch-bytes",
                                   std::to_string(HasPch() ? options_.pch_bytes : 0)};
  for (const auto& d : options_.extra_include_dirs) args.insert(args.end(), {"--include", d});
  return args;
}

namespace {

// The diagnostics of a compile from the logs of its targets, in order:
// warnings come once per arch and are usually the same, so each distinct log
// is kept once, labelled by target only when they differ.
std::string MergeLogs(const std::vector<std::pair<std::string, std::string>>& logs) {
  bool all_same = true;
  for (const auto& [target, text] : logs) all_same = all_same && text == logs.front().second;
  if (all_same) return logs.empty() ? std::string() : logs.front().second;
  std::string out;
  for (const auto& [target, text] : logs) absl::StrAppend(&out, "[", target, "]\n", text, "\n");
  return out;
}

// Compile() of two archs, one per worker, at once: what CompileArchs would
// have made of both (the first arch's PTX and lowered names; its error
// first).
absl::StatusOr<GpuCompileOutput> CompileSplit(const GpuCompileRequest& request,
                                              const std::vector<std::string>& archs,
                                              NvrtcPool::Lease& first, NvrtcPool::Lease& second) {
  GpuCompileRequest low = request, high = request;
  low.archs = {archs[0]};
  high.archs = {archs[1]};
  absl::StatusOr<GpuCompileOutput> b;
  std::thread other([&] { b = second.Compile(high); });
  absl::StatusOr<GpuCompileOutput> a = first.Compile(low);
  other.join();
  if (!a.ok()) return a;
  if (!b.ok()) return b.status();
  std::vector<std::pair<std::string, std::string>> logs;
  if (!a->diagnostics.empty()) logs.emplace_back(archs[0], a->diagnostics);
  if (!b->diagnostics.empty()) logs.emplace_back(archs[1], b->diagnostics);
  a->diagnostics = MergeLogs(logs);
  a->cubins.merge(b->cubins);
  a->compile_ms = std::max(a->compile_ms, b->compile_ms);
  a->pch_used += b->pch_used;
  a->pch_created += b->pch_created;
  return a;
}

}  // namespace

std::vector<std::string> NvrtcCompiler::Targets(const GpuCompileRequest& request) const {
  std::vector<std::string> archs = request.archs.empty() ? options_.archs : request.archs;
  // Lowest first; the lowest one also gives the PTX.
  std::stable_sort(archs.begin(), archs.end(), [](const std::string& a, const std::string& b) {
    return *ArchNumber(a) < *ArchNumber(b);
  });
  archs.erase(std::unique(archs.begin(), archs.end()), archs.end());
  return archs;
}

absl::StatusOr<GpuCompileOutput> NvrtcCompiler::Compile(const GpuCompileRequest& request) const {
  if (!pool_) return CompileHere(request);
  // Arch errors are answered here, without a worker.
  for (const std::string& a : request.archs) OPJIT_RETURN_IF_ERROR(CheckArch(a));
  OPJIT_ASSIGN_OR_RETURN(NvrtcPool::Lease lease, pool_->Acquire(request.tenant));
  const std::vector<std::string> archs = Targets(request);
  if (archs.size() == 2 && ParseArch(archs[0])->suffix.empty()) {
    if (NvrtcPool::Lease second = pool_->TryAcquire(request.tenant)) {
      pool_->CountSplit();
      return CompileSplit(request, archs, lease, second);
    }
  }
  return lease.Compile(request);
}

absl::StatusOr<GpuCompileOutput> NvrtcCompiler::CompileHere(const GpuCompileRequest& request,
                                                            bool* pch_broke) const {
  if (pch_broke != nullptr) *pch_broke = false;
  for (const std::string& a : request.archs) OPJIT_RETURN_IF_ERROR(CheckArch(a));
  const std::vector<std::string> archs = Targets(request);
  // In-memory headers never meet a PCH: NVRTC would take a PCH made from
  // another content of the same name for theirs.
  const bool pch = !options_.pch_dir.empty() && request.headers.empty() && HasPch();
  absl::StatusOr<GpuCompileOutput> out = CompileArchs(request, archs, pch);
  if (pch && !out.ok() && PchFailure(out.status().message())) {
    if (pch_broke != nullptr) *pch_broke = true;
    Logger("gpu")->debug("nvrtc: a PCH failed ({}); compiling without", out.status().ToString());
    out = CompileArchs(request, archs, false);
  }
  return out;
}

absl::StatusOr<GpuCompileOutput> NvrtcCompiler::CompileArchs(const GpuCompileRequest& request,
                                                             const std::vector<std::string>& archs,
                                                             bool pch) const {
  const auto start = std::chrono::steady_clock::now();
  auto log = Logger("gpu");
  std::vector<std::string> options;
  options.push_back("-I" + options_.cuda_root + "/include");
  for (const std::string& d : options_.extra_include_dirs) options.push_back("-I" + d);
  if (!HasStdOption(request.options)) options.push_back("--std=c++17");
  if (pch) {
    std::vector<std::string> p = PchOptions(options_.pch_dir);
    options.insert(options.end(), p.begin(), p.end());
  }
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
    out.pch_used += r.pch_used;
    out.pch_created += r.pch_created;
    if (!r.log.empty()) logs.emplace_back(archs[i], std::move(r.log));
  }
  if (out.ptx.empty()) {
    const std::string target = "compute_" + std::to_string(*ArchNumber(archs[0]));
    OPJIT_ASSIGN_OR_RETURN(CompileResult r, CompileOne(*api_, request, options, target, false));
    out.ptx = std::move(r.ptx);
    out.ptx_arch = target;
    out.pch_used += r.pch_used;
    out.pch_created += r.pch_created;
    if (!r.log.empty()) logs.emplace_back(target, std::move(r.log));
  }
  out.diagnostics = MergeLogs(logs);
  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log->debug("nvrtc compiled {} for {} in {:.1f} ms", request.file_name, absl::StrJoin(archs, ","),
             out.compile_ms);
  if (!out.diagnostics.empty())
    log->trace("nvrtc log for {}:\n{}", request.file_name, out.diagnostics);
  return out;
}

}  // namespace opjit::gpu

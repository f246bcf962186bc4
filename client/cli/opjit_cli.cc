// opjit: the command-line client of opjitd.
//
//   opjit [--server ADDR] [--json] [--timeout SECONDS] COMMAND [ARGS]
//
// Each command takes its own flags (FlagsByCommand); an unknown one is bad
// usage. Exit status: 0 success, 1 the server refused or failed the call (its
// message goes to stderr), 2 bad usage, 3 a gradcheck mismatch.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cpp/npy.h"
#include "client/cpp/opjit_client.h"
#include "server/common/error_info.h"
#include "server/common/random.h"
#include "server/common/sha256.h"
#include "client/cpp/shm_region.h"

namespace {

using opjit::client::Client;

constexpr const char kUsage[] =
    R"(usage: opjit [--server ADDR] [--json] [--timeout SECONDS] COMMAND [ARGS]

Commands:
  info                              server version, CPU target, GPU availability
  register SPEC.json [--namespace NS]
                                    register an op from a JSON spec (opjit.v1.OpDef);
                                    warnings go to stderr
  ops [--namespace NS] [--all-versions]
                                    list ops (latest versions unless --all-versions)
  describe NAME [--version N]       show an op's full definition
  delete NAME [--version N]         delete an op (all versions unless --version)
  compile FILE [--lang c|c++|cuda] [--entry SYM] [--option OPT]... [--library LIB]...
       [--name-expr EXPR]... [--arch sm_NN]... [--aot] [--namespace NS]
                                    compile a kernel source without registering it.
                                    .cu: nvcc (a shared object) with --aot or when the
                                    source has host code (a <<<>>> launch, an extern "C"
                                    host function); NVRTC (CUBIN+PTX) otherwise, and
                                    always with --name-expr unless --aot
  run OP --in X.npy [--in ...] [--attr NAME=VALUE]... [--out Y.npy]...
       [--version N] [--target cpu|gpu] [--transport auto|shm|inline]
                                    run an op's forward on .npy files; one --in per
                                    declared input (a,b.npy for a dynamic input,
                                    "none" for an absent optional one)
  grad OP --in X.npy [--in ...] [--attr NAME=VALUE]... --grad-out DY.npy [--grad-out ...]
       [--out DX.npy]... [--no-grad INDEX]... [--version N] [--target cpu|gpu]
                                    forward with requires_grad, then backward: writes
                                    one input grad per --out (inputs in --no-grad get none)
  gradcheck OP [--in X.npy ...] [--attr NAME=VALUE]... [--shape 4,3] [--seed N]
       [--eps E] [--atol A] [--rtol R] [--version N]
                                    compare the op's backward with central finite
                                    differences; exit 0 pass, 3 mismatch, 1 error
  cache stats | stats               compile-cache counters (admins)
  cache clear [--memory-only]       drop cached kernels (admins)
  token                             print a new bearer token and the sha256 line
                                    for a [[principal]] in opjitd's config (offline)
  help                              this text (also --help, -h, COMMAND --help)

NAME may be qualified with a namespace: ns/name (default namespace "default").
ADDR: unix:/path.sock, /path.sock or host:port, or several of them
comma-separated (the first that answers; the next when it stops answering,
for calls safe to repeat). Default: $OPJIT_SERVER, else
the daemon's default socket ($OPJIT_STATE_DIR or ~/.opjit)/opjitd.sock.
$OPJIT_TOKEN is sent as "authorization: Bearer <token>"; with $OPJIT_TLS_CA
set, TCP goes over TLS checked against that CA.
Exit status: 0 success; 1 the server refused or failed the call (its message
goes to stderr); 2 bad usage; 3 gradcheck mismatch.
)";

struct Globals {
  std::string server;
  bool json = false;
  double timeout_s = 120;
};

int UsageError(const std::string& msg) {
  std::cerr << "opjit: " << msg << "\n\n" << kUsage;
  return 2;
}

std::string g_address;  // for error messages

// Whether `s` says the server could not be reached (no answer from opjitd),
// rather than opjitd answering UNAVAILABLE itself (no GPU, no compiler).
bool Unreachable(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kUnavailable || opjit::GetReason(s).has_value()) return false;
  for (const char* what : {"failed to connect", "Connection refused", "No such file",
                           "connections to all backends failing", "Socket closed",
                           "DNS resolution failed", "Connection reset", "Broken pipe"}) {
    if (std::string(s.message()).find(what) != std::string::npos) return true;
  }
  return false;
}

int Fail(const absl::Status& s) {
  std::cerr << "opjit: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  if (Unreachable(s) && !g_address.empty()) {
    std::cerr << "opjit: is opjitd running at " << g_address
              << "? Start it with `make run`, or pass --server / set OPJIT_SERVER\n";
  }
  return 1;
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  return out;
}

void SplitName(const std::string& qualified, std::string* ns, std::string* name) {
  auto slash = qualified.find('/');
  if (slash == std::string::npos) {
    *ns = "";
    *name = qualified;
  } else {
    *ns = qualified.substr(0, slash);
    *name = qualified.substr(slash + 1);
  }
}

// Parses "--flag value" / "--flag=value" options after the command; the rest
// are positional. Flags in `bool_flags` take no value.
struct Args {
  std::vector<std::string> positional;
  std::multimap<std::string, std::string> flags;
  std::string Get(const std::string& k, const std::string& def = "") const {
    auto it = flags.find(k);
    return it == flags.end() ? def : it->second;
  }
  std::vector<std::string> All(const std::string& k) const {
    std::vector<std::string> out;
    for (auto [it, end] = flags.equal_range(k); it != end; ++it) out.push_back(it->second);
    return out;
  }
  bool Has(const std::string& k) const { return flags.count(k) > 0; }
};

// The flags each command takes: those that take a value, then switches.
struct CommandFlags {
  std::vector<std::string> value_flags, bool_flags;
};

const std::map<std::string, CommandFlags>& FlagsByCommand() {
  static const auto* const kFlags = new std::map<std::string, CommandFlags>{
      {"info", {}},
      {"register", {{"--namespace"}, {}}},
      {"ops", {{"--namespace"}, {"--all-versions"}}},
      {"describe", {{"--version"}, {}}},
      {"delete", {{"--version"}, {}}},
      {"compile",
       {{"--lang", "--entry", "--option", "--library", "--name-expr", "--arch", "--namespace"},
        {"--aot"}}},
      {"run", {{"--in", "--attr", "--out", "--version", "--target", "--transport"}, {}}},
      {"grad", {{"--in", "--attr", "--grad-out", "--out", "--no-grad", "--version", "--target"}, {}}},
      {"gradcheck",
       {{"--in", "--attr", "--shape", "--seed", "--eps", "--atol", "--rtol", "--version"}, {}}},
      {"cache", {{}, {"--memory-only"}}},
      {"stats", {}},
      {"token", {}},
      {"help", {}},
  };
  return *kFlags;
}

absl::StatusOr<Args> ParseArgs(const std::string& cmd, const std::vector<std::string>& argv,
                               const std::vector<std::string>& value_flags,
                               const std::vector<std::string>& bool_flags) {
  Args a;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (s.rfind("--", 0) != 0) {
      a.positional.push_back(s);
      continue;
    }
    std::string key = s, value;
    bool has_eq = false;
    if (auto eq = s.find('='); eq != std::string::npos) {
      key = s.substr(0, eq);
      value = s.substr(eq + 1);
      has_eq = true;
    }
    if (std::find(bool_flags.begin(), bool_flags.end(), key) != bool_flags.end()) {
      a.flags.emplace(key, "1");
    } else if (std::find(value_flags.begin(), value_flags.end(), key) != value_flags.end()) {
      if (!has_eq) {
        if (i + 1 >= argv.size()) return absl::InvalidArgumentError(key + " needs a value");
        value = argv[++i];
      }
      a.flags.emplace(key, value);
    } else {
      std::vector<std::string> known = value_flags;
      known.insert(known.end(), bool_flags.begin(), bool_flags.end());
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown option ", key, " for `", cmd, "`",
          known.empty() ? " (it takes none)" : absl::StrCat(" (it takes ", absl::StrJoin(known, ", "), ")")));
    }
  }
  return a;
}

// --target: "CPU" or "GPU" (any case), or "" when not given.
absl::StatusOr<std::string> ParseTarget(const Args& a) {
  if (!a.Has("--target")) return std::string();
  std::string t = a.Get("--target");
  for (char& ch : t) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (t != "CPU" && t != "GPU") {
    return absl::InvalidArgumentError("--target takes cpu or gpu, got \"" + a.Get("--target") + "\"");
  }
  return t;
}

// An error from a call that ran on `target`, with what to try when the GPU
// is not usable.
int FailOn(const std::string& target, const absl::Status& s) {
  int rc = Fail(s);
  if (target == "GPU" && s.code() == absl::StatusCode::kUnavailable && !Unreachable(s)) {
    std::cerr << "opjit: the op could not run on the GPU; `opjit info` shows the server's GPU "
                 "status. Without --target (or with --target cpu) it runs on the CPU, if the op "
                 "has a CPU implementation\n";
  }
  return rc;
}

int64_t ParseVersion(const Args& a) { return std::stoll(a.Get("--version", "0")); }

void PrintOpSummary(const opjit::v1::OpRecord& r) {
  const auto& op = r.op();
  std::vector<std::string> targets;
  for (const auto& im : op.implementations()) targets.push_back(im.target());
  std::printf("%-10s %-28s v%-4lld %-8s in=%d out=%d attrs=%d  %s\n", op.namespace_().c_str(),
              op.name().c_str(), static_cast<long long>(r.version()),
              absl::StrJoin(targets, ",").c_str(), op.inputs_size(), op.outputs_size(),
              op.attrs_size(), op.doc().substr(0, op.doc().find('\n')).c_str());
}

void PrintCompile(const opjit::v1::CompileResponse& c) {
  // A GPU compile by NVRTC always has PTX; nvcc's shared object has none.
  const std::string gpu_compiler =
      c.target() == "GPU" ? (c.ptx_arch().empty() ? "nvcc shared object: " : "NVRTC: ") : "";
  std::printf("%s key %s%s  %s\n", c.target().c_str(), c.cache_key().substr(0, 16).c_str(),
              c.archs_size()
                  ? absl::StrCat(" (", gpu_compiler, absl::StrJoin(c.archs(), ", "), ")").c_str()
                  : "",
              c.cache_hit().empty()
                  ? absl::StrCat("compiled in ", static_cast<int>(c.compile_ms()), " ms").c_str()
                  : absl::StrCat(c.cache_hit(), " cache hit").c_str());
  if (!c.diagnostics().empty()) std::fprintf(stderr, "%s", c.diagnostics().c_str());
}

// Warnings from the server (RegisterOpResponse, OpRecord), each to stderr
// as "warning: ...".
void PrintWarnings(const google::protobuf::RepeatedPtrField<std::string>& warnings) {
  for (const auto& w : warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
}

int CmdInfo(Client& c, const Globals& g) {
  auto info = c.Info();
  if (!info.ok()) return Fail(info.status());
  if (g.json) {
    std::cout << ToJson(*info);
    return 0;
  }
  std::printf("opjitd %s (kernel ABI %d), pid %d, up %.1f s\n", info->version().c_str(),
              info->kernel_abi_version(), info->pid(), info->uptime_ms() / 1000.0);
  std::printf("state dir: %s\n", info->state_dir().c_str());
  std::printf("listening: %s\n", absl::StrJoin(info->listen(), ", ").c_str());
  std::printf("CPU:       %s, %s\n", info->cpu().triple().c_str(), info->cpu().cpu().c_str());
  std::printf("features:  %s\n", info->cpu().features().c_str());
  std::printf("compiler:  %s\n", info->cpu().compiler().c_str());
  if (info->gpu().available()) {
    std::printf("GPU:       %s\n", absl::StrJoin(info->gpu().devices(), ", ").c_str());
  } else {
    std::printf("GPU:       unavailable: %s\n", info->gpu().reason().c_str());
  }
  std::printf("ops:       %lld\n", static_cast<long long>(info->ops()));
  return 0;
}

int CmdRegister(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("register takes one SPEC file");
  auto spec = opjit::client::LoadOpSpec(a.positional[0]);
  if (!spec.ok()) return Fail(spec.status());
  if (a.Has("--namespace")) spec->set_namespace_(a.Get("--namespace"));
  auto resp = c.Register(*spec);
  if (!resp.ok()) return Fail(resp.status());
  PrintWarnings(resp->warnings());
  if (g.json) {
    std::cout << ToJson(*resp);
    return 0;
  }
  const auto& r = resp->record();
  std::printf("%s %s/%s version %lld (%s)\n", resp->created() ? "registered" : "unchanged",
              r.op().namespace_().c_str(), r.op().name().c_str(),
              static_cast<long long>(r.version()), r.content_hash().substr(0, 12).c_str());
  for (const auto& comp : resp->compiled()) PrintCompile(comp);
  return 0;
}

int CmdOps(Client& c, const Globals& g, const Args& a) {
  auto ops = c.List(a.Get("--namespace"), a.Has("--all-versions"), false);
  if (!ops.ok()) return Fail(ops.status());
  if (g.json) {
    opjit::v1::ListOpsResponse resp;
    for (const auto& r : *ops) *resp.add_ops() = r;
    std::cout << ToJson(resp);
    return 0;
  }
  if (ops->empty()) std::printf("no ops registered\n");
  for (const auto& r : *ops) PrintOpSummary(r);
  return 0;
}

int CmdDescribe(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("describe takes one NAME");
  std::string ns, name;
  SplitName(a.positional[0], &ns, &name);
  auto r = c.Get(ns, name, ParseVersion(a));
  if (!r.ok()) return Fail(r.status());
  PrintWarnings(r->warnings());
  if (g.json) {
    std::cout << ToJson(*r);
    return 0;
  }
  const auto& op = r->op();
  std::printf("%s/%s version %lld  hash %s\n", op.namespace_().c_str(), op.name().c_str(),
              static_cast<long long>(r->version()), r->content_hash().c_str());
  if (!op.doc().empty()) std::printf("  %s\n", op.doc().c_str());
  for (const auto& p : op.inputs()) {
    std::printf("  input  %d %-12s %s\n", p.index(), p.name().c_str(), p.param_type().c_str());
  }
  for (const auto& p : op.outputs()) {
    std::printf("  output %d %-12s %s\n", p.index(), p.name().c_str(), p.param_type().c_str());
  }
  for (const auto& at : op.attrs()) {
    std::printf("  attr   %-14s %-9s %-9s default=%s\n", at.name().c_str(),
                at.value_type().c_str(), at.param_type().c_str(),
                at.default_value().empty() ? "-" : at.default_value().c_str());
  }
  for (const auto& df : op.dtype_formats()) {
    std::vector<std::string> io;
    for (int i = 0; i < df.dtypes_size(); ++i) {
      io.push_back(absl::StrCat(df.dtypes(i), i < df.formats_size() ? "/" + df.formats(i) : ""));
    }
    std::printf("  dtypes (%s)\n", absl::StrJoin(io, ", ").c_str());
  }
  for (const auto& im : op.implementations()) {
    std::printf("  impl   %s %s entry=%s (%zu bytes of source)\n", im.target().c_str(),
                im.language().c_str(), im.entry().c_str(), im.source().size());
  }
  if (!op.backward().op().empty()) std::printf("  bprop  %s\n", op.backward().op().c_str());
  return 0;
}

int CmdDelete(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("delete takes one NAME");
  std::string ns, name;
  SplitName(a.positional[0], &ns, &name);
  auto n = c.Delete(ns, name, ParseVersion(a));
  if (!n.ok()) return Fail(n.status());
  if (g.json) {
    std::printf("{\"deleted\": %d}\n", *n);
  } else {
    std::printf("deleted %d version(s) of %s\n", *n, a.positional[0].c_str());
  }
  return 0;
}

int CmdCompile(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("compile takes one FILE");
  const std::string& file = a.positional[0];
  std::ifstream in(file, std::ios::binary);
  if (!in) return Fail(absl::NotFoundError("cannot read " + file));
  std::stringstream ss;
  ss << in.rdbuf();
  opjit::v1::CompileRequest req;
  req.set_source(ss.str());
  req.set_file_name(std::filesystem::path(file).filename().string());
  std::string lang = a.Get("--lang");
  if (lang.empty()) {
    const std::string ext = std::filesystem::path(file).extension().string();
    lang = ext == ".c" ? "c" : ext == ".cu" ? "cuda" : "c++";
  }
  req.set_language(lang);
  req.set_target(lang == "cuda" ? "GPU" : "CPU");
  req.set_entry(a.Get("--entry"));
  for (const auto& o : a.All("--option")) req.add_compile_options(o);
  for (const auto& l : a.All("--library")) req.add_libraries(l);
  for (const auto& e : a.All("--name-expr")) req.add_name_expressions(e);
  for (const auto& arch : a.All("--arch")) req.add_archs(arch);
  req.set_aot_shared_object(a.Has("--aot"));
  req.set_namespace_(a.Get("--namespace"));
  auto resp = c.Compile(req);
  if (!resp.ok()) return Fail(resp.status());
  if (g.json) {
    std::cout << ToJson(*resp);
    return 0;
  }
  PrintCompile(*resp);
  return 0;
}

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Reads the --in files into groups (see run); "none" is an absent input.
absl::StatusOr<std::vector<std::vector<opjit::client::NpyArray>>> ReadInputs(const Args& a) {
  std::vector<std::vector<opjit::client::NpyArray>> groups;
  for (const auto& spec : a.All("--in")) {
    std::vector<opjit::client::NpyArray> group;
    if (spec != "none") {
      for (const auto& path : SplitComma(spec)) {
        auto arr = opjit::client::ReadNpy(path);
        if (!arr.ok()) {
          return absl::Status(arr.status().code(), absl::StrCat(path, ": ", arr.status().message()));
        }
        group.push_back(*std::move(arr));
      }
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

absl::Status AddAttrs(const Args& a, google::protobuf::Map<std::string, opjit::v1::AttrValue>* attrs) {
  for (const auto& kv : a.All("--attr")) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError("--attr takes NAME=VALUE, got " + kv);
    }
    (*attrs)[kv.substr(0, eq)] = opjit::client::TextAttr(kv.substr(eq + 1));
  }
  return absl::OkStatus();
}

opjit::client::NpyArray FromTensor(const opjit::v1::Tensor& t) {
  opjit::client::NpyArray arr;
  arr.dtype = t.dtype();
  arr.shape.assign(t.shape().begin(), t.shape().end());
  arr.data = t.inline_data();
  return arr;
}

int CmdRun(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("run takes one OP");
  std::string ns, name;
  SplitName(a.positional[0], &ns, &name);
  auto target = ParseTarget(a);
  if (!target.ok()) return UsageError(std::string(target.status().message()));
  opjit::v1::ForwardRequest req;
  req.set_namespace_(ns);
  req.set_op(name);
  req.set_version(ParseVersion(a));
  req.set_target(*target);

  // Read every input first: a bad file fails before anything reaches the server.
  auto read = ReadInputs(a);
  if (!read.ok()) return Fail(read.status());
  auto& groups = *read;
  uint64_t total = 0;
  for (const auto& group : groups) {
    for (const auto& arr : group) total += arr.data.size();
  }
  if (absl::Status s = AddAttrs(a, req.mutable_attrs()); !s.ok()) {
    return UsageError(std::string(s.message()));
  }

  std::string transport = a.Get("--transport", "auto");
  if (transport == "auto") {
    // Shared memory only when every server is on this host (a unix socket).
    const auto& all = c.addresses();
    transport = std::all_of(all.begin(), all.end(),
                            [](const std::string& a) { return a.rfind("unix:", 0) == 0; })
                    ? "shm"
                    : "inline";
  }
  if (transport != "shm" && transport != "inline") {
    return UsageError("--transport takes auto, shm or inline");
  }

  // With shm: one region holds the inputs, and the server places the outputs
  // after them (room for twice the inputs); reading them back is a memcpy.
  std::unique_ptr<opjit::client::ShmMapping> mapping;
  const std::string region = absl::StrCat("cli-", getpid());
  uint64_t outputs_at = 0;
  if (transport == "shm") {
    const uint64_t size = 2 * total + (groups.size() + 8) * 64 + (1 << 20);
    auto info = c.CreateRegion(ns, region, size);
    if (!info.ok()) return Fail(info.status());
    auto m = opjit::client::ShmMapping::Open(info->shm_key(), info->byte_size());
    if (!m.ok()) return Fail(m.status());
    mapping = *std::move(m);
  }
  uint64_t cursor = 0;
  for (auto& group : groups) {
    auto* arg = req.add_inputs();
    for (auto& arr : group) {
      if (mapping) {
        std::memcpy(mapping->data() + cursor, arr.data.data(), arr.data.size());
        *arg->add_tensors() = opjit::client::ShmTensor(arr.dtype, arr.shape, region, cursor);
        cursor = (cursor + arr.data.size() + 63) / 64 * 64;
      } else {
        *arg->add_tensors() = opjit::client::InlineTensor(arr.dtype, arr.shape, arr.data);
      }
    }
  }
  if (mapping) {
    outputs_at = cursor;
    req.add_outputs()->mutable_alloc_in()->set_region(region);
    req.mutable_outputs(0)->mutable_alloc_in()->set_offset(outputs_at);
  }
  auto resp = c.Forward(req);
  if (mapping) (void)c.UnregisterRegion(ns, region);
  if (!resp.ok()) return FailOn(*target, resp.status());

  const auto outs = a.All("--out");
  if (outs.size() > static_cast<size_t>(resp->outputs_size())) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "the op has ", resp->outputs_size(), " output(s) but ", outs.size(), " --out were given")));
  }
  for (int j = 0; j < resp->outputs_size(); ++j) {
    const auto& t = resp->outputs(j);
    opjit::client::NpyArray arr;
    arr.dtype = t.dtype();
    arr.shape.assign(t.shape().begin(), t.shape().end());
    if (t.has_shm()) {
      uint64_t n = 1;
      for (int64_t d : arr.shape) n *= static_cast<uint64_t>(d);
      auto elem = opjit::client::NpyDtypeSize(arr.dtype);
      if (!elem.ok()) return Fail(elem.status());
      n *= *elem;
      if (!mapping || t.shm().offset() + n > mapping->size()) {
        return Fail(absl::InternalError("the server placed an output outside the region"));
      }
      arr.data.assign(reinterpret_cast<const char*>(mapping->data()) + t.shm().offset(), n);
    } else {
      arr.data = t.inline_data();
    }
    if (j < static_cast<int>(outs.size())) {
      if (absl::Status s = opjit::client::WriteNpy(outs[j], arr); !s.ok()) return Fail(s);
    }
    if (!g.json) {
      std::printf("output %d: %s %s%s\n", j, arr.dtype.c_str(), ShapeString(t.shape()).c_str(),
                  j < static_cast<int>(outs.size()) ? (" -> " + outs[j]).c_str() : "");
    }
  }
  if (g.json) {
    std::printf("{\"version\": %lld, \"kernel_ms\": %.3f, \"server_ms\": %.3f, \"outputs\": %d}\n",
                static_cast<long long>(resp->version()), resp->kernel_ms(), resp->server_ms(),
                resp->outputs_size());
  } else {
    std::printf("%s v%lld%s: kernel %.3f ms, server %.3f ms (%s)\n", a.positional[0].c_str(),
                static_cast<long long>(resp->version()), target->empty() ? "" : (" on " + *target).c_str(),
                resp->kernel_ms(), resp->server_ms(), transport.c_str());
  }
  return 0;
}

int CmdGrad(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("grad takes one OP");
  std::string ns, name;
  SplitName(a.positional[0], &ns, &name);
  auto target = ParseTarget(a);
  if (!target.ok()) return UsageError(std::string(target.status().message()));
  auto groups = ReadInputs(a);
  if (!groups.ok()) return Fail(groups.status());
  opjit::v1::ForwardRequest req;
  req.set_namespace_(ns);
  req.set_op(name);
  req.set_version(ParseVersion(a));
  req.set_target(*target);
  if (absl::Status s = AddAttrs(a, req.mutable_attrs()); !s.ok()) return UsageError(std::string(s.message()));
  std::set<int> no_grad;
  for (const auto& i : a.All("--no-grad")) no_grad.insert(std::stoi(i));
  for (size_t i = 0; i < groups->size(); ++i) {
    auto* arg = req.add_inputs();
    for (const auto& arr : (*groups)[i]) {
      *arg->add_tensors() = opjit::client::InlineTensor(arr.dtype, arr.shape, arr.data);
    }
    req.add_requires_grad(!no_grad.count(static_cast<int>(i)));
  }
  auto fwd = c.Forward(req);
  if (!fwd.ok()) return FailOn(*target, fwd.status());
  if (fwd->context_id().empty()) {
    return Fail(absl::FailedPreconditionError("no input requires a grad, so there is no backward"));
  }
  opjit::v1::BackwardRequest breq;
  breq.set_namespace_(ns);
  breq.set_context_id(fwd->context_id());
  for (const auto& path : a.All("--grad-out")) {
    if (path == "none") {
      breq.add_grad_outputs();
      continue;
    }
    auto arr = opjit::client::ReadNpy(path);
    if (!arr.ok()) return Fail(absl::Status(arr.status().code(), absl::StrCat(path, ": ", arr.status().message())));
    *breq.add_grad_outputs() = opjit::client::InlineTensor(arr->dtype, arr->shape, arr->data);
  }
  auto bwd = c.Backward(breq);
  if (!bwd.ok()) return FailOn(*target, bwd.status());
  const auto outs = a.All("--out");
  for (int i = 0; i < bwd->grad_inputs_size(); ++i) {
    const auto& group = bwd->grad_inputs(i);
    if (group.tensors_size() == 0) {
      if (!g.json) std::printf("grad %d: none (no grad required)\n", i);
      continue;
    }
    const auto arr = FromTensor(group.tensors(0));
    if (i < static_cast<int>(outs.size()) && outs[i] != "none") {
      if (absl::Status s = opjit::client::WriteNpy(outs[i], arr); !s.ok()) return Fail(s);
    }
    if (!g.json) {
      std::printf("grad %d: %s %s%s\n", i, arr.dtype.c_str(), ShapeString(group.tensors(0).shape()).c_str(),
                  i < static_cast<int>(outs.size()) ? (" -> " + outs[i]).c_str() : "");
    }
  }
  if (g.json) std::cout << ToJson(*bwd);
  return 0;
}

int CmdGradCheck(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("gradcheck takes one OP");
  std::string ns, name;
  SplitName(a.positional[0], &ns, &name);
  auto groups = ReadInputs(a);
  if (!groups.ok()) return Fail(groups.status());
  opjit::v1::GradCheckRequest req;
  req.set_namespace_(ns);
  req.set_op(name);
  req.set_version(ParseVersion(a));
  if (absl::Status s = AddAttrs(a, req.mutable_attrs()); !s.ok()) return UsageError(std::string(s.message()));
  for (const auto& group : *groups) {
    auto* arg = req.add_inputs();
    for (const auto& arr : group) {
      *arg->add_tensors() = opjit::client::InlineTensor(arr.dtype, arr.shape, arr.data);
    }
  }
  if (a.Has("--shape")) {
    for (const auto& d : SplitComma(a.Get("--shape"))) req.add_random_shape(std::stoll(d));
  }
  req.set_seed(std::stoull(a.Get("--seed", "0")));
  req.set_eps(std::stod(a.Get("--eps", "0")));
  req.set_atol(std::stod(a.Get("--atol", "0")));
  req.set_rtol(std::stod(a.Get("--rtol", "0")));
  auto r = c.GradCheck(req);
  if (!r.ok()) return Fail(r.status());
  if (g.json) {
    std::cout << ToJson(*r);
  } else {
    std::printf("gradcheck %s (%s): %s\n", a.positional[0].c_str(), r->dtype().c_str(),
                r->passed() ? "PASS" : "FAIL");
    std::printf("  %-12s %-12s %-12s %-6s %s\n", "input", "max abs err", "max rel err", "ok",
                "worst (analytic vs numeric)");
    for (const auto& in : r->inputs()) {
      std::printf("  %-12s %-12.3g %-12.3g %-6s [%lld] %.6g vs %.6g\n", in.name().c_str(),
                  in.max_abs_error(), in.max_rel_error(), in.passed() ? "yes" : "NO",
                  static_cast<long long>(in.worst_index()), in.analytic(), in.numeric());
    }
    std::printf("  %s\n", r->message().c_str());
  }
  return r->passed() ? 0 : 3;
}

int CmdCache(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("cache takes `stats` or `clear`");
  if (a.positional[0] == "stats") {
    if (a.Has("--memory-only")) return UsageError("--memory-only goes with `cache clear`");
    auto s = c.CacheStats();
    if (!s.ok()) return Fail(s.status());
    if (g.json) {
      std::cout << ToJson(*s);
      return 0;
    }
    std::printf("memory: %llu entries, %.1f KiB, %llu hits, %llu misses\n",
                (unsigned long long)s->memory_entries(), s->memory_bytes() / 1024.0,
                (unsigned long long)s->memory_hits(), (unsigned long long)s->memory_misses());
    std::printf("disk:   %llu entries, %.1f KiB, %llu hits, %llu misses, %llu corrupt\n",
                (unsigned long long)s->disk_entries(), s->disk_bytes() / 1024.0,
                (unsigned long long)s->disk_hits(), (unsigned long long)s->disk_misses(),
                (unsigned long long)s->disk_corrupt());
    std::printf("compiles: %llu (%llu failed), %.1f ms total; %llu waited on a shared compile\n",
                (unsigned long long)s->compiles(), (unsigned long long)s->compile_failures(),
                s->compile_ms_total(), (unsigned long long)s->single_flight_joins());
    return 0;
  }
  if (a.positional[0] == "clear") {
    auto n = c.ClearCache(a.Has("--memory-only"));
    if (!n.ok()) return Fail(n.status());
    if (g.json) {
      std::printf("{\"removed\": %llu}\n", (unsigned long long)*n);
    } else {
      std::printf("removed %llu cache entries\n", (unsigned long long)*n);
    }
    return 0;
  }
  return UsageError("cache takes `stats` or `clear`");
}

}  // namespace

int main(int argc, char** argv) {
  Globals g;
  int i = 1;
  for (; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--help" || s == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (s == "--json") {
      g.json = true;
    } else if (s == "--server" || s == "--timeout") {
      if (i + 1 >= argc) return UsageError(s + " needs a value");
      const std::string v = argv[++i];
      if (s == "--server") {
        g.server = v;
      } else {
        g.timeout_s = std::atof(v.c_str());
        if (g.timeout_s <= 0) return UsageError("--timeout needs a positive number of seconds");
      }
    } else if (s.rfind("--server=", 0) == 0) {
      g.server = s.substr(9);
    } else if (s.rfind("--timeout=", 0) == 0) {
      g.timeout_s = std::atof(s.c_str() + 10);
      if (g.timeout_s <= 0) return UsageError("--timeout needs a positive number of seconds");
    } else if (s.rfind("--", 0) == 0) {
      return UsageError("unknown option " + s);
    } else {
      break;
    }
  }
  if (i >= argc) return UsageError("no command");
  const std::string cmd = argv[i++];
  std::vector<std::string> rest(argv + i, argv + argc);
  const auto flags = FlagsByCommand().find(cmd);
  if (flags == FlagsByCommand().end()) return UsageError("unknown command " + cmd);
  if (cmd == "help" || std::find(rest.begin(), rest.end(), "--help") != rest.end() ||
      std::find(rest.begin(), rest.end(), "-h") != rest.end()) {
    std::cout << kUsage;
    return 0;
  }
  // --json is accepted after the command too, as scripts tend to put it there.
  if (auto it = std::find(rest.begin(), rest.end(), "--json"); it != rest.end()) {
    g.json = true;
    rest.erase(it);
  }
  auto args = ParseArgs(cmd, rest, flags->second.value_flags, flags->second.bool_flags);
  if (!args.ok()) return UsageError(std::string(args.status().message()));
  if ((cmd == "info" || cmd == "ops" || cmd == "stats" || cmd == "token") &&
      !args->positional.empty()) {
    return UsageError(absl::StrCat(cmd, " takes no arguments, got \"", args->positional[0], "\""));
  }

  if (cmd == "token") {
    auto a = opjit::RandomHex128();
    auto b = opjit::RandomHex128();
    if (!a.ok() || !b.ok()) return Fail(a.ok() ? b.status() : a.status());
    const std::string token = *a + *b;
    std::cout << "token:        " << token << "\n"
              << "token_sha256: [\"" << opjit::Sha256Hex(token) << "\"]   # for opjitd's [[principal]]\n";
    return 0;
  }
  if (cmd == "stats") args->positional = {"stats"};
  // One call per process: opening a fast channel (starting its executor)
  // would cost more than it saves, so the CLI stays on gRPC unless
  // OPJIT_FAST says otherwise.
  auto client = Client::Connect({.address = g.server,
                                 .timeout = std::chrono::milliseconds(
                                     static_cast<int64_t>(g.timeout_s * 1000)),
                                 .fast = std::getenv("OPJIT_FAST") != nullptr ? "" : "off"});
  if (!client.ok()) return Fail(client.status());
  Client& c = **client;
  g_address = absl::StrJoin(c.addresses(), ",");
  try {
    if (cmd == "info") return CmdInfo(c, g);
    if (cmd == "register") return CmdRegister(c, g, *args);
    if (cmd == "ops") return CmdOps(c, g, *args);
    if (cmd == "describe") return CmdDescribe(c, g, *args);
    if (cmd == "delete") return CmdDelete(c, g, *args);
    if (cmd == "compile") return CmdCompile(c, g, *args);
    if (cmd == "cache" || cmd == "stats") return CmdCache(c, g, *args);
    if (cmd == "run") return CmdRun(c, g, *args);
    if (cmd == "grad") return CmdGrad(c, g, *args);
    if (cmd == "gradcheck") return CmdGradCheck(c, g, *args);
  } catch (const std::exception& e) {  // std::stoll on a bad --version
    return UsageError(std::string("bad argument: ") + e.what());
  }
  return UsageError("unknown command " + cmd);
}

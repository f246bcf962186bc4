// opjit: the command-line client of opjitd.
//
//   opjit [--server ADDR] [--json] [--timeout SECONDS] COMMAND [ARGS]
//
// Every command and flag is one entry of one table (Program()): CLI11 parses
// from it, and the same table gives `opjit COMMAND --help`, the man page
// (`opjit --man`) and the bash completion (`opjit --bash-completion`), which
// the build writes. Exit status: see the kExit* constants (and ExitStatusDoc).
// Errors about the command line, the local files and reaching the server are
// one line on stderr.
#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/cli_docs.h"
#include "client/cpp/npy.h"
#include "client/cpp/opjit_client.h"
#include "client/cpp/shm_region.h"
#include "opjit/version.h"
#include "server/common/error_info.h"
#include "server/common/mutex.h"
#include "server/common/random.h"
#include "server/common/sha256.h"
#include "server/common/shell_word.h"

namespace {

using opjit::ShellWord;
using opjit::client::Client;
using opjit::cli::CommandDoc;
using opjit::cli::FlagDoc;
using opjit::cli::ProgramDoc;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;       // the server refused or failed the call; a local file failed
constexpr int kExitUsage = 2;        // bad command line
constexpr int kExitMismatch = 3;     // gradcheck: backward disagrees with finite differences;
                                     // verify: a case failed (or none ran)
constexpr int kExitNotServing = 4;   // health: the server answered, not SERVING
constexpr int kExitUnreachable = 5;  // health: no answer

constexpr const char kExitStatusDoc[] =
    "Exit status: 0 success; 1 the server refused or failed the call, or a local\n"
    "file could not be read or written (the reason on stderr); 2 bad usage; 3 a\n"
    "gradcheck mismatch, or a verify case that failed; `health` only: 4 the\n"
    "server answered but is not SERVING, 5 no server answered.";

constexpr const char kVerifyDoc[] =
    "Runs CAND and REF on the same inputs the server generates for each case\n"
    "(every --shape, every dtype row, --seeds random cases each and a case of\n"
    "special values) and compares the outputs within the tolerances. Without\n"
    "--against, one given case: its inputs (--in) and the outputs it must give\n"
    "(--expect).\n"
    "\n"
    "SHAPES: one case set, the shape of every input in order, separated by ':'\n"
    "(or ';'), each a comma-separated list of dimensions; [] (or nothing) is a\n"
    "scalar:\n"
    "  --shape 4,5:5       input 0 is [4, 5], input 1 is [5]\n"
    "  --shape 7           one shape: every input of the op is [7]\n"
    "  --shape 3:[]        input 1 is a scalar\n"
    "A SHAPES of one entry is used by the server for every input. Without\n"
    "--shape: the server's edge cases (empty, 1, odd and prime sizes, a large\n"
    "one), the same for every input.\n"
    "\n"
    "Prints one row per case (result, max abs/rel/ulp error, the worst element\n"
    "as output[flat index] with the candidate's and the reference's values),\n"
    "a summary with the seed, and a `reproduce:` command line.\n"
    "Exit status: 0 every case that ran passed; 3 a case failed (or none ran);\n"
    "1 an error (an unknown op: NOT_FOUND).";

constexpr const char kBenchDoc[] =
    "Times OP in the daemon on generated inputs (warm-up runs, then runs until\n"
    "--min-reps and --min-time-ms are both reached, or --max-reps): the median,\n"
    "p10 and p90 of the end-to-end and the kernel time, and the spread\n"
    "(p90 - p10) / median, the machine's noise. With --against, REF runs in\n"
    "alternation in the same run, and the ratio OP/REF (kernel time, the median\n"
    "of the per-pair ratios) is printed with its p10 and p90. The whole run\n"
    "counts against --timeout.";

constexpr const char kEnvironmentDoc[] =
    "ADDR: unix:/path.sock, /path.sock or host:port, or several of them\n"
    "comma-separated (the first that answers; the next when it stops answering,\n"
    "for calls safe to repeat). Default: $OPJIT_SERVER, else the daemon's default\n"
    "socket ($OPJIT_STATE_DIR or ~/.opjit)/opjitd.sock.\n"
    "\n"
    "$OPJIT_TOKEN is sent as \"authorization: Bearer <token>\"; with $OPJIT_TLS_CA\n"
    "set, TCP goes over TLS checked against that CA.";

// The whole command line: every command, every flag.
const ProgramDoc& Program() {
  static const ProgramDoc* const kProgram = [] {
    auto* p = new ProgramDoc;
    p->name = "opjit";
    p->summary = "command-line client of opjitd, the JIT kernel daemon";
    p->version = absl::StrCat(OPJIT_VERSION, " (", OPJIT_GIT_REVISION, ")");
    p->globals = {
        {"--server", "ADDR", "the daemon's address (see ENVIRONMENT / ADDR below)"},
        {"--json", "", "print protobuf's JSON, for scripts (also accepted after the command)"},
        {"--timeout", "SECONDS", "per-call deadline; default 120"},
        {"--version", "", "print the version and git revision, and exit"},
    };
    const FlagDoc ns{"--namespace", "NS", ""};
    const FlagDoc in{"--in", "X.npy",
                     "an input, one per declared input in order: a.npy,b.npy for a dynamic "
                     "input, none for an absent optional one",
                     "", true, true};
    const FlagDoc attr{"--attr", "NAME=VALUE", "an attribute of the op", "", false, true};
    const FlagDoc version{"--version", "N", "the op version (default: the latest)"};
    const FlagDoc target{"--target", "cpu|gpu",
                         "which implementation runs; no GPU is a clear UNAVAILABLE, exit 1",
                         "cpu gpu"};
    const FlagDoc against_version{"--against-version", "N",
                                  "the reference's version (default: the latest)"};
    auto with_help = [](FlagDoc f, std::string help) {
      f.help = std::move(help);
      return f;
    };
    p->commands = {
        {"info", "", "", "", false,
         "server version, CPU target, GPU availability, registry backend and cache tiers",
         "", {}},
        {"health", "", "", "", false, "a grpc.health.v1 check, with an exit status for scripts",
         "Exit status: 0 SERVING; 4 the server answered NOT_SERVING (or UNKNOWN);\n"
         "5 no server answered within --timeout (default here: 5 s); 1 the server\n"
         "refused the check (an unknown --service: NOT_FOUND). The check sends no\n"
         "token: the health service answers anyone, as probes need.",
         {{"--service", "NAME", "the service to check; default \"\" (the whole server)"}}},
        {"register", "SPEC.json", "an op spec (opjit.v1.OpDef as JSON)", "", true,
         "register an op from a JSON spec; server warnings go to stderr", "",
         {with_help(ns, "register into NS, overriding the spec's namespace")}},
        {"ops", "", "", "", false, "list ops (latest versions unless --all-versions)", "",
         {with_help(ns, "list one namespace"),
          {"--all-versions", "", "every version, not just the latest"}}},
        {"describe", "NAME", "the op: name or ns/name (default namespace \"default\")", "", false,
         "show an op's full definition; warnings go to stderr", "",
         {with_help(version, "one version (default: the latest)")}},
        {"delete", "NAME", "the op: name or ns/name", "", false,
         "delete an op (every version unless --version)", "",
         {with_help(version, "delete only version N")}},
        {"unquarantine", "NAME", "the op: name or ns/name", "", false,
         "lift an op's quarantine, every version (admins)",
         "A kernel whose executor crashed [exec] quarantine_after times in a row is\n"
         "refused (FAILED_PRECONDITION, KERNEL_QUARANTINED) until this, or until the\n"
         "op is registered again (even with the identical definition).",
         {}},
        {"compile", "FILE", "the kernel source", "", true,
         "compile a kernel source without registering it",
         ".cu: nvcc (a shared object) with --aot or when the source has host code\n"
         "(a <<<>>> launch, an extern \"C\" host function); NVRTC (CUBIN+PTX)\n"
         "otherwise, and always with --name-expr unless --aot.",
         {{"--lang", "c|c++|cuda",
           "default from the extension (.c, .cu, else c++); cuda means the GPU", "c c++ cuda"},
          {"--entry", "SYM", "the object must define SYM (CPU)"},
          {"--option", "OPT", "a compile option", "", false, true},
          {"--library", "LIB", "an allowed library to link", "", false, true},
          {"--name-expr", "EXPR",
           "an NVRTC name expression to lower (keeps the compile on NVRTC unless --aot)", "",
           false, true},
          {"--arch", "sm_NN", "GPU arch (default: the server's)", "", false, true},
          {"--aot", "",
           "force nvcc (a MindSpore aot .cu to a shared object); a .cu with host code goes "
           "to nvcc anyway"},
          with_help(ns, "whose compile quota is charged")}},
        {"run", "OP", "the op: name or ns/name", "", false,
         "run an op's forward on .npy files",
         "--transport auto uses a shared-memory region when every server is on a\n"
         "unix socket, inline bytes otherwise.",
         {in, attr,
          {"--out", "Y.npy", "where output j goes (the j-th --out)", "", true, true},
          version, target,
          {"--transport", "auto|shm|inline", "how tensors travel (default auto)",
           "auto shm inline"}}},
        {"grad", "OP", "the op: name or ns/name", "", false,
         "forward with requires_grad, then backward; writes one input grad per --out",
         "Without --grad-out every output's gradient is ones (MindSpore's default\n"
         "sensitivity, as ms.grad uses), said on stderr.",
         {in, attr,
          {"--grad-out", "DY.npy",
           "the gradient of forward output j (none for a missing one; default: ones for all)",
           "", true, true},
          {"--out", "DX.npy", "where input i's gradient goes (none skips it)", "", true, true},
          {"--no-grad", "INDEX", "an input that needs no gradient", "", false, true}, version,
          target}},
        {"gradcheck", "OP", "the op: name or ns/name", "", false,
         "compare the op's backward with central finite differences",
         "Exit status: 0 the backward matches, 3 it does not, 1 an error.",
         {with_help(in, "an input (default: random inputs)"), attr,
          {"--shape", "4,3", "shape of the random inputs"},
          {"--seed", "N", "seed of the random inputs"},
          {"--eps", "E", "the finite-difference step"},
          {"--atol", "A", "absolute tolerance"},
          {"--rtol", "R", "relative tolerance"}, version}},
        {"verify", "CAND", "the candidate op: name or ns/name, op@N for version N", "", false,
         "check an op against a reference op on generated inputs, case by case",
         kVerifyDoc,
         {{"--against", "REF",
           "the reference op: name, ns/name or op@N (in the candidate's namespace)"},
          against_version,
          with_help(version, "the candidate's version (default: the latest)"),
          {"--shape", "SHAPES", "the inputs' shapes of one case set: 4,5:5 (see below)", "",
           false, true},
          {"--dtype", "DTYPE", "only this dtype row (the first input's dtype)", "", false, true},
          {"--seeds", "COUNT", "random cases per shape and dtype (default 2)"},
          {"--seed", "SEED", "the base seed (default: a fresh one, printed)"},
          {"--low", "LOW", "random values from LOW (with --high)"},
          {"--high", "HIGH", "random values up to HIGH (with --low)"},
          {"--no-special", "", "no case with NaN, Inf, -0.0, denormals, max and lowest"},
          {"--atol", "A", "absolute tolerance (default: the dtype's)"},
          {"--rtol", "R", "relative tolerance (default: the dtype's)"},
          {"--ulps", "COUNT", "units in the last place allowed (default: the dtype's)"},
          {"--fp64-reference", "", "run the reference in float64 where it accepts float64"},
          {"--inplace", "NAME", "an input the candidate may change (in-place ops)", "", false,
           true},
          {"--settle-ms", "MS", "wait before outputs are read again (default 10)"},
          attr,
          with_help(in, "an input of a given case (instead of --against)"),
          {"--expect", "Y.npy", "output j of the given case (with --in)", "", true, true}}},
        {"bench", "OP", "the op: name or ns/name, op@N for version N", "", false,
         "time an op in the daemon (and a reference in alternation)", kBenchDoc,
         {{"--against", "REF",
           "a reference op to time in alternation: name, ns/name or op@N (the op's namespace)"},
          against_version,
          version,
          {"--shape", "SHAPES", "the inputs' shapes, as verify's (default: every input [1048576])"},
          {"--dtype", "DTYPE", "the dtype row (the first input's dtype; default: the first row)"},
          {"--warmup", "COUNT", "untimed runs first (default 5)"},
          {"--min-reps", "COUNT", "at least this many timed runs (default 10)"},
          {"--max-reps", "COUNT", "at most this many timed runs (default 1000)"},
          {"--min-time-ms", "MS", "time for at least this long (default 500)"},
          {"--flush-cache", "", "sweep the last-level cache before every run (cold runs)"},
          {"--seed", "SEED", "the inputs' seed"},
          attr}},
        {"cache", "ACTION", "stats (counters) or clear (drop cached kernels)", "stats clear",
         false, "compile-cache counters, or drop cached kernels (admins)", "",
         {{"--memory-only", "", "with clear: keep the disk cache"}}},
        {"stats", "", "", "", false, "compile-cache counters (as `cache stats`; admins)", "", {}},
        {"token", "", "", "", false,
         "print a new bearer token and its sha256 line for opjitd's config (offline)",
         "Prints two lines:\n"
         "  token: <64 hex digits>\n"
         "  token_sha256 = [\"<sha256 of the token>\"]\n"
         "The second line is TOML: paste it into a [[principal]] of opjitd's config.\n"
         "Give the token to the client ($OPJIT_TOKEN); a script takes it with\n"
         "  opjit token | sed -n 's/^token: //p'",
         {}},
        {"help", "COMMAND", "a command", "", false,
         "the overview, or a command's flags (as COMMAND --help)", "", {}},
    };
    std::string names;
    for (const auto& c : p->commands) names += (names.empty() ? "" : " ") + c.name;
    for (auto& c : p->commands) {
      if (c.name == "help") c.positional_choices = names;
      if (c.name != "help") c.flags.push_back({"--json", "", "print protobuf's JSON, for scripts"});
    }
    p->environment = kEnvironmentDoc;
    p->exit_status = kExitStatusDoc;
    return p;
  }();
  return *kProgram;
}

// Value names whose values are numbers, checked before anything is sent.
bool IntegerValue(const std::string& value_name) {
  return value_name == "N" || value_name == "INDEX";
}
bool NumberValue(const std::string& value_name) {
  return value_name == "E" || value_name == "A" || value_name == "R" ||
         value_name == "SECONDS" || value_name == "LOW" || value_name == "HIGH";
}
// Whole numbers from 0: the largest a value name takes (0 for other names).
uint64_t UnsignedMax(const std::string& value_name) {
  if (value_name == "COUNT" || value_name == "MS") return UINT32_MAX;
  if (value_name == "SEED") return UINT64_MAX;
  return 0;
}

struct Globals {
  std::string server;
  bool json = false;
  double timeout_s = 120;
  bool timeout_given = false;
};

std::string g_command;  // the command being run, for messages
std::string g_address;  // the server's address(es), for messages

// Bad usage: one line, naming where to look.
int UsageError(const std::string& msg) {
  std::cerr << "opjit: " << msg << " (see `opjit " << (g_command.empty() ? "" : g_command + " ")
            << "--help`)\n";
  return kExitUsage;
}

// Whether `s` says the server could not be reached (no answer from opjitd),
// rather than opjitd answering UNAVAILABLE itself (no GPU, no compiler).
bool Unreachable(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kUnavailable || opjit::GetReason(s).has_value()) return false;
  for (const char* what : {"failed to connect", "Connection refused", "No such file",
                           "connections to all backends failing", "Socket closed",
                           "DNS resolution failed", "Connection reset", "Broken pipe",
                           "Permission denied", "no opjitd answered", "no answer to a health",
                           "Deadline Exceeded", "Timeout occurred"}) {
    if (std::string(s.message()).find(what) != std::string::npos) return true;
  }
  return false;
}

// What connecting to unix socket `path` says (errno), without gRPC's words.
int UnixConnectErrno(const std::string& path) {
  sockaddr_un sa{};
  if (path.size() >= sizeof(sa.sun_path)) return ENAMETOOLONG;
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.c_str(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  const int err = rc == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

// One line: why `address` did not answer and what to do about it.
std::string UnreachableLine(const std::string& address) {
  constexpr const char kElsewhere[] = "or pass --server / set OPJIT_SERVER";
  if (address.find(',') != std::string::npos) {
    return absl::StrCat("no opjitd answered at any of ", address,
                        ": check that they run and the addresses, ", kElsewhere);
  }
  if (address.rfind("unix:", 0) != 0) {
    return absl::StrCat("cannot reach opjitd at ", address,
                        ": check the address and that opjitd listens there (--listen), ",
                        kElsewhere);
  }
  const std::string path = address.substr(5);
  const bool system = path.rfind("/run/opjit/", 0) == 0;
  switch (UnixConnectErrno(path)) {
    case EACCES:
    case EPERM:
      if (system) {
        return absl::StrCat("permission denied on ", path,
                            ": join the opjit group (sudo usermod -aG opjit $USER, then log in "
                            "again)");
      }
      return absl::StrCat("permission denied on ", path,
                          ": ask the daemon's owner for access (socket_mode, socket_group), ",
                          kElsewhere);
    case ENOENT:
      if (system) {
        return absl::StrCat("no socket at ", path,
                            ": is opjitd running? Start it with `sudo systemctl start opjitd`, ",
                            kElsewhere);
      }
      return absl::StrCat("no socket at ", path,
                          ": is opjitd running? Start it with `make run` (a build tree) or "
                          "`opjitd`, ",
                          kElsewhere);
    case ECONNREFUSED:
      return absl::StrCat("nothing listens on ", path,
                          " (a stale socket): is opjitd running? Start it with `make run` or "
                          "`opjitd`, ",
                          kElsewhere);
    default:
      return absl::StrCat("cannot reach opjitd at ", address, ": is opjitd running? ",
                          "Start it with `make run` or `opjitd`, ", kElsewhere);
  }
}

int Fail(const absl::Status& s) {
  if (Unreachable(s) && !g_address.empty()) {
    std::cerr << "opjit: UNAVAILABLE: " << UnreachableLine(g_address) << "\n";
    return kExitFailed;
  }
  std::cerr << "opjit: " << absl::StatusCodeToString(s.code()) << ": " << s.message();
  if (s.code() == absl::StatusCode::kUnauthenticated) {
    std::cerr << (std::getenv("OPJIT_TOKEN") == nullptr
                      ? " (no token given: set OPJIT_TOKEN)"
                      : " (check OPJIT_TOKEN: `opjit token` makes one, its sha256 goes in the "
                        "daemon's config)");
  }
  std::cerr << "\n";
  return kExitFailed;
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

// A command's parsed arguments: its positional ones and its flags (a switch
// has the value "1"), in the order given.
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

// While a long call runs, on a terminal: "  compiling… 7s" on stderr, once a
// second after the first, erased when the call ends. Nothing when stderr is
// not a terminal.
class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)) {
    if (::isatty(STDERR_FILENO) != 1) return;
    thread_ = std::thread([this] { Run(); });
  }
  ~Progress() {
    if (!thread_.joinable()) return;
    {
      opjit::MutexLock lock(&mu_);
      done_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

 private:
  void Run() {
    const auto start = std::chrono::steady_clock::now();
    bool shown = false;
    opjit::MutexLock lock(&mu_);
    for (int s = 1;; ++s) {
      // cv.wait_until(lock, t, pred): until done_ or t passed; then done_.
      const auto t = start + std::chrono::seconds(s);
      while (!done_ && cv_.WaitUntil(&mu_, t)) {
      }
      if (done_) break;
      std::fprintf(stderr, "\r  %s\u2026 %ds\033[K", what_.c_str(), s);
      std::fflush(stderr);
      shown = true;
    }
    if (shown) {
      std::fputs("\r\033[K", stderr);
      std::fflush(stderr);
    }
  }

  const std::string what_;
  opjit::Mutex mu_;
  opjit::CondVar cv_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

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
  if (target == "GPU" && s.code() == absl::StatusCode::kUnavailable && !Unreachable(s)) {
    std::cerr << "opjit: " << absl::StatusCodeToString(s.code()) << ": " << s.message()
              << " (the op could not run on the GPU; `opjit info` shows the server's GPU status. "
                 "Without --target, or with --target cpu, it runs on the CPU if the op has a CPU "
                 "implementation)\n";
    return kExitFailed;
  }
  return Fail(s);
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
  const std::string metrics = info->metrics_listen().empty()
                                  ? std::string("off")
                                  : absl::StrCat("http://", info->metrics_listen(), "/metrics");
  std::printf("metrics:   %s\n", metrics.c_str());
  std::printf("CPU:       %s, %s\n", info->cpu().triple().c_str(), info->cpu().cpu().c_str());
  std::printf("features:  %s\n", info->cpu().features().c_str());
  std::printf("compiler:  %s\n", info->cpu().compiler().c_str());
  if (info->gpu().available()) {
    std::printf("GPU:       %s\n", absl::StrJoin(info->gpu().devices(), ", ").c_str());
  } else {
    std::printf("GPU:       unavailable: %s\n", info->gpu().reason().c_str());
  }
  std::printf("ops:       %lld\n", static_cast<long long>(info->ops()));
  auto state = [](const opjit::v1::StoreStatus& s) {
    return absl::StrCat(!s.enabled()   ? "off"
                        : !s.checked() ? "not checked yet"
                        : s.reachable() ? "reachable"
                                        : "UNREACHABLE",
                        s.detail().empty() ? "" : " (" + s.detail() + ")");
  };
  if (info->has_registry_store()) {
    std::printf("registry:  %s, %s\n", info->registry_store().name().c_str(),
                state(info->registry_store()).c_str());
  }
  for (const auto& t : info->cache_tiers()) {
    std::printf("cache:     %-6s %s\n", t.name().c_str(), state(t).c_str());
  }
  return 0;
}

int CmdRegister(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("register takes one SPEC file");
  auto spec = opjit::client::LoadOpSpec(a.positional[0]);
  if (!spec.ok()) return Fail(spec.status());
  if (a.Has("--namespace")) spec->set_namespace_(a.Get("--namespace"));
  absl::StatusOr<opjit::v1::RegisterOpResponse> resp;
  {
    Progress progress("registering (compiling its kernels)");
    resp = c.Register(*spec);
  }
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

int CmdUnquarantine(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("unquarantine takes one NAME");
  std::string ns, name;
  SplitName(a.positional[0], &ns, &name);
  auto n = c.ClearQuarantine(ns, name);
  if (!n.ok()) return Fail(n.status());
  if (g.json) {
    std::printf("{\"lifted\": %d}\n", *n);
  } else {
    std::printf("lifted the quarantine of %d kernel(s) of %s\n", *n, a.positional[0].c_str());
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
  absl::StatusOr<opjit::v1::CompileResponse> resp;
  {
    Progress progress("compiling");
    resp = c.Compile(req);
  }
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

// The --in groups (ReadInputs) as inline tensors, one InputArg per group.
void AddInlineInputs(const std::vector<std::vector<opjit::client::NpyArray>>& groups,
                     google::protobuf::RepeatedPtrField<opjit::v1::InputArg>* inputs) {
  for (const auto& group : groups) {
    auto* arg = inputs->Add();
    for (const auto& arr : group) {
      *arg->add_tensors() = opjit::client::InlineTensor(arr.dtype, arr.shape, arr.data);
    }
  }
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
  absl::StatusOr<opjit::v1::ForwardResponse> resp;
  {
    Progress progress("running (a first call compiles)");
    resp = c.Forward(req);
  }
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

// A tensor of ones shaped and typed like `t` (a forward output), inline:
// the default gradient of an output (MindSpore's sensitivity).
absl::StatusOr<opjit::v1::Tensor> OnesLike(const opjit::v1::Tensor& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape()) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  const std::string& dt = t.dtype();
  std::string one;
  auto put = [&one](auto v) { one.assign(reinterpret_cast<const char*>(&v), sizeof v); };
  if (dt == "float32") put(1.0f);
  else if (dt == "float64") put(1.0);
  else if (dt == "float16") put(uint16_t{0x3C00});
  else if (dt == "bfloat16") put(uint16_t{0x3F80});
  else if (dt == "int8" || dt == "uint8" || dt == "bool") put(uint8_t{1});
  else if (dt == "int16" || dt == "uint16") put(uint16_t{1});
  else if (dt == "int32" || dt == "uint32") put(uint32_t{1});
  else if (dt == "int64" || dt == "uint64") put(uint64_t{1});
  else {
    return absl::InvalidArgumentError(absl::StrCat(
        "output dtype ", dt, " has no default gradient of ones: pass --grad-out for each output"));
  }
  std::string bytes;
  bytes.reserve(n * one.size());
  for (uint64_t i = 0; i < n; ++i) bytes += one;
  return opjit::client::InlineTensor(dt, std::vector<int64_t>(t.shape().begin(), t.shape().end()),
                                     std::move(bytes));
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
  absl::StatusOr<opjit::v1::ForwardResponse> fwd;
  {
    Progress progress("running forward (a first call compiles)");
    fwd = c.Forward(req);
  }
  if (!fwd.ok()) return FailOn(*target, fwd.status());
  if (fwd->context_id().empty()) {
    return Fail(absl::FailedPreconditionError("no input requires a grad, so there is no backward"));
  }
  opjit::v1::BackwardRequest breq;
  breq.set_namespace_(ns);
  breq.set_context_id(fwd->context_id());
  const auto grad_outs = a.All("--grad-out");
  if (grad_outs.empty()) {
    // MindSpore's ms.grad (sens_param=False) and torch's backward of a
    // scalar seed every output with ones: so do we, and say so (zeros, the
    // old default, gave all-zero grads without a word).
    std::fprintf(stderr,
                 "--grad-out not given: using ones for every output (MindSpore's default "
                 "sensitivity)\n");
    for (const auto& out : fwd->outputs()) {
      auto ones = OnesLike(out);
      if (!ones.ok()) return Fail(ones.status());
      *breq.add_grad_outputs() = *std::move(ones);
    }
  }
  for (const auto& path : grad_outs) {
    if (path == "none") {
      breq.add_grad_outputs();
      continue;
    }
    auto arr = opjit::client::ReadNpy(path);
    if (!arr.ok()) return Fail(absl::Status(arr.status().code(), absl::StrCat(path, ": ", arr.status().message())));
    *breq.add_grad_outputs() = opjit::client::InlineTensor(arr->dtype, arr->shape, arr->data);
  }
  absl::StatusOr<opjit::v1::BackwardResponse> bwd;
  {
    Progress progress("running backward");
    bwd = c.Backward(breq);
  }
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
  AddInlineInputs(*groups, req.mutable_inputs());
  if (a.Has("--shape")) {
    for (const auto& d : SplitComma(a.Get("--shape"))) req.add_random_shape(std::stoll(d));
  }
  req.set_seed(std::stoull(a.Get("--seed", "0")));
  req.set_eps(std::stod(a.Get("--eps", "0")));
  req.set_atol(std::stod(a.Get("--atol", "0")));
  req.set_rtol(std::stod(a.Get("--rtol", "0")));
  absl::StatusOr<opjit::v1::GradCheckResponse> r;
  {
    Progress progress("checking gradients");
    r = c.GradCheck(req);
  }
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
  return r->passed() ? kExitOk : kExitMismatch;
}

// SHAPES (see kVerifyDoc): "4,5:5" is [4, 5] then [5]; ';' separates too;
// "[]" or nothing is a scalar; brackets around an input's dims are allowed.
absl::StatusOr<opjit::v1::ShapeSet> ParseShapeSet(const std::string& text) {
  opjit::v1::ShapeSet set;
  const std::vector<std::string> inputs = absl::StrSplit(text, absl::ByAnyChar(":;"));
  for (std::string input : inputs) {
    if (input.size() >= 2 && input.front() == '[' && input.back() == ']') {
      input = input.substr(1, input.size() - 2);
    }
    auto* dims = set.add_inputs();
    if (input.empty()) continue;  // a scalar
    for (const std::string& digits : SplitComma(input)) {
      char* end = nullptr;
      errno = 0;
      const int64_t n = std::strtoll(digits.c_str(), &end, 10);
      if (digits.empty() || !std::isdigit(static_cast<unsigned char>(digits[0])) ||
          *end != '\0' || errno != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--shape takes dimensions like 4,5:5 (inputs separated by ':'), got \"", text, "\""));
      }
      dims->add_values(n);
    }
  }
  return set;
}

// An op of verify and bench as the command line names it: "name" or
// "ns/name", either with "@N" for version N (as the reproduce lines write
// it), else the version `version_flag` gives (default: the latest). Sets
// `*ns` (the op's namespace; "" is "default").
absl::StatusOr<opjit::v1::OpVersionRef> OpRef(const std::string& text, const Args& a,
                                              const std::string& version_flag, std::string* ns) {
  opjit::v1::OpVersionRef ref;
  std::string name = text;
  const size_t at = text.rfind('@');
  if (at != std::string::npos) {
    const std::string v = text.substr(at + 1);
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || !std::isdigit(static_cast<unsigned char>(v[0])) || *end != '\0' ||
        errno != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", text, "\": a version after '@' is a whole number, as in op@2"));
    }
    if (a.Has(version_flag)) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", text, "\" names its version: not with ", version_flag));
    }
    ref.set_version(n);
    name = text.substr(0, at);
  } else {
    ref.set_version(std::stoll(a.Get(version_flag, "0")));
  }
  std::string op;
  SplitName(name, ns, &op);
  ref.set_op(op);
  return ref;
}

// The reference of verify and bench (--against): in the namespace `ns` of
// the candidate ("" and "default" are the same), INVALID_ARGUMENT otherwise.
absl::StatusOr<opjit::v1::OpVersionRef> ReferenceRef(const Args& a, const std::string& ns) {
  std::string ref_ns;
  auto ref = OpRef(a.Get("--against"), a, "--against-version", &ref_ns);
  if (!ref.ok()) return ref.status();
  auto plain = [](const std::string& n) { return n.empty() ? std::string("default") : n; };
  if (a.Get("--against").find('/') != std::string::npos && plain(ref_ns) != plain(ns)) {
    return absl::InvalidArgumentError(absl::StrCat("--against ", a.Get("--against"), " is not in ",
                                                   plain(ns), ": the reference must be in the "
                                                   "candidate's namespace"));
  }
  return ref;
}

// Rows of cells, each column as wide as its widest cell, two spaces apart,
// indented by two; the last column is not padded.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], row[i].size());
    }
  }
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t i = 0; i < row.size(); ++i) {
      line += " " + row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 1, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

// An element of `dtype` as the shortest text that reads back as the same
// value (float32 and narrower as floats, so 3 ULPs apart show).
std::string Value(double v, const std::string& dtype) {
  char buf[64];
  const bool narrow = dtype == "float32" || dtype == "float16" || dtype == "bfloat16";
  const auto r = narrow ? std::to_chars(buf, buf + sizeof(buf), static_cast<float>(v))
                        : std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// An error from an evaluation: the deadline it ran past is --timeout's; a
// daemon without the Evaluator service is older than these commands.
int FailEval(const Globals& g, const absl::Status& s) {
  if (opjit::GetReason(s).has_value()) return Fail(s);
  if (s.code() == absl::StatusCode::kDeadlineExceeded) {
    std::cerr << "opjit: DEADLINE_EXCEEDED: " << s.message() << " (the call ran past --timeout, "
              << g.timeout_s << " s: give it more, or fewer cases or repetitions)\n";
    return kExitFailed;
  }
  if (s.code() == absl::StatusCode::kUnimplemented) {
    std::cerr << "opjit: UNIMPLEMENTED: " << s.message() << " (this opjitd has no "
              << "opjit.v1.Evaluator service: it is older than `opjit " << g_command << "`)\n";
    return kExitFailed;
  }
  return Fail(s);
}

// The request of `opjit verify`, or a usage error's message.
absl::StatusOr<opjit::v1::VerifyRequest> VerifyRequestOf(const Args& a) {
  opjit::v1::VerifyRequest req;
  std::string ns;
  auto candidate = OpRef(a.positional[0], a, "--version", &ns);
  if (!candidate.ok()) return candidate.status();
  req.set_namespace_(ns);
  *req.mutable_candidate() = *candidate;
  const bool given = a.Has("--in") || a.Has("--expect");
  if (a.Has("--against") && given) {
    return absl::InvalidArgumentError("--in and --expect give a case to check without a "
                                      "reference: not with --against");
  }
  if (!a.Has("--against") && !given) {
    return absl::InvalidArgumentError(
        "verify needs --against REF (or a given case: --in X.npy ... --expect Y.npy ...)");
  }
  if (a.Has("--against")) {
    auto ref = ReferenceRef(a, ns);
    if (!ref.ok()) return ref.status();
    *req.mutable_reference() = *ref;
  }
  if (a.Has("--low") != a.Has("--high")) {
    return absl::InvalidArgumentError("--low and --high go together");
  }
  if (absl::Status s = AddAttrs(a, req.mutable_attrs()); !s.ok()) return s;
  for (const auto& text : a.All("--shape")) {
    auto set = ParseShapeSet(text);
    if (!set.ok()) return set.status();
    *req.add_shapes() = *std::move(set);
  }
  for (const auto& d : a.All("--dtype")) req.add_dtypes(d);
  for (const auto& n : a.All("--inplace")) req.add_inplace_inputs(n);
  req.set_seeds(std::stoul(a.Get("--seeds", "0")));
  req.set_seed(std::stoull(a.Get("--seed", "0")));
  req.set_low(std::stod(a.Get("--low", "0")));
  req.set_high(std::stod(a.Get("--high", "0")));
  if (a.Has("--no-special")) req.set_special_values(false);
  if (a.Has("--atol")) req.mutable_tolerance()->set_atol(std::stod(a.Get("--atol")));
  if (a.Has("--rtol")) req.mutable_tolerance()->set_rtol(std::stod(a.Get("--rtol")));
  if (a.Has("--ulps")) req.mutable_tolerance()->set_ulps(std::stoll(a.Get("--ulps")));
  req.set_fp64_reference(a.Has("--fp64-reference"));
  req.set_settle_ms(std::stoul(a.Get("--settle-ms", "0")));
  return req;
}

// Reads the given case (--in, --expect) into `req`.
absl::Status AddGivenCase(const Args& a, opjit::v1::VerifyRequest* req) {
  auto groups = ReadInputs(a);
  if (!groups.ok()) return groups.status();
  auto* given = req->add_given();
  AddInlineInputs(*groups, given->mutable_inputs());
  for (const auto& path : a.All("--expect")) {
    auto arr = opjit::client::ReadNpy(path);
    if (!arr.ok()) {
      return absl::Status(arr.status().code(), absl::StrCat(path, ": ", arr.status().message()));
    }
    *given->add_outputs() = opjit::client::InlineTensor(arr->dtype, arr->shape, arr->data);
  }
  return absl::OkStatus();
}

// The daemon's reproduce line knows no file: a given case's --in and
// --expect files (absolute, so the line runs from any directory) are added.
std::string GivenReproduce(const std::string& line, const Args& a) {
  std::string out = line;
  auto absolute = [](const std::string& path) {
    std::error_code ec;
    std::filesystem::path p = std::filesystem::absolute(path, ec);
    return ec ? path : p.string();
  };
  for (const auto& spec : a.All("--in")) {
    std::vector<std::string> paths;
    if (spec == "none") {
      paths.push_back(spec);
    } else {
      for (const auto& path : SplitComma(spec)) paths.push_back(absolute(path));
    }
    absl::StrAppend(&out, " --in ", ShellWord(absl::StrJoin(paths, ",")));
  }
  for (const auto& path : a.All("--expect")) {
    absl::StrAppend(&out, " --expect ", ShellWord(absolute(path)));
  }
  return out;
}

void PrintVerify(const std::string& what, const opjit::v1::VerifyResponse& r) {
  std::vector<std::vector<std::string>> rows = {{"#", "kind", "dtype", "shapes", "result",
                                                 "max abs err", "max rel err", "max ulp",
                                                 "worst", "candidate vs reference", "message"}};
  for (const auto& k : r.cases()) {
    // The worst element says something where the case failed or differed.
    const bool worst = k.worst_index() >= 0 && !k.skipped() &&
                       (!k.passed() || k.max_abs_error() != 0 || k.max_ulp_error() != 0);
    // Its values, where they were compared: a case that failed before
    // (never written, changed after return) says why in its message.
    const bool compared = worst && (k.max_abs_error() != 0 || k.max_ulp_error() != 0 ||
                                    k.max_rel_error() != 0);
    rows.push_back({absl::StrCat(k.index()), k.kind(), k.dtype(), k.shapes(),
                    k.skipped() ? "skip" : k.passed() ? "pass" : "FAIL",
                    k.skipped() ? "-" : Num(k.max_abs_error()),
                    k.skipped() ? "-" : Num(k.max_rel_error()),
                    k.skipped() ? "-" : Num(k.max_ulp_error()),
                    worst ? absl::StrCat("out", k.worst_output(), "[", k.worst_index(), "]") : "-",
                    compared ? absl::StrCat(Value(k.candidate_value(), k.dtype()), " vs ",
                                            Value(k.reference_value(), k.dtype()))
                             : "-",
                    k.message()});
  }
  PrintTable(rows);
  std::printf("verify %s: %s: %d passed, %d failed, %d skipped; %s; seed %llu\n", what.c_str(),
              r.passed() ? "PASS" : "FAIL", r.cases_passed(), r.cases_failed(),
              r.cases_skipped(), r.deterministic() ? "deterministic" : "NOT deterministic",
              static_cast<unsigned long long>(r.seed()));
  if (r.tolerances_size() > 0) {
    std::printf("tolerances: %s\n", absl::StrJoin(r.tolerances(), "; ").c_str());
  }
  if (!r.reproduce().empty()) std::printf("reproduce: %s\n", r.reproduce().c_str());
}

int CmdVerify(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("verify takes one CAND");
  auto req = VerifyRequestOf(a);
  if (!req.ok()) return UsageError(std::string(req.status().message()));
  if (!req->has_reference()) {
    if (absl::Status s = AddGivenCase(a, &*req); !s.ok()) return Fail(s);
  }
  absl::StatusOr<opjit::v1::VerifyResponse> r;
  {
    Progress progress("verifying (a first call compiles)");
    r = c.Verify(*req);
  }
  if (!r.ok()) return FailEval(g, r.status());
  if (!req->has_reference()) r->set_reproduce(GivenReproduce(r->reproduce(), a));
  if (g.json) {
    std::cout << ToJson(*r);
  } else {
    PrintVerify(a.positional[0] + (a.Has("--against") ? " against " + a.Get("--against") : ""),
                *r);
  }
  return r->passed() ? kExitOk : kExitMismatch;
}

void PrintBench(const std::string& op, const std::string& ref,
                const opjit::v1::BenchmarkResponse& r) {
  std::printf("bench %s (%s): %s\n", op.c_str(), r.shapes().c_str(),
              r.flush_bytes() > 0
                  ? absl::StrCat("cache flushed before every run (", Num(r.flush_bytes() / 1048576),
                                 " MiB)")
                        .c_str()
                  : "warm cache");
  std::vector<std::vector<std::string>> rows = {
      {"", "time", "reps", "median ms", "p10 ms", "p90 ms", "spread"}};
  auto add = [&rows](const std::string& who, const opjit::v1::TimingStats& t) {
    rows.push_back({who, "end-to-end", absl::StrCat(t.reps()), Num(t.median_ms()), Num(t.p10_ms()),
                    Num(t.p90_ms()), absl::StrFormat("%.1f%%", 100 * t.spread())});
    rows.push_back({"", "kernel", "", Num(t.kernel_median_ms()), Num(t.kernel_p10_ms()),
                    Num(t.kernel_p90_ms()), ""});
  };
  add(op, r.op());
  if (r.has_reference()) add(ref, r.reference());
  PrintTable(rows);
  if (r.has_reference()) {
    std::printf("ratio %s / %s (kernel time): %s (p10 %s, p90 %s)\n", op.c_str(), ref.c_str(),
                Num(r.ratio()).c_str(), Num(r.ratio_p10()).c_str(), Num(r.ratio_p90()).c_str());
  }
  if (!r.reproduce().empty()) std::printf("reproduce: %s\n", r.reproduce().c_str());
}

int CmdBench(Client& c, const Globals& g, const Args& a) {
  if (a.positional.size() != 1) return UsageError("bench takes one OP");
  opjit::v1::BenchmarkRequest req;
  std::string ns;
  auto op = OpRef(a.positional[0], a, "--version", &ns);
  if (!op.ok()) return UsageError(std::string(op.status().message()));
  req.set_namespace_(ns);
  *req.mutable_op() = *op;
  if (a.Has("--against")) {
    auto ref = ReferenceRef(a, ns);
    if (!ref.ok()) return UsageError(std::string(ref.status().message()));
    *req.mutable_reference() = *ref;
  }
  if (absl::Status s = AddAttrs(a, req.mutable_attrs()); !s.ok()) {
    return UsageError(std::string(s.message()));
  }
  if (a.Has("--shape")) {
    auto set = ParseShapeSet(a.Get("--shape"));
    if (!set.ok()) return UsageError(std::string(set.status().message()));
    *req.mutable_shape() = *std::move(set);
  }
  req.set_dtype(a.Get("--dtype"));
  req.set_seed(std::stoull(a.Get("--seed", "0")));
  req.set_warmup(std::stoul(a.Get("--warmup", "0")));
  req.set_min_reps(std::stoul(a.Get("--min-reps", "0")));
  req.set_max_reps(std::stoul(a.Get("--max-reps", "0")));
  req.set_min_time_ms(std::stoul(a.Get("--min-time-ms", "0")));
  req.set_flush_cache(a.Has("--flush-cache"));
  absl::StatusOr<opjit::v1::BenchmarkResponse> r;
  {
    Progress progress("benchmarking (a first call compiles)");
    r = c.Benchmark(req);
  }
  if (!r.ok()) return FailEval(g, r.status());
  if (g.json) {
    std::cout << ToJson(*r);
  } else {
    PrintBench(a.positional[0], a.Get("--against"), *r);
  }
  return kExitOk;
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


// grpc.health.v1.Health/Check on each address in turn; the first that
// answers decides. The request and the reply are decoded by hand (field 1 of
// each), so no generated health stubs are needed.
int CmdHealth(const Globals& g, const Args& a) {
  const std::string service = a.Get("--service");
  auto client = Client::Connect({.address = g.server, .fast = "off"});
  if (!client.ok()) return UsageError(std::string(client.status().message()));
  const auto addresses = (*client)->addresses();
  g_address = absl::StrJoin(addresses, ",");
  std::shared_ptr<grpc::ChannelCredentials> tls;
  if (const char* ca = std::getenv("OPJIT_TLS_CA"); ca != nullptr && *ca != '\0') {
    std::ifstream in(ca, std::ios::binary);
    std::stringstream pem;
    pem << in.rdbuf();
    if (!in || pem.str().empty()) {
      std::cerr << "opjit: cannot read the TLS CA file " << ca << " (OPJIT_TLS_CA)\n";
      return kExitFailed;
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    tls = grpc::SslCredentials(ssl);
  }
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    for (size_t n = service.size(); ; n >>= 7) {  // varint length
      request.push_back(static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0)));
      if (n < 0x80) break;
    }
    request += service;
  }
  const double timeout_s = g.timeout_given ? g.timeout_s : 5.0;
  for (const std::string& address : addresses) {
    const bool unix_socket = address.rfind("unix:", 0) == 0;
    auto channel = grpc::CreateChannel(
        address, tls != nullptr && !unix_socket ? tls : grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
    grpc::Slice slice(request);
    grpc::ByteBuffer req(&slice, 1), resp;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status s = done.get_future().get();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      continue;  // no answer here: the next address
    }
    if (!s.ok()) {
      g_address = address;
      std::cerr << "opjit: " << absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code()))
                << ": " << address << ": "
                << (s.error_code() == grpc::StatusCode::NOT_FOUND
                        ? absl::StrCat("no service \"", service, "\" in its health checks")
                        : s.error_message())
                << "\n";
      return kExitFailed;
    }
    std::vector<grpc::Slice> slices;
    std::string body;
    if (resp.Dump(&slices).ok()) {
      for (const auto& sl : slices) body.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
    // HealthCheckResponse { ServingStatus status = 1; }: absent is UNKNOWN (0).
    int status = 0;
    if (body.size() >= 2 && body[0] == '\x08') status = static_cast<unsigned char>(body[1]);
    static const char* const kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
    const std::string name = status >= 0 && status < 4 ? kNames[status] : absl::StrCat(status);
    if (g.json) {
      std::printf("{\"address\": \"%s\", \"service\": \"%s\", \"status\": \"%s\"}\n",
                  address.c_str(), service.c_str(), name.c_str());
    } else if (status == 1) {
      std::printf("%s: SERVING\n", address.c_str());
    }
    if (status == 1) return kExitOk;
    if (!g.json) std::cerr << "opjit: " << address << ": " << name << "\n";
    return kExitNotServing;
  }
  std::cerr << "opjit: UNAVAILABLE: " << UnreachableLine(g_address) << "\n";
  return kExitUnreachable;
}

int CmdToken(const Globals& g) {
  auto a = opjit::RandomHex128();
  auto b = opjit::RandomHex128();
  if (!a.ok() || !b.ok()) return Fail(a.ok() ? b.status() : a.status());
  const std::string token = *a + *b;
  const std::string hash = opjit::Sha256Hex(token);
  if (g.json) {
    std::printf("{\"token\": \"%s\", \"token_sha256\": \"%s\"}\n", token.c_str(), hash.c_str());
    return kExitOk;
  }
  // The first line for the client, the second (TOML) for the daemon's config.
  std::printf("token: %s\ntoken_sha256 = [\"%s\"]\n", token.c_str(), hash.c_str());
  return kExitOk;
}

// The CLI11 parser of `doc`: one subcommand per command. Extras are allowed
// everywhere so that they can be reported in the CLI's own words (Parsed()).
struct Parser {
  CLI::App app;
  Globals globals;
  std::string timeout;
  bool version = false, man = false, completion = false;
  std::map<std::string, CLI::App*> commands;
  std::map<const CLI::Option*, const FlagDoc*> flag_of;
  std::map<std::string, CLI::Option*> positional_of;

  explicit Parser(const ProgramDoc& doc) : app(doc.summary, doc.name) {
    auto fmt = std::make_shared<CLI::Formatter>();
    fmt->label("SUBCOMMAND", "COMMAND");
    fmt->column_width(30);
    app.formatter(fmt);
    app.allow_extras();
    app.require_subcommand(0, 1);
    app.footer(absl::StrCat(doc.environment, "\n\n", doc.exit_status));
    for (const auto& f : doc.globals) {
      CLI::Option* o = nullptr;
      if (f.name == "--server") o = app.add_option(f.name, globals.server, f.help);
      if (f.name == "--timeout") o = app.add_option(f.name, timeout, f.help);
      if (f.name == "--json") o = app.add_flag(f.name, globals.json, f.help);
      if (f.name == "--version") o = app.add_flag(f.name, version, f.help);
      if (o != nullptr && !f.value.empty()) o->type_name(f.value);
    }
    // For the build: the man page and the completion script (hidden).
    app.add_flag("--man", man, "")->group("");
    app.add_flag("--bash-completion", completion, "")->group("");
    for (const auto& c : doc.commands) {
      CLI::App* sub = app.add_subcommand(c.name, c.summary);
      sub->allow_extras();
      sub->group("Commands");
      if (!c.details.empty()) sub->footer(c.details);
      if (!c.positional.empty()) {
        CLI::Option* p = sub->add_option(c.positional, c.positional_help)->type_name("");
        if (c.name != "help") p->required();
        positional_of[c.name] = p;
      }
      for (const auto& f : c.flags) {
        CLI::Option* o = nullptr;
        if (f.value.empty()) {
          o = sub->add_flag(f.name)->description(f.help);
          if (f.name == "--json") o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
        } else {
          const std::string help = f.help + (f.repeatable ? " (repeatable)" : "");
          o = sub->add_option(f.name, help)
                  ->type_name(f.value)
                  ->expected(1);
          if (f.repeatable) o->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
        }
        flag_of[o] = &f;
      }
      commands[c.name] = sub;
    }
  }
};

// The parsed command line as (command, Args), or an exit status to return at
// once (help, version, documents, bad usage).
struct Parsed {
  std::string command;
  Args args;
  int exit = -1;  // >= 0: exit with it
};

Parsed Parse(Parser& p, int argc, char** argv) {
  Parsed out;
  try {
    p.app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << p.app.help();
    out.exit = kExitOk;
    return out;
  } catch (const CLI::ParseError& e) {
    const auto subs = p.app.get_subcommands();
    if (!subs.empty()) g_command = subs.front()->get_name();
    std::string what = e.what();
    // CLI11 says "OP is required"; name the command too.
    if (!g_command.empty()) what = absl::StrCat("`", g_command, "`: ", what);
    out.exit = UsageError(what);
    return out;
  }
  if (p.version) {
    std::printf("opjit %s (git %s)\n", OPJIT_VERSION, OPJIT_GIT_REVISION);
    out.exit = kExitOk;
    return out;
  }
  if (p.man || p.completion) {
    std::cout << (p.man ? opjit::cli::ManPage(Program()) : opjit::cli::BashCompletion(Program()));
    out.exit = kExitOk;
    return out;
  }
  for (const std::string& extra : p.app.remaining()) {
    out.exit = UsageError(extra.rfind("-", 0) == 0 ? "unknown option " + extra
                                                   : "unknown command " + extra);
    return out;
  }
  const auto subs = p.app.get_subcommands();
  if (subs.empty()) {
    out.exit = UsageError("no command given");
    return out;
  }
  if (!p.timeout.empty()) {
    char* end = nullptr;
    p.globals.timeout_s = std::strtod(p.timeout.c_str(), &end);
    if (end == p.timeout.c_str() || *end != '\0' || !(p.globals.timeout_s > 0)) {
      out.exit = UsageError("--timeout needs a positive number of seconds, got \"" + p.timeout + "\"");
      return out;
    }
    p.globals.timeout_given = true;
  }
  CLI::App* sub = subs.front();
  out.command = sub->get_name();
  g_command = out.command;
  const CommandDoc* doc = nullptr;
  for (const auto& c : Program().commands) {
    if (c.name == out.command) doc = &c;
  }
  if (auto it = p.positional_of.find(out.command); it != p.positional_of.end()) {
    for (const auto& v : it->second->results()) out.args.positional.push_back(v);
  }
  for (const std::string& extra : sub->remaining()) {
    if (extra.rfind("-", 0) == 0 && extra.size() > 1) {
      std::string known;
      for (const auto& f : doc->flags) {
        if (f.name != "--json") known += (known.empty() ? "" : ", ") + f.name;
      }
      const std::string name = extra.substr(0, extra.find('='));
      if (out.command == "cache" && name == "--memory-only") {
        out.exit = UsageError("--memory-only goes with `cache clear`");
      } else if (name == "--server" || name == "--timeout") {
        out.exit = UsageError(absl::StrCat(name, " goes before the command: opjit ", name,
                                           " ... ", out.command));
      } else {
        out.exit = UsageError(absl::StrCat("unknown option ", name, " for `", out.command, "`",
                                           known.empty() ? " (it takes none)"
                                                         : " (it takes " + known + ")"));
      }
      return out;
    }
    if (doc->positional.empty()) {
      out.exit = UsageError(absl::StrCat(out.command, " takes no arguments, got \"", extra, "\""));
    } else {
      out.exit = UsageError(absl::StrCat(out.command, " takes one ", doc->positional,
                                         ", got another: \"", extra, "\""));
    }
    return out;
  }
  for (const CLI::Option* o : sub->get_options()) {
    auto it = p.flag_of.find(o);
    if (it == p.flag_of.end() || o->count() == 0) continue;
    const FlagDoc& f = *it->second;
    if (f.name == "--json") {
      p.globals.json = true;
      continue;
    }
    if (f.value.empty()) {
      out.args.flags.emplace(f.name, "1");
      continue;
    }
    for (const std::string& v : o->results()) {
      char* end = nullptr;
      if (IntegerValue(f.value)) {
        errno = 0;
        (void)std::strtoll(v.c_str(), &end, 10);
        if (v.empty() || *end != '\0' || errno != 0) {
          out.exit = UsageError(absl::StrCat(f.name, " takes an integer, got \"", v, "\""));
          return out;
        }
      } else if (const uint64_t max = UnsignedMax(f.value); max != 0) {
        errno = 0;
        const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
        if (v.empty() || !std::isdigit(static_cast<unsigned char>(v[0])) || *end != '\0' ||
            errno != 0 || n > max) {
          out.exit = UsageError(absl::StrCat(f.name, " takes a whole number from 0 to ", max,
                                             ", got \"", v, "\""));
          return out;
        }
      } else if (NumberValue(f.value)) {
        (void)std::strtod(v.c_str(), &end);
        if (v.empty() || *end != '\0') {
          out.exit = UsageError(absl::StrCat(f.name, " takes a number, got \"", v, "\""));
          return out;
        }
      } else if (!f.choices.empty() && f.name != "--target") {
        std::vector<std::string> choices = absl::StrSplit(f.choices, ' ');
        if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
          out.exit = UsageError(absl::StrCat(f.name, " takes ", absl::StrJoin(choices, ", "),
                                             "; got \"", v, "\""));
          return out;
        }
      }
      out.args.flags.emplace(f.name, v);
    }
  }
  if (!doc->positional_choices.empty() && out.command != "help" && !out.args.positional.empty()) {
    std::vector<std::string> choices = absl::StrSplit(doc->positional_choices, ' ');
    const std::string& v = out.args.positional[0];
    if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
      out.exit = UsageError(absl::StrCat(out.command, " takes ", absl::StrJoin(choices, " or "),
                                         ", got \"", v, "\""));
      return out;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Parser parser(Program());
  Parsed parsed = Parse(parser, argc, argv);
  if (parsed.exit >= 0) return parsed.exit;
  const Globals& g = parser.globals;
  const std::string& cmd = parsed.command;
  Args& args = parsed.args;

  if (cmd == "help") {
    if (args.positional.empty()) {
      // app.help() would show the selected command's (help's own) help.
      std::cout << parser.app.get_formatter()->make_help(&parser.app, "opjit",
                                                         CLI::AppFormatMode::Normal);
      return kExitOk;
    }
    auto it = parser.commands.find(args.positional[0]);
    if (it == parser.commands.end()) {
      g_command.clear();
      return UsageError("unknown command " + args.positional[0]);
    }
    std::cout << it->second->help("opjit");
    return kExitOk;
  }
  if (cmd == "token") return CmdToken(g);
  if (cmd == "health") return CmdHealth(g, args);
  if (cmd == "stats") args.positional = {"stats"};
  if (cmd == "cache" && args.positional[0] == "stats" && args.Has("--memory-only")) {
    return UsageError("--memory-only goes with `cache clear`");
  }
  // Flags checked before anything reaches the server.
  if (auto target = ParseTarget(args); !target.ok()) {
    return UsageError(std::string(target.status().message()));
  }
  // One call per process: opening a fast channel (starting its executor)
  // would cost more than it saves, so the CLI stays on gRPC unless
  // OPJIT_FAST says otherwise.
  auto client = Client::Connect({.address = g.server,
                                 .timeout = std::chrono::milliseconds(
                                     static_cast<int64_t>(g.timeout_s * 1000)),
                                 .fast = std::getenv("OPJIT_FAST") != nullptr ? "" : "off"});
  if (!client.ok()) return UsageError(std::string(client.status().message()));
  Client& c = **client;
  g_address = absl::StrJoin(c.addresses(), ",");
  try {
    if (cmd == "info") return CmdInfo(c, g);
    if (cmd == "register") return CmdRegister(c, g, args);
    if (cmd == "ops") return CmdOps(c, g, args);
    if (cmd == "describe") return CmdDescribe(c, g, args);
    if (cmd == "delete") return CmdDelete(c, g, args);
    if (cmd == "unquarantine") return CmdUnquarantine(c, g, args);
    if (cmd == "compile") return CmdCompile(c, g, args);
    if (cmd == "cache" || cmd == "stats") return CmdCache(c, g, args);
    if (cmd == "run") return CmdRun(c, g, args);
    if (cmd == "grad") return CmdGrad(c, g, args);
    if (cmd == "gradcheck") return CmdGradCheck(c, g, args);
    if (cmd == "verify") return CmdVerify(c, g, args);
    if (cmd == "bench") return CmdBench(c, g, args);
  } catch (const std::exception& e) {  // a number out of range
    return UsageError(std::string("bad argument: ") + e.what());
  }
  return UsageError("unknown command " + cmd);
}

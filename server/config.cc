#include "server/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <toml++/toml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace opjit {
namespace {

// Collects the problems of one config file: each names the key and, when the
// file set it, its line.
class Checker {
 public:
  explicit Checker(std::string file) : file_(std::move(file)) {}

  // A problem with `key`, located at `node` (nullptr: where the key was set,
  // if it was).
  void Problem(const std::string& key, const std::string& message,
               const toml::node* node = nullptr) {
    int line = 0;
    if (node != nullptr && node->source().begin.line > 0) {
      line = static_cast<int>(node->source().begin.line);
    } else if (auto l = lines_.find(key); l != lines_.end() && !flags_.count(key)) {
      line = l->second;
    }
    problems_.push_back({Where(key, node), key, message, line});
  }
  // A problem with `key` (absent) caused by `cause` (set): located where
  // `cause` was set.
  void ProblemFrom(const std::string& key, const std::string& cause, const std::string& message) {
    const size_t before = problems_.size();
    Problem(cause, message);
    problems_[before].key = key;
  }
  void ParseError(const toml::parse_error& e) {
    // Line 0: the file could not be read at all.
    problems_.push_back({e.source().begin.line == 0
                             ? file_
                             : absl::StrCat(file_, ":", e.source().begin.line, ":",
                                            e.source().begin.column),
                         "", std::string(e.description()),
                         static_cast<int>(e.source().begin.line)});
  }
  // Remembers that `key` was set at `node`'s line.
  void Saw(const std::string& key, const toml::node& node) {
    lines_[key] = static_cast<int>(node.source().begin.line);
  }
  void SawFlag(const std::string& key, const std::string& flag) { flags_[key] = flag; }
  bool Set(const std::string& key) const { return lines_.count(key) || flags_.count(key); }

  std::vector<ConfigProblem> TakeProblems() {
    std::stable_sort(problems_.begin(), problems_.end(),
                     [](const ConfigProblem& a, const ConfigProblem& b) {
                       return (a.line == 0 ? INT_MAX : a.line) < (b.line == 0 ? INT_MAX : b.line);
                     });
    return std::move(problems_);
  }
  bool ok() const { return problems_.empty(); }
  size_t problem_count() const { return problems_.size(); }

 private:
  std::string Where(const std::string& key, const toml::node* node) const {
    if (node != nullptr && node->source().begin.line > 0) {
      return absl::StrCat(file_, ":", node->source().begin.line);
    }
    if (auto f = flags_.find(key); f != flags_.end()) return f->second;
    if (auto l = lines_.find(key); l != lines_.end()) return absl::StrCat(file_, ":", l->second);
    return file_.empty() ? "flags" : file_;
  }

  const std::string file_;
  std::map<std::string, int> lines_;
  std::map<std::string, std::string> flags_;
  std::vector<ConfigProblem> problems_;
};

// Each Parse* reads the value of `name` from `n` into *out, or records a
// problem and leaves *out alone.
template <typename T>
void ParseInt(Checker& ck, const std::string& name, const toml::node& n, T* out, int64_t lo,
              int64_t hi) {
  std::optional<int64_t> v = n.is_integer() ? n.value<int64_t>() : std::nullopt;
  if (!v) return ck.Problem(name, "expected an integer", &n);
  if (*v < lo || *v > hi) {
    if (hi == std::numeric_limits<int64_t>::max() || hi == std::numeric_limits<T>::max()) {
      return ck.Problem(name, absl::StrCat("expected an integer >= ", lo, ", not ", *v), &n);
    }
    return ck.Problem(name, absl::StrCat("expected an integer in [", lo, ", ", hi, "], not ", *v),
                      &n);
  }
  *out = static_cast<T>(*v);
}

void ParseString(Checker& ck, const std::string& name, const toml::node& n, std::string* out) {
  auto v = n.value<std::string>();
  if (!v) return ck.Problem(name, "expected a string", &n);
  *out = *v;
}

void ParseBool(Checker& ck, const std::string& name, const toml::node& n, bool* out) {
  auto v = n.value<bool>();
  if (!v) return ck.Problem(name, "expected true or false", &n);
  *out = *v;
}

void ParseStrings(Checker& ck, const std::string& name, const toml::node& n,
                  std::vector<std::string>* out) {
  const toml::array* arr = n.as_array();
  if (arr == nullptr) return ck.Problem(name, "expected an array of strings", &n);
  std::vector<std::string> values;
  for (const auto& e : *arr) {
    auto v = e.value<std::string>();
    if (!v) return ck.Problem(name, "expected an array of strings", &e);
    values.push_back(*v);
  }
  *out = std::move(values);
}

void ParseDouble(Checker& ck, const std::string& name, const toml::node& n, double* out) {
  std::optional<double> v =
      n.is_integer() || n.is_floating_point() ? n.value<double>() : std::nullopt;
  if (!v || !std::isfinite(*v) || *v < 0) {
    return ck.Problem(name, "expected a non-negative number", &n);
  }
  *out = *v;
}

void ParseIds(Checker& ck, const std::string& name, const toml::node& n,
              std::vector<uint32_t>* out) {
  const toml::array* arr = n.as_array();
  if (arr == nullptr) return ck.Problem(name, "expected an array of integers", &n);
  for (const auto& e : *arr) {
    std::optional<int64_t> v = e.is_integer() ? e.value<int64_t>() : std::nullopt;
    if (!v || *v < 0 || *v > 0xfffffffell) {
      return ck.Problem(name, "expected an array of uids/gids", &e);
    }
    out->push_back(static_cast<uint32_t>(*v));
  }
}

// Records every key of `t` not in `known`; true when there was none.
bool CheckKeys(Checker& ck, const toml::table& t, const std::string& where,
               const std::set<std::string>& known) {
  bool ok = true;
  for (const auto& [k, v] : t) {
    if (!known.count(std::string(k.str()))) {
      ck.Problem(absl::StrCat(where, std::string(k.str())),
                 absl::StrCat("unknown key (known here: ", absl::StrJoin(known, ", "), ")"), &v);
      ok = false;
    }
  }
  return ok;
}

// A section that must be a table, or nullptr (recording the problem when it
// is something else).
const toml::table* Section(Checker& ck, const toml::table& t, const std::string& key,
                           const std::string& where) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return nullptr;
  ck.Saw(absl::StrCat(where, key), *n);
  if (const toml::table* s = n->as_table()) return s;
  ck.Problem(absl::StrCat(where, key), absl::StrCat("expected a table ([", where, key, "])"), n);
  return nullptr;
}

// "\"a\", \"b\" or \"c\"".
std::string OrList(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    absl::StrAppend(&out, "\"", names[i], "\"");
  }
  return out;
}

// The names of an enum's values, in order, and the parse of one.
template <typename E>
struct Choices {
  std::vector<std::pair<std::string, E>> values;

  std::optional<E> Parse(const std::string& text) const {
    for (const auto& [name, value] : values) {
      if (name == text) return value;
    }
    return std::nullopt;
  }
  std::string NameOf(E e) const {
    for (const auto& [name, value] : values) {
      if (value == e) return name;
    }
    return "?";
  }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const auto& [name, value] : values) names.push_back(name);
    return names;
  }
  // What a bad value's problem says: every allowed value.
  std::string Expected(const std::string& text) const {
    return absl::StrCat("expected ", OrList(Names()), ", not \"", text, "\"");
  }
};

const Choices<Isolation>& IsolationChoices() {
  static const Choices<Isolation> kChoices{
      {{"process", Isolation::kProcess}, {"in-daemon", Isolation::kInDaemon}}};
  return kChoices;
}

const Choices<RegistryBackend>& RegistryBackendChoices() {
  static const Choices<RegistryBackend> kChoices{
      {{"sqlite", RegistryBackend::kSqlite}, {"postgres", RegistryBackend::kPostgres}}};
  return kChoices;
}

const std::vector<std::string>& LogLevels() {
  static const std::vector<std::string> kLevels = {"trace", "debug", "info",    "warn",
                                                   "error", "critical", "off"};
  return kLevels;
}

std::string LogLevelExpected(const std::string& level) {
  return absl::StrCat("expected trace, debug, info, warn, error, critical or off, not \"", level,
                      "\"");
}

std::string Join(const std::vector<std::string>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

// One key of the config file: its name ("section.key"), its type and
// meaning (--help-config), how its value is read into a DaemonConfig and
// how it is printed back (SettingsOf, the defaults of --help-config). The
// table of these rows (Keys()) is the only list of keys: the reads, the
// unknown-key check, SettingsOf and --help-config all iterate it.
struct KeyRow {
  std::string key;
  std::string type;
  std::string doc;
  // Stores the value at `n` (set in the file) or records a problem.
  std::function<void(Checker&, const std::string& key, const toml::node& n, DaemonConfig*)> read;
  std::function<std::string(const DaemonConfig&)> print;
  // The default as --help-config shows it, when print(DaemonConfig{}) is not
  // it (a default computed at load).
  std::string shown_default;
  // Another name for a key the table lists too: left out of SettingsOf.
  bool alias = false;

  KeyRow&& Default(std::string text) && {
    shown_default = std::move(text);
    return std::move(*this);
  }
  KeyRow&& Alias() && {
    alias = true;
    return std::move(*this);
  }
};

using Cfg = DaemonConfig;

template <typename T>
KeyRow Int(std::string key, T Cfg::*f, std::string doc, int64_t lo = 0,
           int64_t hi = std::numeric_limits<T>::max()) {
  const bool open =
      hi == std::numeric_limits<int64_t>::max() || hi == std::numeric_limits<T>::max();
  return {std::move(key),
          open ? absl::StrCat("integer >= ", lo) : absl::StrCat("integer in [", lo, ", ", hi, "]"),
          std::move(doc),
          [f, lo, hi](Checker& ck, const std::string& k, const toml::node& n, Cfg* c) {
            ParseInt(ck, k, n, &(c->*f), lo, hi);
          },
          [f](const Cfg& c) { return absl::StrCat(c.*f); }};
}

KeyRow Str(std::string key, std::string Cfg::*f, std::string doc) {
  return {std::move(key), "string", std::move(doc),
          [f](Checker& ck, const std::string& k, const toml::node& n, Cfg* c) {
            ParseString(ck, k, n, &(c->*f));
          },
          [f](const Cfg& c) { return c.*f; }};
}

KeyRow Bool(std::string key, bool Cfg::*f, std::string doc) {
  return {std::move(key), "boolean", std::move(doc),
          [f](Checker& ck, const std::string& k, const toml::node& n, Cfg* c) {
            ParseBool(ck, k, n, &(c->*f));
          },
          [f](const Cfg& c) { return std::string(c.*f ? "true" : "false"); }};
}

KeyRow Strings(std::string key, std::vector<std::string> Cfg::*f, std::string doc) {
  return {std::move(key), "array of strings", std::move(doc),
          [f](Checker& ck, const std::string& k, const toml::node& n, Cfg* c) {
            ParseStrings(ck, k, n, &(c->*f));
          },
          [f](const Cfg& c) { return Join(c.*f); }};
}

KeyRow Number(std::string key, double Cfg::*f, std::string doc) {
  return {std::move(key), "number >= 0", std::move(doc),
          [f](Checker& ck, const std::string& k, const toml::node& n, Cfg* c) {
            ParseDouble(ck, k, n, &(c->*f));
          },
          [f](const Cfg& c) { return absl::StrCat(c.*f); }};
}

// A string that must be one of `choices`, parsed once, here.
template <typename E>
KeyRow Enum(std::string key, E Cfg::*f, const Choices<E>& choices, std::string doc) {
  return {std::move(key), absl::StrJoin(choices.Names(), " | "), std::move(doc),
          [f, &choices](Checker& ck, const std::string& k, const toml::node& n, Cfg* c) {
            auto v = n.value<std::string>();
            if (!v) return ck.Problem(k, "expected a string", &n);
            if (auto e = choices.Parse(*v)) {
              c->*f = *e;
            } else {
              ck.Problem(k, choices.Expected(*v), &n);
            }
          },
          [f, &choices](const Cfg& c) { return choices.NameOf(c.*f); }};
}

void ReadPrincipals(Checker& ck, const toml::node& n, Cfg* cfg);

// The top level: where the daemon lives and listens, and who may call.
void AddTopLevelKeys(std::vector<KeyRow>& k) {
  // The top level.
  k.push_back(Str("state_dir", &Cfg::state_dir,
                  "Everything the daemon keeps: registry.db, cache/, the lock file, the socket "
                  "(--state-dir).")
                  .Default("$OPJIT_STATE_DIR, else $HOME/.opjit, else /tmp/opjit-<uid>"));
  k.push_back(Strings("listen", &Cfg::listen,
                      "Endpoints: \"unix:/path\" or \"host:port\" (port 0 picks a free one); "
                      "a TCP address other than loopback needs TLS and principals, or "
                      "allow_insecure_tcp (--listen).")
                  .Default("[unix:<state_dir>/opjitd.sock, 127.0.0.1:7878]"));
  KeyRow level = Str("log_level", &Cfg::log_level,
                     "trace, debug, info, warn, error, critical or off (--log-level; a SIGHUP "
                     "applies a change).");
  level.type = absl::StrJoin(LogLevels(), " | ");
  level.read = [](Checker& ck, const std::string& key, const toml::node& n, Cfg* c) {
    std::string v;
    const size_t before = ck.problem_count();
    ParseString(ck, key, n, &v);
    if (ck.problem_count() != before) return;
    if (!ValidLogLevel(v)) return ck.Problem(key, LogLevelExpected(v), &n);
    c->log_level = v;
  };
  k.push_back(std::move(level));
  k.push_back({"max_message_mb", "integer in [1, 2047]",
               "Largest gRPC message, both directions, MiB: a call's inline tensors must fit.",
               [](Checker& ck, const std::string& key, const toml::node& n, Cfg* c) {
                 // gRPC takes the message size as an int.
                 int64_t mb = c->max_message_bytes >> 20;
                 ParseInt(ck, key, n, &mb, 1, 2047);
                 c->max_message_bytes = mb << 20;
               },
               [](const Cfg& c) { return absl::StrCat(c.max_message_bytes >> 20); }});
  k.push_back(Bool("allow_insecure_tcp", &Cfg::allow_insecure_tcp,
                   "Allow a TCP address other than loopback without TLS and principals "
                   "(--allow-insecure-tcp; trusted networks only)."));
  k.push_back({"socket_mode", "octal string", "Mode of the unix socket.",
               [](Checker& ck, const std::string& key, const toml::node& n, Cfg* c) {
                 auto v = n.value<std::string>();
                 char* end = nullptr;
                 const unsigned long mode = v ? std::strtoul(v->c_str(), &end, 8) : 0;
                 if (!v || v->empty() || *end != '\0' || mode > 0777) {
                   return ck.Problem(key, "expected an octal mode string such as \"0660\"", &n);
                 }
                 c->socket_mode = static_cast<unsigned>(mode);
               },
               [](const Cfg& c) {
                 char mode[8];
                 std::snprintf(mode, sizeof(mode), "%04o", c.socket_mode);
                 return std::string(mode);
               }});
  k.push_back(Str("socket_group", &Cfg::socket_group, "Group of the unix socket.")
                  .Default("the daemon's group"));
  k.push_back({"principal", "array of tables",
               "[[principal]]: who may call, one table each: name, role (admin | user | reader "
               "| metrics; default user), namespaces, token_sha256 (hex SHA-256 of bearer "
               "tokens), uids, gids (local callers). None: every local caller is admin. A "
               "SIGHUP applies a change.",
               [](Checker& ck, const std::string&, const toml::node& n, Cfg* c) {
                 ReadPrincipals(ck, n, c);
               },
               nullptr, "none"});
}

// [tls], [metrics], [health] and [quota].
void AddTlsMetricsQuotaKeys(std::vector<KeyRow>& k) {
  // [tls]
  k.push_back(Str("tls.cert", &Cfg::tls_cert,
                  "PEM certificate; with tls.key, every TCP address uses TLS."));
  k.push_back(Str("tls.key", &Cfg::tls_key, "PEM private key of tls.cert."));
  k.push_back(Str("tls.client_ca", &Cfg::tls_client_ca, "PEM CA that signs client certificates."));
  k.push_back(Bool("tls.require_client_cert", &Cfg::tls_require_client_cert,
                   "Refuse TLS clients without a certificate signed by tls.client_ca."));
  // [metrics], [health]
  k.push_back(Str("metrics.listen", &Cfg::metrics_listen,
                  "\"host:port\" of the Prometheus endpoint (\"\": off). With principals a "
                  "scrape needs a bearer token; non-admins see only their namespaces."));
  k.push_back(Int("health.interval_ms", &Cfg::health_interval_ms,
                  "How often the workers and the registry store are probed, ms.", 50, 3600000));
  // [quota]: read before [exec], [shm] and [autograd], whose keys win.
  k.push_back(Int("quota.shm_mb", &Cfg::shm_quota_mb, "Same as shm.quota_mb.").Alias());
  k.push_back(Int("quota.context_mb", &Cfg::context_mb, "Same as autograd.context_mb.").Alias());
  k.push_back(Int("quota.executor_processes", &Cfg::exec_workers, "Same as exec.workers.", 1)
                  .Alias());
  k.push_back(Int("quota.concurrent_compiles", &Cfg::quota_concurrent_compiles,
                  "Compiles a namespace runs at once (a SIGHUP applies a change)."));
  k.push_back(Number("quota.compile_seconds_per_minute",
                     &Cfg::quota_compile_seconds_per_minute,
                     "Compile seconds a namespace may use per minute (a SIGHUP applies a "
                     "change)."));
  k.push_back(Number("quota.calls_per_second", &Cfg::quota_calls_per_second,
                     "Calls per second per namespace, gRPC and fast channels together; 0: no "
                     "bound (a SIGHUP applies a change).")
                  .Default("0 without principals, 20000 with"));
  k.push_back(Int("quota.ops", &Cfg::quota_ops, "Ops per namespace."));
  k.push_back(Int("quota.versions_per_op", &Cfg::quota_versions, "Versions kept per op."));
  k.push_back(Int("quota.namespaces", &Cfg::quota_namespaces,
                  "Namespaces on the daemon (a SIGHUP applies a change)."));
  k.push_back(Int("quota.total_shm_mb", &Cfg::quota_total_shm_mb,
                  "Shared memory of all namespaces together, MiB; 0: a quarter of /dev/shm."));
  k.push_back(Int("quota.total_context_mb", &Cfg::quota_total_context_mb,
                  "Saved tensors of all namespaces' backward contexts together, MiB."));
}

// [compiler].
void AddCompilerKeys(std::vector<KeyRow>& k) {
  // [compiler]
  k.push_back(Int("compiler.workers", &Cfg::compile_workers,
                  "Compile worker processes (opjit-compile-worker); as many NVRTC workers "
                  "(opjit-gpu-sandbox) at most.",
                  1, 1024));
  k.push_back(Int("compiler.timeout_ms", &Cfg::compile_timeout_ms,
                  "A compile running longer is killed, ms.", 1));
  k.push_back(Int("compiler.memory_limit_mb", &Cfg::compile_memory_limit_mb,
                  "Address space of a compile worker, MiB.", 64));
  k.push_back(Int("compiler.threads", &Cfg::compile_threads,
                  "Compile pool threads; 0: workers + long_workers.", 0, 1024));
  k.push_back(Int("compiler.recycle_after", &Cfg::compile_recycle_after,
                  "Compiles, then a worker (clang or NVRTC) is replaced."));
  k.push_back(Int("compiler.recycle_memory_mb", &Cfg::compile_recycle_memory_mb,
                  "Address space that retires a worker, MiB; 0: half of memory_limit_mb."));
  k.push_back(Int("compiler.long_after_ms", &Cfg::compile_long_after_ms,
                  "A compile running longer moves to the long lane, ms."));
  k.push_back(Int("compiler.long_workers", &Cfg::compile_long_workers,
                  "Compiles in the long lane at once.", 0, 1024));
  k.push_back(Int("compiler.long_timeout_ms", &Cfg::compile_long_timeout_ms,
                  "In the long lane timeout_ms counts CPU time; this bounds wall time, ms "
                  "(<= timeout_ms: wall-clock timeout_ms there too).", 1));
  k.push_back(Int("compiler.slow_log_ms", &Cfg::compile_slow_log_ms,
                  "A compile running longer is logged, ms; 0: never.", 0));
  k.push_back(Int("compiler.uid", &Cfg::compile_uid,
                  "Started as root, compile workers run as this uid (and gid), keeping only "
                  "CAP_DAC_READ_SEARCH; never root, nobody, or a uid of exec.uid_range.",
                  1, 4294967294));
  k.push_back(Strings("compiler.extra_include_dirs", &Cfg::extra_include_dirs,
                      "Directories kernels may #include from, besides the kernel headers."));
  k.push_back(Strings("compiler.allowed_libraries", &Cfg::allowed_libraries,
                      "Libraries kernels may link (-l names)."));
  k.push_back(Str("compiler.kernel_include_dir", &Cfg::kernel_include_dir,
                  "The opjit kernel headers.")
                  .Default("the installed or source-tree kernels/include"));
  k.push_back(Strings("compiler.profiles", &Cfg::compiler_profiles,
                      "Named toolchain profiles offered where installed (\"aten\": PyTorch's "
                      "C++ API from libtorch-dev, python3-dev and pybind11-dev); a kernel "
                      "selects one by naming one of its libraries; []: none."));
  // [toolchains.aten]
  k.push_back(Strings("toolchains.aten.namespaces", &Cfg::aten_namespaces,
                      "Namespaces that may select the aten profile; \"*\": every one."));
  k.push_back(Bool("toolchains.aten.pch_at_start", &Cfg::aten_pch_at_start,
                   "Build the aten profile's shared PCH (<torch/extension.h>) as the daemon "
                   "starts; false: at the first compile that selects it."));
}

// [exec].
void AddExecKeys(std::vector<KeyRow>& k) {
  // [exec]
  k.push_back(Int("exec.threads", &Cfg::exec_threads, "Execution pool threads.", 1, 1024));
  k.push_back(Int("exec.queue", &Cfg::exec_queue,
                  "Calls waiting for the pool, then RESOURCE_EXHAUSTED."));
  k.push_back(Int("exec.inline_max_bytes", &Cfg::inline_max_bytes,
                  "Calls with at most this many input bytes run inline."));
  k.push_back(Enum("exec.isolation", &Cfg::isolation, IsolationChoices(),
                   "Where kernels run: process (sandboxed opjit-exec-worker processes, one "
                   "pool per namespace) or in-daemon (inside opjitd: unsafe, for a trusted "
                   "single user) (--isolation)."));
  k.push_back(Int("exec.workers", &Cfg::exec_workers,
                  "Executor processes per namespace, at most.", 1));
  k.push_back(Int("exec.worker_idle_ms", &Cfg::worker_idle_ms,
                  "An idle executor process is stopped after this, ms."));
  k.push_back(Int("exec.kernel_timeout_ms", &Cfg::kernel_timeout_ms,
                  "A kernel running longer is killed (DEADLINE_EXCEEDED), ms.", 1));
  k.push_back(Int("exec.worker_memory_mb", &Cfg::worker_memory_mb,
                  "Private memory of an executor process (RLIMIT_DATA), MiB.", 16,
                  std::numeric_limits<int64_t>::max() >> 20));
  k.push_back(Str("exec.worker_user", &Cfg::worker_user,
                  "Started as root without exec.uid_range, executors drop to this user (\"\" "
                  "keeps root)."));
  k.push_back(Str("exec.uid_range", &Cfg::uid_range,
                  "Started as root, each namespace's executors run as a uid of their own from "
                  "\"<first>-<last>\" (the lowest no daemon on the host holds, claimed in "
                  "uid_claim_dir); \"\": all as worker_user."));
  k.push_back(Str("exec.uid_claim_dir", &Cfg::uid_claim_dir,
                  "Where every opjitd of the host claims the executor uids it hands out "
                  "(uid_range, or a non-root daemon's subordinate ids), so no two daemons share "
                  "one: a directory only its owner (root or the daemon's user) writes."));
  k.push_back(Int("exec.threads_per_executor", &Cfg::threads_per_executor,
                  "Threads an executor may keep while no call runs in it (counted after each "
                  "pool call and every ~100 ms while idle).", 8, 1 << 20));
  k.push_back(Int("exec.threads_per_namespace", &Cfg::threads_per_namespace,
                  "Threads of all of a namespace's executors together (root with "
                  "uid_range).", 8, 1 << 22));
  k.push_back(Int("exec.scratch_mb", &Cfg::scratch_mb, "An executor's scratch space, MiB.", 1,
                  1 << 20));
  k.push_back(Bool("exec.namespaces", &Cfg::exec_namespaces,
                   "Executors and compile workers in PID, mount, IPC, network and UTS "
                   "namespaces of their own."));
  k.push_back(Int("exec.namespace_memory_mb", &Cfg::namespace_memory_mb,
                  "Memory of all of a namespace's executors together (a cgroup), MiB; 0: "
                  "none.", 0, 1 << 30));
  k.push_back(Int("exec.worker_spin_us", &Cfg::worker_spin_us,
                  "An executor's busy-wait for its next call, us; 0: sleep at once.", 0,
                  1000000));
  k.push_back(Int("exec.wait_spin_us", &Cfg::wait_spin_us,
                  "The daemon's busy-wait for a call's result before it sleeps, us.", 0,
                  1000000));
  k.push_back(Int("exec.quarantine_after", &Cfg::quarantine_after,
                  "Crashes in a row of one caller's calls that quarantine a kernel for that caller."));
  k.push_back(Int("exec.quarantine_callers", &Cfg::quarantine_callers,
                  "Callers (readers not counted) a kernel must be quarantined for before it is "
                  "quarantined for everyone.", 1));
}

// [fast], [shm], [autograd], [cache], [cache.remote] and [registry].
void AddMemoryAndStoreKeys(std::vector<KeyRow>& k) {
  // [fast]
  k.push_back(Bool("fast.enabled", &Cfg::fast_enabled, "Same-host fast channels at all."));
  k.push_back(Int("fast.channels", &Cfg::fast_channels,
                  "Open channels per namespace (one executor process each)."));
  k.push_back(Int("fast.total_channels", &Cfg::fast_total_channels, "Open channels in all."));
  k.push_back(Int("fast.spin_us", &Cfg::fast_spin_us,
                  "A channel executor's (and its client's) spin before sleeping, us.", 0,
                  100000));
  k.push_back(Int("fast.handles", &Cfg::fast_handles, "Prepared handles per namespace.", 1));
  // [shm], [autograd]
  k.push_back(Int("shm.quota_mb", &Cfg::shm_quota_mb, "Shared memory per namespace, MiB."));
  k.push_back(Int("shm.lease_ms", &Cfg::lease_ms,
                  "A client's regions are released unless renewed within this, ms.", 1));
  k.push_back(Int("autograd.context_ttl_ms", &Cfg::context_ttl_ms,
                  "A backward context unused this long is released, ms.", 1));
  k.push_back(Int("autograd.context_mb", &Cfg::context_mb,
                  "Saved tensors per namespace, MiB."));
  // [cache], [cache.remote]
  k.push_back(Int("cache.memory_entries", &Cfg::cache_memory_entries,
                  "Compiled kernels kept in memory."));
  k.push_back(Int("cache.memory_mb", &Cfg::cache_memory_mb, "Memory cache size, MiB."));
  k.push_back(Int("cache.disk_mb", &Cfg::cache_disk_mb, "Disk cache size, MiB."));
  k.push_back(Str("cache.remote.url", &Cfg::cache_remote_url,
                  "A Redis tier shared by daemons: \"redis://host:port\" or "
                  "\"unix:/path/redis.sock\" (\"\": off)."));
  k.push_back(Str("cache.remote.key_file", &Cfg::cache_remote_key_file,
                  "The cluster's HMAC key that authenticates shared entries (needed with "
                  "url)."));
  k.push_back(Int("cache.remote.timeout_ms", &Cfg::cache_remote_timeout_ms,
                  "Connect and per-command timeout, ms.", 1, 60000));
  k.push_back(Int("cache.remote.max_mb", &Cfg::cache_remote_max_mb,
                  "Larger artifacts are not shared, MiB.", 1));
  k.push_back(Int("cache.remote.ttl_s", &Cfg::cache_remote_ttl_s,
                  "Shared entries expire after this, s; 0: never."));
  // [registry]
  k.push_back(Enum("registry.backend", &Cfg::registry_backend, RegistryBackendChoices(),
                   "Where op versions are stored: sqlite (<state_dir>/registry.db) or "
                   "postgres (registry.url)."));
  k.push_back(Str("registry.url", &Cfg::registry_url,
                  "postgres: a libpq connection string or URI."));
  k.push_back(Str("registry.password_file", &Cfg::registry_password_file,
                  "postgres: a file holding the password, kept out of the config."));
  k.push_back(Int("registry.poll_ms", &Cfg::registry_poll_ms,
                  "postgres: backstop poll behind LISTEN/NOTIFY, ms.", 50, 600000));
}

// Every key, in the order they are read (an alias before the key it
// stands for, so that the latter wins) and --help-config lists them.
const std::vector<KeyRow>& Keys() {
  static const std::vector<KeyRow> kKeys = [] {
    std::vector<KeyRow> k;
    AddTopLevelKeys(k);
    AddTlsMetricsQuotaKeys(k);
    AddCompilerKeys(k);
    AddExecKeys(k);
    AddMemoryAndStoreKeys(k);
    return k;
  }();
  return kKeys;
}

// "exec.workers" -> {"exec", "workers"}; "state_dir" -> {"", "state_dir"}.
std::pair<std::string, std::string> SplitKey(const std::string& key) {
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos) return {"", key};
  return {key.substr(0, dot), key.substr(dot + 1)};
}

// The keys each section knows ("" is the top level): its rows' and its
// subsections' names.
const std::map<std::string, std::set<std::string>>& KnownKeys() {
  static const std::map<std::string, std::set<std::string>> kKnown = [] {
    std::map<std::string, std::set<std::string>> known;
    for (const KeyRow& row : Keys()) {
      auto [section, leaf] = SplitKey(row.key);
      known[section].insert(leaf);
      while (!section.empty()) {
        auto [parent, name] = SplitKey(section);
        known[parent].insert(name);
        section = parent;
      }
    }
    return known;
  }();
  return kKnown;
}

// Reads the file's tables through the key table: each section is looked up
// once (a section that is not a table is one problem) and checked for
// unknown keys when first seen.
class TomlReader {
 public:
  TomlReader(Checker& ck, const toml::table& root) : ck_(ck) {
    sections_[""] = &root;
    CheckKeys(ck_, root, "", KnownKeys().at(""));
  }

  // The table of `section` ("cache.remote"), or nullptr when it is absent or
  // not a table.
  const toml::table* Find(const std::string& section) {
    if (auto it = sections_.find(section); it != sections_.end()) return it->second;
    auto [parent_name, name] = SplitKey(section);
    const toml::table* parent = Find(parent_name);
    const std::string where = parent_name.empty() ? "" : parent_name + ".";
    const toml::table* t = parent == nullptr ? nullptr : Section(ck_, *parent, name, where);
    sections_[section] = t;
    if (t != nullptr) CheckKeys(ck_, *t, section + ".", KnownKeys().at(section));
    return t;
  }

 private:
  Checker& ck_;
  std::map<std::string, const toml::table*> sections_;
};

void ApplyToml(Checker& ck, const toml::table& root, DaemonConfig* cfg) {
  TomlReader reader(ck, root);
  for (const KeyRow& row : Keys()) {
    auto [section, leaf] = SplitKey(row.key);
    const toml::table* t = reader.Find(section);
    const toml::node* n = t == nullptr ? nullptr : t->get(leaf);
    if (n == nullptr) continue;
    ck.Saw(row.key, *n);
    row.read(ck, row.key, *n, cfg);
  }
}

// [[principal]] tables.
void ReadPrincipals(Checker& ck, const toml::node& n, DaemonConfig* cfg) {
  const toml::array* arr = n.as_array();
  if (arr == nullptr) return ck.Problem("principal", "expected [[principal]] tables", &n);
  for (size_t i = 0; i < arr->size(); ++i) {
    const toml::table* t = (*arr)[i].as_table();
    const std::string where = absl::StrCat("principal[", i, "].");
    ck.Saw(absl::StrCat("principal[", i, "]"), (*arr)[i]);
    if (t == nullptr) {
      ck.Problem(absl::StrCat("principal[", i, "]"), "expected a table", &(*arr)[i]);
      continue;
    }
    CheckKeys(ck, *t, where, {"name", "role", "namespaces", "token_sha256", "uids", "gids"});
    // The key `k` of this principal, marked as seen; nullptr when absent.
    auto get = [&](const char* k) -> const toml::node* {
      const toml::node* v = t->get(k);
      if (v != nullptr) ck.Saw(where + k, *v);
      return v;
    };
    access::PrincipalConfig p;
    std::string role = "user";
    if (const toml::node* v = get("name")) ParseString(ck, where + "name", *v, &p.name);
    if (const toml::node* v = get("role")) ParseString(ck, where + "role", *v, &role);
    if (auto r = access::ParseRole(role)) {
      p.role = *r;
    } else {
      ck.Problem(where + "role", "expected \"admin\", \"user\", \"reader\" or \"metrics\"",
                 t->get("role"));
    }
    if (const toml::node* v = get("namespaces")) {
      ParseStrings(ck, where + "namespaces", *v, &p.namespaces);
    }
    if (const toml::node* v = get("token_sha256")) {
      ParseStrings(ck, where + "token_sha256", *v, &p.token_sha256);
    }
    if (const toml::node* v = get("uids")) ParseIds(ck, where + "uids", *v, &p.uids);
    if (const toml::node* v = get("gids")) ParseIds(ck, where + "gids", *v, &p.gids);
    cfg->principals.push_back(std::move(p));
  }
}

// "<first>-<last>" as [first, last]; "" as {0, 0}. Refused: a range that
// holds root (0), nobody (65534), 65535 or (uid_t)-1, or is reversed.
absl::StatusOr<std::pair<uint32_t, uint32_t>> ParseUidRange(const std::string& text) {
  if (text.empty()) return std::pair<uint32_t, uint32_t>{0, 0};
  const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
      "expected \"<first>-<last>\" (e.g. \"1879048192-1879113727\") or \"\", not \"", text, "\""));
  const size_t dash = text.find('-');
  if (dash == std::string::npos) return bad;
  uint64_t first = 0, last = 0;
  const std::string a = text.substr(0, dash), b = text.substr(dash + 1);
  if (a.empty() || b.empty() || a.size() > 10 || b.size() > 10 ||
      a.find_first_not_of("0123456789") != std::string::npos ||
      b.find_first_not_of("0123456789") != std::string::npos) {
    return bad;
  }
  first = std::stoull(a);
  last = std::stoull(b);
  if (first > last || last >= 0xFFFFFFFFull) return bad;
  if (first == 0 || (first <= 65535 && last >= 65534)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", text, "\" holds root (0) or nobody (65534/65535): executors need uids no one else has"));
  }
  return std::pair<uint32_t, uint32_t>{static_cast<uint32_t>(first), static_cast<uint32_t>(last)};
}

// The checks across keys, once the file and the flags are in.
void CheckCombined(Checker& ck, DaemonConfig& cfg) {
  if (auto range = ParseUidRange(cfg.uid_range); range.ok()) {
    cfg.uid_first = range->first;
    cfg.uid_last = range->second;
  } else {
    ck.Problem("exec.uid_range", std::string(range.status().message()));
  }
  if (cfg.uid_claim_dir.empty() || cfg.uid_claim_dir[0] != '/') {
    ck.Problem("exec.uid_claim_dir", "must be an absolute path (every opjitd of the host claims "
                                     "executor uids there)");
  }
  // The compile uid: no executor's (outside exec.uid_range), not nobody's.
  if (cfg.compile_uid == 65534 || cfg.compile_uid == 65535) {
    ck.Problem("compiler.uid", absl::StrCat(cfg.compile_uid, " is nobody's: compile workers need "
                                            "a uid no one else has"));
  } else if (cfg.uid_first != 0 && cfg.compile_uid >= cfg.uid_first &&
             cfg.compile_uid <= cfg.uid_last) {
    ck.Problem("compiler.uid", absl::StrCat(cfg.compile_uid, " lies in exec.uid_range (",
                                            cfg.uid_range, "), the executors' uids: pick one "
                                            "outside it"));
  }
  // The built-in toolchain profiles (compiler::BuiltinProfileNames(); the
  // config library does not link the compiler, config_test checks the two agree).
  for (const std::string& p : cfg.compiler_profiles) {
    if (p != "aten") {
      ck.Problem("compiler.profiles",
                 absl::StrCat("unknown toolchain profile \"", p, "\" (known: aten)"));
    }
  }
  if (cfg.tls_cert.empty() != cfg.tls_key.empty()) {
    ck.Problem(cfg.tls_cert.empty() ? "tls.key" : "tls.cert", "tls cert and key go together");
  }
  if (cfg.tls_require_client_cert && cfg.tls_client_ca.empty()) {
    ck.Problem("tls.require_client_cert", "needs tls.client_ca (the CA that signs clients)");
  }
  std::error_code ec;
  cfg.state_dir = std::filesystem::absolute(cfg.state_dir, ec).lexically_normal().string();
  while (cfg.state_dir.size() > 1 && cfg.state_dir.back() == '/') cfg.state_dir.pop_back();
  if (cfg.listen.empty()) cfg.listen = {DefaultSocketAddress(cfg.state_dir), kDefaultTcpAddress};
  for (const std::string& address : cfg.listen) {
    if (address.rfind("unix:", 0) == 0) {
      if (address.size() == 5) ck.Problem("listen", "\"unix:\" needs a socket path");
      continue;
    }
    if (address.rfind(':') == std::string::npos) {
      ck.Problem("listen", absl::StrCat("\"", address, "\" is neither unix:/path nor host:port"));
      continue;
    }
    if (IsLoopbackTcp(address) || cfg.allow_insecure_tcp) continue;
    if (!cfg.tls_cert.empty() && !cfg.principals.empty()) continue;
    ck.Problem("listen", absl::StrCat(
        "listen address ", address,
        " is not loopback: that needs TLS ([tls] cert and key) and principals ([[principal]] "
        "with tokens), or anyone who can reach it could run code and read tensors. Listen on "
        "127.0.0.1 or a unix socket, configure both, or set allow_insecure_tcp = true "
        "(--allow-insecure-tcp) on a trusted network"));
  }
  if (cfg.registry_backend == RegistryBackend::kPostgres && cfg.registry_url.empty()) {
    ck.ProblemFrom("registry.url", "registry.backend",
               "registry.backend = \"postgres\" needs registry.url (a libpq connection string "
               "such as \"host=db.example port=5432 dbname=opjit user=opjit\")");
  }
  if (!cfg.cache_remote_url.empty() && cfg.cache_remote_key_file.empty()) {
    ck.ProblemFrom("cache.remote.key_file", "cache.remote.url",
               "cache.remote.url needs cache.remote.key_file: the cluster key that authenticates "
               "shared entries (the same file on every daemon, e.g. 32 random bytes)");
  }
  for (size_t i = 0; i < cfg.principals.size(); ++i) {
    const access::PrincipalConfig& p = cfg.principals[i];
    if (!p.token_sha256.empty() || !p.uids.empty() || !p.gids.empty()) continue;
    ck.Problem(absl::StrCat("principal[", i, "]"),
               absl::StrCat("principal \"", p.name,
                            "\" has no token_sha256, uids or gids: nobody can be it"));
  }
  for (const auto& [index, message] : access::PrincipalProblems(cfg.principals)) {
    ck.Problem(absl::StrCat("principal[", index, "]"), message);
  }
  // Files the daemon reads at start: a missing one is a problem here, one
  // this user may not read is not (the daemon may run as another user).
  for (const auto& [key, path] :
       std::vector<std::pair<const char*, const std::string*>>{
           {"tls.cert", &cfg.tls_cert},
           {"tls.key", &cfg.tls_key},
           {"tls.client_ca", &cfg.tls_client_ca},
           {"cache.remote.key_file", &cfg.cache_remote_key_file},
           {"registry.password_file", &cfg.registry_password_file}}) {
    struct stat st;
    if (!path->empty() && ::stat(path->c_str(), &st) != 0 && errno == ENOENT) {
      ck.Problem(key, "no such file");
    }
  }
  if (cfg.quota_calls_per_second < 0) {
    cfg.quota_calls_per_second = cfg.principals.empty() ? 0 : kSharedCallsPerSecond;
  }
}

}  // namespace

// Whether a TCP listen address ("host:port") binds only the loopback
// interface. An empty host, 0.0.0.0, :: and names other than localhost
// are not.
bool IsLoopbackTcp(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost" || host == "::1") return true;
  if (host.rfind("127.", 0) != 0) return false;
  return host.find_first_not_of("0123456789.") == std::string::npos;
}

std::string Usage() {
  return "Usage: opjitd [OPTION]...\n"
         "       opjitd --check-config FILE\n"
         "       opjitd --verify-cache [--state-dir DIR]\n"
         "The opjit daemon: registers, compiles (JIT) and runs custom operator kernels for\n"
         "clients over gRPC and shared memory.\n"
         "\n"
         "Options:\n"
         "  --config FILE         TOML configuration (every key: deploy/opjitd.toml);\n"
         "                        the flags below override it. A SIGHUP reads it again\n"
         "  --listen ADDR         unix:/path/to.sock or host:port (port 0: any free port).\n"
         "                        Repeatable. Default: unix:<state-dir>/opjitd.sock and\n"
         "                        127.0.0.1:7878\n"
         "  --state-dir DIR       registry, cache, lock file and socket live here.\n"
         "                        Default: $OPJIT_STATE_DIR, else ~/.opjit\n"
         "  --log-level LEVEL     trace, debug, info, warn, error, critical or off\n"
         "                        (default info)\n"
         "  --isolation MODE      where kernels run: process (sandboxed executor\n"
         "                        processes, the default) or in-daemon (inside opjitd;\n"
         "                        unsafe, trusted users only)\n"
         "  --allow-insecure-tcp  allow a TCP address other than loopback without TLS and\n"
         "                        principals (anyone who reaches it can run code; trusted\n"
         "                        networks only)\n"
         "  --check-config FILE   validate FILE (syntax, every key, types, ranges,\n"
         "                        principals) with the flags given applied over it, print\n"
         "                        \"FILE: ok ...\" or one line per problem (FILE:LINE: key:\n"
         "                        problem), and exit; starts nothing, touches no state dir\n"
         "  --verify-cache        check every disk-cache entry's checksum (the daemon may\n"
         "                        be running or not), print what does not verify, and exit\n"
         "  -V, --version         print the version and git revision, and exit\n"
         "  --help-config         print every config key (type, default, meaning), and exit\n"
         "  -h, --help            print this help, and exit\n"
         "\n"
         "Signals:\n"
         "  SIGTERM, SIGINT       stop: in-flight calls get up to 5 s; the socket is\n"
         "                        removed\n"
         "  SIGHUP                read the --config file again and apply what can change\n"
         "                        while serving: [[principal]]s and their tokens, [quota]\n"
         "                        concurrent_compiles, compile_seconds_per_minute,\n"
         "                        calls_per_second and namespaces, and log_level. Each\n"
         "                        change is logged; other changed keys are logged as\n"
         "                        needing a restart; a file with problems is logged and\n"
         "                        ignored (the running configuration stays)\n"
         "\n"
         "Exit status:\n"
         "  0  stopped by SIGTERM/SIGINT; --check-config found no problem; --verify-cache\n"
         "     found every entry intact; --help, --help-config, --version\n"
         "  1  could not start (state dir locked or unwritable, registry, listen address,\n"
         "     ...); --check-config found problems; --verify-cache found corrupt entries\n"
         "  2  bad flags or configuration\n";
}

std::string ConfigProblem::ToString() const {
  if (key.empty()) return absl::StrCat(where, ": ", message);
  return absl::StrCat(where, ": ", key, ": ", message);
}

bool ValidLogLevel(const std::string& level) {
  const std::vector<std::string>& levels = LogLevels();
  return std::find(levels.begin(), levels.end(), level) != levels.end();
}

ConfigResult BuildConfig(const std::string& path, const ConfigFlags& flags) {
  ConfigResult result;
  DaemonConfig& cfg = result.config;
  cfg.config_file = path;
  cfg.flags = flags;
  Checker ck(path);
  if (!path.empty()) {
    toml::table root;
    bool parsed = false;
    try {
      // toml++ reports parse errors by exception; they stay inside this function.
      root = toml::parse_file(path);
      parsed = true;
    } catch (const toml::parse_error& e) {
      ck.ParseError(e);
    }
    if (parsed) ApplyToml(ck, root, &cfg);
  }
  if (!flags.state_dir.empty()) {
    cfg.state_dir = flags.state_dir;
    ck.SawFlag("state_dir", "--state-dir");
  }
  if (!flags.listen.empty()) {
    cfg.listen = flags.listen;
    ck.SawFlag("listen", "--listen");
  }
  if (!flags.log_level.empty()) {
    cfg.log_level = flags.log_level;
    ck.SawFlag("log_level", "--log-level");
    if (!ValidLogLevel(flags.log_level)) {
      ck.Problem("log_level", LogLevelExpected(flags.log_level));
    }
  }
  if (!flags.isolation.empty()) {
    ck.SawFlag("exec.isolation", "--isolation");
    if (auto isolation = IsolationChoices().Parse(flags.isolation)) {
      cfg.isolation = *isolation;
    } else {
      ck.Problem("exec.isolation", IsolationChoices().Expected(flags.isolation));
    }
  }
  if (flags.allow_insecure_tcp) cfg.allow_insecure_tcp = true;
  if (cfg.state_dir.empty()) cfg.state_dir = DefaultStateDir();
  CheckCombined(ck, cfg);
  result.problems = ck.TakeProblems();
  return result;
}

absl::StatusOr<DaemonConfig> LoadConfig(int argc, char** argv) {
  DaemonConfig cfg;
  ConfigFlags flags;
  std::string flag_config;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const char* name) -> absl::StatusOr<std::string> {
      const std::string prefix = absl::StrCat(name, "=");
      if (arg.rfind(prefix, 0) == 0) return arg.substr(prefix.size());
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      return std::string(argv[++i]);
    };
    auto is = [&](const char* name) {
      return arg == name || arg.rfind(absl::StrCat(name, "="), 0) == 0;
    };
    if (arg == "--help" || arg == "-h") return absl::CancelledError(Usage());
    if (arg == "--help-config") return absl::CancelledError(ConfigHelp());
    absl::StatusOr<std::string> v;
    if (arg == "--version" || arg == "-V") {
      cfg.version = true;
      continue;
    }
    if (arg == "--allow-insecure-tcp") {
      flags.allow_insecure_tcp = true;
      continue;
    }
    if (arg == "--verify-cache") {
      cfg.verify_cache = true;
      continue;
    }
    if (is("--listen")) {
      v = value("--listen");
      if (v.ok()) flags.listen.push_back(*v);
    } else if (is("--state-dir")) {
      v = value("--state-dir");
      if (v.ok()) flags.state_dir = *v;
    } else if (is("--config")) {
      v = value("--config");
      if (v.ok()) flag_config = *v;
    } else if (is("--check-config")) {
      v = value("--check-config");
      if (v.ok()) cfg.check_config = *v;
    } else if (is("--isolation")) {
      v = value("--isolation");
      if (v.ok()) flags.isolation = *v;
    } else if (is("--log-level")) {
      v = value("--log-level");
      if (v.ok()) flags.log_level = *v;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", arg, " (opjitd --help lists them)"));
    }
    if (!v.ok()) return v.status();
    if (v->empty()) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
  }
  if (cfg.version || !cfg.check_config.empty()) {
    cfg.config_file = flag_config;
    cfg.flags = flags;
    return cfg;
  }
  const bool verify_cache = cfg.verify_cache;
  ConfigResult built = BuildConfig(flag_config, flags);
  if (!built.problems.empty()) {
    std::vector<std::string> lines;
    for (const ConfigProblem& p : built.problems) lines.push_back(p.ToString());
    return absl::InvalidArgumentError(absl::StrJoin(lines, "\n"));
  }
  built.config.verify_cache = verify_cache;
  return std::move(built.config);
}

std::map<std::string, std::string> SettingsOf(const DaemonConfig& c) {
  std::map<std::string, std::string> settings;
  for (const KeyRow& row : Keys()) {
    if (!row.alias && row.print) settings[row.key] = row.print(c);
  }
  return settings;
}

const char* IsolationName(Isolation isolation) {
  return isolation == Isolation::kInDaemon ? "in-daemon" : "process";
}

const char* RegistryBackendName(RegistryBackend backend) {
  return backend == RegistryBackend::kPostgres ? "postgres" : "sqlite";
}

std::vector<ConfigKeyInfo> ConfigKeys() {
  const DaemonConfig defaults;
  std::vector<ConfigKeyInfo> keys;
  for (const KeyRow& row : Keys()) {
    std::string shown = row.shown_default;
    if (shown.empty()) {
      shown = row.print(defaults);
      if (row.type == "string") shown = absl::StrCat("\"", shown, "\"");
    }
    keys.push_back({row.key, row.type, std::move(shown), row.doc, row.alias});
  }
  return keys;
}

std::string ConfigHelp() {
  std::string out =
      "Every key of opjitd's TOML config (--config FILE), in the order it is read: a key\n"
      "\"a.b\" is b in section [a]. Any other key is refused. Some flags override keys\n"
      "(opjitd --help). For each: KEY  TYPE  (default DEFAULT), then what it does.\n\n";
  for (const ConfigKeyInfo& k : ConfigKeys()) {
    absl::StrAppend(&out, k.key, "  ", k.type, "  (default ", k.default_value, ")\n");
    // The doc, wrapped at 80 columns under a 4-space indent.
    std::string line = "   ";
    for (absl::string_view word : absl::StrSplit(k.doc, ' ', absl::SkipEmpty())) {
      if (line.size() + 1 + word.size() > 80 && line.size() > 3) {
        absl::StrAppend(&out, line, "\n");
        line = "   ";
      }
      absl::StrAppend(&line, " ", word);
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

}  // namespace opjit

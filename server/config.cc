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
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <toml++/toml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

// Each Read* leaves *out alone when the key is absent, and on a bad value
// (recording the problem).
template <typename T>
void ReadInt(Checker& ck, const toml::table& t, const char* key, const std::string& where, T* out,
             int64_t lo = 0, int64_t hi = std::numeric_limits<T>::max()) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return;
  const std::string name = absl::StrCat(where, key);
  ck.Saw(name, *n);
  std::optional<int64_t> v = n->is_integer() ? n->value<int64_t>() : std::nullopt;
  if (!v) return ck.Problem(name, "expected an integer", n);
  if (*v < lo || *v > hi) {
    if (hi == std::numeric_limits<int64_t>::max() || hi == std::numeric_limits<T>::max()) {
      return ck.Problem(name, absl::StrCat("expected an integer >= ", lo, ", not ", *v), n);
    }
    return ck.Problem(name, absl::StrCat("expected an integer in [", lo, ", ", hi, "], not ", *v),
                      n);
  }
  *out = static_cast<T>(*v);
}

void ReadString(Checker& ck, const toml::table& t, const char* key, const std::string& where,
                std::string* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return;
  ck.Saw(absl::StrCat(where, key), *n);
  auto v = n->value<std::string>();
  if (!v) return ck.Problem(absl::StrCat(where, key), "expected a string", n);
  *out = *v;
}

void ReadBool(Checker& ck, const toml::table& t, const char* key, const std::string& where,
              bool* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return;
  ck.Saw(absl::StrCat(where, key), *n);
  auto v = n->value<bool>();
  if (!v) return ck.Problem(absl::StrCat(where, key), "expected true or false", n);
  *out = *v;
}

void ReadStrings(Checker& ck, const toml::table& t, const char* key, const std::string& where,
                 std::vector<std::string>* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return;
  const std::string name = absl::StrCat(where, key);
  ck.Saw(name, *n);
  const toml::array* arr = n->as_array();
  if (arr == nullptr) return ck.Problem(name, "expected an array of strings", n);
  std::vector<std::string> values;
  for (const auto& e : *arr) {
    auto v = e.value<std::string>();
    if (!v) return ck.Problem(name, "expected an array of strings", &e);
    values.push_back(*v);
  }
  *out = std::move(values);
}

void ReadDouble(Checker& ck, const toml::table& t, const char* key, const std::string& where,
                double* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return;
  const std::string name = absl::StrCat(where, key);
  ck.Saw(name, *n);
  std::optional<double> v =
      n->is_integer() || n->is_floating_point() ? n->value<double>() : std::nullopt;
  if (!v || !std::isfinite(*v) || *v < 0) return ck.Problem(name, "expected a non-negative number", n);
  *out = *v;
}

void ReadIds(Checker& ck, const toml::table& t, const char* key, const std::string& where,
             std::vector<uint32_t>* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return;
  const std::string name = absl::StrCat(where, key);
  ck.Saw(name, *n);
  const toml::array* arr = n->as_array();
  if (arr == nullptr) return ck.Problem(name, "expected an array of integers", n);
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
const toml::table* Section(Checker& ck, const toml::table& t, const char* key,
                           const std::string& where) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return nullptr;
  ck.Saw(absl::StrCat(where, key), *n);
  if (const toml::table* s = n->as_table()) return s;
  ck.Problem(absl::StrCat(where, key), absl::StrCat("expected a table ([", where, key, "])"), n);
  return nullptr;
}

void ApplyToml(Checker& ck, const toml::table& root, DaemonConfig* cfg) {
  CheckKeys(ck, root, "",
            {"state_dir", "listen", "log_level", "max_message_mb", "allow_insecure_tcp",
             "compiler", "cache", "exec", "shm", "autograd", "socket_mode", "socket_group",
             "principal", "tls", "metrics", "health", "quota", "fast", "registry"});
  ReadString(ck, root, "socket_group", "", &cfg->socket_group);
  if (const toml::node* n = root.get("socket_mode")) {
    ck.Saw("socket_mode", *n);
    auto v = n->value<std::string>();
    char* end = nullptr;
    const unsigned long mode = v ? std::strtoul(v->c_str(), &end, 8) : 0;
    if (!v || v->empty() || *end != '\0' || mode > 0777) {
      ck.Problem("socket_mode", "expected an octal mode string such as \"0660\"", n);
    } else {
      cfg->socket_mode = static_cast<unsigned>(mode);
    }
  }
  if (const toml::node* n = root.get("principal")) {
    ck.Saw("principal", *n);
    const toml::array* arr = n->as_array();
    if (arr == nullptr) {
      ck.Problem("principal", "expected [[principal]] tables", n);
    } else {
      for (size_t i = 0; i < arr->size(); ++i) {
        const toml::table* t = (*arr)[i].as_table();
        const std::string where = absl::StrCat("principal[", i, "].");
        ck.Saw(absl::StrCat("principal[", i, "]"), (*arr)[i]);
        if (t == nullptr) {
          ck.Problem(absl::StrCat("principal[", i, "]"), "expected a table", &(*arr)[i]);
          continue;
        }
        CheckKeys(ck, *t, where, {"name", "role", "namespaces", "token_sha256", "uids", "gids"});
        access::PrincipalConfig p;
        std::string role = "user";
        ReadString(ck, *t, "name", where, &p.name);
        ReadString(ck, *t, "role", where, &role);
        if (auto r = access::ParseRole(role)) {
          p.role = *r;
        } else {
          ck.Problem(absl::StrCat(where, "role"),
                     "expected \"admin\", \"user\", \"reader\" or \"metrics\"", t->get("role"));
        }
        ReadStrings(ck, *t, "namespaces", where, &p.namespaces);
        ReadStrings(ck, *t, "token_sha256", where, &p.token_sha256);
        ReadIds(ck, *t, "uids", where, &p.uids);
        ReadIds(ck, *t, "gids", where, &p.gids);
        cfg->principals.push_back(std::move(p));
      }
    }
  }
  if (const toml::table* c = Section(ck, root, "tls", "")) {
    CheckKeys(ck, *c, "tls.", {"cert", "key", "client_ca", "require_client_cert"});
    ReadString(ck, *c, "cert", "tls.", &cfg->tls_cert);
    ReadString(ck, *c, "key", "tls.", &cfg->tls_key);
    ReadString(ck, *c, "client_ca", "tls.", &cfg->tls_client_ca);
    ReadBool(ck, *c, "require_client_cert", "tls.", &cfg->tls_require_client_cert);
  }
  if (const toml::table* c = Section(ck, root, "metrics", "")) {
    CheckKeys(ck, *c, "metrics.", {"listen"});
    ReadString(ck, *c, "listen", "metrics.", &cfg->metrics_listen);
  }
  if (const toml::table* c = Section(ck, root, "health", "")) {
    CheckKeys(ck, *c, "health.", {"interval_ms"});
    ReadInt(ck, *c, "interval_ms", "health.", &cfg->health_interval_ms, 50, 3600000);
  }
  if (const toml::table* c = Section(ck, root, "quota", "")) {
    CheckKeys(ck, *c, "quota.",
              {"shm_mb", "context_mb", "executor_processes", "concurrent_compiles",
               "compile_seconds_per_minute", "calls_per_second", "ops", "versions_per_op",
               "namespaces", "total_shm_mb", "total_context_mb"});
    ReadInt(ck, *c, "shm_mb", "quota.", &cfg->shm_quota_mb);
    ReadInt(ck, *c, "context_mb", "quota.", &cfg->context_mb);
    ReadInt(ck, *c, "executor_processes", "quota.", &cfg->exec_workers, 1);
    ReadInt(ck, *c, "concurrent_compiles", "quota.", &cfg->quota_concurrent_compiles);
    ReadDouble(ck, *c, "compile_seconds_per_minute", "quota.",
               &cfg->quota_compile_seconds_per_minute);
    ReadDouble(ck, *c, "calls_per_second", "quota.", &cfg->quota_calls_per_second);
    ReadInt(ck, *c, "ops", "quota.", &cfg->quota_ops);
    ReadInt(ck, *c, "versions_per_op", "quota.", &cfg->quota_versions);
    ReadInt(ck, *c, "namespaces", "quota.", &cfg->quota_namespaces);
    ReadInt(ck, *c, "total_shm_mb", "quota.", &cfg->quota_total_shm_mb);
    ReadInt(ck, *c, "total_context_mb", "quota.", &cfg->quota_total_context_mb);
  }
  ReadString(ck, root, "state_dir", "", &cfg->state_dir);
  ReadStrings(ck, root, "listen", "", &cfg->listen);
  ReadString(ck, root, "log_level", "", &cfg->log_level);
  ReadBool(ck, root, "allow_insecure_tcp", "", &cfg->allow_insecure_tcp);
  // gRPC takes the message size as an int.
  int64_t max_mb = cfg->max_message_bytes >> 20;
  ReadInt(ck, root, "max_message_mb", "", &max_mb, 1, 2047);
  cfg->max_message_bytes = max_mb << 20;
  if (const toml::table* c = Section(ck, root, "compiler", "")) {
    CheckKeys(ck, *c, "compiler.",
              {"workers", "timeout_ms", "memory_limit_mb", "threads", "extra_include_dirs",
               "allowed_libraries", "kernel_include_dir", "recycle_after", "recycle_memory_mb",
               "long_after_ms", "long_workers", "slow_log_ms", "uid"});
    ReadInt(ck, *c, "workers", "compiler.", &cfg->compile_workers, 1, 1024);
    ReadInt(ck, *c, "timeout_ms", "compiler.", &cfg->compile_timeout_ms, 1);
    ReadInt(ck, *c, "memory_limit_mb", "compiler.", &cfg->compile_memory_limit_mb, 64);
    ReadInt(ck, *c, "threads", "compiler.", &cfg->compile_threads, 0, 1024);
    ReadInt(ck, *c, "recycle_after", "compiler.", &cfg->compile_recycle_after);
    ReadInt(ck, *c, "recycle_memory_mb", "compiler.", &cfg->compile_recycle_memory_mb);
    ReadInt(ck, *c, "long_after_ms", "compiler.", &cfg->compile_long_after_ms);
    ReadInt(ck, *c, "long_workers", "compiler.", &cfg->compile_long_workers, 0, 1024);
    ReadInt(ck, *c, "slow_log_ms", "compiler.", &cfg->compile_slow_log_ms, 0);
    ReadInt(ck, *c, "uid", "compiler.", &cfg->compile_uid, 1, 4294967294);
    ReadStrings(ck, *c, "extra_include_dirs", "compiler.", &cfg->extra_include_dirs);
    ReadStrings(ck, *c, "allowed_libraries", "compiler.", &cfg->allowed_libraries);
    ReadString(ck, *c, "kernel_include_dir", "compiler.", &cfg->kernel_include_dir);
  }
  if (const toml::table* c = Section(ck, root, "exec", "")) {
    CheckKeys(ck, *c, "exec.",
              {"threads", "queue", "inline_max_bytes", "isolation", "workers", "worker_idle_ms",
               "kernel_timeout_ms", "worker_memory_mb", "worker_user", "worker_spin_us",
               "wait_spin_us", "quarantine_after", "uid_range", "threads_per_executor",
               "threads_per_namespace", "scratch_mb", "namespaces", "namespace_memory_mb"});
    ReadInt(ck, *c, "threads", "exec.", &cfg->exec_threads, 1, 1024);
    ReadInt(ck, *c, "queue", "exec.", &cfg->exec_queue);
    ReadInt(ck, *c, "inline_max_bytes", "exec.", &cfg->inline_max_bytes);
    ReadString(ck, *c, "isolation", "exec.", &cfg->isolation);
    ReadInt(ck, *c, "workers", "exec.", &cfg->exec_workers, 1);
    ReadInt(ck, *c, "worker_idle_ms", "exec.", &cfg->worker_idle_ms);
    ReadInt(ck, *c, "kernel_timeout_ms", "exec.", &cfg->kernel_timeout_ms, 1);
    ReadInt(ck, *c, "worker_memory_mb", "exec.", &cfg->worker_memory_mb, 16,
            std::numeric_limits<int64_t>::max() >> 20);
    ReadString(ck, *c, "worker_user", "exec.", &cfg->worker_user);
    ReadString(ck, *c, "uid_range", "exec.", &cfg->uid_range);
    ReadInt(ck, *c, "threads_per_executor", "exec.", &cfg->threads_per_executor, 8, 1 << 20);
    ReadInt(ck, *c, "threads_per_namespace", "exec.", &cfg->threads_per_namespace, 8, 1 << 22);
    ReadInt(ck, *c, "scratch_mb", "exec.", &cfg->scratch_mb, 1, 1 << 20);
    ReadBool(ck, *c, "namespaces", "exec.", &cfg->exec_namespaces);
    ReadInt(ck, *c, "namespace_memory_mb", "exec.", &cfg->namespace_memory_mb, 0, 1 << 30);
    ReadInt(ck, *c, "worker_spin_us", "exec.", &cfg->worker_spin_us, 0, 1000000);
    ReadInt(ck, *c, "wait_spin_us", "exec.", &cfg->wait_spin_us, 0, 1000000);
    ReadInt(ck, *c, "quarantine_after", "exec.", &cfg->quarantine_after);
  }
  if (const toml::table* c = Section(ck, root, "fast", "")) {
    CheckKeys(ck, *c, "fast.", {"enabled", "channels", "total_channels", "spin_us", "handles"});
    ReadBool(ck, *c, "enabled", "fast.", &cfg->fast_enabled);
    ReadInt(ck, *c, "channels", "fast.", &cfg->fast_channels);
    ReadInt(ck, *c, "total_channels", "fast.", &cfg->fast_total_channels);
    ReadInt(ck, *c, "spin_us", "fast.", &cfg->fast_spin_us, 0, 100000);
    ReadInt(ck, *c, "handles", "fast.", &cfg->fast_handles, 1);
  }
  if (const toml::table* c = Section(ck, root, "shm", "")) {
    CheckKeys(ck, *c, "shm.", {"quota_mb", "lease_ms"});
    ReadInt(ck, *c, "quota_mb", "shm.", &cfg->shm_quota_mb);
    ReadInt(ck, *c, "lease_ms", "shm.", &cfg->lease_ms, 1);
  }
  if (const toml::table* c = Section(ck, root, "autograd", "")) {
    CheckKeys(ck, *c, "autograd.", {"context_ttl_ms", "context_mb"});
    ReadInt(ck, *c, "context_ttl_ms", "autograd.", &cfg->context_ttl_ms, 1);
    ReadInt(ck, *c, "context_mb", "autograd.", &cfg->context_mb);
  }
  if (const toml::table* c = Section(ck, root, "cache", "")) {
    CheckKeys(ck, *c, "cache.", {"memory_entries", "memory_mb", "disk_mb", "remote"});
    ReadInt(ck, *c, "memory_entries", "cache.", &cfg->cache_memory_entries);
    ReadInt(ck, *c, "memory_mb", "cache.", &cfg->cache_memory_mb);
    ReadInt(ck, *c, "disk_mb", "cache.", &cfg->cache_disk_mb);
    if (const toml::table* r = Section(ck, *c, "remote", "cache.")) {
      CheckKeys(ck, *r, "cache.remote.", {"url", "key_file", "timeout_ms", "max_mb", "ttl_s"});
      ReadString(ck, *r, "url", "cache.remote.", &cfg->cache_remote_url);
      ReadString(ck, *r, "key_file", "cache.remote.", &cfg->cache_remote_key_file);
      ReadInt(ck, *r, "timeout_ms", "cache.remote.", &cfg->cache_remote_timeout_ms, 1, 60000);
      ReadInt(ck, *r, "max_mb", "cache.remote.", &cfg->cache_remote_max_mb, 1);
      ReadInt(ck, *r, "ttl_s", "cache.remote.", &cfg->cache_remote_ttl_s);
    }
  }
  if (const toml::table* c = Section(ck, root, "registry", "")) {
    CheckKeys(ck, *c, "registry.", {"backend", "url", "password_file", "poll_ms"});
    ReadString(ck, *c, "backend", "registry.", &cfg->registry_backend);
    ReadString(ck, *c, "url", "registry.", &cfg->registry_url);
    ReadString(ck, *c, "password_file", "registry.", &cfg->registry_password_file);
    ReadInt(ck, *c, "poll_ms", "registry.", &cfg->registry_poll_ms, 50, 600000);
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
  if (!ValidLogLevel(cfg.log_level)) {
    ck.Problem("log_level", absl::StrCat("expected trace, debug, info, warn, error, critical or "
                                         "off, not \"", cfg.log_level, "\""));
  }
  if (cfg.isolation != "process" && cfg.isolation != "in-daemon") {
    ck.Problem("exec.isolation", absl::StrCat("expected \"process\" or \"in-daemon\", not \"",
                                              cfg.isolation, "\""));
  }
  if (auto range = ParseUidRange(cfg.uid_range); range.ok()) {
    cfg.uid_first = range->first;
    cfg.uid_last = range->second;
  } else {
    ck.Problem("exec.uid_range", std::string(range.status().message()));
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
  if (cfg.registry_backend != "sqlite" && cfg.registry_backend != "postgres") {
    ck.Problem("registry.backend", absl::StrCat("expected \"sqlite\" or \"postgres\", not \"",
                                                cfg.registry_backend, "\""));
  }
  if (cfg.registry_backend == "postgres" && cfg.registry_url.empty()) {
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

std::string Join(const std::vector<std::string>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
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
         "     found every entry intact; --help, --version\n"
         "  1  could not start (state dir locked or unwritable, registry, listen address,\n"
         "     ...); --check-config found problems; --verify-cache found corrupt entries\n"
         "  2  bad flags or configuration\n";
}

std::string ConfigProblem::ToString() const {
  if (key.empty()) return absl::StrCat(where, ": ", message);
  return absl::StrCat(where, ": ", key, ": ", message);
}

bool ValidLogLevel(const std::string& level) {
  static const std::set<std::string> kLevels = {"trace", "debug", "info", "warn",
                                                "error", "critical", "off"};
  return kLevels.count(level) > 0;
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
  }
  if (!flags.isolation.empty()) {
    cfg.isolation = flags.isolation;
    ck.SawFlag("exec.isolation", "--isolation");
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
  auto n = [](auto v) { return absl::StrCat(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", c.socket_mode);
  return {
      {"state_dir", c.state_dir},
      {"listen", Join(c.listen)},
      {"log_level", c.log_level},
      {"max_message_mb", n(c.max_message_bytes >> 20)},
      {"allow_insecure_tcp", b(c.allow_insecure_tcp)},
      {"socket_mode", mode},
      {"socket_group", c.socket_group},
      {"tls.cert", c.tls_cert},
      {"tls.key", c.tls_key},
      {"tls.client_ca", c.tls_client_ca},
      {"tls.require_client_cert", b(c.tls_require_client_cert)},
      {"metrics.listen", c.metrics_listen},
      {"health.interval_ms", n(c.health_interval_ms)},
      {"quota.concurrent_compiles", n(c.quota_concurrent_compiles)},
      {"quota.compile_seconds_per_minute", n(c.quota_compile_seconds_per_minute)},
      {"quota.calls_per_second", n(c.quota_calls_per_second)},
      {"quota.ops", n(c.quota_ops)},
      {"quota.versions_per_op", n(c.quota_versions)},
      {"quota.namespaces", n(c.quota_namespaces)},
      {"quota.total_shm_mb", n(c.quota_total_shm_mb)},
      {"quota.total_context_mb", n(c.quota_total_context_mb)},
      {"compiler.workers", n(c.compile_workers)},
      {"compiler.timeout_ms", n(c.compile_timeout_ms)},
      {"compiler.memory_limit_mb", n(c.compile_memory_limit_mb)},
      {"compiler.threads", n(c.compile_threads)},
      {"compiler.recycle_after", n(c.compile_recycle_after)},
      {"compiler.recycle_memory_mb", n(c.compile_recycle_memory_mb)},
      {"compiler.long_after_ms", n(c.compile_long_after_ms)},
      {"compiler.long_workers", n(c.compile_long_workers)},
      {"compiler.slow_log_ms", n(c.compile_slow_log_ms)},
      {"compiler.uid", n(c.compile_uid)},
      {"compiler.extra_include_dirs", Join(c.extra_include_dirs)},
      {"compiler.allowed_libraries", Join(c.allowed_libraries)},
      {"compiler.kernel_include_dir", c.kernel_include_dir},
      {"exec.threads", n(c.exec_threads)},
      {"exec.queue", n(c.exec_queue)},
      {"exec.inline_max_bytes", n(c.inline_max_bytes)},
      {"exec.isolation", c.isolation},
      {"exec.workers", n(c.exec_workers)},
      {"exec.worker_idle_ms", n(c.worker_idle_ms)},
      {"exec.kernel_timeout_ms", n(c.kernel_timeout_ms)},
      {"exec.worker_memory_mb", n(c.worker_memory_mb)},
      {"exec.worker_user", c.worker_user},
      {"exec.uid_range", c.uid_range},
      {"exec.threads_per_executor", n(c.threads_per_executor)},
      {"exec.threads_per_namespace", n(c.threads_per_namespace)},
      {"exec.scratch_mb", n(c.scratch_mb)},
      {"exec.namespaces", b(c.exec_namespaces)},
      {"exec.namespace_memory_mb", n(c.namespace_memory_mb)},
      {"exec.worker_spin_us", n(c.worker_spin_us)},
      {"exec.wait_spin_us", n(c.wait_spin_us)},
      {"exec.quarantine_after", n(c.quarantine_after)},
      {"fast.enabled", b(c.fast_enabled)},
      {"fast.channels", n(c.fast_channels)},
      {"fast.total_channels", n(c.fast_total_channels)},
      {"fast.spin_us", n(c.fast_spin_us)},
      {"fast.handles", n(c.fast_handles)},
      {"shm.quota_mb", n(c.shm_quota_mb)},
      {"shm.lease_ms", n(c.lease_ms)},
      {"autograd.context_ttl_ms", n(c.context_ttl_ms)},
      {"autograd.context_mb", n(c.context_mb)},
      {"cache.memory_entries", n(c.cache_memory_entries)},
      {"cache.memory_mb", n(c.cache_memory_mb)},
      {"cache.disk_mb", n(c.cache_disk_mb)},
      {"cache.remote.url", c.cache_remote_url},
      {"cache.remote.key_file", c.cache_remote_key_file},
      {"cache.remote.timeout_ms", n(c.cache_remote_timeout_ms)},
      {"cache.remote.max_mb", n(c.cache_remote_max_mb)},
      {"cache.remote.ttl_s", n(c.cache_remote_ttl_s)},
      {"registry.backend", c.registry_backend},
      {"registry.url", c.registry_url},
      {"registry.password_file", c.registry_password_file},
      {"registry.poll_ms", n(c.registry_poll_ms)},
  };
}

}  // namespace opjit

#include "server/config.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>

#include <toml++/toml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace opjit {
namespace {

absl::Status BadKey(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", why));
}

template <typename T>
absl::Status ReadInt(const toml::table& t, const char* key, const std::string& where, T* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  auto v = n->value<int64_t>();
  if (!v || *v < 0) return BadKey(absl::StrCat(where, key), "expected a non-negative integer");
  *out = static_cast<T>(*v);
  return absl::OkStatus();
}

absl::Status ReadString(const toml::table& t, const char* key, const std::string& where,
                        std::string* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  auto v = n->value<std::string>();
  if (!v) return BadKey(absl::StrCat(where, key), "expected a string");
  *out = *v;
  return absl::OkStatus();
}

absl::Status ReadBool(const toml::table& t, const char* key, const std::string& where,
                      bool* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  auto v = n->value<bool>();
  if (!v) return BadKey(absl::StrCat(where, key), "expected true or false");
  *out = *v;
  return absl::OkStatus();
}

absl::Status ReadStrings(const toml::table& t, const char* key, const std::string& where,
                         std::vector<std::string>* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  const toml::array* arr = n->as_array();
  if (arr == nullptr) return BadKey(absl::StrCat(where, key), "expected an array of strings");
  out->clear();
  for (const auto& e : *arr) {
    auto v = e.value<std::string>();
    if (!v) return BadKey(absl::StrCat(where, key), "expected an array of strings");
    out->push_back(*v);
  }
  return absl::OkStatus();
}

absl::Status ReadDouble(const toml::table& t, const char* key, const std::string& where,
                        double* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  std::optional<double> v = n->value<double>();
  if (!v || *v < 0) return BadKey(absl::StrCat(where, key), "expected a non-negative number");
  *out = *v;
  return absl::OkStatus();
}

absl::Status ReadIds(const toml::table& t, const char* key, const std::string& where,
                     std::vector<uint32_t>* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  const toml::array* arr = n->as_array();
  if (arr == nullptr) return BadKey(absl::StrCat(where, key), "expected an array of integers");
  for (const auto& e : *arr) {
    auto v = e.value<int64_t>();
    if (!v || *v < 0 || *v > 0xfffffffell) {
      return BadKey(absl::StrCat(where, key), "expected an array of uids/gids");
    }
    out->push_back(static_cast<uint32_t>(*v));
  }
  return absl::OkStatus();
}

absl::Status CheckKeys(const toml::table& t, const std::string& where,
                       const std::set<std::string>& known) {
  for (const auto& [k, v] : t) {
    if (!known.count(std::string(k.str()))) {
      return BadKey(absl::StrCat(where, std::string(k.str())),
                    absl::StrCat("unknown key (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

#define OPJIT_CFG_TRY(expr)                \
  do {                                     \
    absl::Status s_ = (expr);              \
    if (!s_.ok()) return s_;               \
  } while (0)

absl::Status ApplyToml(const std::string& path, DaemonConfig* cfg) {
  toml::table root;
  try {
    // toml++ reports parse errors by exception; they stay inside this function.
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config ", path, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
        std::string(e.description())));
  }
  OPJIT_CFG_TRY(CheckKeys(root, "",
                          {"state_dir", "listen", "log_level", "max_message_mb", "allow_insecure_tcp", "compiler",
                           "cache", "exec", "shm", "autograd", "socket_mode", "socket_group",
                           "principal", "tls", "metrics", "health", "quota", "fast", "registry"}));
  OPJIT_CFG_TRY(ReadString(root, "socket_group", "", &cfg->socket_group));
  if (const toml::node* n = root.get("socket_mode")) {
    auto v = n->value<std::string>();
    char* end = nullptr;
    const unsigned long mode = v ? std::strtoul(v->c_str(), &end, 8) : 0;
    if (!v || v->empty() || *end != '\0' || mode > 0777) {
      return BadKey("socket_mode", "expected an octal mode string such as \"0660\"");
    }
    cfg->socket_mode = static_cast<unsigned>(mode);
  }
  if (const toml::node* n = root.get("principal")) {
    const toml::array* arr = n->as_array();
    if (arr == nullptr) return BadKey("principal", "expected [[principal]] tables");
    for (size_t i = 0; i < arr->size(); ++i) {
      const toml::table* t = (*arr)[i].as_table();
      const std::string where = absl::StrCat("principal[", i, "].");
      if (t == nullptr) return BadKey(where, "expected a table");
      OPJIT_CFG_TRY(CheckKeys(*t, where, {"name", "role", "namespaces", "token_sha256", "uids", "gids"}));
      access::PrincipalConfig p;
      std::string role = "user";
      OPJIT_CFG_TRY(ReadString(*t, "name", where, &p.name));
      OPJIT_CFG_TRY(ReadString(*t, "role", where, &role));
      auto r = access::ParseRole(role);
      if (!r) {
        return BadKey(absl::StrCat(where, "role"),
                      "expected \"admin\", \"user\", \"reader\" or \"metrics\"");
      }
      p.role = *r;
      OPJIT_CFG_TRY(ReadStrings(*t, "namespaces", where, &p.namespaces));
      OPJIT_CFG_TRY(ReadStrings(*t, "token_sha256", where, &p.token_sha256));
      OPJIT_CFG_TRY(ReadIds(*t, "uids", where, &p.uids));
      OPJIT_CFG_TRY(ReadIds(*t, "gids", where, &p.gids));
      cfg->principals.push_back(std::move(p));
    }
  }
  if (const toml::table* c = root["tls"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "tls.", {"cert", "key", "client_ca", "require_client_cert"}));
    OPJIT_CFG_TRY(ReadString(*c, "cert", "tls.", &cfg->tls_cert));
    OPJIT_CFG_TRY(ReadString(*c, "key", "tls.", &cfg->tls_key));
    OPJIT_CFG_TRY(ReadString(*c, "client_ca", "tls.", &cfg->tls_client_ca));
    OPJIT_CFG_TRY(ReadBool(*c, "require_client_cert", "tls.", &cfg->tls_require_client_cert));
    if (cfg->tls_cert.empty() != cfg->tls_key.empty()) {
      return BadKey("tls", "cert and key go together");
    }
  }
  if (const toml::table* c = root["metrics"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "metrics.", {"listen"}));
    OPJIT_CFG_TRY(ReadString(*c, "listen", "metrics.", &cfg->metrics_listen));
  }
  if (const toml::table* c = root["health"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "health.", {"interval_ms"}));
    OPJIT_CFG_TRY(ReadInt(*c, "interval_ms", "health.", &cfg->health_interval_ms));
  }
  if (const toml::table* c = root["quota"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "quota.",
                            {"shm_mb", "context_mb", "executor_processes", "concurrent_compiles",
                             "compile_seconds_per_minute", "calls_per_second", "ops",
                             "versions_per_op", "namespaces", "total_shm_mb", "total_context_mb"}));
    OPJIT_CFG_TRY(ReadInt(*c, "shm_mb", "quota.", &cfg->shm_quota_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "context_mb", "quota.", &cfg->context_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "executor_processes", "quota.", &cfg->exec_workers));
    OPJIT_CFG_TRY(ReadInt(*c, "concurrent_compiles", "quota.", &cfg->quota_concurrent_compiles));
    OPJIT_CFG_TRY(ReadDouble(*c, "compile_seconds_per_minute", "quota.",
                             &cfg->quota_compile_seconds_per_minute));
    OPJIT_CFG_TRY(ReadDouble(*c, "calls_per_second", "quota.", &cfg->quota_calls_per_second));
    OPJIT_CFG_TRY(ReadInt(*c, "ops", "quota.", &cfg->quota_ops));
    OPJIT_CFG_TRY(ReadInt(*c, "versions_per_op", "quota.", &cfg->quota_versions));
    OPJIT_CFG_TRY(ReadInt(*c, "namespaces", "quota.", &cfg->quota_namespaces));
    OPJIT_CFG_TRY(ReadInt(*c, "total_shm_mb", "quota.", &cfg->quota_total_shm_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "total_context_mb", "quota.", &cfg->quota_total_context_mb));
  }
  OPJIT_CFG_TRY(ReadString(root, "state_dir", "", &cfg->state_dir));
  OPJIT_CFG_TRY(ReadStrings(root, "listen", "", &cfg->listen));
  OPJIT_CFG_TRY(ReadString(root, "log_level", "", &cfg->log_level));
  OPJIT_CFG_TRY(ReadBool(root, "allow_insecure_tcp", "", &cfg->allow_insecure_tcp));
  int64_t max_mb = cfg->max_message_bytes >> 20;
  OPJIT_CFG_TRY(ReadInt(root, "max_message_mb", "", &max_mb));
  cfg->max_message_bytes = max_mb << 20;
  if (const toml::table* c = root["compiler"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "compiler.",
                            {"workers", "timeout_ms", "memory_limit_mb", "threads",
                             "extra_include_dirs", "allowed_libraries", "kernel_include_dir",
                             "recycle_after", "recycle_memory_mb", "long_after_ms",
                             "long_workers"}));
    OPJIT_CFG_TRY(ReadInt(*c, "workers", "compiler.", &cfg->compile_workers));
    OPJIT_CFG_TRY(ReadInt(*c, "timeout_ms", "compiler.", &cfg->compile_timeout_ms));
    OPJIT_CFG_TRY(ReadInt(*c, "memory_limit_mb", "compiler.", &cfg->compile_memory_limit_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "threads", "compiler.", &cfg->compile_threads));
    OPJIT_CFG_TRY(ReadInt(*c, "recycle_after", "compiler.", &cfg->compile_recycle_after));
    OPJIT_CFG_TRY(ReadInt(*c, "recycle_memory_mb", "compiler.", &cfg->compile_recycle_memory_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "long_after_ms", "compiler.", &cfg->compile_long_after_ms));
    OPJIT_CFG_TRY(ReadInt(*c, "long_workers", "compiler.", &cfg->compile_long_workers));
    OPJIT_CFG_TRY(ReadStrings(*c, "extra_include_dirs", "compiler.", &cfg->extra_include_dirs));
    OPJIT_CFG_TRY(ReadStrings(*c, "allowed_libraries", "compiler.", &cfg->allowed_libraries));
    OPJIT_CFG_TRY(ReadString(*c, "kernel_include_dir", "compiler.", &cfg->kernel_include_dir));
  }
  if (const toml::table* c = root["exec"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "exec.",
                            {"threads", "queue", "inline_max_bytes", "isolation", "workers",
                             "worker_idle_ms", "kernel_timeout_ms", "worker_memory_mb",
                             "worker_user", "worker_spin_us", "wait_spin_us", "quarantine_after"}));
    OPJIT_CFG_TRY(ReadInt(*c, "threads", "exec.", &cfg->exec_threads));
    OPJIT_CFG_TRY(ReadInt(*c, "queue", "exec.", &cfg->exec_queue));
    OPJIT_CFG_TRY(ReadInt(*c, "inline_max_bytes", "exec.", &cfg->inline_max_bytes));
    OPJIT_CFG_TRY(ReadString(*c, "isolation", "exec.", &cfg->isolation));
    OPJIT_CFG_TRY(ReadInt(*c, "workers", "exec.", &cfg->exec_workers));
    OPJIT_CFG_TRY(ReadInt(*c, "worker_idle_ms", "exec.", &cfg->worker_idle_ms));
    OPJIT_CFG_TRY(ReadInt(*c, "kernel_timeout_ms", "exec.", &cfg->kernel_timeout_ms));
    OPJIT_CFG_TRY(ReadInt(*c, "worker_memory_mb", "exec.", &cfg->worker_memory_mb));
    OPJIT_CFG_TRY(ReadString(*c, "worker_user", "exec.", &cfg->worker_user));
    OPJIT_CFG_TRY(ReadInt(*c, "worker_spin_us", "exec.", &cfg->worker_spin_us));
    OPJIT_CFG_TRY(ReadInt(*c, "wait_spin_us", "exec.", &cfg->wait_spin_us));
    OPJIT_CFG_TRY(ReadInt(*c, "quarantine_after", "exec.", &cfg->quarantine_after));
  }
  if (const toml::table* c = root["fast"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "fast.", {"enabled", "channels", "total_channels", "spin_us", "handles"}));
    OPJIT_CFG_TRY(ReadBool(*c, "enabled", "fast.", &cfg->fast_enabled));
    OPJIT_CFG_TRY(ReadInt(*c, "channels", "fast.", &cfg->fast_channels));
    OPJIT_CFG_TRY(ReadInt(*c, "total_channels", "fast.", &cfg->fast_total_channels));
    OPJIT_CFG_TRY(ReadInt(*c, "spin_us", "fast.", &cfg->fast_spin_us));
    OPJIT_CFG_TRY(ReadInt(*c, "handles", "fast.", &cfg->fast_handles));
  }
  if (const toml::table* c = root["shm"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "shm.", {"quota_mb", "lease_ms"}));
    OPJIT_CFG_TRY(ReadInt(*c, "quota_mb", "shm.", &cfg->shm_quota_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "lease_ms", "shm.", &cfg->lease_ms));
  }
  if (const toml::table* c = root["autograd"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "autograd.", {"context_ttl_ms", "context_mb"}));
    OPJIT_CFG_TRY(ReadInt(*c, "context_ttl_ms", "autograd.", &cfg->context_ttl_ms));
    OPJIT_CFG_TRY(ReadInt(*c, "context_mb", "autograd.", &cfg->context_mb));
  }
  if (const toml::table* c = root["cache"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "cache.", {"memory_entries", "memory_mb", "disk_mb", "remote"}));
    OPJIT_CFG_TRY(ReadInt(*c, "memory_entries", "cache.", &cfg->cache_memory_entries));
    OPJIT_CFG_TRY(ReadInt(*c, "memory_mb", "cache.", &cfg->cache_memory_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "disk_mb", "cache.", &cfg->cache_disk_mb));
    if (const toml::table* r = (*c)["remote"].as_table()) {
      OPJIT_CFG_TRY(CheckKeys(*r, "cache.remote.", {"url", "key_file", "timeout_ms", "max_mb", "ttl_s"}));
      OPJIT_CFG_TRY(ReadString(*r, "url", "cache.remote.", &cfg->cache_remote_url));
      OPJIT_CFG_TRY(ReadString(*r, "key_file", "cache.remote.", &cfg->cache_remote_key_file));
      OPJIT_CFG_TRY(ReadInt(*r, "timeout_ms", "cache.remote.", &cfg->cache_remote_timeout_ms));
      OPJIT_CFG_TRY(ReadInt(*r, "max_mb", "cache.remote.", &cfg->cache_remote_max_mb));
      OPJIT_CFG_TRY(ReadInt(*r, "ttl_s", "cache.remote.", &cfg->cache_remote_ttl_s));
    }
  }
  if (const toml::table* c = root["registry"].as_table()) {
    OPJIT_CFG_TRY(CheckKeys(*c, "registry.", {"backend", "url", "password_file", "poll_ms"}));
    OPJIT_CFG_TRY(ReadString(*c, "backend", "registry.", &cfg->registry_backend));
    OPJIT_CFG_TRY(ReadString(*c, "url", "registry.", &cfg->registry_url));
    OPJIT_CFG_TRY(ReadString(*c, "password_file", "registry.", &cfg->registry_password_file));
    OPJIT_CFG_TRY(ReadInt(*c, "poll_ms", "registry.", &cfg->registry_poll_ms));
  }
  return absl::OkStatus();
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
  return "usage: opjitd [--listen ADDR]... [--state-dir DIR] [--config FILE] [--log-level LEVEL]\n"
         "              [--isolation process|in-daemon] [--allow-insecure-tcp]\n"
         "       opjitd --verify-cache [--state-dir DIR]\n"
         "\n"
         "  --listen ADDR     unix:/path/to.sock or host:port (port 0: any free port).\n"
         "                    Repeatable. Default: unix:<state-dir>/opjitd.sock and 127.0.0.1:7878\n"
         "  --allow-insecure-tcp  allow a TCP address other than loopback (no TLS, no auth:\n"
         "                    anyone who reaches it can run code; trusted networks only)\n"
         "  --state-dir DIR   registry, cache and socket live here.\n"
         "                    Default: $OPJIT_STATE_DIR, else ~/.opjit\n"
         "  --config FILE     TOML configuration (see deploy/opjitd.toml)\n"
         "  --log-level L     trace, debug, info, warn, error (default info)\n"
         "  --verify-cache    check every disk-cache entry's checksum (the daemon may be\n"
         "                    running or not), print what does not verify, and exit:\n"
         "                    status 0 when all verify, 1 otherwise\n"
         "  --isolation M     where kernels run: process (sandboxed executor processes, the\n"
         "                    default) or in-daemon (inside opjitd; unsafe, trusted users only)\n";
}

absl::StatusOr<DaemonConfig> LoadConfig(int argc, char** argv) {
  DaemonConfig cfg;
  std::vector<std::string> flag_listen;
  std::string flag_state_dir, flag_config, flag_log_level, flag_isolation;
  bool flag_insecure = false;
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
    if (arg == "--allow-insecure-tcp") {
      flag_insecure = true;
      continue;
    }
    if (arg == "--verify-cache") {
      cfg.verify_cache = true;
      continue;
    }
    if (is("--listen")) {
      v = value("--listen");
      if (v.ok()) flag_listen.push_back(*v);
    } else if (is("--state-dir")) {
      v = value("--state-dir");
      if (v.ok()) flag_state_dir = *v;
    } else if (is("--config")) {
      v = value("--config");
      if (v.ok()) flag_config = *v;
    } else if (is("--isolation")) {
      v = value("--isolation");
      if (v.ok()) flag_isolation = *v;
    } else if (is("--log-level")) {
      v = value("--log-level");
      if (v.ok()) flag_log_level = *v;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg, "\n\n", Usage()));
    }
    if (!v.ok()) return v.status();
  }
  if (!flag_config.empty()) OPJIT_CFG_TRY(ApplyToml(flag_config, &cfg));
  if (!flag_state_dir.empty()) cfg.state_dir = flag_state_dir;
  if (!flag_listen.empty()) cfg.listen = flag_listen;
  if (!flag_log_level.empty()) cfg.log_level = flag_log_level;
  if (!flag_isolation.empty()) cfg.isolation = flag_isolation;
  if (flag_insecure) cfg.allow_insecure_tcp = true;
  if (cfg.isolation != "process" && cfg.isolation != "in-daemon") {
    return absl::InvalidArgumentError(absl::StrCat(
        "exec.isolation must be \"process\" or \"in-daemon\", not \"", cfg.isolation, "\""));
  }
  if (cfg.exec_workers < 1) return absl::InvalidArgumentError("exec.workers must be >= 1");
  if (cfg.fast_channels < 0 || cfg.fast_total_channels < 0 || cfg.fast_handles < 1 || cfg.fast_spin_us < 0 ||
      cfg.fast_spin_us > 100000) {
    return absl::InvalidArgumentError(
        "fast: channels and total_channels must be >= 0, handles >= 1, spin_us in [0, 100000]");
  }
  if (cfg.kernel_timeout_ms < 1) {
    return absl::InvalidArgumentError("exec.kernel_timeout_ms must be >= 1");
  }
  if (cfg.state_dir.empty()) cfg.state_dir = DefaultStateDir();
  std::error_code ec;
  cfg.state_dir = std::filesystem::absolute(cfg.state_dir, ec).lexically_normal().string();
  while (cfg.state_dir.size() > 1 && cfg.state_dir.back() == '/') cfg.state_dir.pop_back();
  if (cfg.listen.empty()) cfg.listen = {DefaultSocketAddress(cfg.state_dir), kDefaultTcpAddress};
  for (const std::string& address : cfg.listen) {
    if (address.rfind("unix:", 0) == 0 || IsLoopbackTcp(address) || cfg.allow_insecure_tcp) continue;
    if (!cfg.tls_cert.empty() && !cfg.principals.empty()) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address ", address,
        " is not loopback: that needs TLS ([tls] cert and key) and principals ([[principal]] "
        "with tokens), or anyone who can reach it could run code and read tensors. Listen on "
        "127.0.0.1 or a unix socket, configure both, or set allow_insecure_tcp = true "
        "(--allow-insecure-tcp) on a trusted network"));
  }
  if (cfg.compile_workers < 1) return absl::InvalidArgumentError("compiler.workers must be >= 1");
  if (cfg.compile_threads < 0) return absl::InvalidArgumentError("compiler.threads must be >= 0");
  if (cfg.compile_recycle_after < 0 || cfg.compile_recycle_memory_mb < 0 ||
      cfg.compile_long_after_ms < 0 || cfg.compile_long_workers < 0) {
    return absl::InvalidArgumentError(
        "compiler.recycle_after, recycle_memory_mb, long_after_ms and long_workers must be >= 0");
  }
  if (cfg.registry_backend != "sqlite" && cfg.registry_backend != "postgres") {
    return absl::InvalidArgumentError(absl::StrCat(
        "registry.backend must be \"sqlite\" or \"postgres\", not \"", cfg.registry_backend, "\""));
  }
  if (cfg.registry_backend == "postgres" && cfg.registry_url.empty()) {
    return absl::InvalidArgumentError(
        "registry.backend = \"postgres\" needs registry.url (a libpq connection string such as "
        "\"host=db.example port=5432 dbname=opjit user=opjit\")");
  }
  if (cfg.registry_poll_ms < 50 || cfg.registry_poll_ms > 600000) {
    return absl::InvalidArgumentError("registry.poll_ms must be in [50, 600000]");
  }
  if (!cfg.cache_remote_url.empty() && cfg.cache_remote_key_file.empty()) {
    return absl::InvalidArgumentError(
        "cache.remote.url needs cache.remote.key_file: the cluster key that authenticates "
        "shared entries (the same file on every daemon, e.g. 32 random bytes)");
  }
  if (cfg.cache_remote_timeout_ms < 1 || cfg.cache_remote_timeout_ms > 60000 ||
      cfg.cache_remote_max_mb < 1 || cfg.cache_remote_ttl_s < 0) {
    return absl::InvalidArgumentError(
        "cache.remote: timeout_ms must be in [1, 60000], max_mb >= 1, ttl_s >= 0");
  }
  if (cfg.quota_calls_per_second < 0) {
    cfg.quota_calls_per_second = cfg.principals.empty() ? 0 : kSharedCallsPerSecond;
  }
  if (cfg.max_message_bytes < (1 << 20)) {
    return absl::InvalidArgumentError("max_message_mb must be >= 1");
  }
  return cfg;
}

}  // namespace opjit

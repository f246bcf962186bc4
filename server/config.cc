#include "server/config.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
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
                           "cache", "exec", "shm", "autograd"}));
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
    OPJIT_CFG_TRY(CheckKeys(*c, "cache.", {"memory_entries", "memory_mb", "disk_mb"}));
    OPJIT_CFG_TRY(ReadInt(*c, "memory_entries", "cache.", &cfg->cache_memory_entries));
    OPJIT_CFG_TRY(ReadInt(*c, "memory_mb", "cache.", &cfg->cache_memory_mb));
    OPJIT_CFG_TRY(ReadInt(*c, "disk_mb", "cache.", &cfg->cache_disk_mb));
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
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address ", address,
        " is not loopback, and TCP has no TLS or authentication yet: anyone who can reach it "
        "could run code and read tensors. Listen on 127.0.0.1 or a unix socket, or set "
        "allow_insecure_tcp = true (--allow-insecure-tcp) on a trusted network"));
  }
  if (cfg.compile_workers < 1) return absl::InvalidArgumentError("compiler.workers must be >= 1");
  if (cfg.compile_threads < 0) return absl::InvalidArgumentError("compiler.threads must be >= 0");
  if (cfg.compile_recycle_after < 0 || cfg.compile_recycle_memory_mb < 0 ||
      cfg.compile_long_after_ms < 0 || cfg.compile_long_workers < 0) {
    return absl::InvalidArgumentError(
        "compiler.recycle_after, recycle_memory_mb, long_after_ms and long_workers must be >= 0");
  }
  if (cfg.max_message_bytes < (1 << 20)) {
    return absl::InvalidArgumentError("max_message_mb must be >= 1");
  }
  return cfg;
}

}  // namespace opjit

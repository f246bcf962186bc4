// opjitd configuration: embedded defaults, then a TOML file, then flags.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/access/access.h"
#include "server/common/paths.h"

namespace opjit {

// [quota] calls_per_second's default on a daemon with principals.
inline constexpr double kSharedCallsPerSecond = 20000;

// [exec] isolation: where kernels run.
enum class Isolation {
  kProcess,   // "process": sandboxed opjit-exec-worker processes (the default)
  kInDaemon,  // "in-daemon": inside opjitd, unconfined (a trusted single user)
};
// [registry] backend: where op versions are stored.
enum class RegistryBackend {
  kSqlite,    // "sqlite": <state_dir>/registry.db (the default)
  kPostgres,  // "postgres": registry.url
};
// The config's spelling of each ("process", "postgres", ...).
const char* IsolationName(Isolation isolation);
const char* RegistryBackendName(RegistryBackend backend);

// The flags that override the config file. Kept, so that a reload (SIGHUP)
// applies them over the file again.
struct ConfigFlags {
  std::vector<std::string> listen;
  std::string state_dir, log_level, isolation;
  bool allow_insecure_tcp = false;
};

struct DaemonConfig {
  // Everything the daemon keeps: registry.db, cache/, the lock file.
  // Default: $OPJIT_STATE_DIR, else $HOME/.opjit, else /tmp/opjit-<uid>.
  std::string state_dir;
  // Endpoints: "unix:/path" or "host:port" (port 0 picks a free one).
  // Default: unix:<state_dir>/opjitd.sock and 127.0.0.1:7878.
  std::vector<std::string> listen;
  // trace, debug, info, warn, error. Default: info.
  std::string log_level = "info";
  // Largest gRPC message, both directions: inline tensors of a call must fit
  // (256 MiB of them, plus headers). Default: 320 MiB.
  int64_t max_message_bytes = 320ll << 20;
  // TCP addresses other than loopback are refused without TLS unless this
  // is set. Default: false.
  bool allow_insecure_tcp = false;
  // Mode and group of the unix socket. Default: 0660, the daemon's group.
  unsigned socket_mode = 0660;
  std::string socket_group;

  // [[principal]]: who may call (see server/access/access.h). None: the
  // embedded default, every local caller is admin.
  std::vector<access::PrincipalConfig> principals;

  // [tls]: PEM files; with cert and key set, every TCP address uses TLS.
  std::string tls_cert, tls_key, tls_client_ca;
  bool tls_require_client_cert = false;

  // [metrics] listen: "host:port" of the Prometheus endpoint ("": off). With
  // principals, a scrape needs a bearer token; non-admins see only their
  // namespaces' series.
  std::string metrics_listen;

  // [health] interval_ms: how often workers and the store are probed.
  int64_t health_interval_ms = 2000;

  // [quota] per namespace (shm and context bytes are in [shm]/[autograd];
  // executor processes are exec.workers) and for the whole server.
  int quota_concurrent_compiles = 8;
  double quota_compile_seconds_per_minute = 120;
  // Unset (< 0): kSharedCallsPerSecond once principals are configured, else 0
  // (no bound: the embedded single-user daemon has nobody to share with, and
  // one C++ client on a fast channel makes ~300,000 calls/s).
  double quota_calls_per_second = -1;
  int64_t quota_ops = 1000;
  int64_t quota_versions = 100;
  int64_t quota_namespaces = 64;
  int64_t quota_total_shm_mb = 0;      // 0: a quarter of /dev/shm
  int64_t quota_total_context_mb = 4096;
  // --verify-cache: check the disk cache and exit instead of serving.
  bool verify_cache = false;
  // --check-config FILE: validate FILE and exit instead of serving.
  std::string check_config;
  // --version: print the version and exit.
  bool version = false;
  // --config FILE ("" when none): what a SIGHUP reads again.
  std::string config_file;
  // The flags given, applied again over the file on a reload.
  ConfigFlags flags;

  // [compiler]
  int compile_workers = 2;
  int compile_timeout_ms = 30000;
  int64_t compile_memory_limit_mb = 2048;
  int compile_threads = 0;              // 0: workers + long_workers
  int compile_recycle_after = 256;      // compiles, then a worker is replaced
  int64_t compile_recycle_memory_mb = 0;  // address space that retires a worker (0: half the limit)
  int compile_long_after_ms = 1000;     // a compile running longer moves to the long lane
  int compile_slow_log_ms = 5000;       // a compile running longer is logged (0: never)
  int compile_long_workers = 2;         // compiles in the long lane at once
  // In the long lane timeout_ms counts the worker's CPU time; this bounds
  // the wall time (a busy machine slows a compile without stopping it).
  int compile_long_timeout_ms = 120000;
  // compiler.uid: started as root, the compile workers (and the NVRTC
  // sandboxes) run as this uid and the gid of the same number, keeping only
  // CAP_DAC_READ_SEARCH (to read the include directories, often 0700
  // root's; Landlock still limits what they read). Never root, nobody, or
  // a uid of exec.uid_range (no executor has it). The default is the uid
  // right after the default exec.uid_range. A non-root daemon's compile
  // workers run as its last subordinate uid where it has subordinate ids
  // (main.cc PickSubordinateIds), else as its own uid.
  int64_t compile_uid = 1879113728;
  std::vector<std::string> extra_include_dirs;
  std::vector<std::string> allowed_libraries;
  std::string kernel_include_dir;  // Default: the installed or source-tree kernels/include
  // compiler.profiles: the named toolchain profiles this daemon offers
  // (server/compiler/toolchain_profile.h), each where it is installed (one
  // that is not is logged and stays off). A kernel selects one by naming
  // one of its libraries. Default: ["aten"] (PyTorch's C++ API where
  // libtorch-dev, python3-dev and pybind11-dev are installed).
  std::vector<std::string> compiler_profiles = {"aten"};
  // [toolchains.aten]: who may select the "aten" profile ("*": every
  // namespace), and whether its shared PCH of <torch/extension.h> is built
  // as the daemon starts (else at the first compile that selects it).
  std::vector<std::string> aten_namespaces = {"*"};
  bool aten_pch_at_start = false;

  // [exec]
  int exec_threads = 2;                 // execution pool threads
  int64_t exec_queue = 64;              // calls waiting for the pool, then RESOURCE_EXHAUSTED
  int64_t inline_max_bytes = 256 << 10; // calls with at most this many input bytes run inline
  // Where kernels run: "process" (sandboxed opjit-exec-worker processes, one
  // pool per namespace) or "in-daemon" (inside opjitd: unsafe, for a trusted
  // single user).
  Isolation isolation = Isolation::kProcess;
  int exec_workers = 2;                  // executor processes per namespace, at most
  int64_t worker_idle_ms = 60000;        // an idle executor process is stopped after this
  int64_t kernel_timeout_ms = 60000;     // a kernel running longer is killed (DEADLINE_EXCEEDED)
  int64_t worker_memory_mb = 4096;       // private memory of an executor process (RLIMIT_DATA)
  std::string worker_user = "nobody";    // started as root, executors drop to this user ("" keeps root)
  // Started as root, each namespace's executors run as a uid (and the gid of
  // the same number) of their own from this range, "<first>-<last>": the
  // lowest one that no daemon on the host holds (claimed in uid_claim_dir),
  // held for the daemon's life. The default,
  // 0x70000000 + 64 Ki, lies outside regular users, Debian's subordinate
  // uids (100000-600100000) and systemd's container (524288-1879048191) and
  // foreign (2147352576-2147418111) ranges. "": every namespace's executors
  // run as worker_user, and tenants are not apart by uid (logged).
  std::string uid_range = "1879048192-1879113727";
  uint32_t uid_first = 1879048192, uid_last = 1879113727;  // uid_range, parsed (0, 0: "")
  // Where every daemon of the host claims the uids it hands out (uid_range,
  // or a non-root daemon's subordinate ids), so that no two daemons give
  // their tenants one uid (server/common/uid_claims.h): a directory only its
  // owner writes, root's or the daemon user's. A root daemon creates it
  // (0700); the package's tmpfiles.d makes it for opjit.
  std::string uid_claim_dir = "/run/opjit-uids";
  // Threads an executor may keep while no call runs in it: a pool call
  // that leaves more fails (RESOURCE_EXHAUSTED) and ends its executor; an
  // idle executor (pool or fast channel) found with more, counted every
  // ~100 ms, is stopped.
  int64_t threads_per_executor = 256;
  // Threads (and processes) of all of a namespace's executors together
  // (RLIMIT_NPROC of its uid; only with uid_range on a root daemon).
  int64_t threads_per_namespace = 1024;
  // exec.scratch_mb: an executor's scratch space (a private tmpfs on a root
  // daemon; a cap per file otherwise), MiB.
  int64_t scratch_mb = 64;
  // exec.namespaces: executors and compile workers in PID, mount, IPC,
  // network and UTS namespaces of their own (needs root; without, or when
  // false, a warning says what is weaker).
  bool exec_namespaces = true;
  // exec.namespace_memory_mb: the memory of all of a namespace's executors
  // together, through a cgroup where one is writable (0: none), MiB.
  int64_t namespace_memory_mb = 16384;
  int64_t worker_spin_us = 0;            // an executor's busy-wait for its next call (0: sleep at once; see README)
  int64_t wait_spin_us = 50;             // the daemon's busy-wait for a call's result before it sleeps
  int quarantine_after = 3;              // crashes in a row of one caller's calls: quarantined for it
  int quarantine_callers = 2;            // callers (not readers) quarantined: quarantined for everyone

  // [fast]: prepared calls and same-host fast channels (server/exec/channels.h)
  bool fast_enabled = true;         // fast channels at all
  int64_t fast_channels = 16;       // open channels per namespace (one executor process each)
  int64_t fast_total_channels = 64; // open channels in all
  int64_t fast_spin_us = 50;        // a channel executor's (and its client's) spin before sleeping
  int64_t fast_handles = 4096;      // prepared handles per namespace

  // [shm]
  int64_t shm_quota_mb = 4096;  // shared memory per namespace
  int64_t lease_ms = 300000;    // a client's regions are released unless renewed within this

  // [autograd]
  int64_t context_ttl_ms = 600000;  // a backward context unused this long is released
  int64_t context_mb = 1024;        // saved tensors per namespace

  // [cache]
  int64_t cache_memory_entries = 512;
  int64_t cache_memory_mb = 512;
  int64_t cache_disk_mb = 2048;

  // [cache.remote]: a Redis tier shared by daemons, behind memory and disk
  // (server/cache/remote_tier.h). Off while url is empty.
  std::string cache_remote_url;        // "redis://host:port" or "unix:/path/redis.sock"
  std::string cache_remote_key_file;   // the cluster's HMAC key (required with url)
  int64_t cache_remote_timeout_ms = 250;  // connect and per-command timeout
  int64_t cache_remote_max_mb = 64;       // larger artifacts are not shared
  int64_t cache_remote_ttl_s = 7 * 24 * 3600;  // entries expire (0: never)

  // [registry]: where op versions are stored (server/registry/store.h).
  RegistryBackend registry_backend = RegistryBackend::kSqlite;
  std::string registry_url;                 // postgres: a libpq connection string or URI
  std::string registry_password_file;       // postgres: password, kept out of the config
  int64_t registry_poll_ms = 2000;          // postgres: backstop poll behind LISTEN/NOTIFY
};

inline constexpr const char* kDefaultTcpAddress = "127.0.0.1:7878";

// One problem of a configuration: where it is ("FILE:LINE" for a key set in
// the file, "FILE" for one left at its default, "--flag" for a flag), the
// key ("exec.workers", "principal[1].token_sha256"; "" when the file does not
// parse) and what is wrong. Never holds a secret's value.
struct ConfigProblem {
  std::string where;
  std::string key;
  std::string message;
  int line = 0;  // in the file; 0: none
  // "where: key: message".
  std::string ToString() const;
};

// A configuration and every problem found in it (not only the first), in
// the order of their lines in the file.
struct ConfigResult {
  DaemonConfig config;
  std::vector<ConfigProblem> problems;
};

// Defaults, then the TOML file `path` ("": none), then `flags`, then the
// checks of every key's type and range, of the principals and of the keys
// that go together. Touches nothing on disk but reading `path` (and looking
// whether the files the config names exist). `config.config_file` and
// `config.flags` are set; the config is only meaningful without problems.
ConfigResult BuildConfig(const std::string& path, const ConfigFlags& flags);

// Builds the configuration from defaults, the TOML file named by --config (if
// any) and the flags. INVALID_ARGUMENT for unknown flags or keys and bad
// values, one problem per line; --help (--help-config) returns CANCELLED with
// the usage text (ConfigHelp()) as message. With --check-config or --version
// only the flags are read.
absl::StatusOr<DaemonConfig> LoadConfig(int argc, char** argv);

// Every setting but the principals, as "section.key" -> its value printed
// (file paths as given; no secret is held in the config itself): what a
// reload compares to tell which keys changed.
std::map<std::string, std::string> SettingsOf(const DaemonConfig& cfg);

// One key of the config file, as opjitd --help-config prints it. The list
// comes from config.cc's key table, the one place that names a key, reads
// it, prints it (SettingsOf) and documents it.
struct ConfigKeyInfo {
  std::string key;            // "exec.workers": key workers of section [exec]
  std::string type;           // "integer >= 1", "string", "process | in-daemon", ...
  std::string default_value;  // as written in the file, or how it is computed
  std::string doc;
  bool alias = false;         // another name for a key listed too
};
std::vector<ConfigKeyInfo> ConfigKeys();

// opjitd --help-config: every key, its type, default and meaning.
std::string ConfigHelp();

// The log levels log_level and --log-level accept.
bool ValidLogLevel(const std::string& level);

std::string Usage();

// Whether a TCP listen address ("host:port") binds only the loopback
// interface (127.0.0.0/8, ::1, localhost).
bool IsLoopbackTcp(const std::string& address);

}  // namespace opjit

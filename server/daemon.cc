// opjitd's Daemon (daemon.h): builds the subsystems in order, serves, and
// stops them in the reverse order.
#include "server/daemon.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/access/access.h"
#include "server/access/quotas.h"
#include "server/autograd/autograd.h"
#include "server/evaluate/evaluator.h"
#include "server/common/health_monitor.h"
#include "server/common/logging.h"
#include "server/common/sha256.h"
#include "server/common/status_macros.h"
#include "server/common/subprocess.h"
#include "server/compiler/kernel_compiler.h"
#include "server/daemon_options.h"
#include "server/exec/channels.h"
#include "server/exec/executor.h"
#include "server/exec/handles.h"
#include "server/gpu/driver_probe.h"
#include "server/loader/loader.h"
#include "server/metrics/http_exporter.h"
#include "server/metrics/metrics.h"
#include "server/registry/registry.h"
#include "server/rpc/grpc_server.h"
#include "server/rpc/metrics_interceptor.h"
#include "server/runner/in_process_runner.h"
#include "server/runner/process_runner.h"
#include "server/tensor/region_manager.h"

#include "opjit/version.h"  // generated: OPJIT_VERSION, OPJIT_GIT_REVISION (cmake/version.cmake)

namespace opjit {
namespace {

// The grpc.health.v1 service name that answers NOT_SERVING while the
// registry store cannot be written (registrations and deletes are refused
// with UNAVAILABLE / STORE_UNAVAILABLE meanwhile), SERVING otherwise.
constexpr char kStoreHealthService[] = "opjit.registry.store";

// `r`, or its error as the log line main writes: "<what>: <status>".
template <typename T>
absl::StatusOr<T> Named(absl::StatusOr<T> r, const char* what) {
  if (r.ok()) return r;
  return absl::Status(r.status().code(), absl::StrCat(what, ": ", r.status().ToString()));
}

// Whether a unix socket at `path` accepts connections (another daemon
// serves it): checked before anything is created, so a refused start leaves
// no state dir behind.
bool UnixSocketIsLive(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return live;
}

// Holds an exclusive lock on <state_dir>/opjitd.lock for the daemon's life, so
// two daemons never serve one registry. Returns the fd, or an error naming the
// holder.
absl::StatusOr<int> LockStateDir(const std::string& state_dir) {
  const std::string path = state_dir + "/opjitd.lock";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {0};
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "another opjitd (pid ", n > 0 ? std::string(buf, strcspn(buf, "\n")) : "?",
        ") is already serving state dir ", state_dir,
        "; stop it first or use a different --state-dir"));
  }
  std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    Logger("main")->warn("could not write pid to {}", path);
  }
  return fd;
}

// Gauges read from the subsystems at each scrape, and the subsystems'
// counters as Prometheus counters.
void DeclareCoreMetrics(metrics::Registry& m, compiler::KernelCompiler* compiler,
                        runner::KernelRunner* runner, tensor::RegionManager* regions,
                        autograd::Autograd* autograd, access::AccessControl* access,
                        const std::atomic<HealthMonitor*>* health,
                        const std::atomic<bool>* store_up) {
  m.DeclareGauge("opjit_shm_bytes", "Shared memory held by a namespace's regions.", {"namespace"});
  m.DeclareGauge("opjit_context_bytes",
                 "Bytes of saved tensors in a namespace's backward contexts.", {"namespace"});
  m.DeclareGauge("opjit_namespaces", "Namespaces that exist.", {});
  m.DeclareCounter("opjit_cache_hits_total", "Compile cache hits, by tier (memory, disk, remote).",
                   {"tier"});
  m.DeclareCounter("opjit_cache_misses_total", "Compile cache misses, by tier.", {"tier"});
  m.DeclareGauge("opjit_cache_entries", "Compiled kernels cached.", {"tier"});
  m.DeclareCounter("opjit_cache_remote_rejected_total",
                   "Shared-tier entries that failed authentication (served as misses).", {});
  m.DeclareCounter("opjit_cache_remote_errors_total",
                   "Shared-tier (Redis) connects and commands that failed or timed out.", {});
  m.DeclareCounter("opjit_compiles_total", "Compiles run (cache misses that compiled).", {});
  m.DeclareCounter("opjit_compile_failures_total", "Compiles that failed.", {});
  m.DeclareCounter("opjit_compile_seconds_total", "Seconds spent compiling.", {});
  m.DeclareGauge("opjit_executor_workers", "Executor processes alive.", {});
  m.DeclareCounter("opjit_executor_worker_starts_total", "Executor processes started.", {});
  m.DeclareCounter("opjit_executor_worker_crashes_total", "Executor processes that died in a call.",
                   {});
  m.DeclareCounter("opjit_executor_worker_timeouts_total",
                   "Executor processes killed at a deadline.", {});
  m.DeclareCounter("opjit_executor_thread_cap_stops_total",
                   "Executor processes stopped for keeping more than [exec] "
                   "threads_per_executor threads, when a call ended (after_call) or while no "
                   "call ran (idle); never counted as crashes.",
                   {"when"});
  m.DeclareCounter("opjit_quarantined_kernels_total", "Kernels refused after repeated crashes.",
                   {});
  m.DeclareGauge("opjit_serving", "1 when grpc.health reports SERVING.", {});
  m.DeclareGauge("opjit_registry_store_up",
                 "1 when the registry store answered its last health probe.", {});
  m.AddCollector([=](metrics::Registry& r) {
    r.ClearGauge("opjit_shm_bytes");
    for (const auto& [ns, b] : regions->BytesByNamespace()) {
      r.Set("opjit_shm_bytes", {ns}, static_cast<double>(b));
    }
    r.ClearGauge("opjit_context_bytes");
    for (const auto& [ns, b] : autograd->BytesByNamespace()) {
      r.Set("opjit_context_bytes", {ns}, static_cast<double>(b));
    }
    r.Set("opjit_namespaces", {}, static_cast<double>(access->namespace_count()));
    const compiler::KernelCacheStats c = compiler->Stats();
    r.SetCounter("opjit_cache_hits_total", {"memory"}, static_cast<double>(c.memory_hits));
    r.SetCounter("opjit_cache_hits_total", {"disk"}, static_cast<double>(c.disk_hits));
    r.SetCounter("opjit_cache_misses_total", {"memory"}, static_cast<double>(c.memory_misses));
    r.SetCounter("opjit_cache_misses_total", {"disk"}, static_cast<double>(c.disk_misses));
    r.Set("opjit_cache_entries", {"memory"}, static_cast<double>(c.memory_entries));
    r.Set("opjit_cache_entries", {"disk"}, static_cast<double>(c.disk_entries));
    if (c.remote_enabled) {
      r.SetCounter("opjit_cache_hits_total", {"remote"}, static_cast<double>(c.remote_hits));
      r.SetCounter("opjit_cache_misses_total", {"remote"}, static_cast<double>(c.remote_misses));
      r.SetCounter("opjit_cache_remote_rejected_total", {}, static_cast<double>(c.remote_rejected));
      r.SetCounter("opjit_cache_remote_errors_total", {}, static_cast<double>(c.remote_errors));
    }
    r.SetCounter("opjit_compiles_total", {}, static_cast<double>(c.compiles));
    r.SetCounter("opjit_compile_failures_total", {}, static_cast<double>(c.compile_failures));
    r.SetCounter("opjit_compile_seconds_total", {}, c.compile_ms_total / 1000.0);
    const runner::RunnerStats w = runner->Stats();
    r.Set("opjit_executor_workers", {}, static_cast<double>(w.workers_live));
    r.SetCounter("opjit_executor_worker_starts_total", {}, static_cast<double>(w.workers_started));
    r.SetCounter("opjit_executor_worker_crashes_total", {}, static_cast<double>(w.worker_crashes));
    r.SetCounter("opjit_executor_worker_timeouts_total", {},
                 static_cast<double>(w.worker_timeouts));
    r.SetCounter("opjit_executor_thread_cap_stops_total", {"after_call"},
                 static_cast<double>(w.thread_cap_stops_after_call));
    r.SetCounter("opjit_executor_thread_cap_stops_total", {"idle"},
                 static_cast<double>(w.thread_cap_stops_idle));
    r.SetCounter("opjit_quarantined_kernels_total", {}, static_cast<double>(w.quarantined));
    const HealthMonitor* h = health->load();
    r.Set("opjit_serving", {}, (h == nullptr || h->serving()) ? 1.0 : 0.0);
    r.Set("opjit_registry_store_up", {}, store_up->load() ? 1.0 : 0.0);
  });
}

// Writes the bound addresses, one per line, to <state_dir>/endpoints (atomic),
// so tools and tests can find a port chosen by the OS. False (errno set)
// when the file could not be written or put in place.
bool WriteEndpoints(const std::string& state_dir, const std::vector<std::string>& bound) {
  const std::string tmp = state_dir + "/endpoints.tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& b : bound) out << b << "\n";
    out.flush();
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), (state_dir + "/endpoints").c_str()) == 0;
}

std::string Describe(const access::PrincipalConfig& p) {
  return absl::StrCat("role ", access::RoleName(p.role), ", namespaces [",
                      absl::StrJoin(p.namespaces, ", "), "], ", p.token_sha256.size(),
                      " token(s), uids [", absl::StrJoin(p.uids, ", "), "], gids [",
                      absl::StrJoin(p.gids, ", "), "]");
}

// One log line per principal added, removed or changed. Never a token or
// its hash: only how many were added and removed.
void LogPrincipalChanges(const std::vector<access::PrincipalConfig>& before,
                         const std::vector<access::PrincipalConfig>& after) {
  auto log = Logger("main");
  std::map<std::string, const access::PrincipalConfig*> old_by_name, new_by_name;
  for (const auto& p : before) old_by_name[p.name] = &p;
  for (const auto& p : after) new_by_name[p.name] = &p;
  for (const auto& [name, p] : old_by_name) {
    if (!new_by_name.count(name)) log->info("reload: principal \"{}\" removed", name);
  }
  for (const auto& [name, p] : new_by_name) {
    auto it = old_by_name.find(name);
    if (it == old_by_name.end()) {
      log->info("reload: principal \"{}\" added ({})", name, Describe(*p));
      continue;
    }
    const access::PrincipalConfig& o = *it->second;
    std::vector<std::string> what;
    if (o.role != p->role) {
      what.push_back(absl::StrCat("role ", access::RoleName(o.role), " -> ",
                                  access::RoleName(p->role)));
    }
    if (o.namespaces != p->namespaces) {
      what.push_back(absl::StrCat("namespaces [", absl::StrJoin(o.namespaces, ", "), "] -> [",
                                  absl::StrJoin(p->namespaces, ", "), "]"));
    }
    const std::set<std::string> ot(o.token_sha256.begin(), o.token_sha256.end());
    const std::set<std::string> nt(p->token_sha256.begin(), p->token_sha256.end());
    size_t added = 0, removed = 0;
    for (const auto& h : nt) added += ot.count(h) == 0;
    for (const auto& h : ot) removed += nt.count(h) == 0;
    if (added + removed > 0) {
      what.push_back(absl::StrCat("tokens: ", added, " added, ", removed, " removed"));
    }
    if (o.uids != p->uids) {
      what.push_back(absl::StrCat("uids [", absl::StrJoin(o.uids, ", "), "] -> [",
                                  absl::StrJoin(p->uids, ", "), "]"));
    }
    if (o.gids != p->gids) {
      what.push_back(absl::StrCat("gids [", absl::StrJoin(o.gids, ", "), "] -> [",
                                  absl::StrJoin(p->gids, ", "), "]"));
    }
    if (!what.empty()) {
      log->info("reload: principal \"{}\" changed: {}", name, absl::StrJoin(what, "; "));
    }
  }
}

bool SamePrincipals(const std::vector<access::PrincipalConfig>& a,
                    const std::vector<access::PrincipalConfig>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].role != b[i].role || a[i].namespaces != b[i].namespaces ||
        a[i].token_sha256 != b[i].token_sha256 || a[i].uids != b[i].uids ||
        a[i].gids != b[i].gids) {
      return false;
    }
  }
  return true;
}

// What a reload takes from one principal that keeps, or loses, its name:
// every namespace (`all`), or those outside `keep`. `channels_only`: no
// namespace, but a credential it had (token, uid or gid) is gone, so its
// fast channels (perhaps opened under that credential) close, and their
// clients' reopening goes through authentication again.
struct Revocation {
  std::string principal;
  bool all = false;
  std::set<std::string> keep;
  bool channels_only = false;
};

// The revocations that replacing `before` by `after` implies: a principal
// removed, or changed so that it sees fewer namespaces (a role of metrics
// sees none over gRPC, an admin every one), or with a credential removed.
std::vector<Revocation> RevocationsOf(const std::vector<access::PrincipalConfig>& before,
                                      const std::vector<access::PrincipalConfig>& after) {
  std::map<std::string, const access::PrincipalConfig*> next;
  for (const auto& q : after) next[q.name] = &q;
  auto removed_any = [](const auto& a, const auto& b) {
    for (const auto& x : a) {
      if (std::find(b.begin(), b.end(), x) == b.end()) return true;
    }
    return false;
  };
  std::vector<Revocation> out;
  for (const auto& p : before) {
    Revocation r;
    r.principal = p.name;
    auto it = next.find(p.name);
    if (it == next.end()) {
      r.all = true;
      out.push_back(std::move(r));
      continue;
    }
    const access::PrincipalConfig& q = *it->second;
    if (q.role != access::Role::kAdmin) {
      if (q.role != access::Role::kMetrics) r.keep.insert(q.namespaces.begin(), q.namespaces.end());
      bool loses = p.role == access::Role::kAdmin;
      if (p.role != access::Role::kMetrics) {
        for (const auto& ns : p.namespaces) loses |= r.keep.count(ns) == 0;
      }
      if (loses) {
        out.push_back(std::move(r));
        continue;
      }
    }
    if (removed_any(p.token_sha256, q.token_sha256) || removed_any(p.uids, q.uids) ||
        removed_any(p.gids, q.gids)) {
      r.keep.clear();
      r.all = true;
      r.channels_only = true;
      out.push_back(std::move(r));
    }
  }
  return out;
}

// Applies revocations: the principal's fast channels close (their executors
// stop), and unless only a credential went, its regions, prepared handles
// and backward contexts in the namespaces it lost are released. Calls
// already running finish; every later one is authenticated anew.
void Revoke(const std::vector<Revocation>& revocations, tensor::RegionManager* regions,
            exec::ChannelManager* channels, exec::HandleTable* handles,
            autograd::Autograd* autograd, bool second_pass = false) {
  auto log = Logger("main");
  for (const Revocation& r : revocations) {
    const std::string prefix = r.principal + "/";
    auto lost = [&r](const std::string& ns) { return r.all || r.keep.count(ns) == 0; };
    auto owned = [&](const std::string& ns, const std::string& owner) {
      return owner.compare(0, prefix.size(), prefix) == 0 && lost(ns);
    };
    const int closed = channels->CloseWhere(owned);
    if (r.channels_only) {
      if (second_pass && closed == 0) continue;
      log->info("reload: principal \"{}\" lost a credential: {} fast channel(s) closed",
                r.principal, closed);
      continue;
    }
    const int released = regions->ReleaseWhere(owned);
    const int prepared = handles->ReleaseWhere(owned);
    const int contexts = autograd->ReleaseWhere(
        [&](const std::string& ns, const std::string& caller) {
          return caller == r.principal && lost(ns);
        });
    if (second_pass && closed + released + prepared + contexts == 0) continue;
    log->info("reload: principal \"{}\" revoked in {}: {} fast channel(s) closed, {} region(s), "
              "{} prepared handle(s) and {} backward context(s) released",
              r.principal,
              r.all ? std::string("every namespace")
                    : absl::StrCat("every namespace but [", absl::StrJoin(r.keep, ", "), "]"),
              closed, released, prepared, contexts);
  }
}

// SIGHUP: reads the --config file again and applies what can change while
// serving (principals and tokens, the QuotaManager's quotas, the namespace
// bound, the log level), logging each change; other changed keys are logged
// as needing a restart. A file with problems changes nothing. `running` is
// what is in force, and is updated to what was applied. `revoke` takes
// what principals lost, once the new ones are in force.
void Reload(DaemonConfig* running, access::AccessControl* access, access::QuotaManager* quotas,
            const std::function<void(const std::vector<Revocation>&)>& revoke) {
  auto log = Logger("main");
  if (running->config_file.empty()) {
    log->info("SIGHUP: started without --config, nothing to reload");
    return;
  }
  ConfigResult r = BuildConfig(running->config_file, running->flags);
  if (!r.problems.empty()) {
    log->error("SIGHUP: {} has {} problem(s); the running configuration stays:",
               running->config_file, r.problems.size());
    for (const ConfigProblem& p : r.problems) log->error("reload: {}", p.ToString());
    return;
  }
  DaemonConfig& next = r.config;
  if (running->principals.empty() != next.principals.empty()) {
    log->error("SIGHUP: {} {} principals: switching between none (every local caller is admin) "
               "and some needs a restart; the running configuration stays",
               running->config_file, next.principals.empty() ? "removes every one of the"
                                                             : "adds the first");
    return;
  }
  int applied = 0;
  if (!SamePrincipals(running->principals, next.principals)) {
    if (absl::Status s = access->SetPrincipals(next.principals); !s.ok()) {
      log->error("SIGHUP: principals not changed: {}", std::string(s.message()));
    } else {
      LogPrincipalChanges(running->principals, next.principals);
      const std::vector<Revocation> lost = RevocationsOf(running->principals, next.principals);
      running->principals = next.principals;
      ++applied;
      if (!lost.empty()) revoke(lost);
    }
  }
  auto changed = [&](const char* key, auto before, auto after) {
    if (before == after) return false;
    log->info("reload: {}: {} -> {}", key, before, after);
    ++applied;
    return true;
  };
  bool quota_changed = false;
  quota_changed |= changed("quota.concurrent_compiles", running->quota_concurrent_compiles,
                           next.quota_concurrent_compiles);
  quota_changed |= changed("quota.compile_seconds_per_minute",
                           running->quota_compile_seconds_per_minute,
                           next.quota_compile_seconds_per_minute);
  quota_changed |= changed("quota.calls_per_second", running->quota_calls_per_second,
                           next.quota_calls_per_second);
  if (quota_changed) {
    running->quota_concurrent_compiles = next.quota_concurrent_compiles;
    running->quota_compile_seconds_per_minute = next.quota_compile_seconds_per_minute;
    running->quota_calls_per_second = next.quota_calls_per_second;
    quotas->SetOptions(QuotaOptionsFromConfig(next));
  }
  if (changed("quota.namespaces", running->quota_namespaces, next.quota_namespaces)) {
    running->quota_namespaces = next.quota_namespaces;
    access->SetMaxNamespaces(static_cast<size_t>(next.quota_namespaces));
  }
  // Last, so that the lines above show at the level they were logged under.
  const bool level_changed = changed("log_level", running->log_level, next.log_level);
  // Whatever else differs waits for a restart: named, never its value.
  const std::set<std::string> kApplied = {
      "log_level", "quota.concurrent_compiles", "quota.compile_seconds_per_minute",
      "quota.calls_per_second", "quota.namespaces"};
  const auto before = SettingsOf(*running), after = SettingsOf(next);
  std::vector<std::string> restart;
  for (const auto& [key, value] : after) {
    if (!kApplied.count(key) && before.at(key) != value) restart.push_back(key);
  }
  if (!restart.empty()) {
    log->warn("reload: changed but not applied until a restart: {}", absl::StrJoin(restart, ", "));
  }
  log->info("SIGHUP: {} reloaded: {} change(s) applied{}", running->config_file, applied,
            restart.empty() ? "" : absl::StrCat(", ", restart.size(), " need a restart"));
  if (level_changed) {
    running->log_level = next.log_level;
    SetLogLevel(next.log_level);
  }
}

}  // namespace

Daemon::Parts::~Parts() = default;

Daemon::Daemon(const DaemonConfig& config)
    : cfg_(config), parts_(std::make_unique<Parts>()) {
  sigemptyset(&signals_);
}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(const DaemonConfig& config) {
  std::unique_ptr<Daemon> d(new Daemon(config));
  OPJIT_RETURN_IF_ERROR(d->BlockSignals());
  OPJIT_RETURN_IF_ERROR(d->PrepareStateDir());
  OPJIT_RETURN_IF_ERROR(d->StartRegistry());
  OPJIT_RETURN_IF_ERROR(d->StartCompiler());
  d->facts_ = d->DescribeHost();
  OPJIT_RETURN_IF_ERROR(d->StartRunner());
  OPJIT_RETURN_IF_ERROR(d->StartExecution());
  OPJIT_RETURN_IF_ERROR(d->StartAccess());
  // Before the server: GetServerInfo tells the bound metrics address.
  OPJIT_RETURN_IF_ERROR(d->StartMetricsExporter());
  OPJIT_RETURN_IF_ERROR(d->StartServer());
  d->StartHealth();
  Logger("main")->info("opjitd {} (git {}) ready: state {}, {} op(s), listening on {}",
                       OPJIT_VERSION, OPJIT_GIT_REVISION, d->cfg_.state_dir,
                       d->parts_->registry->Size(),
                       absl::StrJoin(d->parts_->server->bound(), ", "));
  return d;
}

// Signals are taken synchronously by Serve's thread (sigwait); blocked
// before any other thread exists so every thread inherits the mask.
absl::Status Daemon::BlockSignals() {
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  sigaddset(&signals_, SIGHUP);  // a reload (Reload), never a stop
  if (const int e = pthread_sigmask(SIG_BLOCK, &signals_, nullptr); e != 0) {
    return absl::InternalError(absl::StrCat("cannot block signals: ", std::strerror(e)));
  }
  // A peer gone mid-write, a full disk or a file-size limit must fail a
  // write, not kill the daemon.
  if (signal(SIGPIPE, SIG_IGN) == SIG_ERR || signal(SIGXFSZ, SIG_IGN) == SIG_ERR) {
    return absl::InternalError(
        absl::StrCat("cannot ignore SIGPIPE and SIGXFSZ: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// The state dir: created, made private, locked for the daemon's life; the
// helpers a killed predecessor left are ended.
absl::Status Daemon::PrepareStateDir() {
  auto log = Logger("main");
  for (const std::string& l : cfg_.listen) {
    if (l.rfind("unix:", 0) == 0 && UnixSocketIsLive(l.substr(5))) {
      return absl::FailedPreconditionError(
          absl::StrCat("another server is already listening on ", l,
                       "; stop it first or pass a different --listen/--state-dir"));
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(cfg_.state_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create state dir ", cfg_.state_dir, ": ", ec.message()));
  }
  if (::chmod(cfg_.state_dir.c_str(), 0700) != 0) {
    // Not fatal (a state dir owned by someone else, or on a file system
    // without modes): the operator learns that others may read it.
    log->warn("cannot make the state dir {} private (chmod 700): {}", cfg_.state_dir,
              std::strerror(errno));
  }
  OPJIT_ASSIGN_OR_RETURN(const int lock_fd, LockStateDir(cfg_.state_dir));
  parts_->unlock_state_dir.Set([fd = lock_fd] {
    if (::close(fd) != 0) {
      Logger("main")->warn("closing the state dir's lock: {}", std::strerror(errno));
    }
  });
  // Every helper carries a tag of the state dir (as the shm names do). With
  // the lock held no other daemon of this state dir lives, so a tagged
  // helper that is not ours was left by a killed predecessor: end it.
  subprocess::SetInstanceTag(Sha256Hex(cfg_.state_dir).substr(0, 12));
  if (const int ended = subprocess::EndLeftovers(
          subprocess::InstanceTag(),
          {"opjit-exec-worker", "opjit-compile-worker", "opjit-gpu-sandbox"});
      ended > 0) {
    log->warn("ended {} helper process(es) a previous opjitd of this state dir left running",
              ended);
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartRegistry() {
  std::string password;
  if (!cfg_.registry_password_file.empty()) {
    OPJIT_ASSIGN_OR_RETURN(password,
                           ReadSecretFile(cfg_.registry_password_file, "registry.password_file"));
  }
  OPJIT_ASSIGN_OR_RETURN(
      parts_->registry,
      Named(registry::Registry::Create(RegistryOptionsFromConfig(cfg_, std::move(password))),
            "registry"));
  return absl::OkStatus();
}

absl::Status Daemon::StartCompiler() {
  std::string remote_key;
  if (!cfg_.cache_remote_url.empty()) {
    OPJIT_ASSIGN_OR_RETURN(remote_key,
                           ReadSecretFile(cfg_.cache_remote_key_file, "cache.remote.key_file"));
    Logger("main")->info("cache: remote tier {}", cfg_.cache_remote_url);
  }
  compiler::KernelCompilerOptions copts = CompilerOptionsFromConfig(
      cfg_, HelperDir(), FindKernelIncludeDir(cfg_), std::move(remote_key));
  // Root: compiler.uid. Not root, with subordinate ids: the last of them.
  sub_ids_ = std::make_unique<SubordinateIds>(PickSubordinateIds(cfg_));
  OPJIT_RETURN_IF_ERROR(CompileUidFromConfig(cfg_, *sub_ids_, &copts));
  compile_worker_path_ = copts.worker_path;
  OPJIT_ASSIGN_OR_RETURN(parts_->compiler,
                         Named(compiler::KernelCompiler::Create(copts), "compiler"));
  return absl::OkStatus();
}

// What GetServerInfo tells: this host's CPU and GPU, the toolchain.
std::unique_ptr<rpc::ServerFacts> Daemon::DescribeHost() {
  const loader::HostTarget host = loader::DetectHostTarget();
  const gpu::GpuStatus& gpu = gpu::ProbeGpu();
  auto facts = std::make_unique<rpc::ServerFacts>();
  facts->version = OPJIT_VERSION;
  facts->kernel_abi_version = compiler::kKernelAbiVersion;
  facts->state_dir = cfg_.state_dir;
  facts->cpu_triple = host.triple;
  facts->cpu_name = host.cpu;
  facts->cpu_features = host.features;
  facts->compiler_id = parts_->compiler->ToolchainId();
  facts->gpu_available = gpu.available;
  facts->gpu_reason = gpu.reason;
  facts->gpu_devices = gpu.devices;
  if (!gpu.available) Logger("main")->info("GPU unavailable: {}", gpu.reason);
  return facts;
}

// Shared memory, and where user code runs: sandboxed executor processes,
// or (trusted single user) this process.
absl::Status Daemon::StartRunner() {
  OPJIT_ASSIGN_OR_RETURN(parts_->regions,
                         Named(tensor::RegionManager::Create(RegionOptionsFromConfig(cfg_)),
                               "shared memory"));
  const runner::KernelHostOptions hopts = KernelHostOptionsFromConfig(cfg_);
  std::error_code ec;
  std::filesystem::create_directories(hopts.scratch_dir, ec);
  if (ec) {
    // Kernels that load GPU code fail to; the rest are not concerned.
    Logger("main")->warn("cannot create {}: {}", hopts.scratch_dir, ec.message());
  }
  if (cfg_.isolation == Isolation::kInDaemon) {
    Logger("main")->warn(
        "exec.isolation = in-daemon: kernels run inside opjitd, unconfined; a crashing "
        "kernel stops the daemon. Use only for a trusted single user.");
    OPJIT_ASSIGN_OR_RETURN(parts_->runner,
                           Named(runner::InProcessRunner::Create(hopts), "runner"));
  } else {
    runner::ProcessRunnerOptions ropts =
        ProcessRunnerOptionsFromConfig(cfg_, hopts, *sub_ids_, HelperDir());
    // Each namespace's uid, claimed host-wide (no two daemons share one).
    OPJIT_RETURN_IF_ERROR(ClaimUidsFromConfig(cfg_, *sub_ids_, &ropts));
    OPJIT_ASSIGN_OR_RETURN(parts_->runner,
                           Named(runner::ProcessRunner::Create(ropts), "runner"));
  }
  return absl::OkStatus();
}

// The executor, autograd, prepared handles and fast channels, and the
// reaper that releases what lapsed.
absl::Status Daemon::StartExecution() {
  Parts& p = *parts_;
  OPJIT_ASSIGN_OR_RETURN(
      p.executor, Named(exec::Executor::Create(ExecutorOptionsFromConfig(cfg_), p.registry.get(),
                                               p.compiler.get(), p.regions.get(), p.runner.get()),
                        "executor"));
  OPJIT_ASSIGN_OR_RETURN(
      p.autograd, Named(autograd::Autograd::Create(AutogradOptionsFromConfig(cfg_),
                                                   p.registry.get(), p.executor.get()),
                        "autograd"));
  p.evaluator = std::make_unique<evaluate::Evaluator>(evaluate::EvaluatorOptions{},
                                                      p.registry.get(), p.executor.get(),
                                                      p.regions.get());
  p.handles = std::make_unique<exec::HandleTable>(HandleOptionsFromConfig(cfg_), p.registry.get());
  p.channels = std::make_unique<exec::ChannelManager>(
      ChannelOptionsFromConfig(cfg_), p.regions.get(), p.handles.get(), p.runner.get());
  p.registry->SetChangeListener([c = p.channels.get()] { c->OnRegistryChanged(); });
  p.unhook_channels.Set([r = p.registry.get()] { r->SetChangeListener(nullptr); });
  p.reaper = std::thread([&p] {
    MutexLock lock(&p.reaper_mu);
    for (;;) {
      const auto next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (!p.reaper_stop && p.reaper_cv.WaitUntil(&p.reaper_mu, next)) {
      }
      if (p.reaper_stop) return;
      const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
      if (int n = p.regions->ExpireLeases(now); n > 0) {
        Logger("tensor")->info("released {} region(s) whose lease lapsed", n);
      }
      p.runner->Maintain();
      p.channels->Maintain();
      p.handles->Expire([&](const std::string& ns, const std::string& owner) {
        return p.regions->HasOwner(ns, owner);
      });
      if (int n = p.autograd->ExpireContexts(std::chrono::steady_clock::now()); n > 0) {
        Logger("autograd")->info("released {} backward context(s) past their TTL", n);
      }
    }
  });
  p.stop_reaper.Set([&p] {
    {
      MutexLock lock(&p.reaper_mu);
      p.reaper_stop = true;
    }
    p.reaper_cv.SignalAll();
    p.reaper.join();
  });
  return absl::OkStatus();
}

// Who may call (principals), the quotas, and the metrics they all feed.
absl::Status Daemon::StartAccess() {
  Parts& p = *parts_;
  OPJIT_ASSIGN_OR_RETURN(p.access, access::AccessControl::Create(AccessOptionsFromConfig(cfg_)));
  p.access->AddExisting(p.registry->Namespaces());
  p.quotas = std::make_unique<access::QuotaManager>(QuotaOptionsFromConfig(cfg_));
  p.metrics = std::make_unique<metrics::Registry>();
  DeclareCoreMetrics(*p.metrics, p.compiler.get(), p.runner.get(), p.regions.get(),
                     p.autograd.get(), p.access.get(), &p.health_view, &p.store_up);
  return absl::OkStatus();
}

absl::Status Daemon::StartServer() {
  Parts& p = *parts_;
  auto log = Logger("main");
  rpc::CoreRefs core{.registry = p.registry.get(),
                     .compiler = p.compiler.get(),
                     .regions = p.regions.get(),
                     .executor = p.executor.get(),
                     .autograd = p.autograd.get(),
                     .access = p.access.get(),
                     .quotas = p.quotas.get(),
                     .handles = p.handles.get(),
                     .channels = p.channels.get(),
                     .evaluator = p.evaluator.get()};
  rpc::GrpcServerOptions sopts = ServerOptionsFromConfig(cfg_);
  sopts.interceptors.push_back(rpc::MakeMetricsInterceptorFactory(p.metrics.get()));
  // Fast-channel calls never pass through gRPC: they draw credit from the
  // same calls_per_second bucket and are counted in the same metrics.
  p.channels->SetAccounting(
      {.admit = [q = p.quotas.get()](const std::string& ns) {
         return q->AdmitCalls(ns, q->CallCreditBatch());
       },
       .record = [m = p.metrics.get()](const std::string& ns, const std::string& op,
                                       absl::StatusCode code, uint64_t calls,
                                       double kernel_seconds) {
         rpc::CountChannelCalls(m, ns, op, code, calls, kernel_seconds);
       }});
  OPJIT_ASSIGN_OR_RETURN(p.server, rpc::GrpcServer::Start(std::move(sopts), core, *facts_));
  p.drain_server.Set([s = p.server.get(), ev = p.evaluator.get()] {
    // Running evaluations stop at their next run (UNAVAILABLE), so the
    // grace below does not wait on them.
    ev->Stop();
    s->Shutdown(std::chrono::seconds(5));
    s->Wait();
  });
  p.remove_endpoints.Set([path = cfg_.state_dir + "/endpoints"] {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      Logger("main")->warn("cannot remove {}: {}", path, std::strerror(errno));
    }
  });
  if (!WriteEndpoints(cfg_.state_dir, p.server->bound())) {
    // Serving goes on; only tools that look the address up there miss it.
    log->error("cannot write {}/endpoints (the bound addresses): {}", cfg_.state_dir,
               std::strerror(errno));
  }
  for (const std::string& address : cfg_.listen) {
    if (address.rfind("unix:", 0) != 0 && !IsLoopbackTcp(address) &&
        (cfg_.tls_cert.empty() || cfg_.principals.empty())) {
      log->warn("listening on {} without {} (allow_insecure_tcp): anyone who can reach it can "
                "run code and read tensors",
                address, cfg_.tls_cert.empty() ? "TLS" : "principals");
    }
  }
  if (cfg_.principals.empty()) {
    log->info("no principals configured: every local caller is admin (the embedded default)");
  } else {
    log->info("{} principal(s) configured; callers authenticate", cfg_.principals.size());
  }
  return absl::OkStatus();
}

// Health: the workers can be started and the store written; systemd
// (Type=notify) hears READY=1 once started and SERVING, WATCHDOG=1 while
// healthy (no-ops without $NOTIFY_SOCKET).
void Daemon::StartHealth() {
  Parts& p = *parts_;
  auto log = Logger("main");
  std::vector<HealthMonitor::Probe> probes;
  // Starting a worker costs ~0.1 s of CPU: while serving, every 10th round.
  probes.push_back(
      {"compile workers", [path = compile_worker_path_] { return ProbeExecutable(path); }, 10});
  if (cfg_.isolation == Isolation::kProcess) {
    probes.push_back({"executor workers",
                      [path = HelperDir() + "/opjit-exec-worker"] { return ProbeExecutable(path); },
                      10});
  }
  // The registry store: opjit_registry_store_up and the grpc.health service
  // "opjit.registry.store" follow every probe; a flip is logged. What the
  // whole server ("") reports depends on the backend:
  //  - postgres: a shared database that is down stops registrations and
  //    deletes (UNAVAILABLE / STORE_UNAVAILABLE), not calls or reads (the
  //    registry is in memory), so the server stays SERVING and neither a
  //    balancer nor the systemd watchdog takes away what still works;
  //  - sqlite: a local file that cannot be written means this host's disk is
  //    failing, so the whole server is NOT_SERVING until it can be.
  rpc::GrpcServer* grpc_server = p.server.get();
  grpc_server->SetServiceServing(kStoreHealthService, true);
  probes.push_back({"registry store",
                    [r = p.registry.get(), log, grpc_server, store_up = &p.store_up,
                     shared = cfg_.registry_backend != RegistryBackend::kSqlite] {
                      const absl::Status s = r->ProbeStore();
                      if (store_up->exchange(s.ok()) != s.ok()) {
                        grpc_server->SetServiceServing(kStoreHealthService, s.ok());
                        if (s.ok()) {
                          log->info("registry store writable again");
                        } else {
                          log->warn("registry store cannot be written: {} ({}registrations and "
                                    "deletes fail until it is back)",
                                    std::string(s.message()),
                                    shared ? "calls go on; " : "NOT_SERVING; ");
                        }
                      }
                      return shared ? absl::OkStatus() : s;
                    }});
  p.health = std::make_unique<HealthMonitor>(
      std::move(probes), std::chrono::milliseconds(std::max<int64_t>(cfg_.health_interval_ms, 50)),
      [grpc_server, ready = &p.ready](bool serving, const std::string& why) {
        grpc_server->SetServing(serving);
        ready->SetServing(serving, why);
      });
  p.health_view.store(p.health.get());
  p.hide_health.Set([&p] { p.health_view.store(nullptr); });
  p.watchdog = systemd::WatchdogPinger::Start([h = p.health.get()] { return h->serving(); });
  if (p.watchdog) {
    log->info("systemd watchdog: a ping every {} ms while healthy",
              std::chrono::duration_cast<std::chrono::milliseconds>(p.watchdog->period()).count());
  }
}

// [metrics] listen: the Prometheus endpoint. With principals, a scrape
// needs a bearer token: an admin's or a metrics principal's sees every
// series, another principal's only its namespaces' (issue 14).
absl::Status Daemon::StartMetricsExporter() {
  if (cfg_.metrics_listen.empty()) return absl::OkStatus();
  Parts& p = *parts_;
  auto e = metrics::HttpExporter::Start(
      cfg_.metrics_listen, [m = p.metrics.get(), access = p.access.get()](
                               const metrics::HttpExporter::Request& request) {
        using Response = metrics::HttpExporter::Response;
        if (!access->enabled()) return Response::Metrics(m->Render());
        access::PeerInfo peer;
        peer.transport = access::PeerInfo::Transport::kTcp;
        peer.authorization = request.authorization;
        auto principal = access->Authenticate(peer);
        if (!principal.ok()) {
          Logger("metrics")->debug("metrics scrape refused: {}", principal.status().ToString());
          return Response::Unauthorized("opjit");
        }
        if ((*principal)->scrapes_all()) return Response::Metrics(m->Render());
        return Response::Metrics(
            m->Render(metrics::Registry::RenderFilter::Namespaces((*principal)->namespaces)));
      });
  if (!e.ok()) {
    return absl::Status(e.status().code(), absl::StrCat("metrics: ", e.status().message()));
  }
  p.exporter = *std::move(e);
  Logger("main")->info("metrics on http://{}/metrics", p.exporter->address());
  facts_->metrics_listen = p.exporter->address();
  const std::string path = cfg_.state_dir + "/metrics_endpoint";
  std::ofstream out(path, std::ios::trunc);
  out << p.exporter->address() << "\n";
  out.flush();
  if (!out) {
    // Scrapes go on; only tools that look the address up there miss it.
    Logger("main")->error("cannot write {} (the metrics address): {}", path,
                          std::strerror(errno));
  }
  return absl::OkStatus();
}

int Daemon::Serve() {
  served_ = true;
  parts_->ready.StartupDone();
  int sig = 0;
  int error = 0;
  Parts& p = *parts_;
  // A reload's revocations run again a second later, for what calls that
  // were already running at the reload (an OpenChannel, a CreateRegion)
  // made after the first pass.
  std::vector<Revocation> again;
  for (;;) {
    if (again.empty()) {
      error = sigwait(&signals_, &sig);
    } else {
      const timespec wait = {1, 0};
      sig = sigtimedwait(&signals_, nullptr, &wait);
      error = sig >= 0 ? 0 : errno;
      if (error == EAGAIN || error == EINTR) {
        if (error == EAGAIN) {
          Revoke(again, p.regions.get(), p.channels.get(), p.handles.get(), p.autograd.get(),
                 /*second_pass=*/true);
          again.clear();
        }
        continue;
      }
    }
    if (error != 0 || sig != SIGHUP) break;
    Reload(&cfg_, p.access.get(), p.quotas.get(), [&](const std::vector<Revocation>& lost) {
      Revoke(lost, p.regions.get(), p.channels.get(), p.handles.get(), p.autograd.get());
      again = lost;
    });
  }
  if (error != 0) {
    Logger("main")->error("waiting for signals failed: {}; shutting down", std::strerror(error));
    return 0;
  }
  Logger("main")->info("{} received, shutting down", strsignal(sig));
  return sig;
}

void Daemon::Shutdown() {
  if (parts_ == nullptr) return;
  // False without $NOTIFY_SOCKET (no systemd); a failed send is logged by
  // systemd_notify.cc: either way the stop goes on.
  if (served_) static_cast<void>(systemd::NotifyStopping());
  parts_.reset();
  if (served_) Logger("main")->info("bye");
}

}  // namespace opjit

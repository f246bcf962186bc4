// opjitd: wires the core libraries together and serves them over gRPC.
// Nothing here but configuration, construction order and signal handling.
#include <fcntl.h>
#include <linux/capability.h>
#include <pwd.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <algorithm>
#include <atomic>
#include <map>
#include <set>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/access/access.h"
#include "server/access/quotas.h"
#include "server/common/health_monitor.h"
#include "server/common/paths.h"
#include "server/common/systemd_notify.h"
#include "server/common/logging.h"
#include "server/compiler/kernel_compiler.h"
#include "server/metrics/http_exporter.h"
#include "server/metrics/metrics.h"
#include "server/rpc/metrics_interceptor.h"
#include "server/autograd/autograd.h"
#include "server/common/sha256.h"
#include "server/common/subordinate_ids.h"
#include "server/common/subprocess.h"
#include "server/cache/disk_cache.h"
#include "server/config.h"
#include "server/exec/channels.h"
#include "server/exec/executor.h"
#include "server/exec/handles.h"
#include "server/gpu/driver_probe.h"
#include "server/loader/loader.h"
#include "server/runner/in_process_runner.h"
#include "server/runner/process_runner.h"
#include "server/registry/registry.h"
#include "server/rpc/grpc_server.h"
#include "server/tensor/region_manager.h"

#include "opjit/version.h"  // generated: OPJIT_VERSION, OPJIT_GIT_REVISION (cmake/version.cmake)

namespace opjit {
namespace {

// The registry store's last health probe: opjit_registry_store_up, and the
// grpc.health service kStoreHealthService.
std::atomic<bool> store_up{true};

// The grpc.health.v1 service name that answers NOT_SERVING while the
// registry store cannot be written (registrations and deletes are refused
// with UNAVAILABLE / STORE_UNAVAILABLE meanwhile), SERVING otherwise.
constexpr char kStoreHealthService[] = "opjit.registry.store";

// A secret named by the config (`what`, e.g. "cache.remote.key_file"): the
// file's bytes without trailing newlines. Refused when empty; a file that
// others can read is used, with a warning.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, const char* what) {
  struct stat st;
  std::ifstream in(path, std::ios::binary);
  if (!in || stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!bytes.empty() && (bytes.back() == '\n' || bytes.back() == '\r')) bytes.pop_back();
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " is empty"));
  if ((st.st_mode & 077) != 0) {
    Logger("opjitd")->warn("{} {} can be read by other users (mode {:o}); chmod 600 it", what,
                           path, st.st_mode & 0777);
  }
  return bytes;
}

std::string ExeDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

// opjit-compile-worker and the other helpers: <exe>/../libexec/opjit, else
// beside opjitd (the build tree).
std::string HelperDir() { return FindHelperDir(ExeDir()); }

// Kernel headers: the configured dir, else installed next to the binary, else
// the source tree this binary was built from.
// A daemon without root, with subordinate ids (/etc/subuid, /etc/subgid):
// each namespace's executors as one of them, and its compile workers as the
// last, which no executor gets.
struct SubordinateIds {
  uint32_t uid_first = 0, uid_last = 0, gid_first = 0;  // executors
  uint32_t compile_uid = 0, compile_gid = 0;
  std::string why_not;  // empty: use them
};

SubordinateIds PickSubordinateIds(const DaemonConfig& cfg) {
  SubordinateIds out;
  if (::geteuid() == 0) {
    out.why_not = "root";
    return out;
  }
  if (!cfg.exec_namespaces) {
    out.why_not = "exec.namespaces = false";
    return out;
  }
  if (!subprocess::UserNamespaces()) {
    out.why_not = "this kernel refuses it user namespaces";
    return out;
  }
  std::optional<subordinate::Ids> ids = subordinate::ForThisUser();
  if (!ids || std::min(ids->uids.count, ids->gids.count) < 2) {
    out.why_not = "its user has no subordinate ids (at least 2 in /etc/subuid and /etc/subgid) or "
                  "newuidmap and newgidmap are missing";
    return out;
  }
  // One start to prove that newuidmap and newgidmap accept the ranges.
  subprocess::SpawnOptions probe;
  probe.path = "/bin/true";
  probe.own_process_group = false;
  probe.user_namespace = subprocess::SpawnOptions::UserNamespace{ids->uids.first, ids->gids.first,
                                                                 /*map_own_ids=*/true};
  absl::StatusOr<pid_t> pid = subprocess::Spawn(probe);
  absl::StatusOr<subprocess::Exit> e =
      pid.ok() ? subprocess::Wait(*pid) : absl::StatusOr<subprocess::Exit>(pid.status());
  if (!e.ok() || !e->exited() || e->code() != 0) {
    out.why_not = absl::StrCat("mapping its subordinate ids failed (",
                               e.ok() ? e->Describe() : std::string(e.status().message()), ")");
    return out;
  }
  const uint32_t n = std::min(ids->uids.count, ids->gids.count);
  out.uid_first = ids->uids.first;
  out.uid_last = ids->uids.first + n - 2;
  out.gid_first = ids->gids.first;
  out.compile_uid = ids->uids.first + n - 1;
  out.compile_gid = ids->gids.first + n - 1;
  return out;
}

// The process runner's options from the [exec] config.
runner::ProcessRunnerOptions ProcessRunnerOptionsFrom(const DaemonConfig& cfg,
                                                      const runner::KernelHostOptions& host,
                                                      const SubordinateIds& sub) {
  runner::ProcessRunnerOptions o;
  o.worker_path = HelperDir() + "/opjit-exec-worker";
  o.workers_per_namespace = cfg.exec_workers;
  o.idle_ms = cfg.worker_idle_ms;
  o.kernel_timeout_ms = cfg.kernel_timeout_ms;
  o.memory_bytes = static_cast<uint64_t>(cfg.worker_memory_mb) << 20;
  o.spin_us = cfg.worker_spin_us;
  o.wait_spin_us = cfg.wait_spin_us;
  o.quarantine_after = cfg.quarantine_after;
  o.arena_bytes = static_cast<uint64_t>(cfg.max_message_bytes) * 5 / 2;
  o.host = host;
  o.threads_per_executor = static_cast<int>(cfg.threads_per_executor);
  o.threads_per_namespace = static_cast<int>(cfg.threads_per_namespace);
  o.scratch_bytes = static_cast<uint64_t>(cfg.scratch_mb) << 20;
  o.namespace_memory_bytes = static_cast<uint64_t>(cfg.namespace_memory_mb) << 20;
  // Started as root, each namespace's executors run as a uid of their own
  // (exec.uid_range); without a range, all as exec.worker_user.
  if (::geteuid() == 0 && cfg.uid_first != 0) {
    o.uid_first = cfg.uid_first;
    o.uid_last = cfg.uid_last;
    Logger("runner")->info("executors run as a uid per namespace, from {}-{}", cfg.uid_first,
                           cfg.uid_last);
  } else if (::geteuid() == 0) {
    if (cfg.worker_user.empty()) {
      Logger("runner")->warn("exec.uid_range and exec.worker_user are \"\": executors keep root");
    } else if (const passwd* pw = ::getpwnam(cfg.worker_user.c_str())) {
      o.uid = pw->pw_uid;
      o.gid = pw->pw_gid;
    } else {
      Logger("runner")->warn("exec.worker_user \"{}\" does not exist; executors keep root",
                             cfg.worker_user);
    }
    Logger("runner")->warn(
        "WARNING: exec.uid_range = \"\": every namespace's executors share one uid, so tenants "
        "are not apart by uid and exec.threads_per_namespace is not enforced; set exec.uid_range");
  } else if (sub.why_not.empty()) {
    o.uid_first = sub.uid_first;
    o.uid_last = sub.uid_last;
    o.gid_first = sub.gid_first;
    Logger("runner")->info(
        "executors run as a subordinate uid per namespace, from {}-{} (gids from {}), each in "
        "user and PID namespaces of its own",
        o.uid_first, o.uid_last, o.gid_first);
  } else {
    Logger("runner")->warn(
        "WARNING: opjitd is not root and {}, so its executors run as its own uid ({}), each in a "
        "user namespace of its own: tenants are not apart by uid, a kernel shares the daemon's "
        "per-user limits, and exec.threads_per_namespace caps each executor, not a namespace. "
        "Landlock and seccomp still confine every executor; give opjitd's user subordinate ids "
        "(usermod --add-subuids/--add-subgids, with the uidmap package) for a uid per namespace",
        sub.why_not, ::geteuid());
  }
  if (!cfg.exec_namespaces) {
    subprocess::AllowNamespaces(false);
    Logger("runner")->warn(
        "WARNING: exec.namespaces = false: executors share the host's PID, IPC and network "
        "namespaces, and an executor's scratch is a host directory (each file at most "
        "exec.scratch_mb) instead of a private tmpfs. seccomp still refuses every call aimed at "
        "another process");
  } else if (!subprocess::PrivateNamespaces()) {
    Logger("runner")->warn(
        "WARNING: opjitd cannot create namespaces (it is not root and this kernel refuses "
        "unprivileged user namespaces): executors and compile workers share the host's PID, IPC "
        "and network namespaces, and an executor's scratch is a host directory (each file at "
        "most exec.scratch_mb) instead of a private tmpfs. seccomp still refuses every call "
        "aimed at another process");
  } else if (!subprocess::PidNamespaces() && !subprocess::UserNamespaces()) {
    Logger("runner")->warn(
        "WARNING: opjitd is not root: executors and compile workers get network, IPC, mount and "
        "UTS namespaces of their own (through a user namespace) and a private tmpfs scratch, "
        "but share the host's PID namespace (this kernel refuses it a PID namespace). seccomp "
        "still refuses every call aimed at another process");
  }
  return o;
}

std::string FindKernelIncludeDir(const DaemonConfig& cfg) {
  if (!cfg.kernel_include_dir.empty()) return cfg.kernel_include_dir;
  if (const char* env = std::getenv("OPJIT_KERNEL_INCLUDE_DIR"); env && *env) return env;
  const std::string installed = ExeDir() + "/../share/opjit/include";
  if (std::filesystem::exists(installed + "/custom_aot_extra.h")) {
    return std::filesystem::canonical(installed).string();
  }
  return OPJIT_SOURCE_KERNEL_INCLUDE_DIR;
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

// Half of what /dev/shm holds: the default bound on all namespaces' shm.
uint64_t HalfOfDevShm() {
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) != 0) return 0;
  return static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize / 2;
}

// Gauges read from the subsystems at each scrape, and the subsystems'
// counters as Prometheus counters.
void DeclareCoreMetrics(metrics::Registry& m, compiler::KernelCompiler* compiler,
                        runner::KernelRunner* runner, tensor::RegionManager* regions,
                        autograd::Autograd* autograd, access::AccessControl* access,
                        HealthMonitor** health) {
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
    r.SetCounter("opjit_quarantined_kernels_total", {}, static_cast<double>(w.quarantined));
    r.Set("opjit_serving", {}, (*health == nullptr || (*health)->serving()) ? 1.0 : 0.0);
    r.Set("opjit_registry_store_up", {}, store_up.load() ? 1.0 : 0.0);
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

// opjitd --check-config FILE: every problem on its own line (stderr), or one
// "ok" line (stdout). Reads FILE and nothing else; starts nothing.
int CheckConfig(const DaemonConfig& flags_only) {
  const ConfigResult r = BuildConfig(flags_only.check_config, flags_only.flags);
  if (!r.problems.empty()) {
    for (const ConfigProblem& p : r.problems) std::fprintf(stderr, "%s\n", p.ToString().c_str());
    std::fprintf(stderr, "%s: %zu problem(s)\n", flags_only.check_config.c_str(),
                 r.problems.size());
    return 1;
  }
  const DaemonConfig& c = r.config;
  std::printf("%s: ok: %zu principal(s), registry %s, listen %s%s%s, log_level %s\n",
              flags_only.check_config.c_str(), c.principals.size(), c.registry_backend.c_str(),
              absl::StrJoin(c.listen, ", ").c_str(),
              c.metrics_listen.empty() ? "" : absl::StrCat(", metrics ", c.metrics_listen).c_str(),
              c.cache_remote_url.empty() ? "" : ", cache.remote on", c.log_level.c_str());
  return 0;
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

// SIGHUP: reads the --config file again and applies what can change while
// serving (principals and tokens, the QuotaManager's quotas, the namespace
// bound, the log level), logging each change; other changed keys are logged
// as needing a restart. A file with problems changes nothing. `running` is
// what is in force, and is updated to what was applied.
void Reload(DaemonConfig* running, access::AccessControl* access, access::QuotaManager* quotas) {
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
      running->principals = next.principals;
      ++applied;
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
    quotas->SetOptions({.concurrent_compiles = next.quota_concurrent_compiles,
                        .compile_seconds_per_minute = next.quota_compile_seconds_per_minute,
                        .calls_per_second = next.quota_calls_per_second});
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

int Run(int argc, char** argv) {
  auto cfg = LoadConfig(argc, argv);
  if (!cfg.ok()) {
    if (cfg.status().code() == absl::StatusCode::kCancelled) {
      std::fputs(std::string(cfg.status().message()).c_str(), stdout);
      return 0;
    }
    for (absl::string_view line : absl::StrSplit(cfg.status().message(), '\n')) {
      std::fprintf(stderr, "opjitd: %s\n", std::string(line).c_str());
    }
    return 2;
  }
  if (cfg->version) {
    std::printf("opjitd %s (git %s)\n", OPJIT_VERSION, OPJIT_GIT_REVISION);
    return 0;
  }
  if (!cfg->check_config.empty()) return CheckConfig(*cfg);
  SetLogLevel(cfg->log_level);
  if (cfg->verify_cache) {
    const std::string dir = cfg->state_dir + "/cache";
    cache::DiskCacheVerification v = cache::VerifyDiskCache(dir);
    for (const std::string& bad : v.corrupt) std::printf("corrupt: %s\n", bad.c_str());
    std::printf("%s: %llu entries, %llu bytes, %zu corrupt\n", dir.c_str(),
                static_cast<unsigned long long>(v.entries),
                static_cast<unsigned long long>(v.bytes), v.corrupt.size());
    return v.corrupt.empty() ? 0 : 1;
  }
  // Debian's abseil is built with mutex deadlock detection on, which keeps a
  // global lock graph updated on every absl::Mutex acquisition; the lock
  // order here is fixed and tested, so skip that per-call cost.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto log = Logger("main");

  // Signals are taken synchronously by this thread (sigwait below); block them
  // before any other thread exists so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);  // a reload (Reload), never a stop
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::error_code ec;
  std::filesystem::create_directories(cfg->state_dir, ec);
  if (ec) {
    log->error("cannot create state dir {}: {}", cfg->state_dir, ec.message());
    return 1;
  }
  if (::chmod(cfg->state_dir.c_str(), 0700) != 0) {
    // Not fatal (a state dir owned by someone else, or on a file system
    // without modes): the operator learns that others may read it.
    log->warn("cannot make the state dir {} private (chmod 700): {}", cfg->state_dir,
              std::strerror(errno));
  }
  // A full disk or a file-size limit must fail a write, not kill the daemon.
  signal(SIGXFSZ, SIG_IGN);
  auto lock_fd = LockStateDir(cfg->state_dir);
  if (!lock_fd.ok()) {
    log->error("{}", std::string(lock_fd.status().message()));
    return 1;
  }
  // Every helper carries a tag of the state dir (as the shm names do). With
  // the lock held no other daemon of this state dir lives, so a tagged
  // helper that is not ours was left by a killed predecessor: end it.
  subprocess::SetInstanceTag(Sha256Hex(cfg->state_dir).substr(0, 12));
  if (const int ended = subprocess::EndLeftovers(
          subprocess::InstanceTag(),
          {"opjit-exec-worker", "opjit-compile-worker", "opjit-gpu-sandbox"});
      ended > 0) {
    log->warn("ended {} helper process(es) a previous opjitd of this state dir left running",
              ended);
  }

  registry::Registry::Options reg_opts{
      .db_path = cfg->state_dir + "/registry.db",
      .max_ops_per_namespace = static_cast<size_t>(cfg->quota_ops),
      .max_versions_per_op = static_cast<size_t>(cfg->quota_versions)};
  reg_opts.backend = cfg->registry_backend;
  reg_opts.url = cfg->registry_url;
  reg_opts.poll_ms = cfg->registry_poll_ms;
  if (!cfg->registry_password_file.empty()) {
    auto password = ReadSecretFile(cfg->registry_password_file, "registry.password_file");
    if (!password.ok()) {
      log->error("{}", std::string(password.status().message()));
      return 1;
    }
    reg_opts.password = std::move(*password);
  }
  auto registry = registry::Registry::Create(reg_opts);
  if (!registry.ok()) {
    log->error("registry: {}", registry.status().ToString());
    return 1;
  }

  compiler::KernelCompilerOptions copts;
  copts.cache_dir = cfg->state_dir + "/cache";
  copts.worker_path = HelperDir() + "/opjit-compile-worker";
  copts.workers = cfg->compile_workers;
  copts.timeout_ms = cfg->compile_timeout_ms;
  copts.memory_limit_bytes = static_cast<uint64_t>(cfg->compile_memory_limit_mb) << 20;
  copts.kernel_include_dir = FindKernelIncludeDir(*cfg);
  copts.extra_include_dirs = cfg->extra_include_dirs;
  copts.allowed_libraries = cfg->allowed_libraries;
  copts.memory_entries = cfg->cache_memory_entries;
  copts.memory_bytes = static_cast<uint64_t>(cfg->cache_memory_mb) << 20;
  copts.disk_bytes = static_cast<uint64_t>(cfg->cache_disk_mb) << 20;
  copts.pool_threads = cfg->compile_threads;
  copts.recycle_after_compiles = cfg->compile_recycle_after;
  copts.recycle_memory_bytes = cfg->compile_recycle_memory_mb > 0
                                   ? static_cast<uint64_t>(cfg->compile_recycle_memory_mb) << 20
                                   : copts.memory_limit_bytes / 2;
  if (!cfg->cache_remote_url.empty()) {
    auto key = ReadSecretFile(cfg->cache_remote_key_file, "cache.remote.key_file");
    if (!key.ok()) {
      log->error("{}", std::string(key.status().message()));
      return 1;
    }
    copts.remote = {.url = cfg->cache_remote_url,
                    .key = std::move(*key),
                    .timeout_ms = cfg->cache_remote_timeout_ms,
                    .max_bytes = static_cast<uint64_t>(cfg->cache_remote_max_mb) << 20,
                    .ttl_s = cfg->cache_remote_ttl_s};
    log->info("cache: remote tier {}", cfg->cache_remote_url);
  }
  copts.long_after_ms = cfg->compile_long_after_ms;
  copts.long_workers = cfg->compile_long_workers;
  copts.slow_compile_log_ms = cfg->compile_slow_log_ms;
  // Root: compile workers run as compiler.uid, never root, and never an
  // executor's uid (config.cc keeps it out of exec.uid_range; here, out of
  // exec.worker_user's, which executors take when exec.uid_range is "").
  if (::geteuid() == 0) {
    const passwd* pw = cfg->uid_first == 0 && !cfg->worker_user.empty()
                           ? ::getpwnam(cfg->worker_user.c_str())
                           : nullptr;
    if (pw != nullptr && static_cast<int64_t>(pw->pw_uid) == cfg->compile_uid) {
      log->error("compiler.uid {} is exec.worker_user's ({}): executors and compile workers need "
                 "different uids",
                 cfg->compile_uid, cfg->worker_user);
      return 1;
    }
    copts.compile_uid = cfg->compile_uid;
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3] = {};
    if (::syscall(SYS_capget, &header, caps) == 0 &&
        (caps[CAP_TO_INDEX(CAP_DAC_READ_SEARCH)].permitted & CAP_TO_MASK(CAP_DAC_READ_SEARCH))) {
      log->info("compile workers run as uid {} with CAP_DAC_READ_SEARCH alone", cfg->compile_uid);
    } else {
      log->warn(
          "WARNING: opjitd has no CAP_DAC_READ_SEARCH (a container's root?), so its compile "
          "workers run as uid {} with no capability: they read only the include directories "
          "that uid may read (compiler.extra_include_dirs kept 0700 by root are \"not found\")",
          cfg->compile_uid);
    }
  }
  // Not root, with subordinate ids: compile workers as the last of them.
  const SubordinateIds sub_ids = PickSubordinateIds(*cfg);
  if (sub_ids.why_not.empty()) {
    copts.compile_uid = sub_ids.compile_uid;
    copts.compile_gid = sub_ids.compile_gid;
    log->info("compile workers run as subordinate uid {} (gid {}) with CAP_DAC_READ_SEARCH over "
              "opjitd's own files alone",
              sub_ids.compile_uid, sub_ids.compile_gid);
  }
  auto compiler = compiler::KernelCompiler::Create(copts);
  if (!compiler.ok()) {
    log->error("compiler: {}", compiler.status().ToString());
    return 1;
  }

  const loader::HostTarget host = loader::DetectHostTarget();
  const gpu::GpuStatus& gpu = gpu::ProbeGpu();
  rpc::ServerFacts facts;
  facts.version = OPJIT_VERSION;
  facts.kernel_abi_version = compiler::kKernelAbiVersion;
  facts.state_dir = cfg->state_dir;
  facts.cpu_triple = host.triple;
  facts.cpu_name = host.cpu;
  facts.cpu_features = host.features;
  facts.compiler_id = (*compiler)->ToolchainId();
  facts.gpu_available = gpu.available;
  facts.gpu_reason = gpu.reason;
  facts.gpu_devices = gpu.devices;
  if (!gpu.available) log->info("GPU unavailable: {}", gpu.reason);

  // Daemon-created shm objects carry a tag of the state dir, so a restart can
  // remove the orphans of its previous run without touching other daemons'.
  tensor::RegionManagerOptions ropts;
  ropts.instance_tag = Sha256Hex(cfg->state_dir).substr(0, 12);
  ropts.namespace_quota_bytes = static_cast<uint64_t>(cfg->shm_quota_mb) << 20;
  ropts.total_quota_bytes = cfg->quota_total_shm_mb > 0
                                ? static_cast<uint64_t>(cfg->quota_total_shm_mb) << 20
                                : HalfOfDevShm();
  ropts.default_lease_ms = cfg->lease_ms;
  auto regions = tensor::RegionManager::Create(ropts);
  if (!regions.ok()) {
    log->error("shared memory: {}", regions.status().ToString());
    return 1;
  }

  // Where user code runs: sandboxed executor processes, or (trusted single
  // user) this process.
  std::unique_ptr<runner::KernelRunner> kernel_runner;
  runner::KernelHostOptions hopts;
  hopts.allowed_libraries = cfg->allowed_libraries;
  hopts.scratch_dir = cfg->state_dir + "/cache/gpu-load";
  {
    std::error_code ec;
    std::filesystem::create_directories(hopts.scratch_dir, ec);
  }
  if (cfg->isolation == "in-daemon") {
    log->warn("exec.isolation = in-daemon: kernels run inside opjitd, unconfined; a crashing "
              "kernel stops the daemon. Use only for a trusted single user.");
    auto r = runner::InProcessRunner::Create(hopts);
    if (!r.ok()) {
      log->error("runner: {}", r.status().ToString());
      return 1;
    }
    kernel_runner = *std::move(r);
  } else {
    auto r = runner::ProcessRunner::Create(ProcessRunnerOptionsFrom(*cfg, hopts, sub_ids));
    if (!r.ok()) {
      log->error("runner: {}", r.status().ToString());
      return 1;
    }
    kernel_runner = *std::move(r);
  }

  exec::ExecutorOptions eopts;
  eopts.pool_threads = cfg->exec_threads;
  eopts.max_queue = cfg->exec_queue;
  eopts.inline_max_bytes = cfg->inline_max_bytes;
  eopts.max_inline_output_bytes = cfg->max_message_bytes - (1 << 20);
  auto executor = exec::Executor::Create(eopts, registry->get(), compiler->get(), regions->get(),
                                         kernel_runner.get());
  if (!executor.ok()) {
    log->error("executor: {}", executor.status().ToString());
    return 1;
  }

  auto autograd = autograd::Autograd::Create(
      {.ttl_ms = cfg->context_ttl_ms,
       .namespace_bytes = static_cast<uint64_t>(cfg->context_mb) << 20,
       .total_bytes = static_cast<uint64_t>(cfg->quota_total_context_mb) << 20,
       .gradcheck_threads = 1},
      registry->get(), executor->get());
  if (!autograd.ok()) {
    log->error("autograd: {}", autograd.status().ToString());
    return 1;
  }

  // Prepared handles and fast channels.
  exec::HandleTable handles({.max_per_namespace = static_cast<size_t>(cfg->fast_handles),
                             .lease_ms = cfg->lease_ms},
                            registry->get());
  exec::ChannelManager channels({.enabled = cfg->fast_enabled && cfg->fast_channels > 0,
                                 .per_namespace = static_cast<size_t>(cfg->fast_channels),
                                 .total = static_cast<size_t>(cfg->fast_total_channels),
                                 .spin_us = cfg->fast_spin_us},
                                regions->get(), &handles, kernel_runner.get());
  (*registry)->SetChangeListener([&channels] { channels.OnRegistryChanged(); });

  // Releases the regions of clients whose lease lapsed, and idle contexts.
  std::mutex reaper_mu;
  std::condition_variable reaper_cv;
  bool reaper_stop = false;
  std::thread reaper([&] {
    std::unique_lock<std::mutex> lock(reaper_mu);
    while (!reaper_cv.wait_for(lock, std::chrono::seconds(1), [&] { return reaper_stop; })) {
      const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
      if (int n = (*regions)->ExpireLeases(now); n > 0) {
        Logger("tensor")->info("released {} region(s) whose lease lapsed", n);
      }
      kernel_runner->Maintain();
      channels.Maintain();
      handles.Expire([&](const std::string& ns, const std::string& owner) {
        return (*regions)->HasOwner(ns, owner);
      });
      if (int n = (*autograd)->ExpireContexts(std::chrono::steady_clock::now()); n > 0) {
        Logger("autograd")->info("released {} backward context(s) past their TTL", n);
      }
    }
  });

  auto access_control = access::AccessControl::Create(
      {.principals = cfg->principals,
       .daemon_uid = ::getuid(),
       .max_namespaces = static_cast<size_t>(cfg->quota_namespaces)});
  if (!access_control.ok()) {
    log->error("{}", std::string(access_control.status().message()));
    return 1;
  }
  (*access_control)->AddExisting((*registry)->Namespaces());
  access::QuotaManager quotas(
      {.concurrent_compiles = cfg->quota_concurrent_compiles,
       .compile_seconds_per_minute = cfg->quota_compile_seconds_per_minute,
       .calls_per_second = cfg->quota_calls_per_second});

  metrics::Registry metrics;
  HealthMonitor* health_ptr = nullptr;
  DeclareCoreMetrics(metrics, compiler->get(), kernel_runner.get(), regions->get(), autograd->get(),
                     access_control->get(), &health_ptr);

  rpc::CoreRefs core{.registry = registry->get(),
                     .compiler = compiler->get(),
                     .regions = regions->get(),
                     .executor = executor->get(),
                     .autograd = autograd->get(),
                     .access = access_control->get(),
                     .quotas = &quotas,
                     .handles = &handles,
                     .channels = &channels};
  rpc::GrpcServerOptions sopts;
  sopts.listen = cfg->listen;
  sopts.max_message_bytes = static_cast<int>(cfg->max_message_bytes);
  sopts.tls_cert_file = cfg->tls_cert;
  sopts.tls_key_file = cfg->tls_key;
  sopts.tls_client_ca_file = cfg->tls_client_ca;
  sopts.tls_require_client_cert = cfg->tls_require_client_cert;
  sopts.socket_mode = cfg->socket_mode;
  sopts.socket_group = cfg->socket_group;
  sopts.interceptors.push_back(rpc::MakeMetricsInterceptorFactory(&metrics));
  // Fast-channel calls never pass through gRPC: they draw credit from the
  // same calls_per_second bucket and are counted in the same metrics.
  channels.SetAccounting(
      {.admit = [&quotas](const std::string& ns) {
         return quotas.AdmitCalls(ns, quotas.CallCreditBatch());
       },
       .record = [&metrics](const std::string& ns, const std::string& op, absl::StatusCode code,
                            uint64_t calls, double kernel_seconds) {
         rpc::CountChannelCalls(&metrics, ns, op, code, calls, kernel_seconds);
       }});
  auto server = rpc::GrpcServer::Start(std::move(sopts), core, facts);
  if (!server.ok()) {
    log->error("{}", std::string(server.status().message()));
    return 1;
  }
  if (!WriteEndpoints(cfg->state_dir, (*server)->bound())) {
    // Serving goes on; only tools that look the address up there miss it.
    log->error("cannot write {}/endpoints (the bound addresses): {}", cfg->state_dir,
               std::strerror(errno));
  }
  for (const std::string& address : cfg->listen) {
    if (address.rfind("unix:", 0) != 0 && !IsLoopbackTcp(address) &&
        (cfg->tls_cert.empty() || cfg->principals.empty())) {
      log->warn("listening on {} without {} (allow_insecure_tcp): anyone who can reach it can "
                "run code and read tensors",
                address, cfg->tls_cert.empty() ? "TLS" : "principals");
    }
  }
  if (cfg->principals.empty()) {
    log->info("no principals configured: every local caller is admin (the embedded default)");
  } else {
    log->info("{} principal(s) configured; callers authenticate", cfg->principals.size());
  }

  // Health: the workers can be started and the store written.
  std::vector<HealthMonitor::Probe> probes;
  // Starting a worker costs ~0.1 s of CPU: while serving, every 10th round.
  probes.push_back(
      {"compile workers", [p = copts.worker_path] { return ProbeExecutable(p); }, 10});
  if (cfg->isolation == "process") {
    probes.push_back({"executor workers",
                      [p = HelperDir() + "/opjit-exec-worker"] { return ProbeExecutable(p); }, 10});
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
  rpc::GrpcServer* grpc_server = server->get();
  grpc_server->SetServiceServing(kStoreHealthService, true);
  probes.push_back({"registry store",
                    [r = registry->get(), log, grpc_server,
                     shared = cfg->registry_backend != "sqlite"] {
                      const absl::Status s = r->ProbeStore();
                      if (store_up.exchange(s.ok()) != s.ok()) {
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
  // systemd (Type=notify): READY=1 once started and SERVING, WATCHDOG=1 while
  // healthy; no-ops without $NOTIFY_SOCKET.
  systemd::ReadyGate ready;
  auto health = std::make_unique<HealthMonitor>(
      std::move(probes), std::chrono::milliseconds(std::max<int64_t>(cfg->health_interval_ms, 50)),
      [grpc_server, &ready](bool serving, const std::string& why) {
        grpc_server->SetServing(serving);
        ready.SetServing(serving, why);
      });
  health_ptr = health.get();
  auto watchdog = systemd::WatchdogPinger::Start([&health] { return health->serving(); });
  if (watchdog) {
    log->info("systemd watchdog: a ping every {} ms while healthy",
              std::chrono::duration_cast<std::chrono::milliseconds>(watchdog->period()).count());
  }

  std::unique_ptr<metrics::HttpExporter> exporter;
  if (!cfg->metrics_listen.empty()) {
    // With principals, a scrape needs a bearer token: an admin's or a metrics
    // principal's sees every series, another principal's only its
    // namespaces' (issue 14).
    access::AccessControl* access = access_control->get();
    auto e = metrics::HttpExporter::Start(
        cfg->metrics_listen, [&metrics, access](const metrics::HttpExporter::Request& request) {
          using Response = metrics::HttpExporter::Response;
          if (!access->enabled()) return Response::Metrics(metrics.Render());
          access::PeerInfo peer;
          peer.transport = access::PeerInfo::Transport::kTcp;
          peer.authorization = request.authorization;
          auto principal = access->Authenticate(peer);
          if (!principal.ok()) {
            Logger("metrics")->debug("metrics scrape refused: {}", principal.status().ToString());
            return Response::Unauthorized("opjit");
          }
          if ((*principal)->scrapes_all()) return Response::Metrics(metrics.Render());
          return Response::Metrics(metrics.Render(
              metrics::Registry::RenderFilter::Namespaces((*principal)->namespaces)));
        });
    if (!e.ok()) {
      log->error("metrics: {}", std::string(e.status().message()));
      return 1;
    }
    exporter = *std::move(e);
    log->info("metrics on http://{}/metrics", exporter->address());
    std::ofstream(cfg->state_dir + "/metrics_endpoint", std::ios::trunc) << exporter->address() << "\n";
  }
  log->info("opjitd {} (git {}) ready: state {}, {} op(s), listening on {}", OPJIT_VERSION,
            OPJIT_GIT_REVISION, cfg->state_dir, (*registry)->Size(), absl::StrJoin((*server)->bound(), ", "));

  ready.StartupDone();

  int sig = 0;
  while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
    Reload(&*cfg, access_control->get(), &quotas);
  }
  log->info("{} received, shutting down", strsignal(sig));
  systemd::NotifyStopping();
  watchdog.reset();
  exporter.reset();
  health_ptr = nullptr;
  health.reset();
  (*server)->Shutdown(std::chrono::seconds(5));
  (*server)->Wait();
  server->reset();
  {
    std::lock_guard<std::mutex> lock(reaper_mu);
    reaper_stop = true;
  }
  reaper_cv.notify_all();
  reaper.join();
  channels.Shutdown();
  autograd->reset();
  executor->reset();
  kernel_runner.reset();
  regions->reset();
  compiler->reset();
  registry->reset();
  unlink((cfg->state_dir + "/endpoints").c_str());
  close(*lock_fd);
  log->info("bye");
  return 0;
}

}  // namespace
}  // namespace opjit

int main(int argc, char** argv) { return opjit::Run(argc, argv); }

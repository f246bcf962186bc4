// opjitd's config-to-options converters and host facts (daemon_options.h).
#include "server/daemon_options.h"

#include <linux/capability.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/logging.h"
#include "server/common/paths.h"
#include "server/common/sha256.h"
#include "server/common/subordinate_ids.h"
#include "server/common/subprocess.h"
#include "server/common/uid_claims.h"

namespace opjit {

// ---- Host facts ---------------------------------------------------------

std::string ExeDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

std::string HelperDir() { return FindHelperDir(ExeDir()); }

std::string FindKernelIncludeDir(const DaemonConfig& cfg) {
  if (!cfg.kernel_include_dir.empty()) return cfg.kernel_include_dir;
  if (const char* env = std::getenv("OPJIT_KERNEL_INCLUDE_DIR"); env && *env) return env;
  const std::string installed = ExeDir() + "/../share/opjit/include";
  if (std::filesystem::exists(installed + "/custom_aot_extra.h")) {
    return std::filesystem::canonical(installed).string();
  }
  return OPJIT_SOURCE_KERNEL_INCLUDE_DIR;
}

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

uint64_t QuarterOfDevShm() {
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) != 0) return 0;
  return static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize / 4;
}

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
  // Two daemons of this user share these ids: each claims its executors'
  // uids where every daemon of the host does, or it uses none of them.
  absl::StatusOr<std::unique_ptr<UidClaims>> claims = UidClaims::Open(cfg.uid_claim_dir);
  if (!claims.ok()) {
    out.why_not = absl::StrCat(
        "it cannot claim its subordinate uids host-wide (", claims.status().message(),
        "; the package's tmpfiles.d makes it for opjit: install -d -o USER -m 0700 ",
        cfg.uid_claim_dir, ", or set [exec] uid_claim_dir to a directory of its user's that "
        "every daemon of the user shares)");
    return out;
  }
  out.claims = *std::move(claims);
  const uint32_t n = std::min(ids->uids.count, ids->gids.count);
  out.uid_first = ids->uids.first;
  out.uid_last = ids->uids.first + n - 2;
  out.gid_first = ids->gids.first;
  out.compile_uid = ids->uids.first + n - 1;
  out.compile_gid = ids->gids.first + n - 1;
  return out;
}

// ---- [registry] ---------------------------------------------------------

registry::Registry::Options RegistryOptionsFromConfig(const DaemonConfig& cfg,
                                                      std::string password) {
  registry::Registry::Options o{
      .db_path = cfg.state_dir + "/registry.db",
      .max_ops_per_namespace = static_cast<size_t>(cfg.quota_ops),
      .max_versions_per_op = static_cast<size_t>(cfg.quota_versions)};
  o.backend = RegistryBackendName(cfg.registry_backend);
  o.url = cfg.registry_url;
  o.poll_ms = cfg.registry_poll_ms;
  o.password = std::move(password);
  return o;
}

// ---- [compiler], [cache] ------------------------------------------------

std::vector<compiler::ToolchainProfile> ProfilesFromConfig(const DaemonConfig& cfg, bool log) {
  std::vector<compiler::ToolchainProfile> out;
  for (const std::string& name : cfg.compiler_profiles) {
    if (std::any_of(out.begin(), out.end(), [&](const auto& p) { return p.name == name; })) {
      continue;
    }
    absl::StatusOr<compiler::ToolchainProfile> p = compiler::DetectProfile(name);
    if (!p.ok()) {
      if (log) {
        Logger("main")->info("toolchain profile {} is off: {}", name,
                             std::string(p.status().message()));
      }
      continue;
    }
    if (name == "aten") {
      p->namespaces = cfg.aten_namespaces;
      p->pch_at_start = cfg.aten_pch_at_start;
    }
    if (log) {
      Logger("main")->info("toolchain profile {}: include dirs {}, libraries {}, namespaces {}",
                           name, absl::StrJoin(p->include_dirs, ", "),
                           absl::StrJoin(p->libraries, ", "), absl::StrJoin(p->namespaces, ", "));
    }
    out.push_back(*std::move(p));
  }
  return out;
}

compiler::KernelCompilerOptions CompilerOptionsFromConfig(const DaemonConfig& cfg,
                                                          const std::string& helper_dir,
                                                          const std::string& kernel_include_dir,
                                                          std::string remote_key) {
  compiler::KernelCompilerOptions o;
  o.cache_dir = cfg.state_dir + "/cache";
  o.worker_path = helper_dir + "/opjit-compile-worker";
  o.workers = cfg.compile_workers;
  o.timeout_ms = cfg.compile_timeout_ms;
  o.memory_limit_bytes = static_cast<uint64_t>(cfg.compile_memory_limit_mb) << 20;
  o.kernel_include_dir = kernel_include_dir;
  o.extra_include_dirs = cfg.extra_include_dirs;
  o.allowed_libraries = cfg.allowed_libraries;
  o.profiles = ProfilesFromConfig(cfg, /*log=*/true);
  o.memory_entries = cfg.cache_memory_entries;
  o.memory_bytes = static_cast<uint64_t>(cfg.cache_memory_mb) << 20;
  o.disk_bytes = static_cast<uint64_t>(cfg.cache_disk_mb) << 20;
  o.pool_threads = cfg.compile_threads;
  o.recycle_after_compiles = cfg.compile_recycle_after;
  o.recycle_memory_bytes = cfg.compile_recycle_memory_mb > 0
                               ? static_cast<uint64_t>(cfg.compile_recycle_memory_mb) << 20
                               : o.memory_limit_bytes / 2;
  if (!cfg.cache_remote_url.empty()) {
    o.remote = {.url = cfg.cache_remote_url,
                .key = std::move(remote_key),
                .timeout_ms = cfg.cache_remote_timeout_ms,
                .max_bytes = static_cast<uint64_t>(cfg.cache_remote_max_mb) << 20,
                .ttl_s = cfg.cache_remote_ttl_s};
  }
  o.long_after_ms = cfg.compile_long_after_ms;
  o.long_workers = cfg.compile_long_workers;
  o.long_timeout_ms = cfg.compile_long_timeout_ms;
  o.slow_compile_log_ms = cfg.compile_slow_log_ms;
  return o;
}

absl::Status CompileUidFromConfig(const DaemonConfig& cfg, const SubordinateIds& sub,
                                  compiler::KernelCompilerOptions* options) {
  auto log = Logger("main");
  // Root: compile workers run as compiler.uid, never root, and never an
  // executor's uid (config.cc keeps it out of exec.uid_range; here, out of
  // exec.worker_user's, which executors take when exec.uid_range is "").
  if (::geteuid() == 0) {
    const passwd* pw = cfg.uid_first == 0 && !cfg.worker_user.empty()
                           ? ::getpwnam(cfg.worker_user.c_str())
                           : nullptr;
    if (pw != nullptr && static_cast<int64_t>(pw->pw_uid) == cfg.compile_uid) {
      return absl::FailedPreconditionError(
          absl::StrCat("compiler.uid ", cfg.compile_uid, " is exec.worker_user's (",
                       cfg.worker_user, "): executors and compile workers need different uids"));
    }
    options->compile_uid = cfg.compile_uid;
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[_LINUX_CAPABILITY_U32S_3] = {};
    if (::syscall(SYS_capget, &header, caps) == 0 &&
        (caps[CAP_TO_INDEX(CAP_DAC_READ_SEARCH)].permitted & CAP_TO_MASK(CAP_DAC_READ_SEARCH))) {
      log->info("compile workers run as uid {} with CAP_DAC_READ_SEARCH alone", cfg.compile_uid);
    } else {
      log->warn(
          "WARNING: opjitd has no CAP_DAC_READ_SEARCH (a container's root?), so its compile "
          "workers run as uid {} with no capability: they read only the include directories "
          "that uid may read (compiler.extra_include_dirs kept 0700 by root are \"not found\")",
          cfg.compile_uid);
    }
  }
  // Not root, with subordinate ids: compile workers as the last of them.
  if (sub.why_not.empty()) {
    options->compile_uid = sub.compile_uid;
    options->compile_gid = sub.compile_gid;
    log->info("compile workers run as subordinate uid {} (gid {}) with CAP_DAC_READ_SEARCH over "
              "opjitd's own files alone",
              sub.compile_uid, sub.compile_gid);
  }
  return absl::OkStatus();
}

// ---- [shm] --------------------------------------------------------------

tensor::RegionManagerOptions RegionOptionsFromConfig(const DaemonConfig& cfg) {
  tensor::RegionManagerOptions o;
  // Daemon-created shm objects carry a tag of the state dir, so a restart can
  // remove the orphans of its previous run without touching other daemons'.
  o.instance_tag = Sha256Hex(cfg.state_dir).substr(0, 12);
  o.namespace_quota_bytes = static_cast<uint64_t>(cfg.shm_quota_mb) << 20;
  o.total_quota_bytes = cfg.quota_total_shm_mb > 0
                            ? static_cast<uint64_t>(cfg.quota_total_shm_mb) << 20
                            : QuarterOfDevShm();
  // One namespace never holds more than all of them together: a per-namespace
  // quota above the total is the total (what its refusals then name).
  if (o.total_quota_bytes > 0) {
    o.namespace_quota_bytes = std::min(o.namespace_quota_bytes, o.total_quota_bytes);
  }
  o.default_lease_ms = cfg.lease_ms;
  return o;
}

// ---- [exec]: where kernels run ------------------------------------------

runner::KernelHostOptions KernelHostOptionsFromConfig(const DaemonConfig& cfg) {
  runner::KernelHostOptions o;
  o.allowed_libraries = cfg.allowed_libraries;
  // A kernel of a profile links its libraries (the compiler checked the
  // namespace's policy when it compiled it).
  for (const compiler::ToolchainProfile& p : ProfilesFromConfig(cfg, /*log=*/false)) {
    for (const std::string& lib : p.libraries) {
      if (std::find(o.allowed_libraries.begin(), o.allowed_libraries.end(), lib) ==
          o.allowed_libraries.end()) {
        o.allowed_libraries.push_back(lib);
      }
    }
  }
  o.scratch_dir = cfg.state_dir + "/cache/gpu-load";
  return o;
}

runner::ProcessRunnerOptions ProcessRunnerOptionsFromConfig(const DaemonConfig& cfg,
                                                            const runner::KernelHostOptions& host,
                                                            const SubordinateIds& sub,
                                                            const std::string& helper_dir) {
  runner::ProcessRunnerOptions o;
  o.worker_path = helper_dir + "/opjit-exec-worker";
  o.workers_per_namespace = cfg.exec_workers;
  o.idle_ms = cfg.worker_idle_ms;
  o.kernel_timeout_ms = cfg.kernel_timeout_ms;
  o.memory_bytes = static_cast<uint64_t>(cfg.worker_memory_mb) << 20;
  o.spin_us = cfg.worker_spin_us;
  o.wait_spin_us = cfg.wait_spin_us;
  o.quarantine_after = cfg.quarantine_after;
  o.quarantine_callers = cfg.quarantine_callers;
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

absl::Status ClaimUidsFromConfig(const DaemonConfig& cfg, const SubordinateIds& sub,
                                 runner::ProcessRunnerOptions* options) {
  if (options->uid_first == 0) return absl::OkStatus();
  std::shared_ptr<UidClaims> claims = sub.claims;
  if (claims == nullptr) {
    absl::StatusOr<std::unique_ptr<UidClaims>> opened = UidClaims::Open(cfg.uid_claim_dir);
    if (!opened.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          opened.status().message(), ". Every opjitd of a host claims the executor uids it hands "
          "out there, so that no two give their tenants one uid: set [exec] uid_claim_dir to a "
          "directory only root (or the opjit user) writes, shared by every daemon of the host"));
    }
    claims = *std::move(opened);
  }
  Logger("runner")->info("executor uids of {}-{} are claimed host-wide in {}: each namespace "
                         "takes the lowest that no daemon of this host holds",
                         options->uid_first, options->uid_last, claims->dir());
  options->claim_uid = [claims](uint32_t first, uint32_t last) {
    return claims->Claim(first, last);
  };
  return absl::OkStatus();
}

exec::ExecutorOptions ExecutorOptionsFromConfig(const DaemonConfig& cfg) {
  exec::ExecutorOptions o;
  o.pool_threads = cfg.exec_threads;
  o.max_queue = cfg.exec_queue;
  o.inline_max_bytes = cfg.inline_max_bytes;
  o.max_inline_output_bytes = cfg.max_message_bytes - (1 << 20);
  return o;
}

// ---- [autograd] ---------------------------------------------------------

autograd::AutogradOptions AutogradOptionsFromConfig(const DaemonConfig& cfg) {
  return {.ttl_ms = cfg.context_ttl_ms,
          .namespace_bytes = static_cast<uint64_t>(cfg.context_mb) << 20,
          .total_bytes = static_cast<uint64_t>(cfg.quota_total_context_mb) << 20,
          .gradcheck_threads = 1};
}

// ---- [fast] -------------------------------------------------------------

exec::HandleTableOptions HandleOptionsFromConfig(const DaemonConfig& cfg) {
  exec::HandleTableOptions o;
  o.max_per_namespace = static_cast<size_t>(cfg.fast_handles);
  o.lease_ms = cfg.lease_ms;
  return o;
}

exec::ChannelOptions ChannelOptionsFromConfig(const DaemonConfig& cfg) {
  exec::ChannelOptions o;
  o.enabled = cfg.fast_enabled && cfg.fast_channels > 0;
  o.per_namespace = static_cast<size_t>(cfg.fast_channels);
  o.total = static_cast<size_t>(cfg.fast_total_channels);
  o.spin_us = cfg.fast_spin_us;
  return o;
}

// ---- [[principal]], [quota] ---------------------------------------------

access::AccessOptions AccessOptionsFromConfig(const DaemonConfig& cfg) {
  return {.principals = cfg.principals,
          .daemon_uid = ::getuid(),
          .max_namespaces = static_cast<size_t>(cfg.quota_namespaces)};
}

access::QuotaOptions QuotaOptionsFromConfig(const DaemonConfig& cfg) {
  return {.concurrent_compiles = cfg.quota_concurrent_compiles,
          .compile_seconds_per_minute = cfg.quota_compile_seconds_per_minute,
          .calls_per_second = cfg.quota_calls_per_second};
}

// ---- listen, [tls], socket_* --------------------------------------------

rpc::GrpcServerOptions ServerOptionsFromConfig(const DaemonConfig& cfg) {
  rpc::GrpcServerOptions o;
  o.listen = cfg.listen;
  o.max_message_bytes = static_cast<int>(cfg.max_message_bytes);
  o.tls_cert_file = cfg.tls_cert;
  o.tls_key_file = cfg.tls_key;
  o.tls_client_ca_file = cfg.tls_client_ca;
  o.tls_require_client_cert = cfg.tls_require_client_cert;
  o.socket_mode = cfg.socket_mode;
  o.socket_group = cfg.socket_group;
  return o;
}

}  // namespace opjit

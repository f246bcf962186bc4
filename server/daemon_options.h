// opjitd: from the DaemonConfig to each subsystem's options. One converter
// per subsystem, one section each, in the order the Daemon builds them
// (server/daemon.h): a new key's mapping goes here, next to its neighbours.
// Also the host facts the converters need (where the helpers are, the
// subordinate ids of a daemon without root).
//
// The converters read the config and what they are given, nothing else;
// the ones that look at the host say so (ProcessRunnerOptionsFromConfig
// logs what isolation the executors get).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/access/access.h"
#include "server/access/quotas.h"
#include "server/autograd/autograd.h"
#include "server/compiler/kernel_compiler.h"
#include "server/compiler/toolchain_profile.h"
#include "server/config.h"
#include "server/exec/channels.h"
#include "server/exec/executor.h"
#include "server/exec/handles.h"
#include "server/registry/registry.h"
#include "server/rpc/grpc_server.h"
#include "server/runner/kernel_host.h"
#include "server/runner/process_runner.h"
#include "server/tensor/region_manager.h"

namespace opjit {

class UidClaims;  // server/common/uid_claims.h

// ---- Host facts ---------------------------------------------------------

// Where opjitd's executable lies ("." when /proc/self/exe cannot be read).
std::string ExeDir();

// opjit-compile-worker and the other helpers: <exe>/../libexec/opjit, else
// beside opjitd (the build tree).
std::string HelperDir();

// Kernel headers: compiler.kernel_include_dir, else $OPJIT_KERNEL_INCLUDE_DIR,
// else installed next to the binary, else the source tree this binary was
// built from.
std::string FindKernelIncludeDir(const DaemonConfig& cfg);

// A secret named by the config (`what`, e.g. "cache.remote.key_file"): the
// file's bytes without trailing newlines. Refused when empty; a file that
// others can read is used, with a warning.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, const char* what);

// A quarter of what /dev/shm holds: the default bound on all namespaces'
// shm, leaving the rest to the host's other users of /dev/shm (0 when it
// cannot be read).
uint64_t QuarterOfDevShm();

// A daemon without root, with subordinate ids (/etc/subuid, /etc/subgid):
// each namespace's executors as one of them, and its compile workers as the
// last, which no executor gets.
struct SubordinateIds {
  uint32_t uid_first = 0, uid_last = 0, gid_first = 0;  // executors
  uint32_t compile_uid = 0, compile_gid = 0;
  std::string why_not;  // empty: use them
  // Where the executors' uids are claimed host-wide (exec.uid_claim_dir):
  // two daemons of one user share its subordinate ids, and must not share
  // a uid. Without it the ids are not used (why_not says so).
  std::shared_ptr<UidClaims> claims;
};
// Starts /bin/true once in a user namespace to prove the ids map, and opens
// the uid claims.
SubordinateIds PickSubordinateIds(const DaemonConfig& cfg);

// ---- [registry] ---------------------------------------------------------

// `password`: registry.password_file's bytes ("" when none).
registry::Registry::Options RegistryOptionsFromConfig(const DaemonConfig& cfg,
                                                      std::string password);

// ---- [compiler], [cache] ------------------------------------------------

// The toolchain profiles compiler.profiles names, each as found on this host
// with its [toolchains.<name>] policy; one that is not installed is left out
// (and logged, at info, when `log`). Looks at the host (DetectProfile).
std::vector<compiler::ToolchainProfile> ProfilesFromConfig(const DaemonConfig& cfg, bool log);

// `remote_key`: cache.remote.key_file's bytes (unused while cache.remote.url
// is ""). The compile uid is CompileUidFromConfig's. The profiles are
// ProfilesFromConfig's (logged).
compiler::KernelCompilerOptions CompilerOptionsFromConfig(const DaemonConfig& cfg,
                                                          const std::string& helper_dir,
                                                          const std::string& kernel_include_dir,
                                                          std::string remote_key);

// The uid (and gid) compile workers run as, into `options` (logged): as
// root, compiler.uid (refused when it is exec.worker_user's); without root,
// the last subordinate id when `sub` has them; else the daemon's own.
absl::Status CompileUidFromConfig(const DaemonConfig& cfg, const SubordinateIds& sub,
                                  compiler::KernelCompilerOptions* options);

// ---- [shm] --------------------------------------------------------------

tensor::RegionManagerOptions RegionOptionsFromConfig(const DaemonConfig& cfg);

// ---- [exec]: where kernels run ------------------------------------------

// compiler.allowed_libraries and the libraries of the profiles offered here.
runner::KernelHostOptions KernelHostOptionsFromConfig(const DaemonConfig& cfg);

// isolation = process: the executor processes. Logs which uids they run as
// and, with a WARNING, every isolation they lack on this host.
runner::ProcessRunnerOptions ProcessRunnerOptionsFromConfig(const DaemonConfig& cfg,
                                                            const runner::KernelHostOptions& host,
                                                            const SubordinateIds& sub,
                                                            const std::string& helper_dir);

// Where `options` gives each namespace a uid of its own (uid_first): each
// is claimed host-wide, in `sub`'s claims (a non-root daemon) or in
// exec.uid_claim_dir (root, which creates it where missing), so that no two
// daemons of the host hand out one uid. FAILED_PRECONDITION, saying how to
// fix it, when a root daemon cannot use the directory.
absl::Status ClaimUidsFromConfig(const DaemonConfig& cfg, const SubordinateIds& sub,
                                 runner::ProcessRunnerOptions* options);

exec::ExecutorOptions ExecutorOptionsFromConfig(const DaemonConfig& cfg);

// ---- [autograd] ---------------------------------------------------------

autograd::AutogradOptions AutogradOptionsFromConfig(const DaemonConfig& cfg);

// ---- [fast] -------------------------------------------------------------

exec::HandleTableOptions HandleOptionsFromConfig(const DaemonConfig& cfg);
exec::ChannelOptions ChannelOptionsFromConfig(const DaemonConfig& cfg);

// ---- [[principal]], [quota] ---------------------------------------------

access::AccessOptions AccessOptionsFromConfig(const DaemonConfig& cfg);
// Also what a SIGHUP applies.
access::QuotaOptions QuotaOptionsFromConfig(const DaemonConfig& cfg);

// ---- listen, [tls], socket_* --------------------------------------------

// Without interceptors: the Daemon adds its metrics interceptor.
rpc::GrpcServerOptions ServerOptionsFromConfig(const DaemonConfig& cfg);

}  // namespace opjit

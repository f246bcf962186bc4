// opjitd: reads the flags and the config, then runs the Daemon
// (server/daemon.h), which builds, serves and stops the subsystems. The
// one-shot modes (--help, --help-config, --version, --check-config,
// --verify-cache) end here.
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "server/cache/disk_cache.h"
#include "server/common/logging.h"
#include "server/config.h"
#include "server/daemon.h"

#include "opjit/version.h"  // generated: OPJIT_VERSION, OPJIT_GIT_REVISION (cmake/version.cmake)

namespace opjit {
namespace {

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
              flags_only.check_config.c_str(), c.principals.size(),
              RegistryBackendName(c.registry_backend),
              absl::StrJoin(c.listen, ", ").c_str(),
              c.metrics_listen.empty() ? "" : absl::StrCat(", metrics ", c.metrics_listen).c_str(),
              c.cache_remote_url.empty() ? "" : ", cache.remote on", c.log_level.c_str());
  return 0;
}

// opjitd --verify-cache: every disk-cache entry's checksum; the corrupt
// ones on stdout, then a summary. 1 when one does not verify.
int VerifyCache(const DaemonConfig& cfg) {
  const std::string dir = cfg.state_dir + "/cache";
  cache::DiskCacheVerification v = cache::VerifyDiskCache(dir);
  for (const std::string& bad : v.corrupt) std::printf("corrupt: %s\n", bad.c_str());
  std::printf("%s: %llu entries, %llu bytes, %zu corrupt\n", dir.c_str(),
              static_cast<unsigned long long>(v.entries),
              static_cast<unsigned long long>(v.bytes), v.corrupt.size());
  return v.corrupt.empty() ? 0 : 1;
}

int Run(int argc, char** argv) {
  auto cfg = LoadConfig(argc, argv);
  if (!cfg.ok()) {
    // --help, --help-config: the text, on stdout.
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
  if (cfg->verify_cache) return VerifyCache(*cfg);
  // Debian's abseil is built with mutex deadlock detection on, which keeps a
  // global lock graph updated on every absl::Mutex acquisition; the lock
  // order here is fixed and tested, so skip that per-call cost.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // The one place a failed start is logged: the status names what failed.
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Create(*cfg);
  if (!daemon.ok()) {
    Logger("main")->error("{}", std::string(daemon.status().message()));
    return 1;
  }
  (*daemon)->Serve();
  (*daemon)->Shutdown();
  return 0;
}

}  // namespace
}  // namespace opjit

int main(int argc, char** argv) { return opjit::Run(argc, argv); }

#include "server/common/health_monitor.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/common/logging.h"
#include "server/common/subprocess.h"

namespace opjit {

HealthMonitor::HealthMonitor(std::vector<Probe> probes, std::chrono::milliseconds interval,
                             std::function<void(bool, const std::string&)> on_change)
    : probes_(std::move(probes)), interval_(interval), on_change_(std::move(on_change)),
      last_errors_(probes_.size()) {
  thread_ = std::thread([this] { Loop(); });
}

HealthMonitor::~HealthMonitor() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

bool HealthMonitor::serving() const {
  MutexLock lock(&mu_);
  return serving_;
}

std::string HealthMonitor::why() const {
  MutexLock lock(&mu_);
  return why_;
}

void HealthMonitor::Loop() {
  auto log = Logger("health");
  MutexLock lock(&mu_);
  for (uint64_t round = 0; !stop_; ++round) {
    const bool serving_before = serving_;
    lock.Unlock();
    std::string why;
    for (size_t i = 0; i < probes_.size(); ++i) {
      const Probe& p = probes_[i];
      if (!serving_before || p.every <= 1 || round % p.every == 0) {
        absl::Status s = p.check();
        last_errors_[i] = s.ok() ? "" : absl::StrCat(p.name, ": ", s.message());
      }
      if (!last_errors_[i].empty()) {
        if (!why.empty()) why += "; ";
        why += last_errors_[i];
      }
    }
    const bool serving = why.empty();
    lock.Lock();
    const bool changed = !reported_ || serving != serving_;
    serving_ = serving;
    why_ = why;
    reported_ = true;
    if (changed) {
      lock.Unlock();
      if (serving) {
        log->info("SERVING: every probe passes");
      } else {
        log->error("NOT_SERVING: {}", why);
      }
      on_change_(serving, why);
      lock.Lock();
    }
    // cv.wait_for(lock, interval_, pred): until stop_ or the interval passed.
    const auto wake = std::chrono::steady_clock::now() + interval_;
    while (!stop_ && cv_.WaitUntil(&mu_, wake)) {
    }
  }
}

absl::Status ProbeExecutable(const std::string& path) {
  if (access(path.c_str(), X_OK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("the worker program cannot be run (", std::strerror(errno), ")"));
  }
  // Descriptors 0-2 on /dev/null, nothing else of the daemon's; the
  // helpers' environment.
  subprocess::SpawnOptions spawn;
  spawn.path = path;
  spawn.args = {"--probe"};
  spawn.env = subprocess::HelperEnvironment();
  absl::StatusOr<pid_t> pid = subprocess::Spawn(spawn);
  if (!pid.ok()) {
    return absl::UnavailableError(
        absl::StrCat("the worker cannot be started (", pid.status().message(), ")"));
  }
  absl::StatusOr<std::optional<subprocess::Exit>> ended = subprocess::WaitFor(*pid, absl::Seconds(10));
  if (!ended.ok()) return absl::UnavailableError("the worker could not be waited for");
  if (!ended->has_value()) {
    (void)subprocess::Reap(*pid);
    return absl::UnavailableError("the worker did not start within 10 s");
  }
  const subprocess::Exit& e = **ended;
  if (e.exited() && e.code() == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the worker ", e.Describe(), " at start"));
}

}  // namespace opjit

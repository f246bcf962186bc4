#include "server/common/health_monitor.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/common/logging.h"

extern char** environ;

namespace opjit {

HealthMonitor::HealthMonitor(std::vector<Probe> probes, std::chrono::milliseconds interval,
                             std::function<void(bool, const std::string&)> on_change)
    : probes_(std::move(probes)), interval_(interval), on_change_(std::move(on_change)),
      last_errors_(probes_.size()) {
  thread_ = std::thread([this] { Loop(); });
}

HealthMonitor::~HealthMonitor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool HealthMonitor::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return serving_;
}

std::string HealthMonitor::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

void HealthMonitor::Loop() {
  auto log = Logger("health");
  std::unique_lock<std::mutex> lock(mu_);
  for (uint64_t round = 0; !stop_; ++round) {
    const bool serving_before = serving_;
    lock.unlock();
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
    lock.lock();
    const bool changed = !reported_ || serving != serving_;
    serving_ = serving;
    why_ = why;
    reported_ = true;
    if (changed) {
      lock.unlock();
      if (serving) {
        log->info("SERVING: every probe passes");
      } else {
        log->error("NOT_SERVING: {}", why);
      }
      on_change_(serving, why);
      lock.lock();
    }
    cv_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

absl::Status ProbeExecutable(const std::string& path) {
  if (access(path.c_str(), X_OK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("the worker program cannot be run (", std::strerror(errno), ")"));
  }
  const char* argv[] = {path.c_str(), "--probe", nullptr};
  pid_t pid = 0;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  const int rc = posix_spawn(&pid, path.c_str(), &actions, nullptr, const_cast<char**>(argv),
                             environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("the worker cannot be started (", std::strerror(rc), ")"));
  }
  int status = 0;
  for (int i = 0; i < 1000; ++i) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
      return absl::UnavailableError(
          WIFSIGNALED(status)
              ? absl::StrCat("the worker died at start (signal ", WTERMSIG(status), ")")
              : absl::StrCat("the worker exited with status ", WEXITSTATUS(status), " at start"));
    }
    if (r < 0 && errno != EINTR) return absl::UnavailableError("waitpid failed");
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return absl::UnavailableError("the worker did not start within 10 s");
}

}  // namespace opjit

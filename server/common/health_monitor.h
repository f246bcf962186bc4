// Probes what the daemon needs to serve (compile and executor workers can be
// started, the store can be written) every `interval`, and reports the
// result through `on_change` whenever it flips: the daemon maps it to
// grpc.health.v1 SERVING / NOT_SERVING. It recovers by itself: a probe that
// passes again turns the daemon back to SERVING.
//
// Thread-safe; the probes run on the monitor's own thread, one at a time.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "server/common/mutex.h"

namespace opjit {

class HealthMonitor {
 public:
  struct Probe {
    std::string name;
    std::function<absl::Status()> check;
    // While serving, the probe runs every `every`-th round (its last result
    // stands in between): for probes that start a process. While not
    // serving, every probe runs every round, so recovery shows at once.
    int every = 1;
  };

  // Starts probing at once. `on_change(serving, why)` is called from the
  // monitor's thread after the first round and on every flip.
  HealthMonitor(std::vector<Probe> probes, std::chrono::milliseconds interval,
                std::function<void(bool serving, const std::string& why)> on_change);
  ~HealthMonitor();  // stops the thread
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;

  bool serving() const;
  // Names and errors of the probes that failed last round ("" when none).
  std::string why() const;

 private:
  void Loop();

  const std::vector<Probe> probes_;
  const std::chrono::milliseconds interval_;
  const std::function<void(bool, const std::string&)> on_change_;

  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool serving_ ABSL_GUARDED_BY(mu_) = true;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> last_errors_;  // per probe; "" when it passed (monitor thread only)
  std::thread thread_;
};

// A probe that the program `path` can be started: runs `path --probe` and
// expects exit status 0 within 10 s.
absl::Status ProbeExecutable(const std::string& path);

}  // namespace opjit

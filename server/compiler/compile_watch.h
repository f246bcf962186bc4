// Logs compiles that run long: a cold ATen kernel takes 13-25 s, and an
// operator looking at the daemon's log should see that it is compiling, not
// stuck. One thread per watch; it sleeps until the next compile in flight
// reaches a report time.
//
//   compile of ns/op (CPU, key 1a2b3c4d5e6f) still running after 5 s
//   compile of ns/op (CPU, key 1a2b3c4d5e6f) finished after 13.2 s
//
// Only what the caller passes as `what` is logged (an op's name or the
// user's file name, never a host path). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "server/common/mutex.h"

namespace opjit::compiler {

class CompileWatch {
 public:
  using Clock = std::chrono::steady_clock;

  // A compile running `after` is logged (warn, "compiler" logger), again
  // every `every` while it runs, and its total time when it ends. `after` <=
  // 0 turns the watch off (no thread).
  CompileWatch(std::chrono::milliseconds after, std::chrono::milliseconds every);
  ~CompileWatch();
  CompileWatch(const CompileWatch&) = delete;
  CompileWatch& operator=(const CompileWatch&) = delete;

  // A compile starts; returns its ticket for End().
  uint64_t Begin(std::string what);
  // It ended. Logs its total time when it ran past `after`.
  void End(uint64_t ticket, bool ok);

  // Compiles reported as slow so far (for tests).
  uint64_t reported() const;

 private:
  struct Entry {
    std::string what;
    Clock::time_point start, next_report;
    bool reported = false;
  };
  void Run();

  const std::chrono::milliseconds after_, every_;
  mutable Mutex mu_;
  CondVar cv_;  // signalled on a new compile and at the stop
  std::map<uint64_t, Entry> running_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reported_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace opjit::compiler

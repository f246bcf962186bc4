// SpawnThread: one long-lived thread that starts child processes.
//
// Children that must die with the daemon set PR_SET_PDEATHSIG, which Linux
// ties to the *thread* that created them, not the process: a child spawned
// from a short-lived thread (a gRPC or pool thread that later exits) would be
// killed with it. Spawning every such child from this thread, which lives as
// long as its owner, makes PDEATHSIG mean "the daemon died".
//
// Thread-safety: Call may be used from many threads; calls run one at a time.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace opjit {

class SpawnThread {
 public:
  SpawnThread() : thread_([this] { Loop(); }) {}
  ~SpawnThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  SpawnThread(const SpawnThread&) = delete;
  SpawnThread& operator=(const SpawnThread&) = delete;

  // Runs `fn` on the spawning thread and returns its result.
  template <typename T>
  T Call(std::function<T()> fn) {
    std::packaged_task<T()> task(std::move(fn));
    std::future<T> result = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back([&task] { task(); });
    }
    cv_.notify_one();
    return result.get();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                         // guarded by mu_
  std::thread thread_;                        // last: starts after the rest exists
};

}  // namespace opjit

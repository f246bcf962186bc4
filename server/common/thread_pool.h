// A fixed pool of threads with a bounded queue. Submit() never blocks: when
// the queue is full it refuses the task, so callers can answer
// RESOURCE_EXHAUSTED instead of piling up work.
//
// Thread-safe. The destructor finishes queued tasks, then joins.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "server/common/mutex.h"

namespace opjit {

class ThreadPool {
 public:
  ThreadPool(int threads, size_t max_queue, std::string name);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`; false (and `task` is dropped) when the queue is full.
  bool Submit(std::function<void()> task);

  size_t queued() const;

 private:
  void Loop();

  const size_t max_queue_;
  const std::string name_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace opjit

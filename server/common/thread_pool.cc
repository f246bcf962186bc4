#include "server/common/thread_pool.h"

#include <pthread.h>

namespace opjit {

ThreadPool::ThreadPool(int threads, size_t max_queue, std::string name)
    : max_queue_(max_queue), name_(std::move(name)) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
    pthread_setname_np(threads_.back().native_handle(), name_.substr(0, 15).c_str());
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  for (auto& t : threads_) t.join();
}

bool ThreadPool::Submit(std::function<void()> task) {
  {
    MutexLock lock(&mu_);
    if (stopping_ || queue_.size() >= max_queue_) return false;
    queue_.push_back(std::move(task));
  }
  cv_.Signal();
  return true;
}

size_t ThreadPool::queued() const {
  MutexLock lock(&mu_);
  return queue_.size();
}

void ThreadPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      while (!(stopping_ || !queue_.empty())) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace opjit

// A std::mutex and std::condition_variable that clang's thread-safety
// analysis (-Wthread-safety, on in every clang build: see the top-level
// CMakeLists.txt) can check. Same cost as the std types they wrap: nothing
// is added but annotations and, in MutexLock, one bool.
//
//   mutable Mutex mu_;
//   int count_ ABSL_GUARDED_BY(mu_) = 0;
//   void Bump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
//
//   MutexLock lock(&mu_);                  // std::lock_guard / unique_lock
//   while (!ready_) cv_.Wait(&mu_);       // cv.wait(lock, pred)
//   lock.Unlock(); ...; lock.Lock();      // unique_lock's unlock and relock
//
// Not recursive, like std::mutex. Code that already uses absl::Mutex keeps
// it; this is for code written against std::mutex and condition_variable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace opjit {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  // Tells the analysis the caller holds it, where it cannot see so itself
  // (checks nothing at run time).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to destruction, like std::lock_guard; Unlock()
// and Lock() release and take it again in between, like std::unique_lock.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() {
    if (locked_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_->Unlock();
    locked_ = false;
  }
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    mu_->Lock();
    locked_ = true;
  }

 private:
  Mutex* const mu_;
  bool locked_ = true;
};

// std::condition_variable over a Mutex. Every wait may wake spuriously:
// callers loop on their condition, as std's predicate overloads do.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, waits for a signal, takes `mu` again.
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // As Wait, up to `deadline`; false when it passed (std::cv_status::timeout).
  template <class Clock, class Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const std::cv_status s = cv_.wait_until(lock, deadline);
    lock.release();
    return s == std::cv_status::no_timeout;
  }
  // As Wait, up to `timeout`; false when it passed.
  template <class Rep, class Period>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const std::cv_status s = cv_.wait_for(lock, timeout);
    lock.release();
    return s == std::cv_status::no_timeout;
  }

  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace opjit

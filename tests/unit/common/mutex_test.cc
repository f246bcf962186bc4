// server/common/mutex.h: the annotated Mutex, MutexLock and CondVar behave
// as the std::mutex, unique_lock and condition_variable they wrap.
#include "server/common/mutex.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

namespace opjit {
namespace {

struct Box {
  Mutex mu;
  CondVar cv;
  int value ABSL_GUARDED_BY(mu) = 0;
};

TEST(MutexTest, LockUnlockAndRelockAroundWork) {
  Box box;
  {
    MutexLock lock(&box.mu);
    box.value = 1;
    lock.Unlock();
    // Released: another thread can take it.
    std::thread other([&box] {
      MutexLock l(&box.mu);
      box.value = 2;
    });
    other.join();
    lock.Lock();
    EXPECT_EQ(box.value, 2);
  }
  // Released by the destructor.
  if (box.mu.TryLock()) {
    box.mu.Unlock();
  } else {
    ADD_FAILURE() << "the mutex is still held";
  }
}

TEST(MutexTest, DestructorOfAnUnlockedLockLeavesTheMutexFree) {
  Box box;
  {
    MutexLock lock(&box.mu);
    lock.Unlock();
  }
  if (box.mu.TryLock()) {
    box.mu.Unlock();
  } else {
    ADD_FAILURE() << "the mutex is still held";
  }
}

TEST(MutexTest, WaitWakesOnSignalWithTheMutexHeld) {
  Box box;
  std::thread setter([&box] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    MutexLock lock(&box.mu);
    box.value = 7;
    box.cv.Signal();
  });
  {
    MutexLock lock(&box.mu);
    while (box.value == 0) box.cv.Wait(&box.mu);
    EXPECT_EQ(box.value, 7);
  }
  setter.join();
}

TEST(MutexTest, TimedWaitsSayWhetherTheyTimedOut) {
  Box box;
  MutexLock lock(&box.mu);
  EXPECT_FALSE(box.cv.WaitFor(&box.mu, std::chrono::milliseconds(5)));
  EXPECT_FALSE(box.cv.WaitUntil(&box.mu,
                                std::chrono::steady_clock::now() + std::chrono::milliseconds(5)));
  // Still held after a timeout: another thread cannot take it.
  std::thread other([&box] {
    if (box.mu.TryLock()) {
      box.mu.Unlock();
      ADD_FAILURE() << "the mutex was free after a timed-out wait";
    }
  });
  other.join();
}

TEST(MutexTest, SignalAllWakesEveryWaiter) {
  Box box;
  int woken = 0;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&box, &woken] {
      MutexLock lock(&box.mu);
      while (box.value == 0) box.cv.Wait(&box.mu);
      ++woken;
    });
  }
  {
    MutexLock lock(&box.mu);
    box.value = 1;
    box.cv.SignalAll();
  }
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woken, 3);
}

}  // namespace
}  // namespace opjit

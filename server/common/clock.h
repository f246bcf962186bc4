// The time source of everything that expires: prepared-call handles, backward
// contexts and quota windows read it instead of std::chrono::steady_clock, so
// tests step a FakeClock rather than sleep.
#pragma once

#include <atomic>
#include <chrono>

namespace opjit {

class Clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  virtual time_point Now() const = 0;
};

// std::chrono::steady_clock. Process-wide, never null, never destroyed.
const Clock* SteadyClock();

// A clock that moves only when told to. Thread-safe. Starts at an arbitrary
// point well after the steady clock's epoch.
class FakeClock : public Clock {
 public:
  time_point Now() const override { return time_point(std::chrono::nanoseconds(ns_.load())); }
  void Advance(std::chrono::nanoseconds d) { ns_.fetch_add(d.count()); }

 private:
  std::atomic<int64_t> ns_{int64_t{1} << 50};
};

}  // namespace opjit

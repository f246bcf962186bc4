// Per-key deduplication of concurrent work, without blocking anyone.
#pragma once

#include <cassert>
#include <cstddef>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace opjit::cache {

// Runs a piece of work (a compile) once per key however many callers ask for
// it at the same moment, and delivers the one result to all of them through
// callbacks. Nobody waits on a lock or condition for the result, so callers
// may be gRPC callback reactors.
//
//   if (flights.Join(key, [reactor](const absl::StatusOr<K>& r) { ... })) {
//     pool.Schedule([&flights, key] { flights.Complete(key, Compile(key)); });
//   }
//
// Nothing is remembered after Complete(), success or failure: a Join that
// arrives afterwards starts a new flight. So the leader should publish a good
// result (e.g. LruCache::Put) before calling Complete(), and a new leader
// should check that cache again before doing the work, because its Join may
// have raced with the previous flight's Complete().
//
// Thread-safe. Callbacks run on the thread that calls Complete(), outside
// the lock, so they may call Join() again.
template <typename V>
class SingleFlight {
 public:
  using Callback = std::function<void(const absl::StatusOr<V>&)>;

  SingleFlight() = default;
  SingleFlight(const SingleFlight&) = delete;
  SingleFlight& operator=(const SingleFlight&) = delete;

  // Queues `done` on the flight for `key`. Returns true if there was no such
  // flight and this call started one: the caller is then the leader and must
  // eventually call Complete(key, ...) exactly once, or every queued callback
  // (its own included) is lost. Returns false if a flight was already in
  // progress; `done` then runs when that flight completes.
  bool Join(const std::string& key, Callback done) {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = flights_.try_emplace(key);
    it->second.push_back(std::move(done));
    return inserted;
  }

  // Ends the flight for `key` and invokes every callback queued on it, in
  // Join order, with `result`. Calling it for a key with no flight is a bug in
  // the caller (asserts in debug builds; a no-op otherwise).
  void Complete(const std::string& key, const absl::StatusOr<V>& result) {
    std::vector<Callback> waiters;
    {
      absl::MutexLock lock(&mu_);
      auto it = flights_.find(key);
      assert(it != flights_.end() && "SingleFlight::Complete without a flight");
      if (it == flights_.end()) return;
      waiters = std::move(it->second);
      flights_.erase(it);
    }
    for (Callback& done : waiters) {
      if (done) done(result);
    }
  }

  // Number of flights in progress.
  size_t InFlight() const {
    absl::MutexLock lock(&mu_);
    return flights_.size();
  }

 private:
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, std::vector<Callback>> flights_ ABSL_GUARDED_BY(mu_);
};

}  // namespace opjit::cache

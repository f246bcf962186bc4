// In-memory LRU cache of shared, immutable values (loaded kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace opjit::cache {

struct LruStats {
  uint64_t entries = 0;
  uint64_t bytes = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;  // Entries dropped to stay within a bound.
};

// A least-recently-used map from string keys to `shared_ptr<const V>`,
// bounded both by entry count and by a byte budget (the caller states each
// value's size).
//
// Eviction only drops the cache's own reference: callers that got a value from
// Get() keep it alive for as long as they hold it. For compiled code this is
// how unloading works: the value's destructor unloads it, and runs when the
// last reference goes, whether that is the cache's or a request's. Evicted
// and replaced values are released after the lock is dropped, so a
// destructor may take its time and may even call back into the cache.
//
// Thread-safe. Get is one mutex acquisition, one hash lookup and one list
// splice.
template <typename V>
class LruCache {
 public:
  // `max_entries` and `max_bytes` are both enforced on every Put; 0 for
  // either means nothing is retained.
  explicit LruCache(size_t max_entries, size_t max_bytes)
      : max_entries_(max_entries), max_bytes_(max_bytes) {}

  LruCache(const LruCache&) = delete;
  LruCache& operator=(const LruCache&) = delete;

  // Returns the value for `key` and marks it most recently used, or nullptr if
  // absent. Counts a hit or a miss.
  std::shared_ptr<const V> Get(const std::string& key) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it == index_.end()) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->value;
  }

  // Inserts or replaces `key` as the most recently used entry, accounting
  // `bytes` against the byte budget, then evicts least-recently-used entries
  // until both bounds hold. A value larger than the whole byte budget is not
  // retained (and any old value for `key` is dropped). A null `value` erases.
  void Put(const std::string& key, std::shared_ptr<const V> value, size_t bytes) {
    std::vector<std::shared_ptr<const V>> dropped;  // Declared first: released after unlock.
    {
      absl::MutexLock lock(&mu_);
      auto it = index_.find(key);
      if (it != index_.end()) {
        dropped.push_back(std::move(it->second->value));
        bytes_ -= it->second->bytes;
        order_.erase(it->second);
        index_.erase(it);
      }
      if (value == nullptr) return;
      if (bytes > max_bytes_ || max_entries_ == 0) {
        dropped.push_back(std::move(value));
        ++evictions_;
        return;
      }
      order_.push_front(Entry{key, std::move(value), bytes});
      index_.emplace(key, order_.begin());
      bytes_ += bytes;
      while (index_.size() > max_entries_ || bytes_ > max_bytes_) {
        Entry& victim = order_.back();  // Never the new entry: it alone fits.
        dropped.push_back(std::move(victim.value));
        bytes_ -= victim.bytes;
        index_.erase(victim.key);
        order_.pop_back();
        ++evictions_;
      }
    }
  }

  // Removes `key`; true if it was present. Not counted as an eviction.
  bool Erase(const std::string& key) {
    std::shared_ptr<const V> dropped;  // Declared first: released after unlock.
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    dropped = std::move(it->second->value);
    bytes_ -= it->second->bytes;
    order_.erase(it->second);
    index_.erase(it);
    return true;
  }

  // Removes every entry. Not counted as evictions.
  void Clear() {
    std::list<Entry> dropped;
    {
      absl::MutexLock lock(&mu_);
      dropped.swap(order_);
      index_.clear();
      bytes_ = 0;
    }
  }

  LruStats Stats() const {
    absl::MutexLock lock(&mu_);
    return LruStats{index_.size(), bytes_, hits_, misses_, evictions_};
  }

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const V> value;
    size_t bytes;
  };

  // Constant after construction.
  const size_t max_entries_;
  const size_t max_bytes_;

  mutable absl::Mutex mu_;
  std::list<Entry> order_ ABSL_GUARDED_BY(mu_);  // Most recently used first.
  std::unordered_map<std::string, typename std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace opjit::cache

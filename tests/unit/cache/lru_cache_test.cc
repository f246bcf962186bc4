#include "server/cache/lru_cache.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace opjit::cache {
namespace {

std::shared_ptr<const int> Int(int v) { return std::make_shared<const int>(v); }

TEST(LruCacheTest, HitAndMiss) {
  LruCache<int> cache(4, 1000);
  EXPECT_EQ(cache.Get("a"), nullptr);
  cache.Put("a", Int(1), 10);
  auto a = cache.Get("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(*a, 1);
  LruStats s = cache.Stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 10u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.evictions, 0u);
}

TEST(LruCacheTest, EvictsLeastRecentlyUsedByCount) {
  LruCache<int> cache(3, 1000);
  cache.Put("a", Int(1), 1);
  cache.Put("b", Int(2), 1);
  cache.Put("c", Int(3), 1);
  ASSERT_NE(cache.Get("a"), nullptr);  // b is now the least recently used.
  cache.Put("d", Int(4), 1);
  EXPECT_EQ(cache.Get("b"), nullptr);
  for (const char* k : {"a", "c", "d"}) EXPECT_NE(cache.Get(k), nullptr) << k;
  EXPECT_EQ(cache.Stats().entries, 3u);
  EXPECT_EQ(cache.Stats().evictions, 1u);
}

TEST(LruCacheTest, EvictsByBytes) {
  LruCache<int> cache(100, 100);
  cache.Put("a", Int(1), 40);
  cache.Put("b", Int(2), 40);
  cache.Put("c", Int(3), 40);  // 120 > 100: a goes.
  EXPECT_EQ(cache.Get("a"), nullptr);
  EXPECT_EQ(cache.Stats().bytes, 80u);
  cache.Put("big", Int(4), 90);  // Needs b and c gone.
  EXPECT_EQ(cache.Get("b"), nullptr);
  EXPECT_EQ(cache.Get("c"), nullptr);
  EXPECT_NE(cache.Get("big"), nullptr);
  EXPECT_EQ(cache.Stats().bytes, 90u);
  EXPECT_EQ(cache.Stats().evictions, 3u);
}

TEST(LruCacheTest, OversizedValueIsNotRetained) {
  LruCache<int> cache(10, 100);
  cache.Put("a", Int(1), 50);
  cache.Put("huge", Int(2), 101);
  EXPECT_EQ(cache.Get("huge"), nullptr);
  EXPECT_NE(cache.Get("a"), nullptr);
  EXPECT_EQ(cache.Stats().bytes, 50u);
}

TEST(LruCacheTest, ReplaceUpdatesValueAndBytes) {
  LruCache<int> cache(10, 100);
  cache.Put("a", Int(1), 30);
  cache.Put("a", Int(2), 70);
  EXPECT_EQ(*cache.Get("a"), 2);
  EXPECT_EQ(cache.Stats().entries, 1u);
  EXPECT_EQ(cache.Stats().bytes, 70u);
  cache.Put("a", nullptr, 0);  // Null erases.
  EXPECT_EQ(cache.Get("a"), nullptr);
  EXPECT_EQ(cache.Stats().bytes, 0u);
}

TEST(LruCacheTest, EraseAndClear) {
  LruCache<int> cache(10, 100);
  cache.Put("a", Int(1), 10);
  cache.Put("b", Int(2), 10);
  EXPECT_TRUE(cache.Erase("a"));
  EXPECT_FALSE(cache.Erase("a"));
  EXPECT_EQ(cache.Get("a"), nullptr);
  EXPECT_EQ(cache.Stats().bytes, 10u);
  cache.Clear();
  EXPECT_EQ(cache.Get("b"), nullptr);
  EXPECT_EQ(cache.Stats().entries, 0u);
  EXPECT_EQ(cache.Stats().bytes, 0u);
  EXPECT_EQ(cache.Stats().evictions, 0u);
}

// Stands in for loaded code: records when it is "unloaded".
struct Unloadable {
  explicit Unloadable(std::atomic<int>* unloads) : unloads(unloads) {}
  ~Unloadable() { ++*unloads; }
  std::atomic<int>* unloads;
};

TEST(LruCacheTest, EvictedValueLivesWhileInUse) {
  std::atomic<int> unloads{0};
  LruCache<Unloadable> cache(1, 100);
  cache.Put("a", std::make_shared<const Unloadable>(&unloads), 1);
  std::shared_ptr<const Unloadable> in_flight = cache.Get("a");
  cache.Put("b", std::make_shared<const Unloadable>(&unloads), 1);  // Evicts a.
  EXPECT_EQ(cache.Get("a"), nullptr);
  EXPECT_EQ(unloads.load(), 0);  // The request still holds it.
  EXPECT_EQ(in_flight->unloads, &unloads);
  in_flight.reset();
  EXPECT_EQ(unloads.load(), 1);  // Last reference gone: unloaded.

  cache.Put("c", std::make_shared<const Unloadable>(&unloads), 1);  // Evicts b, unused.
  EXPECT_EQ(unloads.load(), 2);
}

// A value whose destructor uses the cache: must not run under the cache's lock.
struct Reentrant {
  ~Reentrant() {
    if (cache != nullptr) observed_entries = cache->Stats().entries;
  }
  LruCache<Reentrant>* cache = nullptr;
  mutable uint64_t observed_entries = 0;
};

TEST(LruCacheTest, DroppedValuesAreReleasedOutsideTheLock) {
  LruCache<Reentrant> cache(1, 100);
  for (int i = 0; i < 3; ++i) {
    auto v = std::make_shared<Reentrant>();
    v->cache = &cache;
    cache.Put("k" + std::to_string(i), std::move(v), 1);  // Evicts the previous one.
  }
  cache.Put("k2", nullptr, 0);  // Replace path.
  auto v = std::make_shared<Reentrant>();
  v->cache = &cache;
  cache.Put("e", std::move(v), 1);
  EXPECT_TRUE(cache.Erase("e"));  // Erase path.
  v = std::make_shared<Reentrant>();
  v->cache = &cache;
  cache.Put("f", std::move(v), 1);
  cache.Clear();  // Clear path.
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(LruCacheTest, ConcurrentUseKeepsBounds) {
  LruCache<int> cache(16, 1000);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      for (int i = 0; i < 5000; ++i) {
        const std::string key = "k" + std::to_string((i * 13 + t) % 40);
        if (auto v = cache.Get(key)) {
          EXPECT_EQ(*v, (i * 13 + t) % 40);
        } else {
          cache.Put(key, Int((i * 13 + t) % 40), 50);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  LruStats s = cache.Stats();
  EXPECT_LE(s.entries, 16u);
  EXPECT_LE(s.bytes, 1000u);
  EXPECT_EQ(s.hits + s.misses, 20000u);
}

}  // namespace
}  // namespace opjit::cache

#include "server/cache/remote_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/cache/redis_server.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::cache {
namespace {

using Clock = std::chrono::steady_clock;
using testing::RedisServer;
using testing::TempDir;

constexpr char kClusterKey[] = "0123456789abcdef-cluster-key";
const std::string kKey = "00112233445566778899aabbccddeeff";
const std::string kOtherKey = "ffeeddccbbaa99887766554433221100";

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

class RemoteTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveRedisServer()) {
      GTEST_SKIP() << "needs " << testing::kRedisServer << " (Debian package redis-server)";
    }
    redis_ = std::make_unique<RedisServer>(dir_.path());
    ASSERT_TRUE(redis_->Start());
  }

  RemoteTierOptions Options(std::string key = kClusterKey) const {
    RemoteTierOptions o;
    o.url = redis_->url();
    o.key = std::move(key);
    return o;
  }

  std::unique_ptr<RemoteTier> Make(const RemoteTierOptions& o) {
    auto tier = RemoteTier::Create(o);
    EXPECT_TRUE(tier.ok()) << tier.status();
    return tier.ok() ? *std::move(tier) : nullptr;
  }

  TempDir dir_;
  std::unique_ptr<RedisServer> redis_;
};

TEST_F(RemoteTierTest, PutThenGetRoundTrips) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  const std::string payload("\x7f" "ELF\0binary\0bytes", 17);
  EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  ASSERT_TRUE(tier->Put("obj", kKey, payload));
  ASSERT_TRUE(tier->Put("manifest", kOtherKey, ""));
  tier->Flush();

  auto got = tier->Get("obj", kKey);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, payload);
  auto empty = tier->Get("manifest", kOtherKey);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(*empty, "");
  // The same key under another kind is another entry.
  EXPECT_TRUE(absl::IsNotFound(tier->Get("gpu", kKey).status()));

  const RemoteTierStats s = tier->Stats();
  EXPECT_EQ(s.puts, 2u);
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.rejected, 0u);
  EXPECT_EQ(s.errors, 0u);
  EXPECT_EQ(s.dropped, 0u);

  // Namespaced, with the default week-long expiry.
  EXPECT_EQ(redis_->Keys("opjit:v1:obj:*"), std::vector<std::string>{"opjit:v1:obj:" + kKey});
  const long long ttl = redis_->RawInt("TTL", "opjit:v1:obj:" + kKey);
  EXPECT_GT(ttl, 7 * 24 * 3600 - 60);
  EXPECT_LE(ttl, 7 * 24 * 3600);
}

TEST_F(RemoteTierTest, TtlZeroMeansNoExpiry) {
  auto o = Options();
  o.ttl_s = 0;
  auto tier = Make(o);
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(tier->Put("obj", kKey, "x"));
  tier->Flush();
  EXPECT_EQ(redis_->RawInt("TTL", "opjit:v1:obj:" + kKey), -1);
}

TEST_F(RemoteTierTest, MalformedKindOrKeyIsInvalidArgument) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(tier->Get("OBJ", kKey).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(tier->Get("obj", "short").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(tier->Get("obj:x", kKey).status()));
  EXPECT_FALSE(tier->Put("obj", "../../etc/passwd0000", "x"));
  EXPECT_FALSE(tier->Put("a:b", kKey, "x"));
}

TEST_F(RemoteTierTest, AnotherClusterKeyIsARejectedMiss) {
  auto writer = Make(Options());
  auto reader = Make(Options("another-cluster-key-0123456789"));
  ASSERT_NE(writer, nullptr);
  ASSERT_NE(reader, nullptr);
  ASSERT_TRUE(writer->Put("obj", kKey, "payload"));
  writer->Flush();
  EXPECT_TRUE(writer->Get("obj", kKey).ok());
  EXPECT_TRUE(absl::IsNotFound(reader->Get("obj", kKey).status()));
  const RemoteTierStats s = reader->Stats();
  EXPECT_EQ(s.rejected, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits, 0u);
  EXPECT_EQ(s.errors, 0u);
}

TEST_F(RemoteTierTest, TamperedEntriesAreRejectedMisses) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  const std::string rkey = RemoteTier::RedisKey("obj", kKey);
  const std::string payload(1000, 'p');
  ASSERT_TRUE(tier->Put("obj", kKey, payload));
  tier->Flush();
  std::string good;
  ASSERT_TRUE(redis_->RawGet(rkey, &good));
  ASSERT_EQ(good.size(), payload.size() + 48);
  // What Seal makes is what Put stored.
  EXPECT_EQ(good, RemoteTier::Seal(kClusterKey, "obj", kKey, payload));

  uint64_t rejected = 0;
  auto expect_rejected = [&](const std::string& value, const char* what) {
    ASSERT_TRUE(redis_->RawSet(rkey, value)) << what;
    EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status())) << what;
    EXPECT_EQ(tier->Stats().rejected, ++rejected) << what;
  };
  for (size_t at : {size_t{0}, size_t{5}, size_t{9}, size_t{20}, size_t{48}, good.size() - 1}) {
    std::string bad = good;
    bad[at] ^= 0x01;
    expect_rejected(bad, "flipped byte");
  }
  expect_rejected(good.substr(0, good.size() - 1), "truncated");
  expect_rejected(good + "x", "extended");
  expect_rejected(good.substr(0, 20), "shorter than the header");
  expect_rejected("", "empty");
  // A forger without the key cannot fix the MAC up: recomputing it with
  // another key is still rejected.
  std::string forged = RemoteTier::Seal("not-the-cluster-key!", "obj", kKey, "evil");
  expect_rejected(forged, "sealed with another key");

  // The original still verifies: nothing above was a false negative.
  ASSERT_TRUE(redis_->RawSet(rkey, good));
  auto got = tier->Get("obj", kKey);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, payload);
  EXPECT_EQ(tier->Stats().errors, 0u);
}

TEST_F(RemoteTierTest, AnEntryCopiedToAnotherKeyOrKindIsRejected) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(tier->Put("obj", kKey, "the object of kKey"));
  tier->Flush();
  std::string value;
  ASSERT_TRUE(redis_->RawGet(RemoteTier::RedisKey("obj", kKey), &value));
  ASSERT_TRUE(redis_->RawSet(RemoteTier::RedisKey("obj", kOtherKey), value));
  ASSERT_TRUE(redis_->RawSet(RemoteTier::RedisKey("manifest", kKey), value));
  EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kOtherKey).status()));
  EXPECT_TRUE(absl::IsNotFound(tier->Get("manifest", kKey).status()));
  EXPECT_EQ(tier->Stats().rejected, 2u);
  EXPECT_TRUE(tier->Get("obj", kKey).ok());
}

TEST_F(RemoteTierTest, OversizePayloadsAreNotStored) {
  auto o = Options();
  o.max_bytes = 1024;
  auto tier = Make(o);
  ASSERT_NE(tier, nullptr);
  EXPECT_FALSE(tier->Put("obj", kKey, std::string(1025, 'x')));
  EXPECT_TRUE(tier->Put("obj", kOtherKey, std::string(1024, 'x')));
  tier->Flush();
  EXPECT_EQ(redis_->RawInt("EXISTS", RemoteTier::RedisKey("obj", kKey)), 0);
  EXPECT_EQ(redis_->RawInt("EXISTS", RemoteTier::RedisKey("obj", kOtherKey)), 1);
  EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  const RemoteTierStats s = tier->Stats();
  EXPECT_EQ(s.oversize, 1u);
  EXPECT_EQ(s.puts, 1u);
}

TEST_F(RemoteTierTest, BadOptionsAreInvalidArgument) {
  for (const char* url :
       {"", "http://127.0.0.1:6379", "redis://", "redis://:6379", "redis://host:",
        "redis://host:0", "redis://host:65536", "redis://host:12ab", "redis://host:6379/0",
        "redis://user@host:6379", "redis://[::1", "unix:", "unix:relative.sock", "unix:/"}) {
    RemoteTierOptions o;
    o.url = url;
    o.key = kClusterKey;
    auto tier = RemoteTier::Create(o);
    EXPECT_TRUE(absl::IsInvalidArgument(tier.status())) << url;
    // The url is for the log, not for whoever sees the status: one message
    // for every malformed url.
    if (*url != '\0') {
      EXPECT_EQ(tier.status().message(),
                "cache.remote url must be redis://host[:port] or unix:/absolute/path.sock")
          << url;
    }
  }
  for (const char* url : {"redis://127.0.0.1:6379", "redis://cache-1.lab:7000",
                          "redis://localhost", "redis://[::1]:6379", "unix:/run/redis.sock"}) {
    RemoteTierOptions o;
    o.url = url;
    o.key = kClusterKey;
    EXPECT_TRUE(RemoteTier::Create(o).ok()) << url;
  }
  RemoteTierOptions o = Options("too-short");
  EXPECT_TRUE(absl::IsInvalidArgument(RemoteTier::Create(o).status()));
  o = Options();
  o.timeout_ms = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(RemoteTier::Create(o).status()));
  o = Options();
  o.ttl_s = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(RemoteTier::Create(o).status()));
}

// Redis killed: a miss (not an error) at once, then no connect attempts
// until the backoff ends; restarted, it serves again.
TEST_F(RemoteTierTest, KilledRedisIsAMissThenBacksOffThenRecovers) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(tier->Put("obj", kKey, "v"));
  tier->Flush();
  ASSERT_TRUE(tier->Get("obj", kKey).ok());  // a pooled connection now exists

  redis_->Kill();
  auto t0 = Clock::now();
  EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  EXPECT_LT(MsSince(t0), 250 + 150);
  EXPECT_EQ(tier->Stats().errors, 1u);
  const auto failed_at = Clock::now();

  // Backing off: every call returns at once and tries nothing.
  t0 = Clock::now();
  for (int i = 0; i < 50; ++i) {
    EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  }
  EXPECT_LT(MsSince(t0), 50.0);
  EXPECT_FALSE(tier->Put("obj", kOtherKey, "w"));  // dropped, not queued
  RemoteTierStats s = tier->Stats();
  EXPECT_EQ(s.errors, 1u);
  EXPECT_EQ(s.misses, 51u);
  EXPECT_EQ(s.dropped, 1u);

  // Restarted (empty: no persistence). Within the backoff it stays a miss;
  // after it, Puts and Gets work again without anything being reset.
  ASSERT_TRUE(redis_->Start());
  EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  bool back = false;
  while (!back && Clock::now() < deadline) {
    if (tier->Put("obj", kKey, "again")) {
      tier->Flush();
      auto got = tier->Get("obj", kKey);
      back = got.ok() && *got == "again";
    }
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(back) << "the tier did not reconnect within 10 s";
  const double recovered_after = MsSince(failed_at);
  EXPECT_GE(recovered_after, RemoteTier::kFirstBackoff.count() - 100);
  EXPECT_LT(recovered_after, RemoteTier::kFirstBackoff.count() + 2000);
  EXPECT_EQ(tier->Stats().errors, 1u);  // the restart cost no further failures
}

// Redis frozen: the command times out (a miss after about timeout_ms), then
// calls return at once during the backoff.
TEST_F(RemoteTierTest, StalledRedisTimesOutThenBacksOff) {
  auto o = Options();
  o.timeout_ms = 200;
  auto tier = Make(o);
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(tier->Put("obj", kKey, "v"));
  tier->Flush();
  ASSERT_TRUE(tier->Get("obj", kKey).ok());

  redis_->Stop();
  auto t0 = Clock::now();
  EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  const double first_ms = MsSince(t0);
  EXPECT_GE(first_ms, 150.0);
  EXPECT_LT(first_ms, 200 + 300);
  EXPECT_EQ(tier->Stats().errors, 1u);
  t0 = Clock::now();
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(absl::IsNotFound(tier->Get("obj", kKey).status()));
  EXPECT_LT(MsSince(t0), 20.0);
  EXPECT_EQ(tier->Stats().errors, 1u);
  redis_->Continue();
}

// The put queue holds at most kMaxQueuedPuts entries: with the writer stuck
// on a frozen Redis, the rest are dropped at once, and Put never blocks.
TEST_F(RemoteTierTest, PutQueueIsBounded) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  ASSERT_TRUE(tier->Put("obj", kKey, "v"));
  tier->Flush();  // the writer holds a connection

  redis_->Stop();
  const size_t attempts = 2 * RemoteTier::kMaxQueuedPuts;
  size_t accepted = 0;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < attempts; ++i) {
    char key[33];
    snprintf(key, sizeof(key), "%032zx", i);
    accepted += tier->Put("obj", key, std::string(100, 'q'));
  }
  EXPECT_LT(MsSince(t0), 100.0);  // never waited on Redis
  // The queue, plus the one the writer may have taken and be stuck on.
  EXPECT_GE(accepted, RemoteTier::kMaxQueuedPuts);
  EXPECT_LE(accepted, RemoteTier::kMaxQueuedPuts + 1);
  EXPECT_GE(tier->Stats().dropped, attempts - accepted);

  // The stuck SET times out; the writer backs off and drops the rest quickly.
  tier->Flush();
  const RemoteTierStats s = tier->Stats();
  EXPECT_EQ(s.puts, 1u);
  EXPECT_EQ(s.dropped, attempts);
  EXPECT_GE(s.errors, 1u);
  redis_->Continue();
}

TEST_F(RemoteTierTest, PutQueueIsBoundedInBytes) {
  auto o = Options();
  o.max_bytes = 8 << 20;  // the queue holds 4 * 8 MiB (over kMinQueuedBytes)
  auto tier = Make(o);
  ASSERT_NE(tier, nullptr);
  redis_->Stop();
  const std::string big(o.max_bytes, 'b');
  int accepted = 0;
  for (int i = 0; i < 6; ++i) {
    char key[33];
    snprintf(key, sizeof(key), "%032x", i);
    accepted += tier->Put("obj", key, big);
  }
  // Four fill the queue; a fifth fits only if the writer already took one.
  EXPECT_GE(accepted, 4);
  EXPECT_LE(accepted, 5);
  EXPECT_GE(tier->Stats().dropped, 1u);
  tier->Flush();
  EXPECT_EQ(tier->Stats().dropped, 6u);
  redis_->Continue();
}

TEST_F(RemoteTierTest, ConcurrentGetsAndPuts) {
  auto tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  constexpr int kThreads = 8, kKeys = 50;
  for (int i = 0; i < kKeys; ++i) {
    char key[33];
    snprintf(key, sizeof(key), "%032x", i);
    ASSERT_TRUE(tier->Put("obj", key, std::string(i + 1, 'a' + i % 26)));
  }
  tier->Flush();
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (int i = 0; i < kKeys; ++i) {
          char key[33];
          snprintf(key, sizeof(key), "%032x", i);
          auto got = tier->Get("obj", key);
          if (!got.ok() || *got != std::string(i + 1, 'a' + i % 26)) bad.fetch_add(1);
          if (i % 10 == t) tier->Put("manifest", key, "m");
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  tier->Flush();
  EXPECT_EQ(bad.load(), 0);
  const RemoteTierStats s = tier->Stats();
  EXPECT_EQ(s.hits, uint64_t{kThreads} * 5 * kKeys);
  EXPECT_EQ(s.errors, 0u);
}

TEST(RemoteTierUnixSocketTest, RoundTripsOverAUnixSocket) {
  if (!testing::HaveRedisServer()) {
    GTEST_SKIP() << "needs " << testing::kRedisServer << " (Debian package redis-server)";
  }
  TempDir dir;
  RedisServer redis(dir.path(), /*unix_socket=*/true);
  ASSERT_TRUE(redis.Start());
  RemoteTierOptions o;
  o.url = redis.url();
  o.key = kClusterKey;
  auto tier = RemoteTier::Create(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  ASSERT_TRUE((*tier)->Put("cubin", kKey, "sass"));
  (*tier)->Flush();
  auto got = (*tier)->Get("cubin", kKey);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "sass");
}

// Nothing listening: a miss, one error, then backoff; never an error status.
TEST(RemoteTierNoServerTest, UnreachableRedisIsAMiss) {
  RemoteTierOptions o;
  o.url = "redis://127.0.0.1:" + std::to_string(testing::FreePort());
  o.key = kClusterKey;
  auto tier = RemoteTier::Create(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("obj", kKey).status()));
  EXPECT_TRUE(absl::IsNotFound((*tier)->Get("obj", kKey).status()));
  EXPECT_FALSE((*tier)->Put("obj", kKey, "x"));
  (*tier)->Flush();
  const RemoteTierStats s = (*tier)->Stats();
  EXPECT_EQ(s.errors, 1u);
  EXPECT_EQ(s.misses, 2u);
}

}  // namespace
}  // namespace opjit::cache

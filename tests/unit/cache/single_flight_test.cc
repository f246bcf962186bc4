#include "server/cache/single_flight.h"

#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace opjit::cache {
namespace {

TEST(SingleFlightTest, SixteenJoinersOneLeader) {
  constexpr int kThreads = 16;
  SingleFlight<int> flights;
  std::latch start(kThreads);
  std::latch joined(kThreads);
  std::atomic<int> leaders{0};
  std::atomic<int> delivered{0};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      start.arrive_and_wait();
      const bool leader = flights.Join("k", [&](const absl::StatusOr<int>& r) {
        if (!r.ok() || *r != 42) ++wrong;
        ++delivered;
      });
      if (leader) ++leaders;
      // The leader finishes only after everyone has joined, so no late Join
      // can start a second flight.
      joined.arrive_and_wait();
      if (leader) flights.Complete("k", 42);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(leaders.load(), 1);
  EXPECT_EQ(delivered.load(), kThreads);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(flights.InFlight(), 0u);
}

TEST(SingleFlightTest, FailureIsDeliveredButNotRemembered) {
  SingleFlight<std::string> flights;
  std::vector<absl::Status> seen;
  auto record = [&](const absl::StatusOr<std::string>& r) { seen.push_back(r.status()); };
  EXPECT_TRUE(flights.Join("k", record));
  EXPECT_FALSE(flights.Join("k", record));
  EXPECT_EQ(flights.InFlight(), 1u);
  flights.Complete("k", absl::InvalidArgumentError("compile error"));
  ASSERT_EQ(seen.size(), 2u);
  for (const absl::Status& s : seen) EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(flights.InFlight(), 0u);

  // The next caller leads a new flight.
  std::string value;
  EXPECT_TRUE(flights.Join("k", [&](const absl::StatusOr<std::string>& r) { value = *r; }));
  flights.Complete("k", std::string("ok"));
  EXPECT_EQ(value, "ok");
}

TEST(SingleFlightTest, KeysAreIndependent) {
  SingleFlight<int> flights;
  int a = 0, b = 0;
  EXPECT_TRUE(flights.Join("a", [&](const absl::StatusOr<int>& r) { a = *r; }));
  EXPECT_TRUE(flights.Join("b", [&](const absl::StatusOr<int>& r) { b = *r; }));
  EXPECT_EQ(flights.InFlight(), 2u);
  flights.Complete("b", 2);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 2);
  flights.Complete("a", 1);
  EXPECT_EQ(a, 1);
  EXPECT_EQ(flights.InFlight(), 0u);
}

TEST(SingleFlightTest, CallbackMayJoinAgain) {
  SingleFlight<int> flights;
  bool rejoined_as_leader = false;
  ASSERT_TRUE(flights.Join("k", [&](const absl::StatusOr<int>&) {
    // Runs outside the lock, after the flight was removed.
    rejoined_as_leader = flights.Join("k", [](const absl::StatusOr<int>&) {});
  }));
  flights.Complete("k", 1);
  EXPECT_TRUE(rejoined_as_leader);
  EXPECT_EQ(flights.InFlight(), 1u);
  flights.Complete("k", 2);
  EXPECT_EQ(flights.InFlight(), 0u);
}

}  // namespace
}  // namespace opjit::cache

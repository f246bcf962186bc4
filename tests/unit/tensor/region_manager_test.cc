#include "server/tensor/region_manager.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "server/common/error_info.h"
#include "server/tensor/tensor_ref.h"
#include "tests/unit/tensor/test_util.h"

namespace opjit::tensor {
namespace {

using testing::ClientShm;
using testing::MapKey;
using testing::ShmExists;
using testing::UniqueTag;

std::unique_ptr<RegionManager> MakeManager(const std::string& tag, uint64_t quota = 4ull << 30,
                                           uint64_t max_regions = 1024) {
  RegionManagerOptions options;
  options.instance_tag = tag;
  options.namespace_quota_bytes = quota;
  options.max_regions_per_namespace = max_regions;
  options.default_lease_ms = 60000;
  options.max_lease_ms = 3600000;
  auto manager = RegionManager::Create(options);
  EXPECT_TRUE(manager.ok()) << manager.status();
  return manager.ok() ? std::move(*manager) : nullptr;
}

class RegionManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tag_ = UniqueTag();
    manager_ = MakeManager(tag_);
    ASSERT_NE(manager_, nullptr);
  }
  std::string ClientKey(const std::string& suffix) { return "/opjit-test." + tag_ + "." + suffix; }

  std::string tag_;
  std::unique_ptr<RegionManager> manager_;
};

TEST(RegionManagerCreateTest, RejectsBadOptions) {
  RegionManagerOptions options;
  EXPECT_EQ(RegionManager::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.instance_tag = "a.b";
  EXPECT_EQ(RegionManager::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.instance_tag = "a/b";
  EXPECT_EQ(RegionManager::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.instance_tag = UniqueTag();
  options.default_lease_ms = options.max_lease_ms + 1;
  EXPECT_EQ(RegionManager::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.default_lease_ms = 1000;
  EXPECT_TRUE(RegionManager::Create(options).ok());
}

TEST_F(RegionManagerTest, CreateRegionUsesUnguessableKeyMode0600AndSharesData) {
  auto info = manager_->CreateRegion("ns", "alice", "in0", 10000, 0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->ns, "ns");
  EXPECT_EQ(info->name, "in0");
  EXPECT_EQ(info->owner, "alice");
  EXPECT_EQ(info->byte_size, 10000u);
  EXPECT_EQ(info->offset, 0u);
  EXPECT_TRUE(info->daemon_owned);
  EXPECT_GT(info->lease_expires_unix_ms, 0);
  EXPECT_TRUE(std::regex_match(info->shm_key, std::regex("/opjit\\." + tag_ + "\\.[0-9a-f]{32}")))
      << info->shm_key;

  struct stat st;
  ASSERT_EQ(::stat(("/dev/shm" + info->shm_key).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_size, 10000);

  auto region = manager_->Acquire("ns", "in0");
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_EQ((*region)->size(), 10000u);
  uint8_t* client = MapKey(info->shm_key, 10000);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client[9999], 0);  // Zero-filled.
  client[0] = 42;
  client[9999] = 7;
  EXPECT_EQ((*region)->data()[0], 42);
  EXPECT_EQ((*region)->data()[9999], 7);
  (*region)->data()[5000] = 99;
  EXPECT_EQ(client[5000], 99);
  ::munmap(client, 10000);

  auto other = manager_->CreateRegion("ns", "alice", "in1", 10, 0);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->shm_key, info->shm_key);
}

TEST_F(RegionManagerTest, RejectsBadNamesSizesLeasesAndDuplicates) {
  for (const std::string& name : {std::string(""), std::string("a/b"), std::string("a b"),
                                  std::string(129, 'x'), std::string("caf\xc3\xa9")}) {
    auto st = manager_->CreateRegion("ns", "o", name, 10, 0).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_TRUE(manager_->CreateRegion("ns", "o", std::string(128, 'x'), 10, 0).ok());
  EXPECT_TRUE(manager_->CreateRegion("ns", "o", "A-z_0.9", 10, 0).ok());

  auto zero = manager_->CreateRegion("ns", "o", "z", 0, 0).status();
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.message().find("size must be > 0"), std::string::npos) << zero;
  EXPECT_EQ(manager_->CreateRegion("ns", "o", "z", 10, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_->CreateRegion("ns\n", "o", "z", 10, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_->CreateRegion("ns", std::string(300, 'o'), "z", 10, 0).status().code(),
            absl::StatusCode::kInvalidArgument);

  ASSERT_TRUE(manager_->CreateRegion("ns", "o", "dup", 10, 0).ok());
  auto dup = manager_->CreateRegion("ns", "p", "dup", 10, 0).status();
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(dup.message(), "region 'dup' is already registered in namespace 'ns'");
  // Names are per namespace.
  EXPECT_TRUE(manager_->CreateRegion("other", "o", "dup", 10, 0).ok());
}

TEST_F(RegionManagerTest, RegistersClientRegionWindow) {
  const uint64_t kObject = 3 * 4096 + 500;
  ClientShm shm(ClientKey("win"), kObject);
  ASSERT_TRUE(shm.ok());
  for (uint64_t i = 0; i < kObject; ++i) shm.data()[i] = static_cast<uint8_t>(i * 7);

  const uint64_t kOffset = 4096 + 100, kSize = 5000;
  auto info = manager_->RegisterRegion("ns", "bob", "w", shm.key(), kOffset, kSize, 0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->daemon_owned);
  EXPECT_EQ(info->shm_key, shm.key());
  EXPECT_EQ(info->offset, kOffset);
  EXPECT_EQ(info->byte_size, kSize);
  auto region = manager_->Acquire("ns", "w");
  ASSERT_TRUE(region.ok());
  ASSERT_EQ((*region)->size(), kSize);
  for (uint64_t i = 0; i < kSize; ++i) {
    ASSERT_EQ((*region)->data()[i], static_cast<uint8_t>((kOffset + i) * 7)) << i;
  }
  (*region)->data()[kSize - 1] = 1;
  EXPECT_EQ(shm.data()[kOffset + kSize - 1], 1);

  // Exactly to the end of the object is fine; one byte more is not.
  EXPECT_TRUE(manager_->RegisterRegion("ns", "bob", "end", shm.key(), 100, kObject - 100, 0).ok());
  auto over = manager_->RegisterRegion("ns", "bob", "over", shm.key(), 100, kObject - 99, 0);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("window [100, 12789) (offset 100 + byte_size 12689)"),
            std::string::npos)
      << over.status();
  EXPECT_NE(over.status().message().find("of 12788 bytes"), std::string::npos) << over.status();
  EXPECT_NE(over.status().message().find("region 'over'"), std::string::npos) << over.status();
  auto overflow = manager_->RegisterRegion("ns", "bob", "of", shm.key(),
                                           std::numeric_limits<uint64_t>::max() - 10, 100, 0);
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kInvalidArgument) << overflow.status();
  EXPECT_EQ(manager_->RegisterRegion("ns", "bob", "zero", shm.key(), 0, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);

  // With the caller's uid known, only its own objects may be registered.
  EXPECT_TRUE(manager_->RegisterRegion("ns", "bob", "mine", shm.key(), 0, 16, 0, ::geteuid()).ok());
  auto foreign =
      manager_->RegisterRegion("ns", "bob", "theirs", shm.key(), 0, 16, 0, ::geteuid() + 1);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied) << foreign.status();
  ASSERT_TRUE(manager_->Unregister("ns", "mine").ok());

  auto missing = manager_->RegisterRegion("ns", "bob", "m", ClientKey("missing"), 0, 10, 0);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  for (const std::string& key :
       {std::string("noslash"), std::string("/a/b"), std::string("/"), std::string(""),
        "/" + std::string(300, 'k'), std::string("/..")}) {
    auto st = manager_->RegisterRegion("ns", "bob", "k", key, 0, 10, 0).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << key;
  }
  // Failed registrations leave no trace.
  EXPECT_EQ(manager_->List("ns").size(), 2u);
  EXPECT_EQ(manager_->GetStats().registered, 3u);
}

TEST_F(RegionManagerTest, AcquireAfterUnregisterIsNotFoundButOldHoldersStillRead) {
  auto info = manager_->CreateRegion("ns", "o", "r", 8192, 0);
  ASSERT_TRUE(info.ok());
  auto held = manager_->Acquire("ns", "r");
  ASSERT_TRUE(held.ok());
  std::shared_ptr<const Region> region = *held;
  std::memset(region->data(), 0xab, 8192);

  ASSERT_TRUE(manager_->Unregister("ns", "r").ok());
  auto again = manager_->Acquire("ns", "r");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.status().message(), "region 'r' is not registered in namespace 'ns'");
  EXPECT_EQ(manager_->Unregister("ns", "r").code(), absl::StatusCode::kNotFound);
  // The key is gone at once; the mapping is not.
  EXPECT_FALSE(ShmExists(info->shm_key));
  for (int i = 0; i < 8192; ++i) ASSERT_EQ(region->data()[i], 0xab);
  region->data()[100] = 1;
  EXPECT_EQ(manager_->GetStats().regions, 0u);
  EXPECT_EQ(manager_->GetStats().bytes, 0u);

  // The name can be reused at once.
  EXPECT_TRUE(manager_->CreateRegion("ns", "o", "r", 16, 0).ok());
  EXPECT_EQ(manager_->Acquire("other", "r").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RegionManagerTest, ReleaseOwnerDropsOnlyThatOwner) {
  ASSERT_TRUE(manager_->CreateRegion("ns", "a", "a1", 10, 0).ok());
  ASSERT_TRUE(manager_->CreateRegion("ns", "a", "a2", 10, 0).ok());
  ASSERT_TRUE(manager_->CreateRegion("ns", "b", "b1", 10, 0).ok());
  ASSERT_TRUE(manager_->CreateRegion("ns2", "a", "a3", 10, 0).ok());
  auto released = manager_->ReleaseOwner("ns", "a");
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 2);
  auto list = manager_->List("ns");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].name, "b1");
  EXPECT_EQ(manager_->List("ns2").size(), 1u);
  EXPECT_EQ(*manager_->ReleaseOwner("ns", "a"), 0);
  EXPECT_EQ(*manager_->ReleaseOwner("nope", "a"), 0);
  EXPECT_EQ(manager_->GetStats().regions, 2u);
}

// A reload revoking principal "carol" everywhere but ns2: its regions in
// other namespaces go (the listener hears them), the rest stay.
TEST_F(RegionManagerTest, ReleaseWhereDropsMatchingOwnersInEveryNamespace) {
  ASSERT_TRUE(manager_->CreateRegion("ns", "carol/1", "c1", 10, 0).ok());
  ASSERT_TRUE(manager_->CreateRegion("ns3", "carol/2", "c2", 10, 0).ok());
  ASSERT_TRUE(manager_->CreateRegion("ns2", "carol/1", "c3", 10, 0).ok());
  ASSERT_TRUE(manager_->CreateRegion("ns", "carola/1", "d1", 10, 0).ok());
  size_t heard = 0;
  manager_->SetRemovalListener(
      [&heard](const std::vector<std::shared_ptr<const Region>>& r) { heard += r.size(); });
  const int n = manager_->ReleaseWhere([](const std::string& ns, const std::string& owner) {
    return owner.rfind("carol/", 0) == 0 && ns != "ns2";
  });
  manager_->SetRemovalListener(nullptr);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(heard, 2u);
  ASSERT_EQ(manager_->List("ns").size(), 1u);
  EXPECT_EQ(manager_->List("ns")[0].name, "d1");
  EXPECT_TRUE(manager_->List("ns3").empty());
  EXPECT_EQ(manager_->List("ns2").size(), 1u);
  EXPECT_EQ(manager_->GetStats().bytes, 20u);
}

TEST_F(RegionManagerTest, ExpireLeasesUsesGivenTime) {
  auto a = manager_->CreateRegion("ns", "a", "a", 10, 1000);
  auto b = manager_->CreateRegion("ns", "b", "b", 10, 5000);
  auto c = manager_->CreateRegion("ns", "c", "c", 10, 0);  // Default: 60 s.
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_GE(b->lease_expires_unix_ms - a->lease_expires_unix_ms, 4000 - 100);
  EXPECT_GE(c->lease_expires_unix_ms - a->lease_expires_unix_ms, 59000 - 100);

  auto held = manager_->Acquire("ns", "a");
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(manager_->ExpireLeases(a->lease_expires_unix_ms - 1), 0);
  EXPECT_EQ(manager_->ExpireLeases(a->lease_expires_unix_ms), 1);
  EXPECT_FALSE(ShmExists(a->shm_key));
  EXPECT_EQ((*held)->data()[0], 0);  // Still mapped for the holder.
  EXPECT_EQ(manager_->Acquire("ns", "a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager_->ExpireLeases(c->lease_expires_unix_ms), 2);
  EXPECT_EQ(manager_->GetStats().expired, 3u);
  EXPECT_EQ(manager_->GetStats().regions, 0u);
}

TEST_F(RegionManagerTest, LongLeasesAreCutToTheMaximum) {
  auto a = manager_->CreateRegion("ns", "a", "a", 10, std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = manager_->CreateRegion("ns", "a", "b", 10, 3600000);
  ASSERT_TRUE(b.ok());
  EXPECT_LE(a->lease_expires_unix_ms, b->lease_expires_unix_ms);
  EXPECT_GE(a->lease_expires_unix_ms, b->lease_expires_unix_ms - 1000);
}

TEST_F(RegionManagerTest, RenewExtendsEveryRegionOfTheOwner) {
  auto a1 = manager_->CreateRegion("ns", "a", "a1", 10, 1000);
  auto a2 = manager_->CreateRegion("ns", "a", "a2", 10, 2000);
  auto b1 = manager_->CreateRegion("ns", "b", "b1", 10, 1000);
  ASSERT_TRUE(a1.ok() && a2.ok() && b1.ok());
  auto expires = manager_->Renew("ns", "a", 100000);
  ASSERT_TRUE(expires.ok()) << expires.status();
  EXPECT_GE(*expires, a2->lease_expires_unix_ms + 90000);
  for (const RegionInfo& info : manager_->List("ns")) {
    if (info.owner == "a") {
      EXPECT_EQ(info.lease_expires_unix_ms, *expires) << info.name;
    }
  }
  EXPECT_EQ(manager_->ExpireLeases(a2->lease_expires_unix_ms), 1);  // Only b1.
  EXPECT_EQ(manager_->List("ns").size(), 2u);
  EXPECT_EQ(manager_->ExpireLeases(*expires), 2);

  auto gone = manager_->Renew("ns", "a", 1000);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(), "owner 'a' has no regions in namespace 'ns'");
  EXPECT_EQ(manager_->Renew("ns", "a", -5).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RegionManagerQuotaTest, QuotaAndRegionCountPerNamespace) {
  std::string tag = UniqueTag();
  auto manager = MakeManager(tag, /*quota=*/10000, /*max_regions=*/3);
  ASSERT_NE(manager, nullptr);
  ASSERT_TRUE(manager->CreateRegion("q", "o", "a", 6000, 0).ok());
  auto over = manager->CreateRegion("q", "o", "b", 5000, 0);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.status().message(),
            "quota shm_bytes (10000) of namespace 'q' exceeded: the namespace would use 11000 "
            "bytes of shared memory; unregister regions or release clients first");
  ASSERT_TRUE(GetReason(over.status()).has_value());
  EXPECT_EQ(GetReason(over.status())->reason, "QUOTA_EXCEEDED");
  EXPECT_EQ(GetReason(over.status())->metadata.at("quota"), "shm_bytes");
  EXPECT_EQ(GetReason(over.status())->metadata.at("limit"), "10000");
  // Registered regions count too.
  ClientShm shm("/opjit-test." + tag + ".q", 8192);
  ASSERT_TRUE(shm.ok());
  EXPECT_EQ(manager->RegisterRegion("q", "o", "r", shm.key(), 0, 4001, 0).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(manager->RegisterRegion("q", "o", "r", shm.key(), 0, 4000, 0).ok());
  EXPECT_EQ(manager->CreateRegion("q", "o", "c", 1, 0).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto huge = manager->CreateRegion("q", "o", "h", std::numeric_limits<uint64_t>::max(), 0);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // Other namespaces have their own quota.
  EXPECT_TRUE(manager->CreateRegion("q2", "o", "a", 10000, 0).ok());
  // Unregistering gives the bytes back.
  ASSERT_TRUE(manager->Unregister("q", "a").ok());
  EXPECT_TRUE(manager->CreateRegion("q", "o", "b", 5000, 0).ok());
  EXPECT_TRUE(manager->CreateRegion("q", "o", "c", 1, 0).ok());
  auto count = manager->CreateRegion("q", "o", "d", 1, 0);
  EXPECT_EQ(count.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(count.status().message().find("quota shm_regions (3)"), std::string::npos)
      << count.status();
  auto stats = manager->GetStats();
  EXPECT_EQ(stats.regions, 4u);
  EXPECT_EQ(stats.bytes, 10000u + 4000 + 5000 + 1);
  EXPECT_EQ(stats.created, 4u);
  EXPECT_EQ(stats.registered, 1u);
}

TEST(RegionManagerLifetimeTest, DestructorUnlinksDaemonObjectsButNotClientOnes) {
  std::string tag = UniqueTag();
  auto manager = MakeManager(tag);
  ASSERT_NE(manager, nullptr);
  auto a = manager->CreateRegion("ns", "o", "a", 100, 0);
  auto b = manager->CreateRegion("ns2", "o", "b", 100, 0);
  ClientShm shm("/opjit-test." + tag + ".c", 4096);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(manager->RegisterRegion("ns", "o", "c", shm.key(), 0, 4096, 0).ok());
  ASSERT_TRUE(a.ok() && b.ok());
  auto held = manager->Acquire("ns", "a");
  ASSERT_TRUE(held.ok());
  std::shared_ptr<const Region> region = *held;
  EXPECT_TRUE(ShmExists(a->shm_key));
  manager.reset();
  EXPECT_FALSE(ShmExists(a->shm_key));
  EXPECT_FALSE(ShmExists(b->shm_key));
  EXPECT_TRUE(ShmExists(shm.key()));
  region->data()[99] = 5;  // Still mapped.
  EXPECT_EQ(region->data()[99], 5);
}

TEST(RegionManagerOrphanTest, CreateUnlinksLeftoversOfAKilledInstance) {
  std::string tag = UniqueTag();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    RegionManagerOptions options;
    options.instance_tag = tag;
    auto manager = RegionManager::Create(options);
    if (!manager.ok()) ::_exit(1);
    std::string keys;
    for (int i = 0; i < 3; ++i) {
      auto info = (*manager)->CreateRegion("ns", "o", "r" + std::to_string(i), 4096, 0);
      if (!info.ok()) ::_exit(2);
      keys += info->shm_key + "\n";
    }
    if (::write(fds[1], keys.data(), keys.size()) != static_cast<ssize_t>(keys.size())) ::_exit(3);
    ::close(fds[1]);
    ::raise(SIGKILL);  // No destructors, no cleanup.
    ::_exit(4);
  }
  ::close(fds[1]);
  std::string keys;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) keys.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL) << wstatus;

  std::vector<std::string> orphans;
  for (size_t pos = 0, nl; (nl = keys.find('\n', pos)) != std::string::npos; pos = nl + 1) {
    orphans.push_back(keys.substr(pos, nl - pos));
  }
  ASSERT_EQ(orphans.size(), 3u);
  for (const auto& key : orphans) EXPECT_TRUE(ShmExists(key)) << key;

  // Lookalikes that are not this instance's objects must survive.
  ClientShm other_tag("/opjit." + tag + "y.0123456789abcdef0123456789abcdef", 16);
  ClientShm not_hex("/opjit." + tag + ".0123456789abcdef0123456789abcdeX", 16);
  ClientShm too_short("/opjit." + tag + ".0123", 16);
  ASSERT_TRUE(other_tag.ok() && not_hex.ok() && too_short.ok());

  auto manager = MakeManager(tag);
  ASSERT_NE(manager, nullptr);
  for (const auto& key : orphans) EXPECT_FALSE(ShmExists(key)) << key;
  EXPECT_TRUE(ShmExists(other_tag.key()));
  EXPECT_TRUE(ShmExists(not_hex.key()));
  EXPECT_TRUE(ShmExists(too_short.key()));
}

TEST(RegionManagerThreadTest, ConcurrentAcquireResolveUnregister) {
  std::string tag = UniqueTag();
  auto manager = MakeManager(tag);
  ASSERT_NE(manager, nullptr);
  constexpr int kRegions = 8;
  constexpr int kThreads = 8;
  constexpr int kIterations = 400;
  constexpr uint64_t kBytes = 4096;
  ClientShm shm("/opjit-test." + tag + ".threads", kBytes * 2);
  ASSERT_TRUE(shm.ok());
  auto name = [](int i) { return "r" + std::to_string(i); };
  for (int i = 0; i < kRegions; ++i) {
    ASSERT_TRUE(manager->CreateRegion("ns", "o", name(i), kBytes, 0).ok());
  }
  std::atomic<int> resolved{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int it = 0; it < kIterations; ++it) {
        const int r = static_cast<int>(rng() % kRegions);
        switch (rng() % 4) {
          case 0:
          case 1: {
            auto region = manager->Acquire("ns", name(r));
            if (!region.ok()) {
              if (!absl::IsNotFound(region.status())) ++failures;
              break;
            }
            // Each thread its own 64 bytes, so the writes below do not race.
            TensorRef ref{.region = name(r),
                          .offset = 64 * static_cast<uint64_t>(t + 1),
                          .dtype = "int32",
                          .shape = {16}};
            auto view = Resolve(*region, ref, "inputs[0]");
            if (!view.ok()) {
              ++failures;
              break;
            }
            auto* p = static_cast<int32_t*>(view->data);
            // The mapping must stay valid whatever the other threads do.
            for (int k = 0; k < 16; ++k) p[k] = t * 100 + k;
            for (int k = 0; k < 16; ++k) {
              if (p[k] != t * 100 + k) ++failures;
            }
            ++resolved;
            break;
          }
          case 2: {
            auto st = manager->Unregister("ns", name(r));
            if (!st.ok() && !absl::IsNotFound(st)) ++failures;
            break;
          }
          case 3: {
            auto st =
                (rng() % 2 == 0)
                    ? manager->CreateRegion("ns", "o", name(r), kBytes, 0).status()
                    : manager->RegisterRegion("ns", "o", name(r), shm.key(), kBytes, kBytes, 0)
                          .status();
            if (!st.ok() && !absl::IsAlreadyExists(st)) ++failures;
            break;
          }
        }
        if (it % 100 == 0) {
          manager->List("ns");
          manager->GetStats();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(resolved.load(), 0);
  auto stats = manager->GetStats();
  EXPECT_EQ(stats.regions, manager->List("ns").size());
  EXPECT_EQ(stats.bytes, stats.regions * kBytes);
}

TEST(RegionManagerQuotaTest, TotalQuotaBoundsAllNamespacesTogether) {
  std::string tag = UniqueTag();
  tensor::RegionManagerOptions o;
  o.instance_tag = tag;
  o.namespace_quota_bytes = 10000;
  o.total_quota_bytes = 15000;
  auto manager = tensor::RegionManager::Create(o);
  ASSERT_TRUE(manager.ok()) << manager.status();
  ASSERT_TRUE((*manager)->CreateRegion("a", "o", "r", 10000, 0).ok());
  auto over = (*manager)->CreateRegion("b", "o", "r", 6000, 0);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetReason(over.status())->metadata.at("quota"), "total_shm_bytes");
  EXPECT_TRUE((*manager)->CreateRegion("b", "o", "r", 5000, 0).ok());
}

TEST(RegionManagerPrincipalTest, AnotherPrincipalsRegionIsNotFound) {
  std::string tag = UniqueTag();
  auto manager = MakeManager(tag, /*quota=*/1 << 20, /*max_regions=*/8);
  ASSERT_NE(manager, nullptr);
  ASSERT_TRUE(manager->CreateRegion("ns", "alice/c1", "r", 64, 0).ok());
  EXPECT_TRUE(manager->Acquire("ns", "r", "alice").ok());
  EXPECT_TRUE(manager->Acquire("ns", "r", "").ok());  // admins
  auto other = manager->Acquire("ns", "r", "carol");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetReason(other.status())->reason, "REGION_NOT_REGISTERED");
  EXPECT_TRUE(manager->List("ns", "carol").empty());
  EXPECT_EQ(manager->List("ns", "alice").size(), 1u);
  EXPECT_EQ(manager->Unregister("ns", "r", "carol").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager->Unregister("ns", "r", "alice").ok());
}

}  // namespace
}  // namespace opjit::tensor

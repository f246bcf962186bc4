#include "server/cache/disk_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/common/sha256.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::cache {
namespace {

using testing::ReadFile;
using testing::SetMtime;
using testing::TempDir;
using testing::WriteFile;

constexpr size_t kHeaderSize = 80;  // magic 4 + version 4 + length 8 + hex SHA-256 64.

std::string Key(int i) { return Sha256Hex("key" + std::to_string(i)); }

std::string EntryPath(const std::string& dir, const std::string& kind, const std::string& key) {
  return dir + "/" + kind + "/" + key.substr(0, 2) + "/" + key;
}

std::unique_ptr<DiskCache> MakeCache(const std::string& dir, uint64_t max_bytes = 1ull << 30) {
  auto cache = DiskCache::Create({.dir = dir, .max_bytes = max_bytes});
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(*cache) : nullptr;
}

// Every entry file under `dir` (key name, path, size).
struct FoundFile {
  std::string kind, key, path;
  uint64_t size;
};
std::vector<FoundFile> ListEntries(const std::string& dir) {
  std::vector<FoundFile> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::string name = e.path().filename().string();
    if (name.starts_with(".")) continue;
    out.push_back({e.path().parent_path().parent_path().filename().string(), name,
                   e.path().string(), static_cast<uint64_t>(e.file_size())});
  }
  return out;
}

size_t CountTempFiles(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().filename().string().starts_with(".tmp.")) ++n;
  }
  return n;
}

TEST(DiskCacheTest, PutGetRoundTrip) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  ASSERT_NE(cache, nullptr);
  const std::string payload("binary\0payload\xff", 15);
  ASSERT_TRUE(cache->Put("obj", Key(1), payload).ok());
  auto got = cache->Get("obj", Key(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, payload);

  // Layout and header.
  const std::string path = EntryPath(tmp.path(), "obj", Key(1));
  const std::string raw = ReadFile(path);
  ASSERT_EQ(raw.size(), kHeaderSize + payload.size());
  EXPECT_EQ(raw.substr(0, 4), "OPJC");
  EXPECT_EQ(raw.substr(kHeaderSize), payload);
  EXPECT_EQ(CountTempFiles(tmp.path()), 0u);

  // Kinds are separate namespaces.
  EXPECT_TRUE(absl::IsNotFound(cache->Get("cubin", Key(1)).status()));

  DiskCacheStats s = cache->Stats();
  EXPECT_EQ(s.puts, 1u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, kHeaderSize + payload.size());
}

TEST(DiskCacheTest, EmptyPayloadAndOverwrite) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  ASSERT_TRUE(cache->Put("manifest", Key(2), "").ok());
  EXPECT_EQ(*cache->Get("manifest", Key(2)), "");
  ASSERT_TRUE(cache->Put("manifest", Key(2), "second").ok());
  EXPECT_EQ(*cache->Get("manifest", Key(2)), "second");
  EXPECT_EQ(cache->Stats().entries, 1u);
  EXPECT_EQ(cache->Stats().bytes, kHeaderSize + 6);
}

TEST(DiskCacheTest, MissIsNotFound) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  auto got = cache->Get("obj", Key(3));
  EXPECT_TRUE(absl::IsNotFound(got.status())) << got.status();
  EXPECT_EQ(cache->Stats().misses, 1u);
  EXPECT_EQ(cache->Stats().hits, 0u);
}

TEST(DiskCacheTest, RejectsMalformedKindAndKey) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  for (const std::string& key :
       {std::string("abc"), std::string("ABCDEF0123456789"), std::string("0123456789abcdeg"),
        std::string("../../etc/passwd0"), std::string(129, 'a'), std::string()}) {
    EXPECT_TRUE(absl::IsInvalidArgument(cache->Get("obj", key).status())) << key;
    EXPECT_TRUE(absl::IsInvalidArgument(cache->Put("obj", key, "x"))) << key;
    EXPECT_TRUE(absl::IsInvalidArgument(cache->Remove("obj", key))) << key;
  }
  for (const std::string& kind : {"", "..", "a/b", "Obj", ".lock"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(cache->Get(kind, Key(1)).status())) << kind;
    EXPECT_TRUE(absl::IsInvalidArgument(cache->Put(kind, Key(1), "x"))) << kind;
  }
  EXPECT_TRUE(cache->Put("obj", std::string(16, 'a'), "min").ok());
  EXPECT_TRUE(cache->Put("obj", std::string(128, 'f'), "max").ok());
}

TEST(DiskCacheTest, CreateFailsClearly) {
  TempDir tmp;
  EXPECT_TRUE(absl::IsInvalidArgument(DiskCache::Create({.dir = ""}).status()));

  WriteFile(tmp.Sub("file"), "not a dir");
  auto under_file = DiskCache::Create({.dir = tmp.Sub("file/cache")});
  ASSERT_FALSE(under_file.ok());
  EXPECT_NE(under_file.status().message().find(tmp.Sub("file/cache")), std::string::npos)
      << under_file.status();

  auto is_file = DiskCache::Create({.dir = tmp.Sub("file")});
  EXPECT_FALSE(is_file.ok());

  if (::geteuid() != 0) {  // Root writes anywhere.
    ASSERT_EQ(::mkdir(tmp.Sub("ro").c_str(), 0555), 0);
    auto ro = DiskCache::Create({.dir = tmp.Sub("ro")});
    ASSERT_FALSE(ro.ok());
    EXPECT_NE(ro.status().message().find("not writable"), std::string::npos) << ro.status();
  }

  // Nested directories are created.
  EXPECT_TRUE(DiskCache::Create({.dir = tmp.Sub("a/b/c")}).ok());
}

// Puts an entry, damages its file with `corrupt`, and checks that Get reports
// a counted miss, deletes the file, and that a new Put replaces it.
void ExpectCorruptionHandled(const std::function<void(const std::string&)>& corrupt) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  const std::string key = Key(7);
  const std::string path = EntryPath(tmp.path(), "obj", key);
  ASSERT_TRUE(cache->Put("obj", key, std::string(300, 'p')).ok());
  corrupt(path);

  auto got = cache->Get("obj", key);
  EXPECT_TRUE(absl::IsNotFound(got.status())) << got.status();
  EXPECT_FALSE(std::filesystem::exists(path));
  DiskCacheStats s = cache->Stats();
  EXPECT_EQ(s.corrupt, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.entries, 0u);

  // Gone now: a plain miss, not another corruption.
  EXPECT_TRUE(absl::IsNotFound(cache->Get("obj", key).status()));
  EXPECT_EQ(cache->Stats().corrupt, 1u);

  ASSERT_TRUE(cache->Put("obj", key, "fresh").ok());
  auto again = cache->Get("obj", key);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, "fresh");
}

TEST(DiskCacheTest, FlippedPayloadByteIsCorrupt) {
  ExpectCorruptionHandled([](const std::string& path) {
    std::string raw = ReadFile(path);
    raw[kHeaderSize + 10] ^= 0x01;
    WriteFile(path, raw);
  });
}

TEST(DiskCacheTest, VerifyReportsCorruptEntriesAndChangesNothing) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  ASSERT_NE(cache, nullptr);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(cache->Put("obj", Key(i), std::string(300 + i, 'x')).ok());
  }
  DiskCacheVerification clean = VerifyDiskCache(tmp.path());
  EXPECT_EQ(clean.entries, 4u);
  EXPECT_TRUE(clean.corrupt.empty());

  const std::string flipped = EntryPath(tmp.path(), "obj", Key(1));
  std::string raw = ReadFile(flipped);
  raw[kHeaderSize + 3] ^= 0x20;
  WriteFile(flipped, raw);
  std::filesystem::resize_file(EntryPath(tmp.path(), "obj", Key(2)), kHeaderSize + 10);
  DiskCacheVerification v = VerifyDiskCache(tmp.path());
  EXPECT_EQ(v.entries, 4u);
  ASSERT_EQ(v.corrupt.size(), 2u);
  std::sort(v.corrupt.begin(), v.corrupt.end());
  const std::string k1 = Key(1), k2 = Key(2);
  const bool one_first = k1 < k2;
  EXPECT_THAT(v.corrupt[one_first ? 0 : 1], ::testing::HasSubstr("checksum mismatch"));
  EXPECT_THAT(v.corrupt[one_first ? 1 : 0], ::testing::HasSubstr("length"));
  // Nothing was deleted: only Get removes what does not verify.
  EXPECT_TRUE(std::filesystem::exists(flipped));
  EXPECT_EQ(VerifyDiskCache(tmp.path()).corrupt.size(), 2u);
}

TEST(DiskCacheTest, TruncatedFileIsCorrupt) {
  ExpectCorruptionHandled(
      [](const std::string& path) { std::filesystem::resize_file(path, kHeaderSize + 100); });
}

TEST(DiskCacheTest, TruncatedHeaderIsCorrupt) {
  ExpectCorruptionHandled([](const std::string& path) { std::filesystem::resize_file(path, 9); });
}

TEST(DiskCacheTest, GarbageHeaderIsCorrupt) {
  ExpectCorruptionHandled([](const std::string& path) {
    std::string raw = ReadFile(path);
    for (size_t i = 0; i < kHeaderSize; ++i) raw[i] = static_cast<char>(i * 37);
    WriteFile(path, raw);
  });
}

TEST(DiskCacheTest, WrongLengthFieldIsCorrupt) {
  ExpectCorruptionHandled([](const std::string& path) {
    std::string raw = ReadFile(path);
    raw[8] ^= 0x01;  // Payload length, little-endian.
    WriteFile(path, raw);
  });
}

TEST(DiskCacheTest, FileWrittenByOtherVersionIsCorrupt) {
  ExpectCorruptionHandled([](const std::string& path) {
    std::string raw = ReadFile(path);
    raw[4] = 9;  // Format version.
    WriteFile(path, raw);
  });
}

TEST(DiskCacheTest, EvictsLeastRecentlyUsedByMtime) {
  TempDir tmp;
  // Each entry file is exactly 1000 bytes; the bound holds five.
  const std::string payload(1000 - kHeaderSize, 'x');
  auto cache = MakeCache(tmp.path(), 5000);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(cache->Put("obj", Key(i), payload).ok());
    // Oldest first: key 0 an hour ago, key 4 an hour less four minutes ago.
    SetMtime(EntryPath(tmp.path(), "obj", Key(i)), -3600 + 60 * i);
  }
  EXPECT_EQ(cache->Stats().evictions, 0u);
  // A hit makes key 0 the most recently used.
  ASSERT_TRUE(cache->Get("obj", Key(0)).ok());

  // 6000 > 5000: evict oldest-first until <= 4500, i.e. keys 1 and 2.
  ASSERT_TRUE(cache->Put("obj", Key(5), payload).ok());
  for (int i : {0, 3, 4, 5}) EXPECT_TRUE(cache->Get("obj", Key(i)).ok()) << i;
  for (int i : {1, 2}) {
    EXPECT_TRUE(absl::IsNotFound(cache->Get("obj", Key(i)).status())) << i;
    EXPECT_FALSE(std::filesystem::exists(EntryPath(tmp.path(), "obj", Key(i))));
  }
  DiskCacheStats s = cache->Stats();
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.entries, 4u);
  EXPECT_EQ(s.bytes, 4000u);
  EXPECT_EQ(s.corrupt, 0u);
}

TEST(DiskCacheTest, NeverEvictsTheKeyJustWritten) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path(), 1000);
  ASSERT_TRUE(cache->Put("obj", Key(1), std::string(400, 'a')).ok());
  // Key 1 looks newer than anything written now, so key 2 is the oldest.
  SetMtime(EntryPath(tmp.path(), "obj", Key(1)), 86400);
  ASSERT_TRUE(cache->Put("obj", Key(2), std::string(1500, 'b')).ok());
  EXPECT_TRUE(cache->Get("obj", Key(2)).ok());
  EXPECT_TRUE(absl::IsNotFound(cache->Get("obj", Key(1)).status()));
  EXPECT_EQ(cache->Stats().evictions, 1u);
}

TEST(DiskCacheTest, RemoveAndClear) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(cache->Put(i % 2 ? "obj" : "pch", Key(i), "v").ok());
  EXPECT_TRUE(cache->Remove("pch", Key(0)).ok());
  EXPECT_TRUE(absl::IsNotFound(cache->Remove("pch", Key(0))));
  EXPECT_TRUE(absl::IsNotFound(cache->Get("pch", Key(0)).status()));
  EXPECT_EQ(cache->Stats().entries, 3u);

  ASSERT_TRUE(cache->Clear().ok());
  EXPECT_EQ(cache->Stats().entries, 0u);
  EXPECT_EQ(cache->Stats().bytes, 0u);
  EXPECT_TRUE(ListEntries(tmp.path()).empty());
  EXPECT_TRUE(std::filesystem::exists(tmp.Sub(".lock")));
  for (int i = 1; i < 4; ++i) {
    EXPECT_TRUE(absl::IsNotFound(cache->Get(i % 2 ? "obj" : "pch", Key(i)).status()));
  }
  ASSERT_TRUE(cache->Put("obj", Key(9), "after").ok());
  EXPECT_EQ(*cache->Get("obj", Key(9)), "after");
}

TEST(DiskCacheTest, CreateScansExistingEntriesAndRemovesStaleTempFiles) {
  TempDir tmp;
  {
    auto cache = MakeCache(tmp.path());
    ASSERT_TRUE(cache->Put("obj", Key(1), "one").ok());
    ASSERT_TRUE(cache->Put("cubin", Key(2), "two!").ok());
  }
  const std::string shard = tmp.path() + "/obj/" + Key(1).substr(0, 2);
  WriteFile(shard + "/.tmp.1.stale", "crashed writer");
  SetMtime(shard + "/.tmp.1.stale", -2 * 3600);
  WriteFile(shard + "/.tmp.2.fresh", "writer in progress");

  auto cache = MakeCache(tmp.path());
  EXPECT_EQ(cache->Stats().entries, 2u);
  EXPECT_EQ(cache->Stats().bytes, 2 * kHeaderSize + 7);
  EXPECT_FALSE(std::filesystem::exists(shard + "/.tmp.1.stale"));
  EXPECT_TRUE(std::filesystem::exists(shard + "/.tmp.2.fresh"));
  EXPECT_EQ(*cache->Get("cubin", Key(2)), "two!");
}

TEST(DiskCacheTest, TwoInstancesShareOneDirectory) {
  TempDir tmp;
  auto a = MakeCache(tmp.path(), 5000);
  auto b = MakeCache(tmp.path(), 5000);
  ASSERT_TRUE(a->Put("obj", Key(1), "from a").ok());
  EXPECT_EQ(*b->Get("obj", Key(1)), "from a");
  ASSERT_TRUE(b->Put("obj", Key(1), "from b").ok());
  EXPECT_EQ(*a->Get("obj", Key(1)), "from b");
  ASSERT_TRUE(b->Remove("obj", Key(1)).ok());
  EXPECT_TRUE(absl::IsNotFound(a->Get("obj", Key(1)).status()));

  // Writes from both count against the shared bound, though each instance
  // only tracks its own.
  const std::string payload(1000 - kHeaderSize, 'z');
  for (int i = 0; i < 6; ++i) ASSERT_TRUE((i % 2 ? a : b)->Put("obj", Key(10 + i), payload).ok());
  uint64_t total = 0;
  for (const FoundFile& f : ListEntries(tmp.path())) total += f.size;
  EXPECT_LE(total, 5000u);
  EXPECT_GT(a->Stats().evictions + b->Stats().evictions, 0u);
}

TEST(DiskCacheTest, ConcurrentThreads) {
  TempDir tmp;
  auto cache = MakeCache(tmp.path(), 20000);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 100; ++i) {
        const int k = (i * 7 + t) % 16;
        const std::string payload(100 * k, static_cast<char>('a' + k));
        if (!cache->Put("obj", Key(k), payload).ok()) ++bad;
        auto got = cache->Get("obj", Key(k + 1));
        if (got.ok() ? *got != std::string(100 * (k + 1), static_cast<char>('a' + k + 1))
                     : !absl::IsNotFound(got.status())) {
          ++bad;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(cache->Stats().corrupt, 0u);
  EXPECT_EQ(CountTempFiles(tmp.path()), 0u);
}

// The payload every process writes for key `i`: content-addressed, so equal
// keys always mean equal bytes; sizes vary from 0 to ~6 KB.
std::string PayloadFor(int i) {
  std::mt19937 rng(static_cast<uint32_t>(i) * 2654435761u);
  std::string s(rng() % 6000, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Runs in a forked child: returns the process exit code.
int ChildWorkload(const std::string& dir, uint64_t max_bytes, int child) {
  auto cache = DiskCache::Create({.dir = dir, .max_bytes = max_bytes});
  if (!cache.ok()) return 2;
  std::mt19937 rng(1234 + child);
  for (int op = 0; op < 200; ++op) {
    const int i = static_cast<int>(rng() % 48);
    if (rng() % 2 == 0) {
      if (!(*cache)->Put("obj", Key(i), PayloadFor(i)).ok()) return 3;
    } else {
      auto got = (*cache)->Get("obj", Key(i));
      if (got.ok() && *got != PayloadFor(i)) return 4;
      if (!got.ok() && !absl::IsNotFound(got.status())) return 5;
    }
  }
  // Nothing any process writes is ever corrupt; ~300 KB of Puts against a
  // 40 KB bound must have evicted.
  if ((*cache)->Stats().corrupt != 0) return 6;
  return (*cache)->Stats().evictions > 0 ? 0 : 7;
}

TEST(DiskCacheTest, ManyProcessesShareOneDirectoryWhileEvicting) {
  TempDir tmp;
  constexpr uint64_t kMaxBytes = 40000;  // About a third of the working set.
  std::vector<pid_t> children;
  for (int c = 0; c < 4; ++c) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ::_exit(ChildWorkload(tmp.path(), kMaxBytes, c));
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "child " << pid;
  }

  // Every file left is a whole, valid entry with the right content.
  auto cache = MakeCache(tmp.path(), kMaxBytes);
  const std::vector<FoundFile> files = ListEntries(tmp.path());
  EXPECT_FALSE(files.empty());
  uint64_t total = 0;
  for (const FoundFile& f : files) {
    total += f.size;
    int index = -1;
    for (int i = 0; i < 48; ++i) {
      if (Key(i) == f.key) index = i;
    }
    ASSERT_GE(index, 0) << f.path;
    auto got = cache->Get(f.kind, f.key);
    ASSERT_TRUE(got.ok()) << f.path << ": " << got.status();
    EXPECT_EQ(*got, PayloadFor(index)) << f.path;
  }
  EXPECT_EQ(cache->Stats().corrupt, 0u);
  EXPECT_EQ(CountTempFiles(tmp.path()), 0u);
  // The bound is soft across processes, but eviction kept the total near it.
  EXPECT_LE(total, 2 * kMaxBytes);
}

}  // namespace
}  // namespace opjit::cache

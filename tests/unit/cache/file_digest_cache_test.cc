#include "server/cache/file_digest_cache.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "server/common/sha256.h"
#include "tests/unit/cache/test_util.h"

namespace opjit::cache {
namespace {

using testing::SetMtime;
using testing::TempDir;
using testing::WriteFile;

TEST(FileDigestCacheTest, DigestIsSha256OfContent) {
  TempDir tmp;
  WriteFile(tmp.Sub("a.h"), "#pragma once\n");
  FileDigestCache digests(0);
  auto d = digests.Digest(tmp.Sub("a.h"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, Sha256Hex("#pragma once\n"));
}

TEST(FileDigestCacheTest, DetectsContentChange) {
  TempDir tmp;
  const std::string path = tmp.Sub("a.h");
  FileDigestCache digests(0);
  WriteFile(path, "int x = 1;");
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("int x = 1;"));
  // Same size, written at once: stamps may not move, but the file is racy.
  WriteFile(path, "int x = 2;");
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("int x = 2;"));
  // Replaced by rename (new inode).
  WriteFile(tmp.Sub("b.h"), "int y;");
  std::filesystem::rename(tmp.Sub("b.h"), path);
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("int y;"));
}

TEST(FileDigestCacheTest, RehashesOnlyWhenStampChanges) {
  TempDir tmp;
  const std::string path = tmp.Sub("a.h");
  FileDigestCache digests(0);
  WriteFile(path, "old");
  SetMtime(path, -100);  // Old enough not to be racy.
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("old"));
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("old"));
  EXPECT_EQ(digests.Stats().hashes, 1u);
  EXPECT_EQ(digests.Stats().stats, 2u);

  WriteFile(path, "new");
  SetMtime(path, -50);
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("new"));
  EXPECT_EQ(digests.Stats().hashes, 2u);
  EXPECT_EQ(digests.Stats().entries, 1u);
}

TEST(FileDigestCacheTest, WithinIntervalSkipsStat) {
  TempDir tmp;
  const std::string path = tmp.Sub("a.h");
  FileDigestCache digests(3600 * 1000);
  WriteFile(path, "v1");
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("v1"));
  WriteFile(path, "v2");
  // Memoised answer, no stat: up to one interval stale by contract.
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("v1"));
  EXPECT_EQ(digests.Stats().stats, 1u);
  EXPECT_EQ(digests.Stats().lookups, 2u);
  digests.Clear();
  EXPECT_EQ(*digests.Digest(path), Sha256Hex("v2"));
}

TEST(FileDigestCacheTest, MissingFileIsNotFound) {
  TempDir tmp;
  FileDigestCache digests(0);
  EXPECT_TRUE(absl::IsNotFound(digests.Digest(tmp.Sub("none.h")).status()));
  WriteFile(tmp.Sub("a.h"), "x");
  ASSERT_TRUE(digests.Digest(tmp.Sub("a.h")).ok());
  std::filesystem::remove(tmp.Sub("a.h"));
  EXPECT_TRUE(absl::IsNotFound(digests.Digest(tmp.Sub("a.h")).status()));
  EXPECT_EQ(digests.Stats().entries, 0u);
  EXPECT_TRUE(absl::IsInvalidArgument(digests.Digest(tmp.path()).status()));
}

}  // namespace
}  // namespace opjit::cache

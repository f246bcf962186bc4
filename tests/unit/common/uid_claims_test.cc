// UidClaims (server/common/uid_claims.h): host-wide claims on executor uids,
// one open-file-description lock per uid in <dir>/uids.lock. Two objects
// are two descriptors, so they claim apart as two daemons do; a claim goes
// with its object (as with a daemon that dies). Also what the directory
// must be: absolute, not a symlink, written by its owner alone.
#include "server/common/uid_claims.h"

#include <pwd.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace opjit {
namespace {

class UidClaimsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/opjit-uid-claims-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    top_ = tmpl;
    dir_ = top_ + "/claims";
  }
  void TearDown() override { std::filesystem::remove_all(top_); }

  std::unique_ptr<UidClaims> Open() {
    auto c = UidClaims::Open(dir_);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::string top_, dir_;
};

TEST_F(UidClaimsTest, CreatesItsDirectoryAndALockFileOnlyItsOwnerOpens) {
  auto c = Open();
  ASSERT_NE(c, nullptr);
  struct stat ds {}, fs {};
  ASSERT_EQ(::stat(dir_.c_str(), &ds), 0);
  EXPECT_TRUE(S_ISDIR(ds.st_mode));
  EXPECT_EQ(ds.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat((dir_ + "/uids.lock").c_str(), &fs), 0);
  EXPECT_EQ(fs.st_mode & 0777, 0600u);
  EXPECT_EQ(fs.st_uid, ::geteuid());
}

TEST_F(UidClaimsTest, TwoHoldersClaimApartAndAClaimGoesWithItsHolder) {
  auto a = Open();
  auto b = Open();
  ASSERT_TRUE(a && b);
  const uint32_t first = 2000000000u, last = first + 3;
  // Each takes the lowest uid that nobody holds.
  EXPECT_EQ(*a->Claim(first, last), first);
  EXPECT_EQ(*b->Claim(first, last), first + 1);
  EXPECT_EQ(*a->Claim(first, last), first + 2);
  EXPECT_TRUE(b->HeldElsewhere(first));
  EXPECT_FALSE(a->HeldElsewhere(first));  // its own
  EXPECT_EQ(a->held(), (std::set<uint32_t>{first, first + 2}));
  // A holder that goes (a daemon that dies) gives its uids back at once.
  a.reset();
  EXPECT_FALSE(b->HeldElsewhere(first));
  EXPECT_EQ(*b->Claim(first, last), first);
  EXPECT_EQ(*b->Claim(first, last), first + 2);
}

TEST_F(UidClaimsTest, ARangeOthersHoldIsRefusedWithResourceExhausted) {
  auto a = Open();
  auto b = Open();
  ASSERT_TRUE(a && b);
  const uint32_t first = 2000000100u;
  ASSERT_TRUE(a->Claim(first, first + 1).ok());
  ASSERT_TRUE(b->Claim(first, first + 1).ok());
  absl::StatusOr<uint32_t> full = b->Claim(first, first + 1);
  ASSERT_TRUE(absl::IsResourceExhausted(full.status())) << full.status();
  EXPECT_NE(full.status().message().find("1 by this server's namespaces, 1 by other opjitd"),
            std::string::npos)
      << full.status();
  // The same answer for a second without another scan, then a new look.
  a.reset();
  EXPECT_TRUE(absl::IsResourceExhausted(b->Claim(first, first + 1).status()));
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  absl::StatusOr<uint32_t> again = b->Claim(first, first + 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, first);
}

TEST_F(UidClaimsTest, RefusesADirectoryOthersMayWriteASymlinkAndARelativePath) {
  ASSERT_EQ(::mkdir(dir_.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);
  auto open = UidClaims::Open(dir_);
  EXPECT_TRUE(absl::IsFailedPrecondition(open.status())) << open.status();
  EXPECT_NE(open.status().message().find("chmod 700"), std::string::npos) << open.status();
  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
  const std::string link = top_ + "/link";
  ASSERT_EQ(::symlink(dir_.c_str(), link.c_str()), 0);
  open = UidClaims::Open(link);
  EXPECT_TRUE(absl::IsFailedPrecondition(open.status())) << open.status();
  EXPECT_FALSE(UidClaims::Open("relative/claims").ok());
  EXPECT_TRUE(UidClaims::Open(dir_).ok());
}

// A root daemon gives the lock file to the directory's owner (the package's
// opjit user), whose daemons must open it too.
TEST_F(UidClaimsTest, AsRootTheLockFileBelongsToTheDirectorysOwner) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root";
  const passwd* nobody = ::getpwnam("nobody");
  ASSERT_NE(nobody, nullptr);
  ASSERT_EQ(::mkdir(dir_.c_str(), 0700), 0);
  ASSERT_EQ(::chown(dir_.c_str(), nobody->pw_uid, nobody->pw_gid), 0);
  auto c = Open();
  ASSERT_NE(c, nullptr);
  struct stat fs {};
  ASSERT_EQ(::stat((dir_ + "/uids.lock").c_str(), &fs), 0);
  EXPECT_EQ(fs.st_uid, nobody->pw_uid);
  EXPECT_EQ(fs.st_mode & 0777, 0600u);
  EXPECT_TRUE(c->Claim(2000000200u, 2000000201u).ok());
}

}  // namespace
}  // namespace opjit

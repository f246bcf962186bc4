// The ACL that lets a client of another uid open a daemon-created region.
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "server/common/posix_acl.h"
#include "server/tensor/region.h"
#include "server/tensor/region_manager.h"
#include "tests/unit/tensor/test_util.h"

namespace opjit::tensor {
namespace {

using testing::UniqueTag;

constexpr uid_t kGranted = 65000;  // uids no account on the test host uses
constexpr uid_t kStranger = 65001;

struct AclEntry {
  uint16_t tag, perm;
  uint32_t id;
  bool operator==(const AclEntry& o) const {
    return std::tie(tag, perm, id) == std::tie(o.tag, o.perm, o.id);
  }
};

uint32_t Le(const uint8_t* p, int bytes) {
  uint32_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The access ACL of `path` decoded from its xattr. Empty with `*err` set to
// errno when there is none (ENODATA), or to EBADMSG when it is malformed.
std::vector<AclEntry> ReadAcl(const std::string& path, int* err) {
  uint8_t buf[256];
  *err = 0;
  ssize_t n = ::getxattr(path.c_str(), "system.posix_acl_access", buf, sizeof(buf));
  if (n < 0) {
    *err = errno;
    return {};
  }
  if (n < 4 || (n - 4) % 8 != 0 || Le(buf, 4) != 2) {
    *err = EBADMSG;
    return {};
  }
  std::vector<AclEntry> out;
  for (ssize_t at = 4; at < n; at += 8) {
    out.push_back({static_cast<uint16_t>(Le(buf + at, 2)),
                   static_cast<uint16_t>(Le(buf + at + 2, 2)), Le(buf + at + 4, 4)});
  }
  return out;
}

std::vector<AclEntry> ExpectedAcl(uid_t uid) {
  return {{0x01, 6, 0xffffffffu},
          {0x02, 6, static_cast<uint32_t>(uid)},
          {0x04, 0, 0xffffffffu},
          {0x10, 6, 0xffffffffu},
          {0x20, 0, 0xffffffffu}};
}

// In a child running as `uid`:`uid` with no supplementary groups, opens
// `key` read-write and checks its first byte is `expect`. Returns 0 on
// success, 2 for EACCES, other values for other failures.
int OpenAs(uid_t uid, const std::string& key, uint8_t expect) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setresgid(uid, uid, uid) != 0 ||
        ::setresuid(uid, uid, uid) != 0) {
      ::_exit(10);
    }
    int fd = ::shm_open(key.c_str(), O_RDWR, 0);
    if (fd < 0) ::_exit(errno == EACCES ? 2 : 3);
    void* p = ::mmap(nullptr, 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) ::_exit(4);
    ::_exit(*static_cast<uint8_t*>(p) == expect ? 0 : 5);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

class RegionAclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    key_ = "/opjit-acl-test." + UniqueTag();
    ::shm_unlink(key_.c_str());
  }
  void TearDown() override { ::shm_unlink(key_.c_str()); }
  std::string Path() const { return "/dev/shm" + key_; }

  // Skips the test when /dev/shm takes no ACLs (the feature cannot work).
  void RequireAclSupport() {
    int fd = ::shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    absl::Status s = GrantUserReadWrite(fd, kGranted);
    ::close(fd);
    ::shm_unlink(key_.c_str());
    if (absl::IsFailedPrecondition(s)) GTEST_SKIP() << "/dev/shm has no POSIX ACL support";
    ASSERT_TRUE(s.ok()) << s;
  }

  std::string key_;
};

TEST_F(RegionAclTest, GrantWritesExactlyOneUserEntry) {
  RequireAclSupport();
  if (IsSkipped()) return;
  int fd = ::shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(GrantUserReadWrite(fd, kGranted).ok());
  struct stat st;
  ASSERT_EQ(::fstat(fd, &st), 0);
  ::close(fd);
  EXPECT_EQ(st.st_mode & 0777, 0660u);  // group bits show the mask; no group entry has rights
  int err;
  EXPECT_EQ(ReadAcl(Path(), &err), ExpectedAcl(kGranted));
  EXPECT_EQ(err, 0);
}

TEST_F(RegionAclTest, NoAclSupportIsFailedPrecondition) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);  // pipefs has no xattrs: EOPNOTSUPP
  absl::Status s = GrantUserReadWrite(fds[0], kGranted);
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST_F(RegionAclTest, CreateShmGrantsTheClientOnly) {
  RequireAclSupport();
  if (IsSkipped()) return;
  auto region = Region::CreateShm(key_, 4096, RegionInfo{}, kGranted);
  ASSERT_TRUE(region.ok()) << region.status();
  (*region)->data()[0] = 0x5a;
  int err;
  EXPECT_EQ(ReadAcl(Path(), &err), ExpectedAcl(kGranted));
  struct stat st;
  ASSERT_EQ(::stat(Path().c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, ::geteuid());  // the daemon stays the owner (it unlinks)
  if (::geteuid() != 0) GTEST_SKIP() << "opening as other uids needs root";
  EXPECT_EQ(OpenAs(kGranted, key_, 0x5a), 0);
  EXPECT_EQ(OpenAs(kStranger, key_, 0x5a), 2);  // EACCES
  region->reset();
  EXPECT_FALSE(testing::ShmExists(key_));
}

TEST_F(RegionAclTest, CreateShmWithoutAForeignClientSetsNoAcl) {
  for (std::optional<uid_t> uid : {std::optional<uid_t>(), std::optional<uid_t>(::geteuid())}) {
    auto region = Region::CreateShm(key_, 4096, RegionInfo{}, uid);
    ASSERT_TRUE(region.ok()) << region.status();
    int err;
    EXPECT_TRUE(ReadAcl(Path(), &err).empty());
    EXPECT_EQ(err, ENODATA);
    struct stat st;
    ASSERT_EQ(::stat(Path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    region->reset();
  }
  if (::geteuid() != 0) return;
  // Without the ACL another uid is refused: what the grant is for.
  auto region = Region::CreateShm(key_, 4096, RegionInfo{});
  ASSERT_TRUE(region.ok());
  EXPECT_EQ(OpenAs(kGranted, key_, 0), 2);
}

TEST_F(RegionAclTest, RegionManagerPassesTheClientUid) {
  RequireAclSupport();
  if (IsSkipped()) return;
  RegionManagerOptions options;
  options.instance_tag = UniqueTag();
  auto manager = RegionManager::Create(options);
  ASSERT_TRUE(manager.ok()) << manager.status();
  auto info = (*manager)->CreateRegion("ns", "owner/c", "r", 4096, 0, kGranted);
  ASSERT_TRUE(info.ok()) << info.status();
  int err;
  EXPECT_EQ(ReadAcl("/dev/shm" + info->shm_key, &err), ExpectedAcl(kGranted));
  auto plain = (*manager)->CreateRegion("ns", "owner/c", "p", 4096, 0);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(ReadAcl("/dev/shm" + plain->shm_key, &err).empty());
  EXPECT_EQ(err, ENODATA);
  if (::geteuid() != 0) return;
  EXPECT_EQ(OpenAs(kGranted, info->shm_key, 0), 0);
  EXPECT_EQ(OpenAs(kGranted, plain->shm_key, 0), 2);
}

}  // namespace
}  // namespace opjit::tensor

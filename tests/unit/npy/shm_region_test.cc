#include "client/cpp/shm_region.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <regex>
#include <string>

namespace opjit::client {
namespace {

bool ShmExists(const std::string& key) {
  struct stat st;
  return ::stat(("/dev/shm" + key).c_str(), &st) == 0;
}

std::string TestKey() {
  auto key = ShmMapping::RandomKey("opjit-npy-test." + std::to_string(::getpid()));
  EXPECT_TRUE(key.ok()) << key.status();
  return key.ok() ? *key : "";
}

TEST(ShmMappingTest, RandomKeyIsUnguessableHex) {
  auto a = ShmMapping::RandomKey("client");
  auto b = ShmMapping::RandomKey("client");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(std::regex_match(*a, std::regex("/client\\.[0-9a-f]{32}"))) << *a;
  EXPECT_NE(*a, *b);
  EXPECT_EQ(ShmMapping::RandomKey("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmMapping::RandomKey("a/b").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmMappingTest, CreateOpenShareBytesAndCreatorUnlinks) {
  const std::string key = TestKey();
  auto created = ShmMapping::Create(key, 10000);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE((*created)->owns_key());
  EXPECT_EQ((*created)->size(), 10000u);
  struct stat st;
  ASSERT_EQ(::stat(("/dev/shm" + key).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(ShmMapping::Create(key, 10).status().code(), absl::StatusCode::kAlreadyExists);

  {
    auto opened = ShmMapping::Open(key, 10000);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_FALSE((*opened)->owns_key());
    (*created)->data()[9999] = 17;
    EXPECT_EQ((*opened)->data()[9999], 17);
    auto span = (*opened)->As<float>(4, 3);
    ASSERT_TRUE(span.ok()) << span.status();
    (*span)[2] = 1.5f;
    float f;
    std::memcpy(&f, (*created)->data() + 12, sizeof(f));
    EXPECT_EQ(f, 1.5f);
  }
  EXPECT_TRUE(ShmExists(key));  // Open() never unlinks.
  auto small = ShmMapping::Open(key, 10001);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  created->reset();
  EXPECT_FALSE(ShmExists(key));
  EXPECT_EQ(ShmMapping::Open(key, 10).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmMappingTest, AsChecksBoundsAlignmentAndOverflow) {
  auto m = ShmMapping::Create(TestKey(), 64);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->As<uint32_t>(0, 16).ok());
  EXPECT_TRUE((*m)->As<uint32_t>(64, 0).ok());
  EXPECT_EQ((*m)->As<uint32_t>(0, 17).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->As<uint32_t>(4, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->As<uint32_t>(2, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->As<uint8_t>(65, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->As<uint64_t>(8, SIZE_MAX).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->As<uint8_t>(UINT64_MAX, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmMappingTest, RejectsBadKeysAndSizes) {
  for (const std::string& key :
       {std::string("x"), std::string("/a/b"), std::string("/"), std::string("")}) {
    EXPECT_EQ(ShmMapping::Create(key, 10).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ShmMapping::Open(key, 10).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(ShmMapping::Create(TestKey(), 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// An object to register with a daemon of another user grants exactly that
// uid (ServerInfo.daemon_uid) by a POSIX ACL; one for our own uid gets none.
TEST(ShmMappingTest, CreateGrantsTheDaemonUidByAcl) {
  const std::string key = TestKey();
  const uid_t daemon_uid = ::geteuid() == 65000 ? 65001 : 65000;
  auto granted = ShmMapping::Create(key, 4096, daemon_uid);
  if (absl::IsFailedPrecondition(granted.status())) GTEST_SKIP() << "/dev/shm takes no ACLs";
  ASSERT_TRUE(granted.ok()) << granted.status();
  const std::string path = "/dev/shm" + key;
  char acl[64];
  ssize_t n = ::getxattr(path.c_str(), "system.posix_acl_access", acl, sizeof(acl));
  ASSERT_GT(n, 0) << std::strerror(errno);
  // The xattr: {u32 version 2}, then {u16 tag, u16 perm, u32 id} little-endian.
  std::string want;
  auto put = [&want](uint32_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) want.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(2, 4);
  const uint32_t entries[][3] = {{0x01, 6, 0xffffffffu},   // owner rw
                                 {0x02, 6, daemon_uid},    // the daemon rw
                                 {0x04, 0, 0xffffffffu},   // owning group none
                                 {0x10, 6, 0xffffffffu},   // mask rw
                                 {0x20, 0, 0xffffffffu}};  // others none
  for (const auto& e : entries) {
    put(e[0], 2);
    put(e[1], 2);
    put(e[2], 4);
  }
  EXPECT_EQ(std::string(acl, static_cast<size_t>(n)), want);
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, ::geteuid());  // still ours: RegisterRegion checks the owner
  granted->reset();

  auto own = ShmMapping::Create(key, 4096, ::geteuid());
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_LT(::getxattr(path.c_str(), "system.posix_acl_access", acl, sizeof(acl)), 0);
  EXPECT_EQ(errno, ENODATA);
}

}  // namespace
}  // namespace opjit::client

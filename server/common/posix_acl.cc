#include "server/common/posix_acl.h"

#include <sys/xattr.h>

#include <cerrno>
#include <cstdint>
#include <string>

namespace opjit {
namespace {

// The xattr's format: a little-endian header {u32 version = 2}, then entries
// {u16 tag, u16 perm, u32 id}, sorted by tag, then by id.
constexpr uint32_t kAclXattrVersion = 2;
constexpr uint16_t kAclUserObj = 0x01;
constexpr uint16_t kAclUser = 0x02;
constexpr uint16_t kAclGroupObj = 0x04;
constexpr uint16_t kAclMask = 0x10;
constexpr uint16_t kAclOther = 0x20;
constexpr uint16_t kAclReadWrite = 6;
constexpr uint16_t kAclAll = 7;
constexpr uint32_t kAclUndefinedId = 0xffffffffu;

void PutLe(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

}  // namespace

// Owner and `uid` get `perm`, the owning group and others nothing.
static absl::Status GrantUser(int fd, uid_t uid, uint16_t perm) {
  std::string acl;
  PutLe(&acl, kAclXattrVersion, 4);
  auto entry = [&](uint16_t tag, uint16_t perm, uint32_t id) {
    PutLe(&acl, tag, 2);
    PutLe(&acl, perm, 2);
    PutLe(&acl, id, 4);
  };
  entry(kAclUserObj, perm, kAclUndefinedId);
  entry(kAclUser, perm, static_cast<uint32_t>(uid));
  entry(kAclGroupObj, 0, kAclUndefinedId);
  entry(kAclMask, perm, kAclUndefinedId);
  entry(kAclOther, 0, kAclUndefinedId);
  if (::fsetxattr(fd, "system.posix_acl_access", acl.data(), acl.size(), 0) != 0) {
    const int e = errno;
    if (e == EOPNOTSUPP) {
      return absl::FailedPreconditionError("the file system does not support POSIX ACLs");
    }
    return absl::ErrnoToStatus(e, "set a POSIX ACL");
  }
  return absl::OkStatus();
}

absl::Status GrantUserReadWrite(int fd, uid_t uid) { return GrantUser(fd, uid, kAclReadWrite); }

absl::Status GrantUserAll(int fd, uid_t uid) { return GrantUser(fd, uid, kAclAll); }

}  // namespace opjit

// POSIX access ACLs on open files, written as the kernel's
// "system.posix_acl_access" xattr (linux/posix_acl_xattr.h), so neither the
// daemon nor the C++ client needs libacl.
//
// Used for shared memory between two uids: the daemon grants a client's uid
// on regions it creates (server/tensor/region.cc), and a client grants the
// daemon's uid on objects it registers (client/cpp/shm_region.cc); and for
// nvcc's temp directory (GrantUserAll).
#pragma once

#include <sys/types.h>

#include "absl/status/status.h"

namespace opjit {

// Sets the access ACL of the open file `fd` (which this process owns) to:
// owner rw, user `uid` rw, owning group none, mask rw, others none. Replaces
// any ACL the file had; the mode's group bits then show the mask (0660).
// FAILED_PRECONDITION when the file system does not support POSIX ACLs
// (EOPNOTSUPP); other failures as their errno's code. Messages name no file.
absl::Status GrantUserReadWrite(int fd, uid_t uid);

// The same with read, write and execute (search, for a directory): a
// non-root daemon lets a compile uid of its own work in a temp directory
// it owns (server/gpu/nvcc_compiler.cc).
absl::Status GrantUserAll(int fd, uid_t uid);

}  // namespace opjit

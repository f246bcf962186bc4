// A mapped POSIX shared-memory region: the unit of same-host tensor transport.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace opjit::tensor {

// What the daemon knows about one region, as reported to clients.
struct RegionInfo {
  std::string ns;             // Namespace (one per client identity/tenant).
  std::string name;           // Unique within `ns`; what TensorRef::region names.
  std::string owner;          // The client that registered it; leases are per owner.
  std::string shm_key;        // POSIX shm name, "/..." (what shm_open takes).
  uint64_t offset = 0;        // Start of the region within the shm object.
  uint64_t byte_size = 0;     // Usable bytes from `offset`.
  bool daemon_owned = false;  // Created (and unlinked in the end) by the daemon.
  // Wall-clock time (ms since the Unix epoch) at which the region is released
  // unless its owner renews. Kept by RegionManager; 0 in Region::info().
  int64_t lease_expires_unix_ms = 0;
  // The region's number (Region::serial()), how fast-channel calls name it.
  // Kept by RegionManager; 0 in Region::info().
  uint64_t id = 0;
};

// One mmap'd window [offset, offset + byte_size) of a POSIX shm object.
//
// Everything about a Region is fixed at creation: the mapping, the data
// pointer, the size and the info. Only the bytes change (kernels write outputs
// into them), which is why data() hands out a mutable pointer from a const
// Region. RegionManager hands Regions out as std::shared_ptr<const Region>; the
// destructor munmaps, so a mapping outlives every in-flight call holding it.
// For a daemon-created region the destructor also shm_unlinks the key (a no-op
// if RegionManager already did).
//
// Limitation (shared with every shm transport, Triton's included): whoever can
// open the shm object can ftruncate it smaller after it was mapped; touching
// pages past the new end then raises SIGBUS. Only the client that owns the
// region (or has the key) can do that, and only to its own calls.
//
// Thread-safe: immutable after creation.
class Region {
 public:
  // Creates a new shm object `shm_key` with shm_open(O_CREAT | O_EXCL, 0600),
  // sizes it to `byte_size` bytes, reserves its pages (posix_fallocate, so a
  // full /dev/shm shows up here as RESOURCE_EXHAUSTED instead of as SIGBUS on
  // first touch) and maps it read-write. ALREADY_EXISTS if the key is taken;
  // on any failure the object is unlinked again. The region unlinks the key
  // when destroyed. `info` supplies ns/name/owner; its shm_key, offset,
  // byte_size and daemon_owned are overwritten.
  //
  // `client_uid`: the uid of the client that will shm_open the object, where
  // known (SO_PEERCRED). When it differs from the daemon's euid, the object
  // gets a POSIX access ACL granting exactly that uid read-write (see
  // GrantUserReadWrite); the daemon stays the owner, so it can still unlink
  // the key in a sticky /dev/shm. FAILED_PRECONDITION, naming the remedies,
  // when the file system has no ACL support: a region the client cannot open
  // is never handed out.
  static absl::StatusOr<std::unique_ptr<Region>> CreateShm(
      const std::string& shm_key, uint64_t byte_size, RegionInfo info,
      std::optional<uid_t> client_uid = std::nullopt);

  // Maps [offset, offset + byte_size) of the existing shm object `shm_key`
  // read-write. The window must lie within the object (INVALID_ARGUMENT naming
  // the sizes); a missing key gives NOT_FOUND, no permission PERMISSION_DENIED.
  // With `required_uid` set, the object must be owned by that uid
  // (PERMISSION_DENIED otherwise). Never unlinks the key. `info`'s shm_key,
  // offset, byte_size and daemon_owned are overwritten.
  static absl::StatusOr<std::unique_ptr<Region>> MapExisting(
      const std::string& shm_key, uint64_t offset, uint64_t byte_size, RegionInfo info,
      std::optional<uid_t> required_uid = std::nullopt);

  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // First usable byte (the byte at `info().offset` of the shm object).
  uint8_t* data() const { return data_; }
  // Usable bytes from data(); always > 0.
  uint64_t size() const { return info_.byte_size; }
  const RegionInfo& info() const { return info_; }
  const std::string& name() const { return info_.name; }

  // Identity of the underlying shm object (from fstat), so that two regions
  // mapping the same object (the same key registered twice, or a client
  // registering the daemon's key) are recognised as aliases by Overlaps().
  dev_t object_device() const { return dev_; }
  ino_t object_inode() const { return ino_; }

  // An open read-write descriptor of the shm object, for handing the region
  // to an executor process (SCM_RIGHTS), which maps the same window. Owned
  // by the region.
  int fd() const { return fd_; }
  // Unique in this process and never reused: executor processes cache their
  // mappings by it, so a name registered again is never confused with the
  // old region.
  uint64_t serial() const { return serial_; }

 private:
  Region();

  void* map_base_ = nullptr;  // What mmap returned (page-aligned).
  size_t map_length_ = 0;     // What was mapped: delta + byte_size.
  uint8_t* data_ = nullptr;   // map_base_ + (offset % page size).
  RegionInfo info_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  bool unlink_on_destroy_ = false;
  int fd_ = -1;
  uint64_t serial_ = 0;
};

}  // namespace opjit::tensor

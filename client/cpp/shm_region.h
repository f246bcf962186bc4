// Client side of shared-memory tensor transport: map a region the daemon
// created, or create one to register with it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace opjit::client {

// A read-write mapping of a whole POSIX shm object.
//
// Create() makes a new object (and the destructor unlinks it again); Open()
// maps an existing one, such as a region the daemon created
// (RegionInfo::shm_key and byte_size). The destructor munmaps.
//
// Not thread-safe for the bytes (callers coordinate who writes where); the
// accessors are const and safe to call from several threads.
class ShmMapping {
 public:
  // Creates the shm object `key` ("/name": one leading '/', no other) with
  // mode 0600 and `bytes` bytes (> 0), reserves its pages so a full /dev/shm
  // fails here (RESOURCE_EXHAUSTED) rather than as SIGBUS later, and maps it.
  // ALREADY_EXISTS if the key is taken. The mapping unlinks the key when
  // destroyed.
  //
  // `grant_uid`: for an object to be registered (RegisterRegion) with a
  // daemon that runs as another user, pass the daemon's uid
  // (ServerInfo.daemon_uid): unless it is this process's euid, the object
  // gets a POSIX ACL entry giving exactly that uid read-write (this process
  // stays the owner, as RegisterRegion requires). FAILED_PRECONDITION when
  // /dev/shm does not support ACLs.
  static absl::StatusOr<std::unique_ptr<ShmMapping>> Create(
      const std::string& key, uint64_t bytes, std::optional<uid_t> grant_uid = std::nullopt);

  // Maps the first `bytes` bytes (> 0) of the existing shm object `key`.
  // NOT_FOUND if it does not exist, INVALID_ARGUMENT if it is smaller than
  // `bytes`. Never unlinks the key.
  static absl::StatusOr<std::unique_ptr<ShmMapping>> Open(const std::string& key, uint64_t bytes);

  // A key "/<prefix>.<32 random hex>" for Create(), from 128 bits of the
  // kernel's CSPRNG. `prefix` must match [A-Za-z0-9_.-]{1,64}.
  static absl::StatusOr<std::string> RandomKey(const std::string& prefix);

  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& key() const { return key_; }
  // True if this mapping created the object (and will unlink it).
  bool owns_key() const { return owns_key_; }

  // `count` elements of T starting `offset` bytes into the mapping.
  // INVALID_ARGUMENT, naming the numbers, unless the whole range fits (checked
  // without overflow) and offset is a multiple of alignof(T).
  template <class T>
  absl::StatusOr<std::span<T>> As(uint64_t offset, size_t count) const {
    static_assert(std::is_trivially_copyable_v<T>, "shm holds plain bytes");
    if (offset % alignof(T) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offset ", offset, " is not a multiple of the element's ", alignof(T), " bytes"));
    }
    if (offset > size_ || count > (size_ - offset) / sizeof(T)) {
      return absl::InvalidArgumentError(absl::StrCat(count, " elements of ", sizeof(T),
                                                     " bytes at offset ", offset, " do not fit in ",
                                                     key_, " (", size_, " bytes)"));
    }
    return std::span<T>(reinterpret_cast<T*>(data_ + offset), count);
  }

 private:
  ShmMapping(std::string key, uint8_t* data, uint64_t size, bool owns_key)
      : key_(std::move(key)), data_(data), size_(size), owns_key_(owns_key) {}

  const std::string key_;
  uint8_t* const data_;
  const uint64_t size_;
  const bool owns_key_;
};

}  // namespace opjit::client

// Helpers shared by the tensor unit tests.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace opjit::tensor::testing {

// An instance tag no other test process uses at the same time.
inline std::string UniqueTag() {
  static std::atomic<int> counter{0};
  return "t" + std::to_string(::getpid()) + "x" + std::to_string(counter++);
}

// True if /dev/shm holds `key` ("/name").
inline bool ShmExists(const std::string& key) {
  struct stat st;
  return ::stat(("/dev/shm" + key).c_str(), &st) == 0;
}

// A shm object made the way a client would, unlinked when the test ends.
class ClientShm {
 public:
  ClientShm(const std::string& key, uint64_t bytes) : key_(key), bytes_(bytes) {
    ::shm_unlink(key.c_str());
    int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return;
    if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) data_ = static_cast<uint8_t*>(p);
    }
    ::close(fd);
  }
  ~ClientShm() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    ::shm_unlink(key_.c_str());
  }
  ClientShm(const ClientShm&) = delete;
  ClientShm& operator=(const ClientShm&) = delete;

  bool ok() const { return data_ != nullptr; }
  uint8_t* data() const { return data_; }
  const std::string& key() const { return key_; }

 private:
  std::string key_;
  uint64_t bytes_;
  uint8_t* data_ = nullptr;
};

// Maps `key` independently of the code under test; nullptr on failure.
inline uint8_t* MapKey(const std::string& key, uint64_t bytes) {
  int fd = ::shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

}  // namespace opjit::tensor::testing

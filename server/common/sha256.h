// SHA-256 digests (OpenSSL), as lowercase hex.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace opjit {

// Digest of `data` as 64 lowercase hex characters.
std::string Sha256Hex(std::string_view data);

// Incremental digest. Feed parts with Update(), then HexDigest() once.
// Fields are length-prefixed by UpdateField() so that ("ab","c") and
// ("a","bc") hash differently. Not thread-safe.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(std::string_view data);
  // Hashes the 8-byte length of `data`, then `data`.
  void UpdateField(std::string_view data);
  std::string HexDigest();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace opjit

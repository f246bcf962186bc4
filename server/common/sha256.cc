#include "server/common/sha256.h"

#include <openssl/evp.h>

#include <cstdint>
#include <cstdlib>

namespace opjit {

struct Sha256::Impl {
  EVP_MD_CTX* ctx = nullptr;
};

Sha256::Sha256() : impl_(std::make_unique<Impl>()) {
  impl_->ctx = EVP_MD_CTX_new();
  // Allocation failure here is not recoverable; a null ctx would be UB below.
  if (impl_->ctx == nullptr || EVP_DigestInit_ex(impl_->ctx, EVP_sha256(), nullptr) != 1) abort();
}

Sha256::~Sha256() { EVP_MD_CTX_free(impl_->ctx); }

void Sha256::Update(std::string_view data) {
  EVP_DigestUpdate(impl_->ctx, data.data(), data.size());
}

void Sha256::UpdateField(std::string_view data) {
  uint64_t n = data.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  EVP_DigestUpdate(impl_->ctx, len, sizeof(len));
  EVP_DigestUpdate(impl_->ctx, data.data(), data.size());
}

std::string Sha256::HexDigest() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(impl_->ctx, md, &len);
  static const char kHex[] = "0123456789abcdef";
  std::string out(2 * len, '0');
  for (unsigned int i = 0; i < len; ++i) {
    out[2 * i] = kHex[md[i] >> 4];
    out[2 * i + 1] = kHex[md[i] & 15];
  }
  return out;
}

std::string Sha256Hex(std::string_view data) {
  Sha256 h;
  h.Update(data);
  return h.HexDigest();
}

}  // namespace opjit

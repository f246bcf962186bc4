#include "server/gpu/cubin.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace opjit::gpu {
namespace {

// The SM field moved between toolkits. Observed with CUDA 13.0 (nvcc -cubin
// and NVRTC, sm_75 ... sm_120, 2025): EI_OSABI = 0x41, EI_ABIVERSION = 8 and
//   sm_75 0x06004b04, sm_80 0x06005004, sm_86 0x06005604, sm_89 0x06005904,
//   sm_90 0x06005a04, sm_100 0x06006402, sm_120 0x06007802,
// so the SM is bits 8..15. Toolkits up to CUDA 12 wrote EI_OSABI = 0x33 and
// EI_ABIVERSION = 7 with the SM in bits 0..7 (and the virtual arch of the
// embedded PTX in bits 16..23), e.g. 0x00500550 for sm_80. Note that sm_90a
// and sm_90 carry the same SM byte: the arch-specific suffix is not checked.
constexpr uint8_t kNewCudaAbiVersion = 8;

template <typename T>
T Load(std::string_view bytes, size_t offset) {
  T v;
  std::memcpy(&v, bytes.data() + offset, sizeof(T));
  return v;  // little-endian host and image (checked by the caller)
}

}  // namespace

absl::StatusOr<CubinInfo> InspectCubin(std::string_view elf) {
  constexpr size_t kEhdrSize = 64;  // sizeof(Elf64_Ehdr)
  if (elf.size() < kEhdrSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a cubin: ", elf.size(), " bytes is shorter than an ELF64 header"));
  }
  if (std::memcmp(elf.data(),
                  "\x7f"
                  "ELF",
                  4) != 0) {
    return absl::InvalidArgumentError("not a cubin: no ELF magic");
  }
  if (elf[4] != 2 /* ELFCLASS64 */) {
    return absl::InvalidArgumentError("not a cubin: not an ELF64 image");
  }
  if (elf[5] != 1 /* ELFDATA2LSB */) {
    return absl::InvalidArgumentError("not a cubin: not little-endian");
  }
  const uint16_t machine = Load<uint16_t>(elf, 18);
  if (machine != kEmCuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a cubin: e_machine is ", machine, ", expected ", kEmCuda, " (EM_CUDA)"));
  }
  CubinInfo info;
  info.os_abi = static_cast<uint8_t>(elf[7]);
  info.abi_version = static_cast<uint8_t>(elf[8]);
  info.e_flags = Load<uint32_t>(elf, 48);
  info.sm = info.abi_version >= kNewCudaAbiVersion ? static_cast<int>((info.e_flags >> 8) & 0xff)
                                                   : static_cast<int>(info.e_flags & 0xff);
  return info;
}

absl::Status CheckCubin(std::string_view elf, int sm) {
  absl::StatusOr<CubinInfo> info = InspectCubin(elf);
  if (!info.ok()) return info.status();
  if (info->sm != sm) {
    return absl::InvalidArgumentError(absl::StrCat("cubin is for sm_", info->sm, ", expected sm_",
                                                   sm, " (e_flags 0x", absl::Hex(info->e_flags),
                                                   ", ELF ABI version ", info->abi_version, ")"));
  }
  return absl::OkStatus();
}

}  // namespace opjit::gpu

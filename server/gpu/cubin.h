// Checks that a byte string is a CUBIN (an NVIDIA GPU ELF image) for a given
// SM version, without the CUDA driver. Used by tests and by the daemon to
// validate cached cubins before handing them to cuModuleLoadData.
//
// How the SM version is encoded (derived from the cubins that CUDA 13.0's
// NVRTC and nvcc write, see the comment in cubin.cc):
//   EI_OSABI 0x41, EI_ABIVERSION >= 8 (CUDA 13):  SM = (e_flags >> 8) & 0xff
//                                                 e.g. sm_90 -> 0x06005a04
//   EI_OSABI 0x33, EI_ABIVERSION <= 7 (older):    SM = e_flags & 0xff
//                                                 e.g. sm_80 -> 0x00500550
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace opjit::gpu {

// ELF e_machine of NVIDIA GPU code.
inline constexpr uint16_t kEmCuda = 190;

struct CubinInfo {
  int sm = 0;               // e.g. 90 for sm_90
  uint8_t os_abi = 0;       // EI_OSABI
  uint8_t abi_version = 0;  // EI_ABIVERSION
  uint32_t e_flags = 0;
};

// Parses the ELF header of `elf`. INVALID_ARGUMENT when it is not a
// little-endian ELF64 image with e_machine EM_CUDA (190), or is truncated.
absl::StatusOr<CubinInfo> InspectCubin(std::string_view elf);

// OK when `elf` is a CUBIN for exactly `sm` (90 for sm_90); otherwise
// INVALID_ARGUMENT saying what was found.
absl::Status CheckCubin(std::string_view elf, int sm);

}  // namespace opjit::gpu

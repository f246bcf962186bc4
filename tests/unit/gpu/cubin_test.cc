#include "server/gpu/cubin.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace opjit::gpu {
namespace {

// A 64-byte ELF64 header with the given fields.
std::string Header(uint16_t machine, uint8_t os_abi, uint8_t abi_version, uint32_t flags) {
  std::string h(64, '\0');
  std::memcpy(h.data(),
              "\x7f"
              "ELF",
              4);
  h[4] = 2;  // ELFCLASS64
  h[5] = 1;  // little-endian
  h[6] = 1;  // EV_CURRENT
  h[7] = static_cast<char>(os_abi);
  h[8] = static_cast<char>(abi_version);
  std::memcpy(h.data() + 18, &machine, 2);
  std::memcpy(h.data() + 48, &flags, 4);
  return h;
}

TEST(CubinTest, Cuda13Layout) {
  // As written by CUDA 13.0 for sm_90 and sm_120.
  EXPECT_TRUE(CheckCubin(Header(190, 0x41, 8, 0x06005a04), 90).ok());
  EXPECT_TRUE(CheckCubin(Header(190, 0x41, 8, 0x06007802), 120).ok());
  absl::Status s = CheckCubin(Header(190, 0x41, 8, 0x06005004), 90);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("sm_80"), std::string::npos) << s;
}

TEST(CubinTest, LegacyLayout) {
  // CUDA <= 12: SM in the low byte, PTX arch in bits 16..23.
  EXPECT_TRUE(CheckCubin(Header(190, 0x33, 7, 0x00500550), 80).ok());
  EXPECT_TRUE(CheckCubin(Header(190, 0x33, 7, 0x005a055a), 90).ok());
  EXPECT_FALSE(CheckCubin(Header(190, 0x33, 7, 0x00500550), 90).ok());
}

TEST(CubinTest, RejectsNonCubins) {
  EXPECT_EQ(CheckCubin("", 90).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCubin(std::string(10, 'x'), 90).code(), absl::StatusCode::kInvalidArgument);
  std::string h = Header(190, 0x41, 8, 0x06005a04);
  h[0] = 'X';
  EXPECT_NE(std::string(CheckCubin(h, 90).message()).find("magic"), std::string::npos);
  // x86-64 (62) is an ELF, but no cubin.
  absl::Status s = CheckCubin(Header(62, 0, 0, 0), 90);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("e_machine is 62"), std::string::npos) << s;
  h = Header(190, 0x41, 8, 0x06005a04);
  h[4] = 1;  // ELFCLASS32
  EXPECT_FALSE(CheckCubin(h, 90).ok());
  h = Header(190, 0x41, 8, 0x06005a04);
  h[5] = 2;  // big-endian
  EXPECT_FALSE(CheckCubin(h, 90).ok());
  EXPECT_FALSE(CheckCubin(Header(190, 0x41, 8, 0x06005a04).substr(0, 40), 90).ok());
}

TEST(CubinTest, InspectReportsFields) {
  absl::StatusOr<CubinInfo> info = InspectCubin(Header(190, 0x41, 8, 0x06005604));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->sm, 86);
  EXPECT_EQ(info->os_abi, 0x41);
  EXPECT_EQ(info->abi_version, 8);
  EXPECT_EQ(info->e_flags, 0x06005604u);
}

}  // namespace
}  // namespace opjit::gpu

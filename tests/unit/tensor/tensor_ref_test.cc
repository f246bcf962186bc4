#include "server/tensor/tensor_ref.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "server/tensor/region_manager.h"
#include "tests/unit/tensor/test_util.h"

namespace opjit::tensor {
namespace {

using testing::ClientShm;
using testing::UniqueTag;

TEST(ByteSizeTest, DtypeSizes) {
  const std::vector<std::pair<std::string, uint64_t>> kSizes = {
      {"float16", 2}, {"float32", 4}, {"float64", 8}, {"int8", 1},   {"int16", 2},  {"int32", 4},
      {"int64", 8},   {"uint8", 1},   {"uint16", 2},  {"uint32", 4}, {"uint64", 8}, {"bool", 1}};
  for (const auto& [dtype, size] : kSizes) {
    auto scalar = ByteSize(dtype, {});
    ASSERT_TRUE(scalar.ok()) << dtype;
    EXPECT_EQ(*scalar, size) << dtype;
    EXPECT_EQ(*ByteSize(dtype, {2, 3, 4}), 24 * size) << dtype;
    EXPECT_EQ(*ByteSize(dtype, {0}), 0u) << dtype;
  }
}

TEST(ByteSizeTest, RefusesBadDtypesShapesAndOverflow) {
  auto unknown = ByteSize("float128", {1});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(),
            "unknown dtype 'float128'; known dtypes: bool, float16, float32, float64, int16, "
            "int32, int64, int8, uint16, uint32, uint64, uint8");
  auto negative = ByteSize("float32", {2, -1});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(negative.status().message(), "dimension 1 of shape [2, -1] is negative");
  const int64_t kBig = int64_t{1} << 62;
  auto overflow = ByteSize("float32", {kBig});
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overflow.status().message().find("too large"), std::string::npos) << overflow.status();
  EXPECT_EQ(ByteSize("float32", {kBig, kBig, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ByteSize("uint8", {int64_t{1} << 32, int64_t{1} << 32}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A zero dimension makes the tensor empty whatever the others say.
  EXPECT_EQ(*ByteSize("float32", {kBig, kBig, 0}), 0u);
  EXPECT_EQ(*ByteSize("uint8", {(int64_t{1} << 62) - 1, 2}), (uint64_t{1} << 63) - 2);
}

class ResolveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tag_ = UniqueTag();
    RegionManagerOptions options;
    options.instance_tag = tag_;
    auto manager = RegionManager::Create(options);
    ASSERT_TRUE(manager.ok()) << manager.status();
    manager_ = std::move(*manager);
    ASSERT_TRUE(manager_->CreateRegion("ns", "o", "buf", 1024, 0).ok());
    auto region = manager_->Acquire("ns", "buf");
    ASSERT_TRUE(region.ok());
    region_ = *region;
  }

  absl::StatusOr<TensorView> Resolve1(uint64_t offset, const std::string& dtype,
                                      std::vector<int64_t> shape) {
    return Resolve(
        region_,
        TensorRef{.region = "buf", .offset = offset, .dtype = dtype, .shape = std::move(shape)},
        "inputs[1]");
  }

  std::string tag_;
  std::unique_ptr<RegionManager> manager_;
  std::shared_ptr<const Region> region_;
};

TEST_F(ResolveTest, ResolvesInBoundsTensors) {
  auto view = Resolve1(16, "float32", {2, 3});
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->data, region_->data() + 16);
  EXPECT_EQ(view->nbytes, 24u);
  EXPECT_EQ(view->dtype, "float32");
  EXPECT_EQ(view->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(view->keep_alive, region_);
  // The whole region, exactly.
  EXPECT_TRUE(Resolve1(0, "float64", {128}).ok());
  EXPECT_TRUE(Resolve1(1016, "int64", {}).ok());
  // An empty tensor at the very end.
  EXPECT_TRUE(Resolve1(1024, "float32", {0}).ok());
  // ref.region may be left empty by callers that looked the region up.
  EXPECT_TRUE(Resolve(region_, TensorRef{.dtype = "uint8", .shape = {3}}, "x").ok());
}

TEST_F(ResolveTest, RefusesOutOfBoundsMisalignedAndMalformed) {
  auto misaligned = Resolve1(3, "float32", {1});
  EXPECT_EQ(misaligned.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(misaligned.status().message(),
            "inputs[1]: offset 3 is not a multiple of float32's 4 bytes");

  auto past_end = Resolve1(1028, "uint8", {0});
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(past_end.status().message(),
            "inputs[1]: offset 1028 is past the end of region 'buf' (1024 bytes)");

  auto too_big = Resolve1(1000, "float32", {2, 4});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(too_big.status().message(),
            "inputs[1]: float32 [2, 4] needs 32 bytes at offset 1000, but region 'buf' has only "
            "24 bytes from there (1024 in all)");

  // offset + nbytes would wrap around 2^64 if computed naively.
  auto wrap = Resolve1(1024, "uint8", {int64_t{1} << 62, 4});
  EXPECT_EQ(wrap.status().code(), absl::StatusCode::kInvalidArgument);
  auto wrap2 = Resolve1(UINT64_MAX - 3, "uint8", {8});
  EXPECT_EQ(wrap2.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrap2.status().message().find("past the end"), std::string::npos);

  auto huge = Resolve1(0, "float32", {int64_t{1} << 62});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(huge.status().message().substr(0, 11), "inputs[1]: ");
  EXPECT_NE(huge.status().message().find("too large"), std::string::npos) << huge.status();

  auto negative = Resolve1(0, "float32", {-1});
  EXPECT_EQ(negative.status().message(), "inputs[1]: dimension 0 of shape [-1] is negative");

  auto dtype = Resolve1(0, "complex64", {1});
  EXPECT_EQ(dtype.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dtype.status().message().find("inputs[1]: unknown dtype 'complex64'; known dtypes:"),
            std::string::npos);

  auto rank = Resolve1(0, "uint8", std::vector<int64_t>(17, 1));
  EXPECT_EQ(rank.status().message(), "inputs[1]: rank 17 is over the maximum of 16");
  EXPECT_TRUE(Resolve1(0, "uint8", std::vector<int64_t>(16, 1)).ok());

  auto wrong =
      Resolve(region_, TensorRef{.region = "other", .dtype = "uint8", .shape = {1}}, "outputs[0]");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Resolve(nullptr, TensorRef{.dtype = "uint8"}, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ResolveTest, RegionRegisteredAtAnOddOffsetIsAlignmentChecked) {
  ClientShm shm("/opjit-test." + tag_ + ".odd", 8192);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(manager_->RegisterRegion("ns", "o", "odd", shm.key(), 4097, 100, 0).ok());
  auto odd = manager_->Acquire("ns", "odd");
  ASSERT_TRUE(odd.ok());
  auto f = Resolve(*odd, TensorRef{.region = "odd", .offset = 0, .dtype = "float32", .shape = {1}},
                   "inputs[0]");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("region 'odd' starts at byte 4097"), std::string::npos)
      << f.status();
  auto u = Resolve(*odd, TensorRef{.region = "odd", .offset = 3, .dtype = "uint8", .shape = {97}},
                   "inputs[0]");
  ASSERT_TRUE(u.ok()) << u.status();
  shm.data()[4097 + 3] = 77;
  EXPECT_EQ(static_cast<uint8_t*>(u->data)[0], 77);
}

TEST_F(ResolveTest, OverlapsSeesRangesAndAliasedMappings) {
  auto a = Resolve1(0, "float32", {4});   // [0, 16)
  auto b = Resolve1(12, "float32", {4});  // [12, 28)
  auto c = Resolve1(16, "float32", {4});  // [16, 32)
  auto e = Resolve1(8, "float32", {0});   // Empty.
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && e.ok());
  EXPECT_TRUE(Overlaps(*a, *b));
  EXPECT_TRUE(Overlaps(*b, *a));
  EXPECT_TRUE(Overlaps(*a, *a));
  EXPECT_FALSE(Overlaps(*a, *c));
  EXPECT_TRUE(Overlaps(*b, *c));
  EXPECT_FALSE(Overlaps(*a, *e));

  ASSERT_TRUE(manager_->CreateRegion("ns", "o", "buf2", 1024, 0).ok());
  auto other = Resolve(*manager_->Acquire("ns", "buf2"),
                       TensorRef{.region = "buf2", .dtype = "float32", .shape = {4}}, "x");
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(Overlaps(*a, *other));

  // The same client object registered twice, as two windows: distinct
  // mappings, one memory.
  ClientShm shm("/opjit-test." + tag_ + ".alias", 16384);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(manager_->RegisterRegion("ns", "o", "w1", shm.key(), 0, 8192, 0).ok());
  ASSERT_TRUE(manager_->RegisterRegion("ns", "o", "w2", shm.key(), 4096, 8192, 0).ok());
  auto w1 = *manager_->Acquire("ns", "w1");
  auto w2 = *manager_->Acquire("ns", "w2");
  auto x = Resolve(w1, TensorRef{.offset = 4096, .dtype = "uint8", .shape = {16}}, "x");
  auto y = Resolve(w2, TensorRef{.offset = 8, .dtype = "uint8", .shape = {16}}, "y");
  auto z = Resolve(w2, TensorRef{.offset = 16, .dtype = "uint8", .shape = {16}}, "z");
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  EXPECT_TRUE(Overlaps(*x, *y));   // Object bytes [4096, 4112) and [4104, 4120).
  EXPECT_FALSE(Overlaps(*x, *z));  // [4096, 4112) and [4112, 4128).
  // And the daemon's own object registered by key under a second name.
  auto buf_info = manager_->List("ns")[0];
  ASSERT_EQ(buf_info.name, "buf");
  ASSERT_TRUE(manager_->RegisterRegion("ns", "o", "buf-alias", buf_info.shm_key, 0, 1024, 0).ok());
  auto alias = Resolve(*manager_->Acquire("ns", "buf-alias"),
                       TensorRef{.offset = 8, .dtype = "float32", .shape = {1}}, "x");
  ASSERT_TRUE(alias.ok());
  EXPECT_NE(alias->data, static_cast<uint8_t*>(a->data) + 8);
  EXPECT_TRUE(Overlaps(*a, *alias));
  EXPECT_FALSE(Overlaps(*c, *alias));
}

}  // namespace
}  // namespace opjit::tensor

// Tensors inside shared-memory regions: references from clients, and the
// checked views that kernels get.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/tensor/region.h"

namespace opjit::tensor {

// Most dimensions a tensor may have.
inline constexpr size_t kMaxRank = 16;

// A tensor as a client names it: `shape` elements of `dtype`, C order,
// starting `offset` bytes into region `region`. Unchecked.
struct TensorRef {
  std::string region;
  uint64_t offset = 0;
  std::string dtype;
  std::vector<int64_t> shape;
};

// A tensor checked against its region: data .. data + nbytes lies inside the
// mapping, and data is aligned to the element size. `keep_alive` holds the
// mapping; keep the view (or a copy of keep_alive) for as long as data is used.
struct TensorView {
  void* data = nullptr;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  std::shared_ptr<const Region> keep_alive;
};

// Bytes per element of `dtype` (float16, float32, float64, int8, int16,
// int32, int64, uint8, uint16, uint32, uint64, bool); INVALID_ARGUMENT listing
// the known dtypes otherwise.
absl::StatusOr<uint64_t> DtypeSize(const std::string& dtype);

// Bytes of a C-order tensor of `dtype` and `shape` (a scalar for shape ()).
// INVALID_ARGUMENT for an unknown dtype, a negative dimension, or a size that
// would exceed 2^63 - 1 bytes (so kernels indexing with int64 never wrap).
// A zero dimension gives 0 whatever the others are.
absl::StatusOr<uint64_t> ByteSize(const std::string& dtype, const std::vector<int64_t>& shape);

// Checks `ref` against `region` and returns the view of its bytes. Everything
// is checked before any pointer is formed: a non-null region, ref.region
// naming it (when set), rank <= kMaxRank, the dtype and shape (as ByteSize),
// offset <= region size, nbytes <= size - offset, and the element alignment of
// the start address (offset, and the region's own start in its shm object).
// All failures are INVALID_ARGUMENT with messages that begin with `what`
// (e.g. "inputs[1]") and give the region and the numbers.
absl::StatusOr<TensorView> Resolve(std::shared_ptr<const Region> region, const TensorRef& ref,
                                   const std::string& what);

// True if the two views share at least one byte: their address ranges
// intersect, or they lie in the same shm object (even through two different
// mappings or regions) at intersecting object offsets. Empty views overlap
// nothing. The executor refuses outputs that overlap inputs or each other.
bool Overlaps(const TensorView& a, const TensorView& b);

}  // namespace opjit::tensor

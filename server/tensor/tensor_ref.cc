#include "server/tensor/tensor_ref.h"

#include <array>
#include <cstdint>
#include <limits>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "server/common/error_info.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/status_macros.h"

namespace opjit::tensor {
namespace {

struct DtypeEntry {
  std::string_view name;
  uint64_t size;
};
// Sorted by name, so the error message lists them in order.
constexpr std::array<DtypeEntry, 12> kDtypes = {{
    {"bool", 1},
    {"float16", 2},
    {"float32", 4},
    {"float64", 8},
    {"int16", 2},
    {"int32", 4},
    {"int64", 8},
    {"int8", 1},
    {"uint16", 2},
    {"uint32", 4},
    {"uint64", 8},
    {"uint8", 1},
}};

std::string Clip(std::string_view s) {
  return s.size() <= 64 ? std::string(s) : std::string(s.substr(0, 64)) + "...";
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  if (shape.size() > kMaxRank * 2) {
    return absl::StrCat("[", absl::StrJoin(shape.begin(), shape.begin() + kMaxRank, ", "),
                        ", ... (", shape.size(), " dims)]");
  }
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// [begin, end) as (shm object id, object offsets) when the view's region is
// known.
struct ObjectRange {
  bool known = false;
  dev_t dev = 0;
  ino_t ino = 0;
  uint64_t begin = 0, end = 0;
};

ObjectRange ObjectRangeOf(const TensorView& v) {
  ObjectRange r;
  const Region* region = v.keep_alive.get();
  if (region == nullptr) return r;
  auto data = reinterpret_cast<uintptr_t>(v.data);
  auto base = reinterpret_cast<uintptr_t>(region->data());
  if (data < base || data - base > region->size() || v.nbytes > region->size() - (data - base)) {
    return r;  // Not a view Resolve made; fall back to addresses only.
  }
  r.known = true;
  r.dev = region->object_device();
  r.ino = region->object_inode();
  r.begin = region->info().offset + (data - base);
  r.end = r.begin + v.nbytes;
  return r;
}

}  // namespace

absl::StatusOr<uint64_t> DtypeSize(const std::string& dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.name == dtype) return e.size;
  }
  std::vector<std::string> names;
  names.reserve(kDtypes.size());
  for (const DtypeEntry& e : kDtypes) names.emplace_back(e.name);
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", Clip(dtype),
                                                 "'; known dtypes: ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<uint64_t> ByteSize(const std::string& dtype, const std::vector<int64_t>& shape) {
  OPJIT_ASSIGN_OR_RETURN(uint64_t elem, DtypeSize(dtype));
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("dimension ", i, " of shape ", ShapeString(shape), " is negative"));
    }
    empty = empty || shape[i] == 0;
  }
  if (empty) return 0;
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t bytes = elem;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes) || bytes > kMax) {
      return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " of ", dtype,
                                                     " is too large: over 2^63 - 1 bytes"));
    }
  }
  return bytes;
}

absl::StatusOr<TensorView> Resolve(std::shared_ptr<const Region> region, const TensorRef& ref,
                                   const std::string& what) {
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no region"));
  }
  const std::string& name = region->name();
  if (!ref.region.empty() && ref.region != name) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": refers to region '", Clip(ref.region),
                                                   "' but was resolved against region '", name,
                                                   "'"));
  }
  if (ref.shape.size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", ref.shape.size(), " is over the maximum of ", kMaxRank));
  }
  absl::StatusOr<uint64_t> elem = DtypeSize(ref.dtype);
  if (!elem.ok())
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", elem.status().message()));
  absl::StatusOr<uint64_t> nbytes = ByteSize(ref.dtype, ref.shape);
  if (!nbytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", nbytes.status().message()));
  }
  const uint64_t size = region->size();
  if (ref.offset > size) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", ref.offset,
                                                   " is past the end of region '", name, "' (",
                                                   size, " bytes)"));
  }
  if (*nbytes > size - ref.offset) {
    return WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            what, ": ", ref.dtype, " ", ShapeString(ref.shape), " needs ", *nbytes,
            " bytes at offset ", ref.offset, ", but region '", name, "' has only ",
            size - ref.offset, " bytes from there (", size, " in all)")),
        reason::kRegionTooSmall, {{"tensor", std::string(what)}, {"needed", absl::StrCat(*nbytes)}});
  }
  if (ref.offset % *elem != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", ref.offset,
                                                   " is not a multiple of ", ref.dtype, "'s ",
                                                   *elem, " bytes"));
  }
  // The region's start is page-aligned within its mapping, plus the client's
  // registration offset; that offset may itself misalign the data.
  const uint64_t region_misalign = reinterpret_cast<uintptr_t>(region->data()) % *elem;
  if (region_misalign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": region '", name, "' starts at byte ", region->info().offset,
                     " of its shared memory object, which is not a multiple of ", ref.dtype, "'s ",
                     *elem, " bytes; register the region at an aligned offset"));
  }
  TensorView view;
  view.data = region->data() + ref.offset;  // In bounds: checked above.
  view.dtype = ref.dtype;
  view.shape = ref.shape;
  view.nbytes = *nbytes;
  view.keep_alive = std::move(region);
  return view;
}

bool Overlaps(const TensorView& a, const TensorView& b) {
  if (a.nbytes == 0 || b.nbytes == 0 || a.data == nullptr || b.data == nullptr) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data);
  auto b0 = reinterpret_cast<uintptr_t>(b.data);
  if (a0 < b0 + b.nbytes && b0 < a0 + a.nbytes) return true;
  ObjectRange ra = ObjectRangeOf(a);
  ObjectRange rb = ObjectRangeOf(b);
  return ra.known && rb.known && ra.dev == rb.dev && ra.ino == rb.ino && ra.begin < rb.end &&
         rb.begin < ra.end;
}

}  // namespace opjit::tensor

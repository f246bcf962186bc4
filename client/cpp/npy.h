// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0),
// for the client and CLI to move tensors in and out of opjit.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace opjit::client {

// A dense C-order array.
struct NpyArray {
  // opjit dtype name: float16, float32, float64, int8, int16, int32, int64,
  // uint8, uint16, uint32, uint64 or bool.
  std::string dtype;
  // Dimensions; {} is a scalar (one element).
  std::vector<int64_t> shape;
  // Raw little-endian element bytes, C order; exactly
  // product(shape) * dtype size bytes.
  std::string data;
};

// Bytes per element of an opjit dtype; INVALID_ARGUMENT listing the known
// dtypes otherwise.
absl::StatusOr<uint64_t> NpyDtypeSize(std::string_view dtype);

// OK if `array` has a known dtype, non-negative dimensions (at most 64 of
// them), and data of exactly the size the dtype and shape call for;
// INVALID_ARGUMENT saying what is wrong otherwise.
absl::Status ValidateNpyArray(const NpyArray& array);

// Parses the contents of a .npy file. Accepts little-endian ('<'), native
// ('=', this being a little-endian host) and byte-order-free ('|') numeric and
// bool arrays in C order. Everything else is INVALID_ARGUMENT with a reason a
// user can act on: big-endian data, Fortran order, object/string/unicode/
// complex/datetime/structured dtypes, bad magic or version, a malformed
// header, truncated data, trailing bytes.
absl::StatusOr<NpyArray> ParseNpy(std::string_view bytes);

// Reads and parses the .npy file at `path`. Errors from opening or reading the
// file carry the OS error's code (NOT_FOUND, PERMISSION_DENIED, ...) and the
// path; parse errors are INVALID_ARGUMENT naming the path.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// The .npy encoding of `array`: format 1.0 (2.0 if the header exceeds 65535
// bytes), header padded so the data starts at a multiple of 64 bytes, as
// NumPy writes it. Returns "" if ValidateNpyArray(array) fails.
std::string SerializeNpy(const NpyArray& array);

// Writes SerializeNpy(array) to `path` atomically (a temporary file in the
// same directory, then rename). INVALID_ARGUMENT for an invalid array; OS
// errors carry their code and the path.
absl::Status WriteNpy(const std::string& path, const NpyArray& array);

}  // namespace opjit::client

// Placement: turns a checked call's tensor references into locations a
// kernel runner can use. Every shm reference is checked against its
// region's bounds, alignment and the other tensors of the call before any
// location exists; inline outputs get buffers in the result. A null input
// (TensorArg::Null) has no data to check: its location is null too.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "server/exec/checks.h"
#include "server/runner/kernel_runner.h"

namespace opjit::tensor {
class RegionManager;
}

namespace opjit::exec {

// The tensors of one call, placed. Output locations InMemory point into
// `result.outputs[j]`'s inline bytes: keep a Placed where it is (do not move
// it) until the kernel ran.
struct Placed {
  absl::InlinedVector<runner::TensorLoc, 4> inputs;
  absl::InlinedVector<runner::TensorLoc, 4> outputs;
  ForwardResult result;
  Placed() = default;
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;
};

// Places `call` (checked as `c`, with output descriptors `out_descs`).
// Errors: NOT_FOUND for an unknown region; INVALID_ARGUMENT for bounds,
// alignment, overlaps, inline sizes and placement counts;
// RESOURCE_EXHAUSTED when inline outputs exceed `max_inline_output_bytes`.
absl::Status Place(const ForwardCall& call, const Checked& c,
                   const std::vector<TensorDesc>& out_descs, tensor::RegionManager* regions,
                   uint64_t max_inline_output_bytes, Placed* placed);

}  // namespace opjit::exec

#include "server/exec/placement.h"

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/tensor/region.h"
#include "server/tensor/region_manager.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::exec {
namespace {

uint64_t Align64(uint64_t x) { return (x + 63) & ~uint64_t{63}; }

}  // namespace

absl::Status Place(const ForwardCall& call, const Checked& c,
                   const std::vector<TensorDesc>& out_descs, tensor::RegionManager* regions,
                   uint64_t max_inline_output_bytes, Placed* placed) {
  const registry::OpDef& def = c.record->def;
  // Views only for the overlap checks; the locations keep the regions.
  absl::InlinedVector<tensor::TensorView, 4> in_views;
  for (size_t i = 0; i < call.inputs.size(); ++i) {
    for (size_t k = 0; k < call.inputs[i].size(); ++k) {
      const TensorArg& arg = call.inputs[i][k];
      // Named only for messages; not built on the hot path.
      auto what = [&] {
        return absl::StrCat("inputs[", i, "]",
                            call.inputs[i].size() > 1 ? absl::StrCat("[", k, "]") : "", " (",
                            def.inputs[i].name, ")");
      };
      if (arg.is_null()) {
        // No data, so nothing to bounds-check: the kernel gets a null
        // pointer.
        if (!arg.desc.shape.empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat(what(), ": a null tensor has rank 0 and no data"));
        }
        placed->inputs.push_back(runner::TensorLoc::Null(arg.desc));
        continue;
      }
      OPJIT_ASSIGN_OR_RETURN(uint64_t nbytes, tensor::ByteSize(arg.desc.dtype, arg.desc.shape));
      if (const ShmRef* shm = arg.shm()) {
        OPJIT_ASSIGN_OR_RETURN(auto region, regions->Acquire(call.ns, shm->region, call.principal));
        OPJIT_ASSIGN_OR_RETURN(
            auto view, tensor::Resolve(region, {shm->region, shm->offset, arg.desc.dtype, arg.desc.shape},
                                       what()));
        placed->inputs.push_back(
            runner::TensorLoc::Region(arg.desc, nbytes, std::move(region), shm->offset));
        in_views.push_back(std::move(view));
      } else {
        const std::string_view bytes = arg.inline_bytes()->bytes;
        if (bytes.size() != nbytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              what(), ": ", bytes.size(), " inline bytes, but ", DescString(arg.desc),
              " needs ", nbytes));
        }
        // The request's bytes are this call's private copy; kernels get void*.
        placed->inputs.push_back(
            runner::TensorLoc::Memory(arg.desc, nbytes, const_cast<char*>(bytes.data())));
      }
    }
  }

  const size_t n_out = out_descs.size();
  if (!call.outputs.empty() && call.outputs.size() != 1 && call.outputs.size() != n_out) {
    return absl::InvalidArgumentError(absl::StrCat("give one output placement per output (", n_out,
                                                   "), one for all, or none; got ",
                                                   call.outputs.size()));
  }
  ForwardResult& result = placed->result;
  result.version = c.record->version;
  result.outputs.resize(n_out);
  placed->outputs.resize(n_out);
  absl::InlinedVector<tensor::TensorView, 4> out_views;
  uint64_t alloc_cursor = 0;
  uint64_t inline_out = 0;
  std::shared_ptr<const tensor::Region> alloc_region;
  for (size_t j = 0; j < n_out; ++j) {
    OutputPlacement place;
    if (call.outputs.size() == 1) place = call.outputs[0];
    if (call.outputs.size() == n_out) place = call.outputs[j];
    auto what = [&] { return absl::StrCat("outputs[", j, "] (", def.outputs[j].name, ")"); };
    OPJIT_ASSIGN_OR_RETURN(uint64_t nbytes, tensor::ByteSize(out_descs[j].dtype, out_descs[j].shape));
    OutputResult& r = result.outputs[j];
    r.desc = out_descs[j];
    runner::TensorLoc& loc = placed->outputs[j];
    loc.desc = out_descs[j];
    loc.nbytes = nbytes;
    switch (place.kind) {
      case OutputPlacement::Kind::kInline:
        inline_out += nbytes;
        if (inline_out > max_inline_output_bytes) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "op ", OpName(def), ": the outputs need ", inline_out,
              "+ bytes inline, over the server's ", max_inline_output_bytes,
              "-byte message limit; place them in shared memory (alloc_in or shm)"));
        }
        r.data.emplace<OwnedBytes>().bytes.resize(nbytes);
        loc.where = runner::InMemory{r.mutable_inline_bytes()->bytes.data()};
        break;
      case OutputPlacement::Kind::kShm:
      case OutputPlacement::Kind::kAllocIn: {
        if (place.kind == OutputPlacement::Kind::kShm && call.outputs.size() == 1 && n_out > 1) {
          return absl::InvalidArgumentError(
              "one fixed shm placement cannot hold several outputs; use alloc_in or one per output");
        }
        OPJIT_ASSIGN_OR_RETURN(auto region, regions->Acquire(call.ns, place.region, call.principal));
        if (place.offset > region->size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              what(), ": offset ", place.offset, " is past the end of region \"", place.region,
              "\" (", region->size(), " bytes)"));
        }
        uint64_t offset = place.offset;
        if (place.kind == OutputPlacement::Kind::kAllocIn) {
          if (alloc_region != region) {
            alloc_region = region;
            alloc_cursor = Align64(place.offset);
          }
          offset = alloc_cursor;
          alloc_cursor = Align64(alloc_cursor + nbytes);
        }
        OPJIT_ASSIGN_OR_RETURN(
            auto view, tensor::Resolve(region,
                                       {place.region, offset, out_descs[j].dtype, out_descs[j].shape},
                                       what()));
        for (const auto& in : in_views) {
          // An output that is exactly an input (the same bytes: an in-place
          // or `out=` op writing its input) is accepted when the call keeps
          // its output bytes, which zero-filling would otherwise wipe. Any
          // other overlap is refused.
          if (call.keep_output_bytes && view.data == in.data && view.nbytes == in.nbytes) continue;
          if (tensor::Overlaps(view, in)) {
            return absl::InvalidArgumentError(
                absl::StrCat(what(), " overlaps an input in region \"", place.region, "\""));
          }
        }
        for (const auto& other : out_views) {
          if (tensor::Overlaps(view, other)) {
            return absl::InvalidArgumentError(
                absl::StrCat(what(), " overlaps another output in region \"", place.region, "\""));
          }
        }
        r.data = ShmRef{place.region, offset};
        // The region came from Acquire with the caller's principal: its
        // bytes are the caller's to read, so they may stay if it asked.
        loc.where = runner::InRegion{std::move(region), offset, call.keep_output_bytes};
        out_views.push_back(std::move(view));
        break;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace opjit::exec

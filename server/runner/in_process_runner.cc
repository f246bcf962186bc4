#include "server/runner/in_process_runner.h"

#include <chrono>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/tensor/region.h"

namespace opjit::runner {
namespace {

class InProcessInstance : public KernelInstance {
 public:
  explicit InProcessInstance(std::unique_ptr<HostInstance> inst) : inst_(std::move(inst)) {}

  absl::StatusOr<std::vector<int64_t>> InferShape() override { return inst_->InferShape(); }

  absl::Status Run(const RunArgs& args) override {
    absl::InlinedVector<HostTensor, 4> in, out;
    for (const TensorLoc& t : args.inputs) in.push_back(ToHost(t));
    for (const TensorLoc& t : args.outputs) out.push_back(ToHost(t));
    // A started kernel cannot be stopped in this process: it runs to the end.
    HostCall call;
    call.flush_caches = args.flush_caches;
    absl::Status s = RunTimed(*inst_, in, out, &call);
    if (args.kernel_ms != nullptr) *args.kernel_ms = call.kernel_ms;
    if (args.flushed_bytes != nullptr) *args.flushed_bytes = call.flushed_bytes;
    return s;
  }

 private:
  std::unique_ptr<HostInstance> inst_;
};

}  // namespace

HostTensor ToHost(const TensorLoc& loc) {
  HostTensor t;
  t.desc = loc.desc;
  if (loc.is_null()) {
    t.null = true;
  } else if (const InRegion* r = loc.in_region()) {
    t.data = r->region->data() + r->offset;
    // Only a region's bytes may be kept: inline buffers are always zeroed.
    t.keep_bytes = r->keep_bytes;
  } else {
    t.data = loc.in_memory()->data;
  }
  return t;
}

absl::StatusOr<std::unique_ptr<InProcessRunner>> InProcessRunner::Create(
    const KernelHostOptions& options) {
  OPJIT_ASSIGN_OR_RETURN(auto host, KernelHost::Create(options));
  return std::unique_ptr<InProcessRunner>(new InProcessRunner(std::move(host)));
}

absl::StatusOr<std::shared_ptr<KernelInstance>> InProcessRunner::Instance(const InstanceSpec& spec) {
  OPJIT_ASSIGN_OR_RETURN(auto inst, host_->NewInstance(spec));
  return std::shared_ptr<KernelInstance>(new InProcessInstance(std::move(inst)));
}

}  // namespace opjit::runner

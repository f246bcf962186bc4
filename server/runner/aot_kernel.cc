#include "server/runner/aot_kernel.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::runner {
namespace {

constexpr size_t kWorkspaceAlignment = 64;

// The argument arrays of one aot call. Shapes are copied (into one flat
// buffer), so a kernel that writes through `shapes` cannot change anyone's
// descriptors. Small calls allocate nothing.
class CallArgs {
 public:
  // `total_dims` bounds the dims of all tensors added, so pointers into the
  // dims buffer stay valid.
  explicit CallArgs(size_t total_dims) { dims_.reserve(total_dims); }
  // `dtype` must outlive the call.
  void Add(void* data, const char* dtype, const std::vector<int64_t>& shape) {
    Add(data, dtype, shape.data(), shape.size());
  }
  void Add(void* data, const char* dtype, const int64_t* shape, size_t ndim) {
    params_.push_back(data);
    ndims_.push_back(static_cast<int>(ndim));
    const size_t at = dims_.size();
    dims_.insert(dims_.end(), shape, shape + ndim);
    shape_ptrs_.push_back(dims_.data() + at);
    dtypes_.push_back(dtype);
  }
  // Changes the rank the kernel sees for parameter `i` (its dims stay).
  void SetRank(int i, int ndim) { ndims_[i] = ndim; }
  void AddAll(const std::vector<TensorDesc>& descs) {
    for (const TensorDesc& d : descs) Add(nullptr, d.dtype.c_str(), d.shape);
  }
  int nparam() const { return static_cast<int>(params_.size()); }
  void** params() { return params_.data(); }
  int* ndims() { return ndims_.data(); }
  int64_t** shapes() { return shape_ptrs_.data(); }
  const char** dtypes() { return dtypes_.data(); }

  static size_t Dims(const std::vector<TensorDesc>& descs) {
    size_t n = 0;
    for (const TensorDesc& d : descs) n += d.shape.size();
    return n;
  }

 private:
  static constexpr size_t kInline = 8;
  absl::InlinedVector<void*, kInline> params_;
  absl::InlinedVector<int, kInline> ndims_;
  absl::InlinedVector<int64_t, 4 * kInline> dims_;
  absl::InlinedVector<int64_t*, kInline> shape_ptrs_;
  absl::InlinedVector<const char*, kInline> dtypes_;
};

// Calls `call` and turns an escaping C++ exception into INTERNAL.
template <typename F>
absl::Status CatchKernelExceptions(const std::string& what, F&& call) {
  try {
    call();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " ran out of memory (the executor's memory limit)"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, " threw an exception: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, " threw a non-standard exception"));
  }
  return absl::OkStatus();
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status CheckTensors(const char* kind, absl::Span<const HostTensor> got,
                          const std::vector<TensorDesc>& want) {
  if (got.size() != want.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", want.size(), " ", kind, "s, got ", got.size()));
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(got[i].desc == want[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          kind, " ", i, ": expected ", DescString(want[i]), ", got ", DescString(got[i].desc)));
    }
    if (got[i].null) {
      // A slot without data (not saved for a bprop): rank 0, no pointer.
      if (got[i].data != nullptr || !got[i].desc.shape.empty() || std::string_view(kind) != "input") {
        return absl::InvalidArgumentError(
            absl::StrCat(kind, " ", i, ": a null slot must be an input of rank 0 without data"));
      }
      continue;
    }
    if (got[i].data == nullptr && NumElements(got[i].desc.shape) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(kind, " ", i, " has no data"));
    }
  }
  return absl::OkStatus();
}

// Bytes of guarded workspaces the process keeps between calls, over all
// instances; beyond it a call's workspaces are unmapped after it.
constexpr uint64_t kKeptWorkspaceBytes = 64ull << 20;
std::atomic<uint64_t> g_kept_workspace_bytes{0};

uint64_t MappedBytes(const guard::GuardedMapping& m) {
  return m.usable() + 2 * guard::PageSize();
}

}  // namespace

std::string DescString(const TensorDesc& desc) {
  return absl::StrCat(desc.dtype, "[", absl::StrJoin(desc.shape, ","), "]");
}

AotKernelInstance::AotKernelInstance(std::shared_ptr<const loader::LoadedKernel> kernel,
                                     std::string entry, std::vector<TensorDesc> inputs,
                                     std::map<std::string, registry::AttrValue> attrs,
                                     AotKernelOptions options)
    : kernel_(std::move(kernel)),
      entry_(std::move(entry)),
      what_("kernel " + entry_),
      inputs_(std::move(inputs)),
      options_(options),
      extra_(std::move(attrs)) {}

AotKernelInstance::~AotKernelInstance() {
  {
    MutexLock lock(&ws_mu_);
    g_kept_workspace_bytes.fetch_sub(ws_kept_bytes_, std::memory_order_relaxed);
  }
  // The kernel data's destructor is kernel code: run it while kernel_ still
  // holds the code.
  extra_.DestructKernelData();
}

absl::StatusOr<std::unique_ptr<AotKernelInstance>> AotKernelInstance::Create(
    std::shared_ptr<const loader::LoadedKernel> kernel, const std::string& entry,
    std::vector<TensorDesc> inputs, std::vector<TensorDesc> outputs,
    std::map<std::string, registry::AttrValue> attrs, AotKernelOptions options) {
  if (kernel == nullptr) return absl::InvalidArgumentError("no kernel given");
  void* fn = kernel->Find(entry);
  if (fn == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entry symbol '", entry, "' not found; the object defines: ",
        kernel->defined_symbols().empty() ? "nothing"
                                          : absl::StrJoin(kernel->defined_symbols(), ", ")));
  }
  std::unique_ptr<AotKernelInstance> instance(new AotKernelInstance(
      std::move(kernel), entry, std::move(inputs), std::move(attrs), options));
  instance->fn_ = reinterpret_cast<EntryFn>(fn);
  instance->init_ = instance->kernel_->FindAs<InitFn>(entry + "Init");
  instance->infer_shape_ = instance->kernel_->FindAs<InferShapeFn>(entry + "InferShape");

  if (!outputs.empty()) {
    MutexLock call_lock(&instance->call_mu_);
    OPJIT_RETURN_IF_ERROR(instance->RunInitLocked(outputs));
  }
  return instance;
}

absl::Status AotKernelInstance::RunInitLocked(const std::vector<TensorDesc>& outputs) const {
  absl::Status status;
  if (init_ != nullptr) {
    CallArgs args(CallArgs::Dims(inputs_) + CallArgs::Dims(outputs));
    args.AddAll(inputs_);
    args.AddAll(outputs);
    int rc = 0;
    guard::SetRunning(entry_.c_str());
    status = CatchKernelExceptions(
        entry_ + " Init", [&] { rc = init_(args.ndims(), args.shapes(), args.dtypes(), &extra_); });
    guard::SetRunning(nullptr);
    if (status.ok()) status = extra_.TakeStatus(entry_ + " Init");
    if (status.ok() && rc != 0) {
      status = absl::InvalidArgumentError(absl::StrCat(entry_, " Init returned ", rc));
    }
  }
  {
    MutexLock lock(&state_mu_);
    init_status_ = status;
    outputs_ = outputs;
    workspace_ = extra_.WorkSpace();
  }
  init_done_.store(true, std::memory_order_release);
  if (!status.ok()) Logger("runner")->debug("{}", status.ToString());
  return status;
}

const std::vector<TensorDesc>& AotKernelInstance::outputs() const {
  static const std::vector<TensorDesc> kUnknown;
  return init_done_.load(std::memory_order_acquire) ? outputs_ : kUnknown;
}

std::vector<size_t> AotKernelInstance::workspace_sizes() const {
  MutexLock lock(&state_mu_);
  return workspace_;
}

absl::StatusOr<AotKernelInstance::Workspaces> AotKernelInstance::TakeWorkspaces() const {
  Workspaces ws;
  {
    MutexLock lock(&ws_mu_);
    if (!ws_kept_.empty()) {
      ws = std::move(ws_kept_.back());
      ws_kept_.pop_back();
      uint64_t bytes = 0;
      for (const auto& m : ws) bytes += MappedBytes(*m);
      ws_kept_bytes_ -= bytes;
      g_kept_workspace_bytes.fetch_sub(bytes, std::memory_order_relaxed);
    }
  }
  // Zero-filled: a workspace never hands the kernel (or, through a buggy
  // kernel, its caller) bytes left over from earlier calls. A new mapping
  // is zero already.
  for (const auto& m : ws) m->Zero();
  for (size_t i = ws.size(); i < workspace_.size(); ++i) {
    auto m = guard::GuardedMapping::Anonymous(workspace_[i], kWorkspaceAlignment);
    if (!m.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("kernel ", entry_,
                                                       ": cannot allocate a workspace of ",
                                                       workspace_[i], " bytes"));
    }
    (*m)->Describe(guard::Kind::kWorkspace, static_cast<uint32_t>(i), 0, entry_.c_str());
    ws.push_back(*std::move(m));
  }
  return ws;
}

void AotKernelInstance::KeepWorkspaces(Workspaces ws) const {
  if (ws.empty()) return;
  uint64_t bytes = 0;
  for (const auto& m : ws) bytes += MappedBytes(*m);
  MutexLock lock(&ws_mu_);
  if (ws_kept_.size() >= 2) return;
  if (g_kept_workspace_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes >
      kKeptWorkspaceBytes) {
    g_kept_workspace_bytes.fetch_sub(bytes, std::memory_order_relaxed);
    return;
  }
  ws_kept_bytes_ += bytes;
  ws_kept_.push_back(std::move(ws));
}

absl::Status AotKernelInstance::CheckWorkspaces(const Workspaces& ws) const {
  for (size_t i = 0; i < ws.size(); ++i) {
    if (ws[i]->SlackIntact()) continue;
    return WithReason(
        absl::AbortedError(absl::StrCat(
            what_, " wrote past the end (or before the start) of its workspace ", i, " (",
            workspace_[i], " bytes, as its Init asked with SetWorkSpace); the call failed")),
        reason::kKernelFailed, {{"cause", "workspace_overflow"}});
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> AotKernelInstance::InferShape() const {
  if (infer_shape_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("kernel ", entry_, " defines no ", entry_, "InferShape"));
  }
  MutexLock call_lock(&call_mu_);
  CallArgs args(CallArgs::Dims(inputs_));
  args.AddAll(inputs_);
  std::vector<int64_t> shape;
  guard::SetRunning(entry_.c_str());
  absl::Status ran = CatchKernelExceptions(
      entry_ + " InferShape", [&] { shape = infer_shape_(args.ndims(), args.shapes(), &extra_); });
  guard::SetRunning(nullptr);
  OPJIT_RETURN_IF_ERROR(ran);
  OPJIT_RETURN_IF_ERROR(extra_.TakeStatus(entry_ + " InferShape"));
  bool unknown_rank = shape.size() == 1 && shape[0] == -2;
  for (int64_t d : shape) {
    if (d < -1 && !unknown_rank) {
      return absl::InvalidArgumentError(absl::StrCat(entry_, " InferShape returned [",
                                                     absl::StrJoin(shape, ","),
                                                     "]: dims must be >= -1, or [-2]"));
    }
  }
  return shape;
}

absl::Status AotKernelInstance::Run(absl::Span<const HostTensor> inputs,
                                    absl::Span<const HostTensor> outputs) const {
  OPJIT_RETURN_IF_ERROR(CheckTensors("input", inputs, inputs_));

  // Deferred Init: the first Run brings the outputs.
  if (!init_done_.load(std::memory_order_acquire)) {
    MutexLock call_lock(&call_mu_);
    if (!init_done_.load(std::memory_order_acquire)) {
      std::vector<TensorDesc> descs;
      for (const HostTensor& t : outputs) descs.push_back(t.desc);
      RunInitLocked(descs).IgnoreError();  // kept in init_status_
    }
  }
  // init_done_ is set: outputs_, workspace_ and init_status_ no longer change,
  // so they are read without the lock from here on.
  OPJIT_RETURN_IF_ERROR(init_status_);
  OPJIT_RETURN_IF_ERROR(CheckTensors("output", outputs, outputs_));
  if (options_.zero_outputs) {
    // Every output starts zeroed, on every transport (inline tensors in an
    // executor's arena or a daemon buffer, shm ranges, fast channels): what
    // the kernel does not write reads as 0, never as an earlier call's bytes
    // (this client's, or another principal's of the namespace). A plain
    // memset: on these hosts it costs a fraction of a kernel's own write,
    // while fresh zero pages (MADV_REMOVE, a punched hole) cost a fault per
    // page, over 10x more (bench/zero_bench.cc). An output the caller asked
    // to keep (keep_bytes: its own shared memory, bytes it could read
    // anyway) is left as it is.
    for (const HostTensor& t : outputs) {
      if (t.data == nullptr || t.keep_bytes) continue;
      OPJIT_ASSIGN_OR_RETURN(uint64_t n, tensor::ByteSize(t.desc.dtype, t.desc.shape));
      std::memset(t.data, 0, n);
    }
  }

  OPJIT_ASSIGN_OR_RETURN(Workspaces workspaces, TakeWorkspaces());
  size_t dims = workspace_.size();
  for (const HostTensor& t : inputs) dims += t.null ? 1 : t.desc.shape.size();
  for (const HostTensor& t : outputs) dims += t.desc.shape.size();
  CallArgs args(dims);
  for (const HostTensor& t : inputs) {
    if (t.null) {
      // params[i] = nullptr, ndims[i] = 0; shapes[i] is never null: it points
      // at a 0 of the call's own, so a kernel that reads a dim it should not
      // reads 0 rather than another tensor's dims.
      const int64_t zero = 0;
      args.Add(nullptr, t.desc.dtype.c_str(), &zero, 1);
      args.SetRank(args.nparam() - 1, 0);
      continue;
    }
    args.Add(t.data, t.desc.dtype.c_str(), t.desc.shape);
  }
  for (const HostTensor& t : outputs) args.Add(t.data, t.desc.dtype.c_str(), t.desc.shape);
  for (size_t i = 0; i < workspace_.size(); ++i) {
    const int64_t dim = static_cast<int64_t>(workspace_[i]);  // copied by Add
    args.Add(workspaces[i]->data(), "uint8", &dim, 1);
  }

  // Held for the call only when serialize_runs; the analysis does not follow
  // a lock taken on one path only, and nothing it guards is read below.
  std::optional<MutexLock> call_lock;
  if (options_.serialize_runs) call_lock.emplace(&call_mu_);
  int rc = 0;
  void* extra = static_cast<AotExtra*>(&extra_);
  guard::SetRunning(entry_.c_str());  // for an executor's fault handler
  absl::Status ran = CatchKernelExceptions(what_, [&] {
    rc = fn_(args.nparam(), args.params(), args.ndims(), args.shapes(), args.dtypes(),
             /*stream=*/nullptr, extra);
  });
  guard::SetRunning(nullptr);
  absl::Status slack = CheckWorkspaces(workspaces);
  KeepWorkspaces(std::move(workspaces));
  OPJIT_RETURN_IF_ERROR(slack);
  OPJIT_RETURN_IF_ERROR(ran);
  OPJIT_RETURN_IF_ERROR(extra_.TakeStatus(what_));
  if (rc != 0) {
    return WithReason(absl::AbortedError(absl::StrCat(what_, " returned ", rc)),
                      reason::kKernelFailed, {{"return_code", absl::StrCat(rc)}});
  }
  return absl::OkStatus();
}

}  // namespace opjit::runner

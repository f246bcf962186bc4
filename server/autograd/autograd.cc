#include "server/autograd/autograd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/logging.h"
#include "server/common/mutex.h"
#include "server/common/random.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"
#include "server/common/thread_pool.h"
#include "server/registry/bprop_args.h"
#include "server/registry/registry.h"
#include "server/tensor/elements.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::autograd {
namespace {

using Clock = std::chrono::steady_clock;
using exec::SavedTensor;
using exec::TensorArg;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}


bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// What a forward with requires_grad leaves for its backward.
struct Context {
  std::string id;
  std::string ns;
  std::string caller;  // the principal whose forward left it (ForwardCall::caller)
  std::shared_ptr<const registry::OpRecord> record;
  std::vector<bool> requires_grad;                 // per declared input
  // Per declared input: one per tensor, a copy or a null placeholder (not
  // saved); empty for an absent optional input, or when not differentiable.
  std::vector<std::vector<SavedTensor>> inputs;
  std::vector<SavedTensor> outputs;                // per output (empty: not differentiable)
  std::vector<exec::TensorDesc> output_descs;      // per output, always
  std::vector<size_t> input_counts;                // tensors per declared input
  std::vector<exec::TensorDesc> input_descs;       // per declared input: its first tensor's
  std::map<std::string, exec::AttrArg> attrs;      // the forward's attrs
  uint64_t bytes = 0;
  Clock::time_point last_used;
};

TensorArg ArgOf(const SavedTensor& t) {
  if (const exec::OwnedBytes* b = t.bytes()) return {t.desc, exec::InlineBytes{b->bytes}};
  return {t.desc, exec::NullTensor{}};
}

// A saved tensor's bytes; none for a placeholder.
const std::string& BytesOf(const SavedTensor& t) {
  static const std::string kNone;
  const exec::OwnedBytes* b = t.bytes();
  return b != nullptr ? b->bytes : kNone;
}

// A slot without data: the kernel gets params[i] == nullptr, ndims[i] == 0.
TensorArg NullArg(const std::string& dtype) { return TensorArg::Null(dtype); }

// Whether a grad the bprop wrote inline carries anything: a value other than
// zero (for floating dtypes, -0.0 is zero too). A grad written to the
// caller's shared memory is the caller's to read.
bool HoldsNonzeroGrad(const exec::OutputResult& out) {
  const exec::OwnedBytes* owned = out.inline_bytes();
  if (owned == nullptr) return false;
  const std::string& b = owned->bytes;
  const tensor::Dtype dtype = tensor::DtypeOf(out.desc.dtype);
  const size_t width = dtype.is_float() ? dtype.size : 0;
  for (size_t k = 0; k < b.size(); ++k) {
    // The sign bit is the top bit of the last byte of each little-endian element.
    const bool sign_byte = width != 0 && k % width == width - 1;
    const auto byte = static_cast<unsigned char>(b[k]);
    if ((sign_byte ? (byte & 0x7f) : byte) != 0) return true;
  }
  return false;
}

// An output's inline bytes; none for one in shared memory (gradcheck's
// calls place none there).
const std::string& InlineOf(const exec::OutputResult& o) {
  static const std::string kNone;
  const exec::OwnedBytes* b = o.inline_bytes();
  return b != nullptr ? b->bytes : kNone;
}

// Element access in double for the floating dtypes gradcheck supports
// (tensor/elements.h: float16 rounds to nearest, NaN stays NaN).
double Get(const std::string& dtype, const std::string& bytes, size_t i) {
  return tensor::ReadElement(tensor::DtypeOf(dtype), bytes.data(), i);
}

void Set(const std::string& dtype, std::string* bytes, size_t i, double v) {
  tensor::WriteElement(tensor::DtypeOf(dtype), bytes->data(), i, v);
}

bool IsFloat(const std::string& dtype) { return tensor::DtypeOf(dtype).is_float(); }

// The bprop's inputs, in backward.inputs' order (by default MindSpore's
// (inputs, outputs, grads)). A forward tensor not saved is a null
// placeholder (params[i] == nullptr, ndims[i] == 0, its dtype); only an
// optional input absent in the forward stays absent. Zero-filled grads live
// in `zeros`, reserved by the caller for every argument (no reallocation).
absl::StatusOr<std::vector<std::vector<TensorArg>>> BpropInputs(
    const Context& ctx, const BackwardCall& call, const std::vector<registry::BpropArg>& args,
    std::vector<std::string>* zeros) {
  const registry::OpDef& fdef = ctx.record->def;
  std::vector<std::vector<TensorArg>> inputs;
  for (const registry::BpropArg& a : args) {
    std::vector<TensorArg> group;
    const size_t j = a.index;
    switch (a.kind) {
      case registry::BpropArg::Kind::kInput:
        if (j < ctx.inputs.size()) {
          for (const auto& t : ctx.inputs[j]) group.push_back(ArgOf(t));
        }
        break;
      case registry::BpropArg::Kind::kOutput:
        group.push_back(j < ctx.outputs.size() ? ArgOf(ctx.outputs[j])
                                               : NullArg(ctx.output_descs[j].dtype));
        break;
      case registry::BpropArg::Kind::kGrad: {
        const bool nondiff = Contains(fdef.backward.non_differentiable, fdef.outputs[j].name);
        const bool given = j < call.grad_outputs.size() && call.grad_outputs[j].has_value();
        const auto& desc = ctx.output_descs[j];
        if (given && !nondiff) {
          const TensorArg& g = *call.grad_outputs[j];
          if (g.desc.shape != desc.shape || g.desc.dtype != desc.dtype) {
            return absl::InvalidArgumentError(absl::StrCat(
                "grad_outputs[", j, "] (", fdef.outputs[j].name, ") is ",
                exec::DescString(g.desc), " but the output was ", exec::DescString(desc)));
          }
          group.push_back(g);
        } else if (fdef.backward.materialize_grads) {
          auto n = tensor::ByteSize(desc.dtype, desc.shape);
          if (!n.ok()) return n.status();
          zeros->emplace_back(*n, '\0');
          group.push_back(TensorArg::Inline(desc, zeros->back()));
        } else {
          group.push_back(NullArg(desc.dtype));  // a missing grad, in its slot
        }
        break;
      }
    }
    inputs.push_back(std::move(group));
  }
  return inputs;
}

// Where the bprop writes its grads. A grad for an input that needs none is
// not the caller's: it comes back inline (a placement of one for all
// outputs is spread per output), so that it can be looked at and dropped
// without touching the caller's shared memory.
std::vector<exec::OutputPlacement> GradPlacements(const Context& ctx,
                                                  std::vector<exec::OutputPlacement> given) {
  const auto& rg = ctx.requires_grad;
  if (given.empty() || std::find(rg.begin(), rg.end(), false) == rg.end()) return given;
  std::vector<exec::OutputPlacement> per(rg.size());
  for (size_t i = 0; i < rg.size(); ++i) {
    if (!rg[i]) continue;  // kInline
    if (given.size() == 1) {
      per[i] = given[0];
    } else if (i < given.size()) {
      per[i] = given[i];
    }
  }
  return per;
}

// Whether a tensor of `shape` broadcasts to `to` (numpy's and torch's rule).
bool Expandable(const std::vector<int64_t>& shape, const std::vector<int64_t>& to) {
  if (shape.size() > to.size()) return false;
  for (size_t k = 1; k <= shape.size(); ++k) {
    const int64_t a = shape[shape.size() - k];
    if (a != 1 && a != to[to.size() - k]) return false;
  }
  return true;
}

// A grad `g` of the bprop for forward input `i`, in that input's shape: a
// grad that broadcasts to the input's shape is summed back to it (torch's
// engine sum_to, MindSpore's auto_reduce), as every client's tape does; any
// other shape is refused, naming the input and both shapes. Only grads the
// daemon holds inline are reduced here; one written to the caller's shared
// memory, or one with a context of its own (create_graph, whose graph a sum
// here would cut), is left for the client's tape to reduce.
absl::Status FitGrad(const Context& ctx, size_t i, exec::OutputResult* g, bool reduce) {
  const exec::TensorDesc& want = ctx.input_descs[i];
  if (want.dtype.empty() || g->desc.shape == want.shape) return absl::OkStatus();
  const registry::OpDef& fdef = ctx.record->def;
  const std::string who = absl::StrCat("the bprop ", fdef.backward.op, " of ", ctx.ns, "/",
                                       fdef.name, " returned a grad for input ",
                                       fdef.inputs[i].name, " of shape ", exec::DescString(g->desc),
                                       " but the input is ", exec::DescString(want));
  if (!Expandable(want.shape, g->desc.shape)) {
    return WithReason(absl::InvalidArgumentError(absl::StrCat(
                          who, ", and the grad cannot be summed to it (it does not broadcast)")),
                      reason::kGradShape, {{"input", fdef.inputs[i].name}});
  }
  exec::OwnedBytes* owned = g->mutable_inline_bytes();
  if (!reduce || owned == nullptr) return absl::OkStatus();
  const tensor::Dtype dtype = tensor::DtypeOf(g->desc.dtype);
  auto n_out = tensor::ByteSize(g->desc.dtype, want.shape);
  if (!n_out.ok()) return n_out.status();
  std::vector<int64_t> in_shape = g->desc.shape;  // the grad's
  const size_t lead = in_shape.size() - want.shape.size();
  size_t n_in = 1, n_want = 1;
  for (int64_t d : in_shape) n_in *= static_cast<size_t>(d);
  for (int64_t d : want.shape) n_want *= static_cast<size_t>(d);
  if (owned->bytes.size() < n_in * dtype.size) {
    return absl::InternalError(absl::StrCat(who, ": the grad holds fewer bytes than its shape"));
  }
  std::vector<double> sum(n_want, 0.0);
  std::vector<int64_t> idx(in_shape.size(), 0);
  for (size_t e = 0; e < n_in; ++e) {
    size_t target = 0;
    for (size_t k = lead; k < in_shape.size(); ++k) {
      const int64_t w = want.shape[k - lead];
      target = target * static_cast<size_t>(w) + static_cast<size_t>(w == 1 ? 0 : idx[k]);
    }
    sum[target] += tensor::ReadElement(dtype, owned->bytes.data(), e);
    for (size_t k = in_shape.size(); k-- > 0;) {  // next index, row-major
      if (++idx[k] < in_shape[k]) break;
      idx[k] = 0;
    }
  }
  std::string out(*n_out, '\0');
  for (size_t e = 0; e < n_want; ++e) tensor::WriteElement(dtype, out.data(), e, sum[e]);
  owned->bytes = std::move(out);
  g->desc.shape = want.shape;
  return absl::OkStatus();
}

// The bprop's outputs as the grads of the forward's inputs: one per input
// that requires one, reduced to the input's shape (FitGrad). A nonzero grad for one that needs none is dropped and
// reported (a warning, or an error when backward.stop_gradient_grads says).
absl::Status CollectGrads(const Context& ctx, exec::ForwardResult* bprop, BackwardResult* out,
                          bool reduce) {
  const registry::OpDef& fdef = ctx.record->def;
  out->grad_inputs.resize(ctx.requires_grad.size());
  for (size_t i = 0; i < ctx.requires_grad.size(); ++i) {
    if (i >= bprop->outputs.size()) continue;
    if (ctx.input_counts[i] == 0) continue;  // an absent optional input has no grad
    if (ctx.requires_grad[i]) {
      // A dynamic input's tensors may differ in shape; the bprop gives one grad.
      if (ctx.input_counts[i] == 1 && i < ctx.input_descs.size()) {
        OPJIT_RETURN_IF_ERROR(FitGrad(ctx, i, &bprop->outputs[i], reduce));
      }
      out->grad_inputs[i].push_back(std::move(bprop->outputs[i]));
      continue;
    }
    if (!HoldsNonzeroGrad(bprop->outputs[i])) continue;
    const std::string what = absl::StrCat(
        "the bprop ", fdef.backward.op, " of ", ctx.ns, "/", fdef.name,
        " returned a nonzero grad for input ", fdef.inputs[i].name,
        ", which needs none (requires_grad false, Paddle's stop_gradient)");
    if (fdef.backward.stop_gradient_grads == registry::Backward::StopGradientGrads::kError) {
      return WithReason(absl::FailedPreconditionError(absl::StrCat(
                            what, "; backward.stop_gradient_grads is \"error\": return zeros "
                            "for it, or set requires_grad on it")),
                        reason::kStopGradientGrad, {{"input", fdef.inputs[i].name}});
    }
    out->warnings.push_back(absl::StrCat(what, "; it was dropped"));
  }
  return absl::OkStatus();
}

}  // namespace

struct Autograd::Impl {
  AutogradOptions options;
  registry::Registry* registry = nullptr;
  exec::Executor* executor = nullptr;
  std::unique_ptr<ThreadPool> pool;  // gradcheck

  mutable Mutex mu;
  std::unordered_map<std::string, std::shared_ptr<Context>> contexts ABSL_GUARDED_BY(mu);
  std::map<std::string, uint64_t> ns_bytes ABSL_GUARDED_BY(mu);

  absl::Status Keep(std::shared_ptr<Context> ctx) {
    MutexLock lock(&mu);
    uint64_t& used = ns_bytes[ctx->ns];
    if (used + ctx->bytes > options.namespace_bytes) {
      return QuotaExceeded(
          "context_bytes", absl::StrCat(options.namespace_bytes), ctx->ns,
          absl::StrCat("the namespace holds ", used, " bytes of backward contexts and this one "
                       "needs ", ctx->bytes, " more. Run or release pending backwards "
                       "(ReleaseContext), or forward without requires_grad"));
    }
    if (options.total_bytes > 0) {
      uint64_t total = 0;
      for (const auto& [ns, b] : ns_bytes) total += b;
      if (total + ctx->bytes > options.total_bytes) {
        return QuotaExceeded("total_context_bytes", absl::StrCat(options.total_bytes), "",
                             "the server holds too many backward contexts; release pending "
                             "backwards or try again later");
      }
    }
    used += ctx->bytes;
    contexts[ctx->id] = std::move(ctx);
    return absl::OkStatus();
  }

  void DropLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = contexts.find(id);
    if (it == contexts.end()) return;
    ns_bytes[it->second->ns] -= it->second->bytes;
    contexts.erase(it);
  }

  absl::StatusOr<std::shared_ptr<Context>> Take(const std::string& ns, const std::string& id,
                                                bool retain) {
    MutexLock lock(&mu);
    auto it = contexts.find(id);
    if (it == contexts.end() || it->second->ns != ns) {
      return WithReason(absl::FailedPreconditionError(absl::StrCat(
          "no backward context \"", Excerpt(id), "\" in namespace \"", Excerpt(ns),
          "\": run the forward with requires_grad on an input first (a context is kept only "
          "then), and note that a context is released after one backward unless "
          "retain_context is set, and after ", options.ttl_ms / 1000, " s unused")),
                        reason::kContextNotFound);
    }
    std::shared_ptr<Context> ctx = it->second;
    ctx->last_used = Clock::now();
    if (!retain) DropLocked(id);
    return ctx;
  }
};

Autograd::Autograd(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Autograd::~Autograd() { impl_->pool.reset(); }

absl::StatusOr<std::unique_ptr<Autograd>> Autograd::Create(const AutogradOptions& options,
                                                           registry::Registry* registry,
                                                           exec::Executor* executor) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->registry = registry;
  impl->executor = executor;
  impl->pool = std::make_unique<ThreadPool>(options.gradcheck_threads, 16, "opjit-gradchk");
  return std::unique_ptr<Autograd>(new Autograd(std::move(impl)));
}

void Autograd::ForwardAsync(exec::ForwardCall call, std::vector<bool> requires_grad,
                            ForwardCallback done) {
  const bool any = std::find(requires_grad.begin(), requires_grad.end(), true) != requires_grad.end();
  if (!any) {
    impl_->executor->ForwardAsync(std::move(call), [done](absl::StatusOr<exec::ForwardResult> r) {
      if (!r.ok()) return done(r.status());
      done(GradForwardResult{*std::move(r), ""});
    });
    return;
  }
  auto record = impl_->registry->GetShared(call.ns, call.op, call.version);
  if (!record.ok()) return done(record.status());
  const registry::OpDef& def = (*record)->def;
  if (requires_grad.size() != def.inputs.size()) {
    return done(absl::InvalidArgumentError(absl::StrCat(
        "requires_grad has ", requires_grad.size(), " flag(s); op ", def.ns, "/", def.name,
        " has ", def.inputs.size(), " declared input(s): give one per input, or none")));
  }
  if (def.backward.op.empty()) {
    // An op without a backward runs all the same, and its outputs are not
    // differentiable: the context keeps no tensors, and a backward through
    // it fails with NOT_DIFFERENTIABLE naming the op (PyTorch and Paddle
    // fail at backward, not at forward).
    call.save_inputs.clear();
    call.save_outputs.clear();
  } else {
    // Save what the bprop reads: the tensors backward.inputs names (all of
    // them by default), less those save_for_backward leaves out. The rest
    // come back as null placeholders, which keep the bprop's positions.
    auto args = registry::ResolveBpropArgs(def);
    if (!args.ok()) return done(args.status());
    const auto& save = def.backward.save_for_backward;
    call.save_inputs.assign(def.inputs.size(), false);
    call.save_outputs.assign(def.outputs.size(), false);
    for (const registry::BpropArg& a : *args) {
      if (a.kind == registry::BpropArg::Kind::kInput) {
        call.save_inputs[a.index] = save.empty() || Contains(save, def.inputs[a.index].name);
      } else if (a.kind == registry::BpropArg::Kind::kOutput) {
        call.save_outputs[a.index] = save.empty() || Contains(save, def.outputs[a.index].name);
      }
    }
  }
  auto ctx = std::make_shared<Context>();
  auto id = RandomHex128();
  if (!id.ok()) return done(id.status());
  ctx->id = *std::move(id);
  ctx->ns = call.ns;
  ctx->caller = call.caller;
  ctx->record = *record;
  ctx->requires_grad = std::move(requires_grad);
  ctx->attrs = call.attrs;
  for (const auto& group : call.inputs) {
    ctx->input_counts.push_back(group.size());
    ctx->input_descs.push_back(group.empty() ? exec::TensorDesc{} : group[0].desc);
  }
  Impl* impl = impl_.get();
  impl->executor->ForwardAsync(
      std::move(call), [impl, ctx, done](absl::StatusOr<exec::ForwardResult> r) {
        if (!r.ok()) return done(r.status());
        ctx->record = r->record;  // the version that ran
        ctx->inputs = std::move(r->saved_inputs);
        ctx->outputs = std::move(r->saved_outputs);
        for (const auto& o : r->outputs) ctx->output_descs.push_back(o.desc);
        for (const auto& g : ctx->inputs) {
          for (const auto& t : g) ctx->bytes += BytesOf(t).size();
        }
        for (const auto& t : ctx->outputs) ctx->bytes += BytesOf(t).size();
        ctx->last_used = Clock::now();
        if (absl::Status s = impl->Keep(ctx); !s.ok()) return done(s);
        Logger("autograd")->debug("context {} kept for {}/{} ({} bytes)", ctx->id.substr(0, 8),
                                  ctx->ns, ctx->record->def.name, ctx->bytes);
        done(GradForwardResult{*std::move(r), ctx->id});
      });
}

void Autograd::BackwardAsync(BackwardCall call, BackwardCallback done) {
  const auto t0 = Clock::now();
  Impl* impl = impl_.get();
  auto taken = impl->Take(call.ns, call.context_id, call.retain_context);
  if (!taken.ok()) return done(taken.status());
  std::shared_ptr<Context> ctx = *std::move(taken);
  const registry::OpDef& fdef = ctx->record->def;
  if (fdef.backward.op.empty()) {
    const std::string op = absl::StrCat(fdef.ns, "/", fdef.name);
    return done(WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "op ", op, " (version ", ctx->record->version, ") is not differentiable: it has no "
            "backward op (backward.op is empty), so no grad flows back through its outputs. "
            "Register it with backward.op naming its bprop, or stop the gradient before it")),
        reason::kNotDifferentiable, {{"op", op}, {"version", absl::StrCat(ctx->record->version)}}));
  }
  const size_t n_out = fdef.outputs.size();
  if (call.grad_outputs.size() > n_out) {
    return done(absl::InvalidArgumentError(absl::StrCat(
        "op ", fdef.ns, "/", fdef.name, " has ", n_out, " output(s) but ",
        call.grad_outputs.size(), " grad_outputs were given")));
  }
  auto bprop = impl->registry->GetShared(ctx->ns, fdef.backward.op, 0);
  if (!bprop.ok()) {
    return done(absl::FailedPreconditionError(absl::StrCat(
        "the backward op \"", fdef.backward.op, "\" of ", fdef.ns, "/", fdef.name,
        " is not registered: ", bprop.status().message())));
  }
  const registry::OpDef& bdef = (*bprop)->def;
  const size_t n_in = fdef.inputs.size();
  auto args = registry::ResolveBpropArgs(fdef);
  if (!args.ok()) return done(args.status());
  if (bdef.inputs.size() != args->size() || bdef.outputs.size() != n_in) {
    // Registration checks this; a bprop stored before it did is told here.
    return done(registry::CheckBpropSignature(fdef, bdef));
  }

  // Zero buffers for missing grads live as long as the call.
  auto zeros = std::make_shared<std::vector<std::string>>();
  zeros->reserve(args->size());
  exec::ForwardCall bcall;
  bcall.ns = ctx->ns;
  bcall.principal = call.principal;
  bcall.quarantine_caller = call.quarantine_caller;
  bcall.caller = ctx->caller;
  bcall.op = bdef.name;
  bcall.version = (*bprop)->version;
  bcall.deadline = call.deadline;
  bcall.outputs = GradPlacements(*ctx, call.outputs);
  bcall.keep_output_bytes = call.keep_output_bytes;
  auto inputs = BpropInputs(*ctx, call, *args, zeros.get());
  if (!inputs.ok()) return done(inputs.status());
  bcall.inputs = *std::move(inputs);
  // The bprop sees the forward's attrs that it declares.
  for (const auto& [name, arg] : ctx->attrs) {
    for (const auto& a : bdef.attrs) {
      if (a.name == name) bcall.attrs[name] = arg;
    }
  }
  // create_graph: a grad for every bprop input that has data (a null slot
  // is no tensor of the caller's, so it gets none).
  std::vector<bool> bprop_grad;
  if (call.create_graph) {
    for (const auto& group : bcall.inputs) bprop_grad.push_back(!group.empty() && !group[0].is_null());
  }

  const bool reduce = !call.create_graph;
  auto finish = [ctx, zeros, done, t0, reduce](absl::StatusOr<GradForwardResult> r) {
    if (!r.ok()) {
      return done(Annotate(r.status(), absl::StrCat("backward of ", ctx->ns, "/",
                                                    ctx->record->def.name, ": ")));
    }
    BackwardResult out;
    out.kernel_ms = r->forward.kernel_ms;
    out.context_id = r->context_id;
    if (absl::Status s = CollectGrads(*ctx, &r->forward, &out, reduce); !s.ok()) return done(s);
    out.server_ms = MsSince(t0);
    done(std::move(out));
  };
  if (call.create_graph) {
    ForwardAsync(std::move(bcall), std::move(bprop_grad), finish);
  } else {
    impl->executor->ForwardAsync(std::move(bcall), [finish](absl::StatusOr<exec::ForwardResult> r) {
      if (!r.ok()) return finish(r.status());
      finish(GradForwardResult{*std::move(r), ""});
    });
  }
}

absl::Status Autograd::Release(const std::string& ns, const std::string& context_id) {
  MutexLock lock(&impl_->mu);
  auto it = impl_->contexts.find(context_id);
  if (it == impl_->contexts.end() || it->second->ns != ns) {
    return WithReason(absl::NotFoundError(absl::StrCat("no backward context \"",
                                                       Excerpt(context_id), "\" in namespace \"",
                                                       Excerpt(ns), "\"")),
                      reason::kContextNotFound);
  }
  impl_->DropLocked(context_id);
  return absl::OkStatus();
}

int Autograd::ExpireContexts(Clock::time_point now) {
  MutexLock lock(&impl_->mu);
  std::vector<std::string> expired;
  for (const auto& [id, ctx] : impl_->contexts) {
    if (now - ctx->last_used > std::chrono::milliseconds(impl_->options.ttl_ms)) expired.push_back(id);
  }
  for (const auto& id : expired) impl_->DropLocked(id);
  return static_cast<int>(expired.size());
}

int Autograd::ReleaseWhere(
    const std::function<bool(const std::string& ns, const std::string& caller)>& doomed) {
  MutexLock lock(&impl_->mu);
  std::vector<std::string> matched;
  for (const auto& [id, ctx] : impl_->contexts) {
    if (!ctx->caller.empty() && doomed(ctx->ns, ctx->caller)) matched.push_back(id);
  }
  for (const auto& id : matched) impl_->DropLocked(id);
  return static_cast<int>(matched.size());
}

std::map<std::string, uint64_t> Autograd::BytesByNamespace() const {
  MutexLock lock(&impl_->mu);
  std::map<std::string, uint64_t> out;
  for (const auto& [ns, b] : impl_->ns_bytes) {
    if (b > 0) out[ns] = b;
  }
  return out;
}

size_t Autograd::LiveContexts() const {
  MutexLock lock(&impl_->mu);
  return impl_->contexts.size();
}

namespace {

// Blocking helpers for gradcheck, which runs on its own pool thread.
absl::StatusOr<GradForwardResult> ForwardNow(Autograd* ag, exec::ForwardCall call,
                                             std::vector<bool> rg) {
  std::promise<absl::StatusOr<GradForwardResult>> p;
  auto f = p.get_future();
  ag->ForwardAsync(std::move(call), std::move(rg),
                   [&p](absl::StatusOr<GradForwardResult> r) { p.set_value(std::move(r)); });
  return f.get();
}

absl::StatusOr<BackwardResult> BackwardNow(Autograd* ag, BackwardCall call) {
  std::promise<absl::StatusOr<BackwardResult>> p;
  auto f = p.get_future();
  ag->BackwardAsync(std::move(call),
                    [&p](absl::StatusOr<BackwardResult> r) { p.set_value(std::move(r)); });
  return f.get();
}

// Gradcheck's inputs: the call's own, or random ones in the widest floating
// dtype the op takes (`*dtype`); an error when there are none to check or
// too many elements to perturb.
absl::Status GradCheckInputs(const GradCheckCall& c, const registry::OpDef& def,
                             std::vector<std::vector<SavedTensor>>* inputs, std::string* dtype) {
  const size_t n_in = def.inputs.size();
  // The inputs: given, or random in the widest floating dtype the op takes.
  if (!c.inputs.empty()) {
    if (c.inputs.size() != n_in) {
      return absl::InvalidArgumentError(
          absl::StrCat("give one input group per declared input (", n_in, ")"));
    }
    for (size_t i = 0; i < n_in; ++i) {
      for (const auto& t : c.inputs[i]) {
        const exec::InlineBytes* b = t.inline_bytes();
        if (b == nullptr) return absl::InvalidArgumentError("gradcheck takes inline inputs only");
        (*inputs)[i].push_back(SavedTensor::Copy(t.desc, std::string(b->bytes)));
        if (IsFloat(t.desc.dtype) && dtype->empty()) *dtype = t.desc.dtype;
      }
    }
  } else {
    for (const char* want : {"float64", "float32", "float16"}) {
      for (const auto& df : def.dtype_formats) {
        bool all = true;
        for (size_t i = 0; i < n_in; ++i) all &= df.io[i].first == want;
        if (all && dtype->empty()) *dtype = want;
      }
    }
    if (dtype->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "op ", def.name, " has no dtype combination with all-floating inputs to check"));
    }
    std::mt19937_64 rng(c.seed);
    std::uniform_real_distribution<double> mag(0.5, 1.5);
    for (size_t i = 0; i < n_in; ++i) {
      const int count = def.inputs[i].param_type == registry::ParamType::kOptional ? 0
                        : def.inputs[i].param_type == registry::ParamType::kDynamic ? 2
                                                                                     : 1;
      for (int k = 0; k < count; ++k) {
        auto n = tensor::ByteSize(*dtype, c.random_shape);
        if (!n.ok()) return n.status();
        SavedTensor t = SavedTensor::Copy({*dtype, c.random_shape}, std::string(*n, '\0'));
        std::string* bytes = &t.mutable_bytes()->bytes;
        const size_t elems = *n / registry::DtypeSize(*dtype);
        for (size_t e = 0; e < elems; ++e) Set(*dtype, bytes, e, (rng() & 1 ? 1 : -1) * mag(rng));
        (*inputs)[i].push_back(std::move(t));
      }
    }
  }
  // The quota: every element costs two forward calls.
  size_t total_elems = 0;
  for (const auto& g : *inputs) {
    for (const auto& t : g) total_elems += BytesOf(t).size() / std::max<size_t>(registry::DtypeSize(t.desc.dtype), 1);
  }
  if (total_elems > kMaxGradCheckElements) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gradcheck would perturb ", total_elems, " input elements (two calls each); at most ",
        kMaxGradCheckElements, ": check on smaller inputs (random_shape)"));
  }
  return absl::OkStatus();
}

// Compares the backward's grad of input `i`'s tensor `k` with central
// differences of `dot` (<f(x), v>), element by element, into `*gi`.
template <class Dot>
absl::Status CompareWithCentralDifferences(const GradCheckCall& c, const registry::OpDef& def,
                                           const std::vector<std::vector<SavedTensor>>& inputs,
                                           size_t i, size_t k, const exec::OutputResult& grad,
                                           double eps, double atol, double rtol, Dot& dot,
                                           GradCheckInput* gi) {
  const std::string& analytic = InlineOf(grad);
  const std::string& idtype = inputs[i][k].desc.dtype;
  const std::string& x = BytesOf(inputs[i][k]);
  const size_t elems = x.size() / registry::DtypeSize(idtype);
  for (size_t e = 0; e < elems; ++e) {
    if (std::chrono::steady_clock::now() > c.deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "gradcheck of ", def.name, " ran past its deadline after ", e, " of ", elems,
          " elements of ", gi->name));
    }
    auto in = inputs;
    // Gradcheck's inputs all have bytes (GradCheckInputs copies them).
    std::string* xe = &in[i][k].mutable_bytes()->bytes;
    const double x0 = Get(idtype, x, e);
    Set(idtype, xe, e, x0 + eps);
    auto plus = dot(in);
    Set(idtype, xe, e, x0 - eps);
    auto minus = dot(in);
    if (!plus.ok()) return plus.status();
    if (!minus.ok()) return minus.status();
    // The step actually taken, after rounding to the dtype.
    const double h = Get(idtype, *xe, e);
    Set(idtype, xe, e, x0 + eps);
    const double step = Get(idtype, *xe, e) - h;
    const double numeric = (*plus - *minus) / step;
    const double a = Get(grad.desc.dtype, analytic, e);
    const double abs_err = std::fabs(a - numeric);
    const double rel_err = abs_err / std::max(std::fabs(numeric), 1e-12);
    if (abs_err > atol + rtol * std::fabs(numeric)) gi->passed = false;
    if (abs_err > gi->max_abs_error || gi->worst_index < 0) {
      gi->worst_index = static_cast<int64_t>(e);
      gi->analytic = a;
      gi->numeric = numeric;
    }
    gi->max_abs_error = std::max(gi->max_abs_error, abs_err);
    gi->max_rel_error = std::max(gi->max_rel_error, rel_err);
  }
  return absl::OkStatus();
}

}  // namespace

void Autograd::GradCheckAsync(GradCheckCall call, GradCheckCallback done) {
  auto shared = std::make_shared<GradCheckCall>(std::move(call));
  auto work = [this, shared, done] {
    const GradCheckCall& c = *shared;
    auto record = impl_->registry->GetShared(c.ns, c.op, c.version);
    if (!record.ok()) return done(record.status());
    const registry::OpDef& def = (*record)->def;
    const size_t n_in = def.inputs.size();

    std::vector<std::vector<SavedTensor>> inputs(n_in);
    std::string dtype;
    if (absl::Status s = GradCheckInputs(c, def, &inputs, &dtype); !s.ok()) return done(s);
    const double eps = c.eps > 0 ? c.eps : dtype == "float64" ? 1e-6 : dtype == "float16" ? 1e-2 : 1e-3;
    const double atol = c.atol > 0 ? c.atol : dtype == "float64" ? 1e-5 : dtype == "float16" ? 1e-1 : 1e-3;
    const double rtol = c.rtol > 0 ? c.rtol : dtype == "float64" ? 1e-4 : dtype == "float16" ? 5e-2 : 1e-2;

    auto make_call = [&](const std::vector<std::vector<SavedTensor>>& in) {
      exec::ForwardCall f;
      f.ns = c.ns;
      f.principal = c.principal;
      f.quarantine_caller = c.quarantine_caller;
      f.op = c.op;
      f.version = (*record)->version;
      f.attrs = c.attrs;
      f.deadline = c.deadline;
      for (const auto& g : in) {
        std::vector<TensorArg> group;
        for (const auto& t : g) group.push_back(ArgOf(t));
        f.inputs.push_back(std::move(group));
      }
      return f;
    };
    std::vector<bool> rg(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      rg[i] = !inputs[i].empty() && IsFloat(inputs[i][0].desc.dtype);
    }
    auto fwd = ForwardNow(this, make_call(inputs), rg);
    if (!fwd.ok()) return done(fwd.status());
    if (fwd->context_id.empty()) {
      return done(absl::FailedPreconditionError("no input of the op can take a grad"));
    }
    // A random cotangent v per differentiable output: checks J^T v.
    std::mt19937_64 rng(c.seed + 1);
    std::uniform_real_distribution<double> vdist(-1.0, 1.0);
    std::vector<SavedTensor> v;
    std::vector<double> vscale;
    BackwardCall bc;
    bc.ns = c.ns;
    bc.principal = c.principal;
    bc.quarantine_caller = c.quarantine_caller;
    bc.context_id = fwd->context_id;
    for (size_t j = 0; j < fwd->forward.outputs.size(); ++j) {
      const auto& o = fwd->forward.outputs[j];
      SavedTensor t = SavedTensor::Copy(o.desc, std::string(InlineOf(o).size(), '\0'));
      const bool diff = IsFloat(o.desc.dtype) &&
                        !Contains(def.backward.non_differentiable, def.outputs[j].name);
      if (diff) {
        const size_t elems = InlineOf(o).size() / registry::DtypeSize(o.desc.dtype);
        for (size_t e = 0; e < elems; ++e) Set(o.desc.dtype, &t.mutable_bytes()->bytes, e, vdist(rng));
      }
      v.push_back(std::move(t));
    }
    for (const auto& t : v) bc.grad_outputs.push_back(ArgOf(t));
    auto bwd = BackwardNow(this, bc);
    if (!bwd.ok()) return done(bwd.status());

    // <f(x), v> in double.
    auto dot = [&](const std::vector<std::vector<SavedTensor>>& in) -> absl::StatusOr<double> {
      auto r = impl_->executor->Forward(make_call(in));
      if (!r.ok()) return r.status();
      double s = 0;
      for (size_t j = 0; j < r->outputs.size(); ++j) {
        const auto& o = r->outputs[j];
        if (!IsFloat(o.desc.dtype)) continue;
        const std::string& bytes = InlineOf(o);
        const size_t elems = bytes.size() / registry::DtypeSize(o.desc.dtype);
        for (size_t e = 0; e < elems; ++e) {
          s += Get(o.desc.dtype, bytes, e) * Get(v[j].desc.dtype, BytesOf(v[j]), e);
        }
      }
      return s;
    };

    GradCheckResult result;
    result.dtype = dtype;
    for (size_t i = 0; i < n_in; ++i) {
      for (size_t k = 0; k < inputs[i].size(); ++k) {
        if (!rg[i]) continue;
        GradCheckInput gi;
        gi.name = inputs[i].size() > 1 ? absl::StrCat(def.inputs[i].name, "[", k, "]")
                                        : def.inputs[i].name;
        const auto& grads = bwd->grad_inputs[i];
        if (k >= grads.size()) {
          gi.passed = false;
          result.message = absl::StrCat("the backward gave no grad for ", gi.name);
          result.inputs.push_back(gi);
          continue;
        }
        absl::Status s = CompareWithCentralDifferences(c, def, inputs, i, k, grads[k], eps, atol,
                                                       rtol, dot, &gi);
        if (!s.ok()) return done(s);
        result.passed &= gi.passed;
        result.inputs.push_back(gi);
      }
    }
    if (result.message.empty()) {
      result.message = result.passed
                           ? absl::StrCat("backward matches central differences (eps ", eps,
                                          ", atol ", atol, ", rtol ", rtol, ")")
                           : absl::StrCat("backward differs from central differences (eps ", eps,
                                          ", atol ", atol, ", rtol ", rtol, ")");
    }
    done(std::move(result));
  };
  if (!impl_->pool->Submit(std::move(work))) {
    done(absl::ResourceExhaustedError("too many gradchecks are queued; retry later"));
  }
}

}  // namespace opjit::autograd

#include "server/exec/executor.h"

#include <algorithm>
#include <atomic>
#include <future>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/cache/lru_cache.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/common/thread_pool.h"
#include "server/compiler/kernel_compiler.h"
#include "server/exec/checks.h"
#include "server/exec/placement.h"
#include "server/exec/shape_rules.h"
#include "server/registry/registry.h"
#include "server/runner/gpu_runner.h"
#include "server/runner/kernel_runner.h"
#include "server/tensor/guarded_copy.h"
#include "server/tensor/region.h"
#include "server/tensor/region_manager.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::exec {
namespace {

using Clock = std::chrono::steady_clock;
using registry::OpDef;
using runner::KernelInstance;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What stands for a tensor that is not saved: its dtype, no data.
SavedTensor Placeholder(const TensorDesc& desc) { return SavedTensor::Null(desc.dtype); }

// A saved copy of a placed tensor. Shm bytes are read under the copy guard:
// a client may shrink its object under us.
absl::StatusOr<SavedTensor> Save(const runner::TensorLoc& loc) {
  if (loc.is_null()) return Placeholder(loc.desc);
  SavedTensor saved = SavedTensor::Copy(loc.desc, std::string(loc.nbytes, '\0'));
  if (loc.nbytes == 0) return saved;
  char* dst = saved.mutable_bytes()->bytes.data();
  if (const runner::InRegion* r = loc.in_region()) {
    OPJIT_RETURN_IF_ERROR(tensor::GuardedCopy(dst, r->region->data() + r->offset, loc.nbytes));
  } else {
    std::memcpy(dst, loc.in_memory()->data, loc.nbytes);
  }
  return saved;
}

// One call in flight.
struct CallState {
  ForwardCall call;
  FlatInputs flat_inputs;
  // Being filled on the first call of a shape (then published); shared
  // read-only from the call-shape cache after.
  std::shared_ptr<Checked> building;
  std::shared_ptr<const Checked> checked;
  std::string shape_key;  // set while building
  Executor::Callback done;
  // Set for PrepareAsync: the call stops once it is checked.
  Executor::PrepareCallback prepared;
  Clock::time_point t0;
};

}  // namespace

struct Executor::Impl {
  ExecutorOptions options;
  registry::Registry* registry = nullptr;
  compiler::KernelCompiler* compiler = nullptr;
  tensor::RegionManager* regions = nullptr;
  runner::KernelRunner* runner = nullptr;
  std::unique_ptr<cache::LruCache<KernelInstance>> instances;
  std::unique_ptr<cache::LruCache<OpPlan>> plans;
  std::unique_ptr<cache::LruCache<Checked>> shapes;  // by ShapeKey
  std::unique_ptr<ThreadPool> pool;
  std::atomic<uint64_t> calls{0}, failures{0}, inline_runs{0}, pool_runs{0}, rejected{0};
  std::atomic<uint64_t> instance_hits{0};

  void Fail(CallState& st, absl::Status s) {
    failures.fetch_add(1, std::memory_order_relaxed);
    if (st.prepared) return st.prepared(std::move(s));
    st.done(std::move(s));
  }
  // Checks the call (from the call-shape cache when it can) and runs it or,
  // for PrepareAsync, answers what it would run.
  void Start(std::shared_ptr<CallState> st);
  // A prepared call is complete: answers it with what it runs.
  void AnswerPrepared(CallState& st);
  // The instance spec of a checked call (outputs filled in when known).
  absl::StatusOr<runner::InstanceSpec> SpecFor(const ForwardCall& call, const FlatInputs& flat,
                                               const Checked& c, const OpPlan& plan);

  // Queues `task` on the execution pool, or answers RESOURCE_EXHAUSTED.
  void SubmitOrRefuse(std::function<void()> task, const std::shared_ptr<CallState>& st) {
    if (pool->Submit(std::move(task))) return;
    rejected.fetch_add(1);
    Fail(*st, absl::ResourceExhaustedError(absl::StrCat("the execution queue is full (",
                                                        options.max_queue,
                                                        " calls waiting); retry with backoff")));
  }

  // A call of a shape seen before: runs it with what was found then, if
  // still current. False: take the full path.
  bool TryCachedShape(std::shared_ptr<CallState>& st);
  // The call's op version is checked (st->building); runs it with `plan`.
  void Dispatch(std::shared_ptr<CallState> st, std::shared_ptr<const OpPlan> plan);
  // Runs the checked call inline or on the pool.
  void Run(std::shared_ptr<CallState> st, std::shared_ptr<KernelInstance> inst);
  // Runs on the thread that decided where the call runs, then answers.
  void RunAndAnswer(CallState& st, const std::shared_ptr<KernelInstance>& inst, bool on_pool);

  absl::StatusOr<std::shared_ptr<KernelInstance>> Instance(const ForwardCall& call,
                                                           const FlatInputs& flat,
                                                           const Checked& c, const OpPlan& plan);
  // Output descriptors from rules or the kernel's InferShape.
  absl::StatusOr<std::vector<TensorDesc>> OutputDescs(const ForwardCall& call, const Checked& c,
                                                      KernelInstance* inst);
  // Places the tensors and runs the kernel.
  absl::StatusOr<ForwardResult> Execute(const ForwardCall& call, const Checked& c,
                                        KernelInstance* inst, Clock::time_point t0);
};

// Output descriptors from declarative rules; nullopt when some output takes
// its shape from the kernel's InferShape.
static absl::StatusOr<std::optional<std::vector<TensorDesc>>> RuleDescs(const ForwardCall& call,
                                                                 const Checked& c) {
  const OpDef& def = c.record->def;
  for (const auto& r : def.output_rules) {
    if (r.kind == registry::OutputRule::Kind::kInferShape) return std::nullopt;
  }
  const auto first_shapes = FirstShapes(call);
  std::vector<TensorDesc> outputs;
  for (size_t j = 0; j < def.outputs.size(); ++j) {
    registry::OutputRule rule;  // default: same as input 0
    if (!def.output_rules.empty()) rule = def.output_rules[j];
    OPJIT_ASSIGN_OR_RETURN(Shape shape, ApplyShapeRule(rule, static_cast<int>(j), first_shapes,
                                                       c.shaped, c.attrs));
    outputs.push_back({rule.dtype.empty() ? *c.output_dtypes[j] : rule.dtype, std::move(shape)});
  }
  return outputs;
}

absl::StatusOr<std::shared_ptr<KernelInstance>> Executor::Impl::Instance(const ForwardCall& call,
                                                                         const FlatInputs& flat,
                                                                         const Checked& c,
                                                                         const OpPlan& plan) {
  const std::string& entry = c.impl->entry;
  const std::string key = InstanceKey(call.ns, plan.kernel->cache_key, entry, flat, c.attrs);
  if (auto hit = instances->Get(key)) {
    instance_hits.fetch_add(1, std::memory_order_relaxed);
    return std::const_pointer_cast<KernelInstance>(hit);
  }
  OPJIT_ASSIGN_OR_RETURN(runner::InstanceSpec spec, SpecFor(call, flat, c, plan));
  OPJIT_ASSIGN_OR_RETURN(std::shared_ptr<KernelInstance> inst, runner->Instance(spec));
  instances->Put(key, inst, 1);
  return inst;
}

absl::StatusOr<runner::InstanceSpec> Executor::Impl::SpecFor(const ForwardCall& call,
                                                             const FlatInputs& flat,
                                                             const Checked& c, const OpPlan& plan) {
  const OpDef& def = c.record->def;
  runner::InstanceSpec spec;
  spec.ns = call.ns;
  spec.label = absl::StrCat(OpName(def), " v", c.record->version);
  spec.kernel = plan.kernel;
  spec.def = std::shared_ptr<const OpDef>(c.record, &c.record->def);
  spec.impl_index = plan.impl_index;
  spec.entry = c.impl->entry;
  spec.inputs = FlatInputDescs(flat);
  for (const registry::TensorParam* p : c.input_params) spec.input_names.push_back(p->name);
  // Output shapes from declarative rules are known now, so Init can run at
  // creation; with the kernel's InferShape they are known only after it.
  OPJIT_ASSIGN_OR_RETURN(auto rule_descs, RuleDescs(call, c));
  if (rule_descs) spec.outputs = *std::move(rule_descs);
  spec.attrs = c.attrs;
  return spec;
}

absl::StatusOr<std::vector<TensorDesc>> Executor::Impl::OutputDescs(const ForwardCall& call,
                                                                    const Checked& c,
                                                                    KernelInstance* inst) {
  const OpDef& def = c.record->def;
  const auto first_shapes = FirstShapes(call);
  std::vector<TensorDesc> out;
  std::optional<Shape> inferred;
  for (size_t j = 0; j < def.outputs.size(); ++j) {
    registry::OutputRule rule;  // default: same as input 0
    if (!def.output_rules.empty()) rule = def.output_rules[j];
    Shape shape;
    if (rule.kind == registry::OutputRule::Kind::kInferShape) {
      if (c.impl->target == registry::Target::kGpu) {
        return absl::FailedPreconditionError(absl::StrCat(
            "op ", OpName(def), ": output ", j, " takes its shape from the kernel's InferShape, "
            "which GPU implementations do not have; give it a declarative output rule"));
      }
      if (!inferred) {
        auto s = inst->InferShapeFor(call.quarantine_caller);
        if (!s.ok()) {
          return Annotate(s.status(), absl::StrCat("op ", OpName(def), ": "));
        }
        inferred = *std::move(s);
      }
      shape = *inferred;
    } else {
      OPJIT_ASSIGN_OR_RETURN(shape, ApplyShapeRule(rule, static_cast<int>(j), first_shapes,
                                                   c.shaped, c.attrs));
    }
    out.push_back({rule.dtype.empty() ? *c.output_dtypes[j] : rule.dtype, std::move(shape)});
  }
  return out;
}

absl::StatusOr<ForwardResult> Executor::Impl::Execute(const ForwardCall& call, const Checked& c,
                                                      KernelInstance* inst, Clock::time_point t0) {
  const OpDef& def = c.record->def;
  const bool has_deadline = call.deadline != Clock::time_point::max();
  Placed placed;
  OPJIT_RETURN_IF_ERROR(
      Place(call, c, c.out_descs, regions, options.max_inline_output_bytes, &placed));
  if (has_deadline && Clock::now() > call.deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("op ", OpName(def), ": the deadline passed before the kernel started"));
  }
  ForwardResult& result = placed.result;
  const auto k0 = Clock::now();
  double kernel_ms = -1;
  absl::Status run = inst->Run({placed.inputs, placed.outputs, call.deadline, &kernel_ms,
                                call.flush_caches, &result.flushed_bytes, call.quarantine_caller});
  // The runner's measure when it has one (an executor process reports the
  // kernel alone, not its own start or the hop); else the whole Run.
  result.kernel_ms = kernel_ms >= 0 ? kernel_ms : MsSince(k0);
  if (!run.ok()) {
    return Annotate(run, absl::StrCat("op ", OpName(def), ": "));
  }
  if (has_deadline && Clock::now() > call.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(
        "op ", OpName(def), ": the kernel finished after the deadline (it ran ",
        static_cast<int64_t>(result.kernel_ms), " ms); its outputs were dropped"));
  }
  // Copies for a backward context, taken before the caller's buffers can change.
  if (!call.save_inputs.empty() || !call.save_outputs.empty()) {
    result.saved_inputs.resize(call.inputs.size());
    size_t f = 0;
    for (size_t i = 0; i < call.inputs.size(); ++i) {
      const bool save = i < call.save_inputs.size() && call.save_inputs[i];
      for (size_t k = 0; k < call.inputs[i].size(); ++k, ++f) {
        if (!save) {
          result.saved_inputs[i].push_back(Placeholder(placed.inputs[f].desc));
          continue;
        }
        OPJIT_ASSIGN_OR_RETURN(SavedTensor s, Save(placed.inputs[f]));
        result.saved_inputs[i].push_back(std::move(s));
      }
    }
    result.saved_outputs.resize(placed.outputs.size());
    for (size_t j = 0; j < placed.outputs.size(); ++j) {
      if (j >= call.save_outputs.size() || !call.save_outputs[j]) {
        result.saved_outputs[j] = Placeholder(placed.outputs[j].desc);
        continue;
      }
      OPJIT_ASSIGN_OR_RETURN(result.saved_outputs[j], Save(placed.outputs[j]));
    }
  }
  result.record = c.record;
  result.server_ms = MsSince(t0);
  return std::move(result);
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Executor::~Executor() { impl_->pool.reset(); }

absl::StatusOr<std::unique_ptr<Executor>> Executor::Create(const ExecutorOptions& options,
                                                           registry::Registry* registry,
                                                           compiler::KernelCompiler* compiler,
                                                           tensor::RegionManager* regions,
                                                           runner::KernelRunner* runner) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->registry = registry;
  impl->compiler = compiler;
  impl->regions = regions;
  impl->runner = runner;
  impl->instances = std::make_unique<cache::LruCache<KernelInstance>>(
      options.instance_cache_entries, options.instance_cache_entries);
  impl->plans = std::make_unique<cache::LruCache<OpPlan>>(options.instance_cache_entries,
                                                          options.instance_cache_entries);
  impl->shapes = std::make_unique<cache::LruCache<Checked>>(options.instance_cache_entries,
                                                            options.instance_cache_entries);
  impl->pool = std::make_unique<ThreadPool>(options.pool_threads, options.max_queue, "opjit-exec");
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

void Executor::PrepareAsync(ForwardCall call, PrepareCallback done) {
  auto st = std::make_shared<CallState>();
  st->t0 = Clock::now();
  st->call = std::move(call);
  st->prepared = std::move(done);
  impl_->Start(std::move(st));
}

void Executor::ForwardAsync(ForwardCall call, Callback done) {
  impl_->calls.fetch_add(1, std::memory_order_relaxed);
  auto st = std::make_shared<CallState>();
  st->t0 = Clock::now();
  st->call = std::move(call);
  st->done = std::move(done);
  impl_->Start(std::move(st));
}

void Executor::Impl::Start(std::shared_ptr<CallState> st) {
  Impl* impl = this;
  Flatten(st->call, &st->flat_inputs);
  if (impl->TryCachedShape(st)) return;

  // The full path: look the op version up and check the call against it.
  const ForwardCall& c = st->call;
  const uint64_t generation = impl->registry->generation();
  auto record = impl->registry->GetShared(c.ns, c.op, c.version);
  if (!record.ok()) return impl->Fail(*st, record.status());
  st->building = std::make_shared<Checked>();
  Checked& checked = *st->building;
  checked.registry_generation = generation;
  checked.record = *std::move(record);
  const OpDef& def = checked.record->def;
  if (c.target == registry::Target::kGpu) {
    if (absl::Status gpu = runner::GpuRunner::Available(); !gpu.ok()) {
      return impl->Fail(*st, absl::UnavailableError(
                                 absl::StrCat("op ", OpName(def), " on GPU: ", gpu.message())));
    }
  }
  if (absl::Status s = CheckInputs(c, def, &checked); !s.ok()) return impl->Fail(*st, s);

  // A cached op version: its plan has the kernel and the parsed defaults.
  const std::string plan_key = PlanKey(checked.record.get(), c.target);
  if (std::shared_ptr<const OpPlan> plan = impl->plans->Get(plan_key)) {
    checked.impl = plan->impl;
    if (absl::Status s = CheckAttrs(c, def, plan->defaults, &checked); !s.ok()) {
      return impl->Fail(*st, s);
    }
    return impl->Dispatch(std::move(st), std::move(plan));
  }

  // First call of this version on this target: check, compile (usually a
  // compile-cache hit: registration compiled it), then remember the plan.
  int impl_index = -1;
  for (size_t i = 0; i < def.implementations.size(); ++i) {
    if (def.implementations[i].target == c.target) {
      checked.impl = &def.implementations[i];
      impl_index = static_cast<int>(i);
    }
  }
  if (checked.impl == nullptr) {
    return impl->Fail(*st, absl::InvalidArgumentError(absl::StrCat(
                               "op ", OpName(def), " v", checked.record->version, " has no ",
                               registry::TargetName(c.target), " implementation")));
  }
  auto defaults = ParseDefaults(def);
  if (!defaults.ok()) return impl->Fail(*st, defaults.status());
  if (absl::Status s = CheckAttrs(c, def, *defaults, &checked); !s.ok()) {
    return impl->Fail(*st, s);
  }
  auto plan = std::make_shared<OpPlan>();
  plan->record = checked.record;
  plan->impl = checked.impl;
  plan->impl_index = impl_index;
  plan->defaults = *std::move(defaults);
  impl->compiler->CompileAsync(
      compiler::JobForImplementation(def, *checked.impl),
      [impl, st, plan, plan_key](absl::StatusOr<compiler::CompileOutcome> compiled) {
        if (!compiled.ok()) return impl->Fail(*st, compiled.status());
        plan->kernel = compiled->kernel;
        impl->plans->Put(plan_key, plan, 1);
        impl->Dispatch(st, plan);
      });
}

bool Executor::Impl::TryCachedShape(std::shared_ptr<CallState>& st) {
  const ForwardCall& c = st->call;
  st->shape_key = ShapeKey(c);
  std::shared_ptr<const Checked> hit = shapes->Get(st->shape_key);
  if (hit == nullptr || hit->registry_generation != registry->generation()) return false;
  std::shared_ptr<KernelInstance> inst = hit->instance.lock();
  if (inst == nullptr) return false;  // evicted: look it up (or create it) again
  instance_hits.fetch_add(1, std::memory_order_relaxed);
  st->checked = std::move(hit);
  if (st->prepared) {
    AnswerPrepared(*st);
    return true;
  }
  Run(std::move(st), std::move(inst));
  return true;
}

void Executor::Impl::AnswerPrepared(CallState& st) {
  const Checked& c = *st.checked;
  PreparedCall p;
  p.record = c.record;
  p.target = c.impl->target;
  p.inputs = FlatInputDescs(st.flat_inputs);
  p.outputs = c.out_descs;
  for (auto* list : {&p.inputs, &p.outputs}) {
    for (const TensorDesc& d : *list) {
      auto bytes = tensor::ByteSize(d.dtype, d.shape);
      if (!bytes.ok()) return Fail(st, bytes.status());
      (list == &p.inputs ? p.input_bytes : p.output_bytes).push_back(*bytes);
    }
  }
  auto spec = SpecFor(st.call, st.flat_inputs, c, *c.plan);
  if (!spec.ok()) return Fail(st, spec.status());
  p.instance = *std::move(spec);
  p.instance.outputs = c.out_descs;
  st.prepared(std::move(p));
}

void Executor::Impl::Dispatch(std::shared_ptr<CallState> st, std::shared_ptr<const OpPlan> plan) {
  Checked& checked = *st->building;
  checked.plan = plan;
  auto fail = [&](const absl::Status& s) {
    Fail(*st, Annotate(s, absl::StrCat("op ", OpName(checked.record->def), ": ")));
  };
  auto created = Instance(st->call, st->flat_inputs, checked, *plan);
  if (!created.ok()) return fail(created.status());
  std::shared_ptr<KernelInstance> inst = *std::move(created);
  auto descs = OutputDescs(st->call, checked, inst.get());
  if (!descs.ok()) return Fail(*st, descs.status());
  checked.out_descs = *std::move(descs);
  checked.instance = inst;
  // Checked is complete: share it with later calls of this shape.
  st->checked = std::move(st->building);
  shapes->Put(st->shape_key, st->checked, 1);
  if (st->prepared) return AnswerPrepared(*st);
  Run(std::move(st), std::move(inst));
}

void Executor::Impl::Run(std::shared_ptr<CallState> st, std::shared_ptr<KernelInstance> inst) {
  const Checked& checked = *st->checked;
  // Device work (copies, launch, sync) and big inputs run on the pool, so a
  // slow kernel never holds a gRPC thread; small CPU calls run inline.
  if (checked.impl->target != registry::Target::kGpu &&
      checked.input_bytes <= options.inline_max_bytes) {
    return RunAndAnswer(*st, inst, /*on_pool=*/false);
  }
  SubmitOrRefuse([this, st, inst = std::move(inst)] { RunAndAnswer(*st, inst, true); }, st);
}

void Executor::Impl::RunAndAnswer(CallState& st, const std::shared_ptr<KernelInstance>& inst,
                                  bool on_pool) {
  auto r = Execute(st.call, *st.checked, inst.get(), st.t0);
  if (!r.ok()) return Fail(st, r.status());
  r->ran_inline = !on_pool;
  (on_pool ? pool_runs : inline_runs).fetch_add(1, std::memory_order_relaxed);
  st.done(*std::move(r));
}

absl::StatusOr<ForwardResult> Executor::Forward(ForwardCall call) {
  std::promise<absl::StatusOr<ForwardResult>> promise;
  auto future = promise.get_future();
  ForwardAsync(std::move(call), [&promise](absl::StatusOr<ForwardResult> r) {
    promise.set_value(std::move(r));
  });
  return future.get();
}

int Executor::LiftQuarantine(const std::string& ns, const std::string& name) {
  return impl_->runner->LiftQuarantine(absl::StrCat(ns, "/", name));
}

ExecutorStats Executor::Stats() const {
  ExecutorStats s;
  s.calls = impl_->calls.load();
  s.failures = impl_->failures.load();
  s.inline_runs = impl_->inline_runs.load();
  s.pool_runs = impl_->pool_runs.load();
  s.rejected = impl_->rejected.load();
  s.instances = impl_->instances->Stats().entries;
  s.instance_hits = impl_->instance_hits.load();
  s.queued = impl_->pool->queued();
  return s;
}

}  // namespace opjit::exec

#include "server/exec/executor.h"

#include <algorithm>
#include <atomic>
#include <future>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "absl/strings/str_join.h"
#include "server/cache/lru_cache.h"
#include "server/common/logging.h"
#include "server/common/status_macros.h"
#include "server/common/thread_pool.h"
#include "server/compiler/kernel_compiler.h"
#include "server/exec/gpu_runner.h"
#include "server/exec/shape_rules.h"
#include "server/registry/attr_value.h"
#include "server/registry/registry.h"
#include "server/tensor/region_manager.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::exec {
namespace {

using Clock = std::chrono::steady_clock;
using registry::OpDef;
using registry::ParamType;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string OpName(const OpDef& def) { return absl::StrCat(def.ns, "/", def.name); }

uint64_t Align64(uint64_t x) { return (x + 63) & ~uint64_t{63}; }

std::string ParamNames(const std::vector<registry::TensorParam>& params) {
  std::vector<std::string> names;
  for (const auto& p : params) names.push_back(p.name);
  return absl::StrJoin(names, ", ");
}

std::string ComboString(const registry::DtypeFormat& df, size_t n_inputs) {
  std::vector<std::string> in, out;
  for (size_t i = 0; i < df.io.size(); ++i) (i < n_inputs ? in : out).push_back(df.io[i].first);
  return absl::StrCat("(", absl::StrJoin(in, ", "), ") -> (", absl::StrJoin(out, ", "), ")");
}

struct OpPlan;

// What checking a call against its op version found. It depends only on the
// call's shape (namespace, op, version, target, input dtypes and shapes,
// attrs), so it is shared by every later call of the same shape while the
// registry is unchanged (see ShapeKey). Pointers point into `record`.
struct Checked {
  std::shared_ptr<const registry::OpRecord> record;
  const registry::Implementation* impl = nullptr;
  std::map<std::string, registry::AttrValue> attrs;
  absl::InlinedVector<const registry::TensorParam*, 4> input_params;  // one per flat input
  std::vector<bool> present;                                          // per declared input
  absl::InlinedVector<const std::string*, 4> output_dtypes;
  uint64_t input_bytes = 0;
  // Set once the kernel is at hand, before the entry is shared.
  std::shared_ptr<const OpPlan> plan;
  uint64_t registry_generation = 0;
  // The CPU kernel instance; not owned: the instance cache decides its life
  // (kernel data is destroyed on eviction), and an expired one is looked up
  // again.
  std::weak_ptr<const AotKernelInstance> instance;
};

// Per call: the call's input descriptors, flattened (dynamic groups
// expanded), pointing into the call.
using FlatInputs = absl::InlinedVector<const TensorDesc*, 4>;

void Flatten(const ForwardCall& call, FlatInputs* flat) {
  for (const auto& group : call.inputs) {
    for (const TensorArg& arg : group) flat->push_back(&arg.desc);
  }
}

// The shape of each declared input's first tensor (empty if absent), for
// declarative output rules.
std::vector<Shape> FirstShapes(const ForwardCall& call) {
  std::vector<Shape> shapes;
  shapes.reserve(call.inputs.size());
  for (const auto& group : call.inputs) shapes.push_back(group.empty() ? Shape{} : group[0].desc.shape);
  return shapes;
}

std::vector<TensorDesc> FlatInputDescs(const FlatInputs& flat) {
  std::vector<TensorDesc> descs;
  descs.reserve(flat.size());
  for (const TensorDesc* d : flat) descs.push_back(*d);
  return descs;
}

absl::Status CheckInputs(const ForwardCall& call, const OpDef& def, Checked* c) {
  if (call.inputs.size() != def.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "op ", OpName(def), " takes ", def.inputs.size(), " input(s) (", ParamNames(def.inputs),
        "), got ", call.inputs.size(), "; an absent optional input is an empty entry"));
  }
  std::vector<const std::string*> group_dtype(def.inputs.size(), nullptr);
  for (size_t i = 0; i < def.inputs.size(); ++i) {
    const auto& param = def.inputs[i];
    const auto& group = call.inputs[i];
    auto what = [&] { return absl::StrCat("input ", i, " (", param.name, ")"); };
    if (param.param_type == ParamType::kRequired && group.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " is required: give exactly one tensor, got ", group.size()));
    }
    if (param.param_type == ParamType::kOptional && group.size() > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " is optional: give zero or one tensor, got ", group.size()));
    }
    if (param.param_type == ParamType::kDynamic && group.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " is dynamic: give one or more tensors, got none"));
    }
    c->present.push_back(!group.empty());
    for (size_t k = 0; k < group.size(); ++k) {
      const TensorDesc& d = group[k].desc;
      if (!registry::IsKnownDtype(d.dtype)) {
        return absl::InvalidArgumentError(
            absl::StrCat(what(), ": unknown dtype \"", d.dtype, "\" (known: ",
                         absl::StrJoin(registry::KnownDtypes(), ", "), ")"));
      }
      if (k > 0 && d.dtype != group[0].desc.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            what(), ": the tensors of a dynamic input share one dtype; tensor ", k, " is ", d.dtype,
            ", tensor 0 is ", group[0].desc.dtype));
      }
      OPJIT_ASSIGN_OR_RETURN(uint64_t nbytes, tensor::ByteSize(d.dtype, d.shape));
      c->input_bytes += nbytes;
      c->input_params.push_back(&param);
    }
    if (!group.empty()) group_dtype[i] = &group[0].desc.dtype;
  }
  // The first dtype_format whose input dtypes match gives the output dtypes.
  const size_t n_in = def.inputs.size();
  for (const auto& df : def.dtype_formats) {
    bool match = true;
    for (size_t i = 0; i < n_in && match; ++i) {
      if (c->present[i] && df.io[i].first != *group_dtype[i]) match = false;
    }
    if (!match) continue;
    for (size_t j = 0; j < def.outputs.size(); ++j) c->output_dtypes.push_back(&df.io[n_in + j].first);
    return absl::OkStatus();
  }
  std::vector<std::string> got, accepted;
  for (size_t i = 0; i < n_in; ++i) got.push_back(c->present[i] ? *group_dtype[i] : "absent");
  for (const auto& df : def.dtype_formats) accepted.push_back(ComboString(df, n_in));
  return absl::InvalidArgumentError(absl::StrCat(
      "op ", OpName(def), " does not accept input dtypes (", absl::StrJoin(got, ", "),
      "); accepted combinations: ", absl::StrJoin(accepted, "; ")));
}

// The op's attr defaults, parsed once per op version.
absl::StatusOr<std::map<std::string, registry::AttrValue>> ParseDefaults(const OpDef& def) {
  std::map<std::string, registry::AttrValue> defaults;
  for (const auto& a : def.attrs) {
    if (a.default_value.empty()) continue;
    auto v = registry::ParseAttrValue(a.value_type, a.default_value);
    if (!v.ok()) {
      return absl::InternalError(absl::StrCat("op ", OpName(def), ": the stored default of attr ",
                                              a.name, " no longer parses: ", v.status().message()));
    }
    defaults.emplace(a.name, *std::move(v));
  }
  return defaults;
}

absl::Status CheckAttrs(const ForwardCall& call, const OpDef& def,
                        const std::map<std::string, registry::AttrValue>& defaults, Checked* c) {
  for (const auto& [name, arg] : call.attrs) {
    auto it = std::find_if(def.attrs.begin(), def.attrs.end(),
                           [&](const registry::AttrDef& a) { return a.name == name; });
    if (it == def.attrs.end()) {
      std::vector<std::string> names;
      for (const auto& a : def.attrs) names.push_back(a.name);
      return absl::InvalidArgumentError(absl::StrCat("op ", OpName(def), " has no attr \"", name,
                                                     "\" (", names.empty() ? "it has no attrs" : "attrs: ",
                                                     absl::StrJoin(names, ", "), ")"));
    }
    absl::StatusOr<registry::AttrValue> v =
        arg.is_text ? registry::ParseAttrValue(it->value_type, arg.text)
                    : registry::CoerceAttrValue(it->value_type, arg.value);
    if (!v.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("attr ", name, " (",
                                                     registry::ValueTypeName(it->value_type),
                                                     "): ", v.status().message()));
    }
    c->attrs[name] = *std::move(v);
  }
  for (const auto& a : def.attrs) {
    if (c->attrs.count(a.name)) continue;
    if (auto d = defaults.find(a.name); d != defaults.end()) {
      c->attrs.emplace(a.name, d->second);
    } else if (a.param_type == ParamType::kRequired) {
      return absl::InvalidArgumentError(absl::StrCat("op ", OpName(def), " needs attr \"", a.name,
                                                     "\" (", registry::ValueTypeName(a.value_type), ")"));
    }
  }
  return absl::OkStatus();
}

// Binary cache keys: exact, and cheap to build on every call.
void AppendBytes(std::string* key, const void* p, size_t n) {
  key->append(static_cast<const char*>(p), n);
}
template <typename T>
void AppendPod(std::string* key, T v) {
  AppendBytes(key, &v, sizeof v);
}
void AppendKeyValue(std::string* key, bool v) { AppendPod<uint8_t>(key, v); }
void AppendKeyValue(std::string* key, int64_t v) { AppendPod(key, v); }
void AppendKeyValue(std::string* key, double v) { AppendPod(key, v); }
void AppendKeyValue(std::string* key, const std::string& v) {
  AppendPod<uint64_t>(key, v.size());
  key->append(v);
}
void AppendKeyValue(std::string* key, const std::vector<bool>& v) {
  AppendPod<uint64_t>(key, v.size());
  for (bool b : v) AppendPod<uint8_t>(key, b);
}
template <typename T>
void AppendKeyValue(std::string* key, const std::vector<T>& v) {
  AppendPod<uint64_t>(key, v.size());
  for (const T& x : v) AppendKeyValue(key, x);
}

// Identifies a kernel instance: the loaded code (the instance holds it, so
// the address is not reused while the entry lives), the entry, the input
// dtypes and shapes, and the attrs.
std::string InstanceKey(const loader::LoadedKernel* kernel, const std::string& entry,
                        absl::Span<const TensorDesc* const> inputs,
                        const std::map<std::string, registry::AttrValue>& attrs) {
  std::string key;
  key.reserve(128);
  AppendPod(&key, kernel);
  AppendKeyValue(&key, entry);
  for (const TensorDesc* d : inputs) {
    AppendKeyValue(&key, d->dtype);
    AppendKeyValue(&key, d->shape);
  }
  for (const auto& [name, v] : attrs) {
    AppendKeyValue(&key, name);
    AppendPod<uint8_t>(&key, static_cast<uint8_t>(v.index()));
    std::visit([&key](const auto& x) { AppendKeyValue(&key, x); }, v);
  }
  return key;
}

// What the executor keeps per op version and target once the kernel is at
// hand, so a call of a cached op skips the compile cache (its key hashing
// and header checks) and the parsing of attr defaults. (Headers edited under
// a running daemon reach a registered op when it is registered again, as a
// new version.)
struct OpPlan {
  std::shared_ptr<const registry::OpRecord> record;
  const registry::Implementation* impl = nullptr;  // in record
  std::shared_ptr<const compiler::CompiledKernel> kernel;
  std::map<std::string, registry::AttrValue> defaults;
};

// The plan cache key: the record's address (the plan holds the record, so
// the address is not reused while the entry lives) and the target. Short
// enough for the small-string buffer.
std::string PlanKey(const registry::OpRecord* record, registry::Target target) {
  std::string key;
  AppendPod(&key, record);
  AppendPod(&key, static_cast<uint8_t>(target));
  return key;
}

// The call-shape cache key: everything Checked depends on besides the
// registry's contents. Tensor placement, offsets and bytes are not in it.
std::string ShapeKey(const ForwardCall& call) {
  std::string key;
  key.reserve(96);
  AppendKeyValue(&key, call.ns);
  AppendKeyValue(&key, call.op);
  AppendPod(&key, call.version);
  AppendPod(&key, static_cast<uint8_t>(call.target));
  AppendPod<uint64_t>(&key, call.inputs.size());
  for (const auto& group : call.inputs) {
    AppendPod<uint64_t>(&key, group.size());
    for (const TensorArg& arg : group) {
      AppendKeyValue(&key, arg.desc.dtype);
      AppendKeyValue(&key, arg.desc.shape);
    }
  }
  for (const auto& [name, arg] : call.attrs) {
    AppendKeyValue(&key, name);
    AppendPod<uint8_t>(&key, arg.is_text);
    if (arg.is_text) {
      AppendKeyValue(&key, arg.text);
    } else {
      AppendPod<uint8_t>(&key, static_cast<uint8_t>(arg.value.index()));
      std::visit([&key](const auto& x) { AppendKeyValue(&key, x); }, arg.value);
    }
  }
  return key;
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
  Clock::time_point t0;
};

}  // namespace

struct Executor::Impl {
  ExecutorOptions options;
  registry::Registry* registry = nullptr;
  compiler::KernelCompiler* compiler = nullptr;
  tensor::RegionManager* regions = nullptr;
  std::unique_ptr<cache::LruCache<AotKernelInstance>> instances;
  std::unique_ptr<cache::LruCache<OpPlan>> plans;
  std::unique_ptr<cache::LruCache<Checked>> shapes;  // by ShapeKey
  std::unique_ptr<GpuRunner> gpu_runner;
  std::unique_ptr<ThreadPool> pool;
  std::atomic<uint64_t> calls{0}, failures{0}, inline_runs{0}, pool_runs{0}, rejected{0};
  std::atomic<uint64_t> instance_hits{0};

  void Fail(CallState& st, absl::Status s) {
    failures.fetch_add(1, std::memory_order_relaxed);
    st.done(std::move(s));
  }

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
  // Runs the checked call with its kernel instance (CPU) or kernel (GPU).
  void Run(std::shared_ptr<CallState> st, std::shared_ptr<const AotKernelInstance> inst);
  // Runs on the thread that decided where the call runs, then answers.
  void RunAndAnswer(CallState& st, std::shared_ptr<const AotKernelInstance> inst,
                    std::shared_ptr<const compiler::CompiledKernel> gpu_kernel, bool on_pool);

  absl::StatusOr<std::shared_ptr<const AotKernelInstance>> Instance(const ForwardCall& call,
                                                                    const FlatInputs& flat,
                                                                    const Checked& c,
                                                                    const OpPlan& plan);
  // Output descriptors from rules or the kernel's InferShape. `inst` is null
  // for GPU kernels, whose outputs follow declarative rules.
  absl::StatusOr<std::vector<TensorDesc>> OutputDescs(const ForwardCall& call, const Checked& c,
                                                      const AotKernelInstance* inst);
  // Resolves tensors, places outputs and runs the kernel: the CPU instance
  // `inst`, or else the GPU kernel `gpu_kernel`.
  absl::StatusOr<ForwardResult> Execute(const ForwardCall& call, const Checked& c,
                                        std::shared_ptr<const AotKernelInstance> inst,
                                        std::shared_ptr<const compiler::CompiledKernel> gpu_kernel,
                                        Clock::time_point t0);
};

absl::StatusOr<std::shared_ptr<const AotKernelInstance>> Executor::Impl::Instance(
    const ForwardCall& call, const FlatInputs& flat, const Checked& c, const OpPlan& plan) {
  const std::string& entry = c.impl->entry;
  const std::string key = InstanceKey(plan.kernel->kernel.get(), entry, flat, c.attrs);
  if (auto hit = instances->Get(key)) {
    instance_hits.fetch_add(1, std::memory_order_relaxed);
    return hit;
  }
  const OpDef& def = c.record->def;
  bool infer = false;
  for (const auto& r : def.output_rules) infer |= r.kind == registry::OutputRule::Kind::kInferShape;
  // Output shapes from declarative rules are known now, so Init can run at
  // creation; with the kernel's InferShape they are known only after it.
  std::vector<TensorDesc> outputs;
  if (!infer) {
    const std::vector<Shape> first_shapes = FirstShapes(call);
    for (size_t j = 0; j < def.outputs.size(); ++j) {
      registry::OutputRule rule;  // default: same as input 0
      if (!def.output_rules.empty()) rule = def.output_rules[j];
      OPJIT_ASSIGN_OR_RETURN(Shape shape, ApplyShapeRule(rule, static_cast<int>(j), first_shapes,
                                                         c.present, c.attrs));
      outputs.push_back({rule.dtype.empty() ? *c.output_dtypes[j] : rule.dtype, std::move(shape)});
    }
  }
  AotKernelOptions opts;
  // A kernel with Init may keep state in its kernel data; calls into one
  // instance are serialised then. Without Init, calls run concurrently.
  opts.serialize_runs = plan.kernel->kernel->Find(entry + "Init") != nullptr;
  OPJIT_ASSIGN_OR_RETURN(auto created,
                         AotKernelInstance::Create(plan.kernel->kernel, entry, FlatInputDescs(flat),
                                                   std::move(outputs), c.attrs, opts));
  std::shared_ptr<const AotKernelInstance> inst(std::move(created));
  instances->Put(key, inst, 1);
  return inst;
}

absl::StatusOr<std::vector<TensorDesc>> Executor::Impl::OutputDescs(const ForwardCall& call,
                                                                    const Checked& c,
                                                                    const AotKernelInstance* inst) {
  const OpDef& def = c.record->def;
  const std::vector<Shape> first_shapes = FirstShapes(call);
  std::vector<TensorDesc> out;
  std::optional<Shape> inferred;
  for (size_t j = 0; j < def.outputs.size(); ++j) {
    registry::OutputRule rule;  // default: same as input 0
    if (!def.output_rules.empty()) rule = def.output_rules[j];
    Shape shape;
    if (rule.kind == registry::OutputRule::Kind::kInferShape) {
      if (inst == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "op ", OpName(def), ": output ", j, " takes its shape from the kernel's InferShape, "
            "which GPU implementations do not have; give it a declarative output rule"));
      }
      if (!inferred) {
        auto s = inst->InferShape();
        if (!s.ok()) {
          return absl::Status(s.status().code(),
                              absl::StrCat("op ", OpName(def), ": ", s.status().message()));
        }
        inferred = *std::move(s);
      }
      shape = *inferred;
    } else {
      OPJIT_ASSIGN_OR_RETURN(shape, ApplyShapeRule(rule, static_cast<int>(j), first_shapes,
                                                   c.present, c.attrs));
    }
    out.push_back({rule.dtype.empty() ? *c.output_dtypes[j] : rule.dtype, std::move(shape)});
  }
  return out;
}

absl::StatusOr<ForwardResult> Executor::Impl::Execute(
    const ForwardCall& call, const Checked& c, std::shared_ptr<const AotKernelInstance> inst,
    std::shared_ptr<const compiler::CompiledKernel> gpu_kernel, Clock::time_point t0) {
  const OpDef& def = c.record->def;
  // An instance whose Init ran knows its outputs; otherwise rules or InferShape.
  std::vector<TensorDesc> computed;
  const std::vector<TensorDesc>* known = inst != nullptr ? &inst->outputs() : nullptr;
  if (known == nullptr || known->empty()) {
    OPJIT_ASSIGN_OR_RETURN(computed, OutputDescs(call, c, inst.get()));
    known = &computed;
  }
  const std::vector<TensorDesc>& out_descs = *known;
  const bool has_deadline = call.deadline != Clock::time_point::max();

  // Inputs: every reference is checked against its region before a pointer exists.
  absl::InlinedVector<HostTensor, 4> inputs;
  std::vector<tensor::TensorView> views;  // keeps regions mapped until we return
  size_t flat = 0;
  for (size_t i = 0; i < call.inputs.size(); ++i) {
    for (size_t k = 0; k < call.inputs[i].size(); ++k, ++flat) {
      const TensorArg& arg = call.inputs[i][k];
      // Named only for messages; not built on the hot path.
      auto what = [&] {
        return absl::StrCat("inputs[", i, "]",
                            call.inputs[i].size() > 1 ? absl::StrCat("[", k, "]") : "", " (",
                            def.inputs[i].name, ")");
      };
      OPJIT_ASSIGN_OR_RETURN(uint64_t nbytes, tensor::ByteSize(arg.desc.dtype, arg.desc.shape));
      if (arg.in_shm) {
        OPJIT_ASSIGN_OR_RETURN(auto region, regions->Acquire(call.ns, arg.region));
        OPJIT_ASSIGN_OR_RETURN(
            auto view, tensor::Resolve(std::move(region),
                                       {arg.region, arg.offset, arg.desc.dtype, arg.desc.shape}, what()));
        inputs.push_back({view.data, arg.desc});
        views.push_back(std::move(view));
      } else {
        if (arg.inline_bytes.size() != nbytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              what(), ": ", arg.inline_bytes.size(), " inline bytes, but ", DescString(arg.desc),
              " needs ", nbytes));
        }
        // The request's bytes are this call's private copy; kernels get void*.
        inputs.push_back({const_cast<char*>(arg.inline_bytes.data()), arg.desc});
      }
    }
  }

  // Outputs.
  const size_t n_out = out_descs.size();
  if (!call.outputs.empty() && call.outputs.size() != 1 && call.outputs.size() != n_out) {
    return absl::InvalidArgumentError(absl::StrCat("give one output placement per output (", n_out,
                                                   "), one for all, or none; got ",
                                                   call.outputs.size()));
  }
  ForwardResult result;
  result.version = c.record->version;
  result.outputs.resize(n_out);
  absl::InlinedVector<HostTensor, 4> outputs(n_out);
  std::vector<tensor::TensorView> out_views;
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
    outputs[j].desc = out_descs[j];
    switch (place.kind) {
      case OutputPlacement::Kind::kInline:
        inline_out += nbytes;
        if (inline_out > options.max_inline_output_bytes) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "op ", OpName(def), ": the outputs need ", inline_out,
              "+ bytes inline, over the server's ", options.max_inline_output_bytes,
              "-byte message limit; place them in shared memory (alloc_in or shm)"));
        }
        r.inline_bytes.resize(nbytes);
        outputs[j].data = r.inline_bytes.data();
        break;
      case OutputPlacement::Kind::kShm:
      case OutputPlacement::Kind::kAllocIn: {
        if (place.kind == OutputPlacement::Kind::kShm && call.outputs.size() == 1 && n_out > 1) {
          return absl::InvalidArgumentError(
              "one fixed shm placement cannot hold several outputs; use alloc_in or one per output");
        }
        OPJIT_ASSIGN_OR_RETURN(auto region, regions->Acquire(call.ns, place.region));
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
            auto view, tensor::Resolve(std::move(region),
                                       {place.region, offset, out_descs[j].dtype, out_descs[j].shape},
                                       what()));
        for (const auto& in : views) {
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
        r.in_shm = true;
        r.region = place.region;
        r.offset = offset;
        outputs[j].data = view.data;
        out_views.push_back(std::move(view));
        break;
      }
    }
  }

  if (has_deadline && Clock::now() > call.deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("op ", OpName(def), ": the deadline passed before the kernel started"));
  }
  const auto k0 = Clock::now();
  absl::Status run;
  if (inst != nullptr) {
    run = inst->Run(inputs, outputs);
  } else {
    std::vector<std::string> input_names;
    for (const registry::TensorParam* p : c.input_params) input_names.push_back(p->name);
    run = gpu_runner->Run(def, *c.impl, *gpu_kernel, c.attrs, inputs, input_names, outputs);
  }
  result.kernel_ms = MsSince(k0);
  if (!run.ok()) {
    return absl::Status(run.code(), absl::StrCat("op ", OpName(def), ": ", run.message()));
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
        if (!save) continue;
        auto n = tensor::ByteSize(inputs[f].desc.dtype, inputs[f].desc.shape);
        result.saved_inputs[i].push_back(
            {inputs[f].desc, std::string(static_cast<const char*>(inputs[f].data), n.value_or(0))});
      }
    }
    result.saved_outputs.resize(n_out);
    for (size_t j = 0; j < n_out; ++j) {
      if (j >= call.save_outputs.size() || !call.save_outputs[j]) continue;
      auto n = tensor::ByteSize(outputs[j].desc.dtype, outputs[j].desc.shape);
      result.saved_outputs[j] = {outputs[j].desc, std::string(static_cast<const char*>(outputs[j].data),
                                                             n.value_or(0))};
    }
  }
  result.record = c.record;
  result.server_ms = MsSince(t0);
  return result;
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Executor::~Executor() { impl_->pool.reset(); }

absl::StatusOr<std::unique_ptr<Executor>> Executor::Create(const ExecutorOptions& options,
                                                           registry::Registry* registry,
                                                           compiler::KernelCompiler* compiler,
                                                           tensor::RegionManager* regions) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->registry = registry;
  impl->compiler = compiler;
  impl->regions = regions;
  impl->instances = std::make_unique<cache::LruCache<AotKernelInstance>>(
      options.instance_cache_entries, options.instance_cache_entries);
  impl->plans = std::make_unique<cache::LruCache<OpPlan>>(options.instance_cache_entries,
                                                          options.instance_cache_entries);
  impl->shapes = std::make_unique<cache::LruCache<Checked>>(options.instance_cache_entries,
                                                            options.instance_cache_entries);
  impl->gpu_runner = std::make_unique<GpuRunner>(options.scratch_dir);
  impl->pool = std::make_unique<ThreadPool>(options.pool_threads, options.max_queue, "opjit-exec");
  return std::unique_ptr<Executor>(new Executor(std::move(impl)));
}

void Executor::ForwardAsync(ForwardCall call, Callback done) {
  Impl* impl = impl_.get();
  impl->calls.fetch_add(1, std::memory_order_relaxed);
  auto st = std::make_shared<CallState>();
  st->t0 = Clock::now();
  st->call = std::move(call);
  st->done = std::move(done);
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
    if (absl::Status gpu = GpuRunner::Available(); !gpu.ok()) {
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
  for (const auto& im : def.implementations) {
    if (im.target == c.target) checked.impl = &im;
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
  if (c.target == registry::Target::kGpu && !GpuRunner::Available().ok()) return false;
  st->shape_key = ShapeKey(c);
  std::shared_ptr<const Checked> hit = shapes->Get(st->shape_key);
  if (hit == nullptr || hit->registry_generation != registry->generation()) return false;
  std::shared_ptr<const AotKernelInstance> inst;
  if (!hit->plan->kernel->gpu) {
    inst = hit->instance.lock();
    if (inst == nullptr) return false;  // evicted: look it up (or create it) again
    instance_hits.fetch_add(1, std::memory_order_relaxed);
  }
  st->checked = std::move(hit);
  Run(std::move(st), std::move(inst));
  return true;
}

void Executor::Impl::Dispatch(std::shared_ptr<CallState> st, std::shared_ptr<const OpPlan> plan) {
  Checked& checked = *st->building;
  checked.plan = plan;
  std::shared_ptr<const AotKernelInstance> inst;
  if (!plan->kernel->gpu) {
    auto created = Instance(st->call, st->flat_inputs, checked, *plan);
    if (!created.ok()) {
      return Fail(*st, absl::Status(created.status().code(),
                                    absl::StrCat("op ", OpName(checked.record->def), ": ",
                                                 created.status().message())));
    }
    inst = *std::move(created);
    checked.instance = inst;
  }
  // Checked is complete: share it with later calls of this shape.
  st->checked = std::move(st->building);
  shapes->Put(st->shape_key, st->checked, 1);
  Run(std::move(st), std::move(inst));
}

void Executor::Impl::Run(std::shared_ptr<CallState> st,
                         std::shared_ptr<const AotKernelInstance> inst) {
  const Checked& checked = *st->checked;
  if (checked.plan->kernel->gpu) {
    // Device work (copies, launch, sync) always runs on the pool.
    auto kernel = checked.plan->kernel;
    return SubmitOrRefuse([this, st, kernel] { RunAndAnswer(*st, nullptr, kernel, true); }, st);
  }
  if (checked.input_bytes <= options.inline_max_bytes) {
    return RunAndAnswer(*st, std::move(inst), nullptr, /*on_pool=*/false);
  }
  SubmitOrRefuse([this, st, inst = std::move(inst)] { RunAndAnswer(*st, inst, nullptr, true); },
                 st);
}

void Executor::Impl::RunAndAnswer(CallState& st, std::shared_ptr<const AotKernelInstance> inst,
                                  std::shared_ptr<const compiler::CompiledKernel> gpu_kernel,
                                  bool on_pool) {
  auto r = Execute(st.call, *st.checked, std::move(inst), std::move(gpu_kernel), st.t0);
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

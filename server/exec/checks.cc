#include "server/exec/checks.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"
#include "server/registry/attr_value.h"
#include "server/tensor/tensor_ref.h"

namespace opjit::exec {
namespace {

using registry::OpDef;
using registry::ParamType;

std::string ParamNames(const std::vector<registry::TensorParam>& params) {
  std::vector<std::string> names;
  for (const auto& p : params) names.push_back(p.name);
  return absl::StrJoin(names, ", ");
}

std::string ComboString(const registry::DtypeFormat& df, size_t n_inputs) {
  std::vector<std::string> in, out;
  for (size_t i = 0; i < df.io.size(); ++i) {
    // MindSpore's DataType.None_None: any dtype (or an absent optional input).
    (i < n_inputs ? in : out).push_back(df.io[i].first.empty() ? "None" : df.io[i].first);
  }
  return absl::StrCat("(", absl::StrJoin(in, ", "), ") -> (", absl::StrJoin(out, ", "), ")");
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

// The registry's own copy of a known dtype name: lives as long as the
// process, so a Checked shared by later calls may point at it.
const std::string* StableDtype(const std::string& dtype) {
  for (const std::string& d : registry::KnownDtypes()) {
    if (d == dtype) return &d;
  }
  return nullptr;
}

}  // namespace

std::string OpName(const OpDef& def) { return absl::StrCat(def.ns, "/", def.name); }

void Flatten(const ForwardCall& call, FlatInputs* flat) {
  for (const auto& group : call.inputs) {
    for (const TensorArg& arg : group) flat->push_back(&arg.desc);
  }
}

std::vector<std::vector<int64_t>> FirstShapes(const ForwardCall& call) {
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(call.inputs.size());
  for (const auto& group : call.inputs) {
    shapes.push_back(group.empty() ? std::vector<int64_t>{} : group[0].desc.shape);
  }
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
    c->shaped.push_back(!group.empty() && !group[0].is_null());
    for (size_t k = 0; k < group.size(); ++k) {
      const TensorDesc& d = group[k].desc;
      if (group[k].is_null() && !d.shape.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(what(), ": a null tensor has rank 0"));
      }
      if (!registry::IsKnownDtype(d.dtype)) {
        return absl::InvalidArgumentError(
            absl::StrCat(what(), ": unknown dtype \"", Excerpt(d.dtype), "\" (known: ",
                         absl::StrJoin(registry::KnownDtypes(), ", "), ")"));
      }
      if (k > 0 && d.dtype != group[0].desc.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            what(), ": the tensors of a dynamic input share one dtype; tensor ", k, " is ", d.dtype,
            ", tensor 0 is ", group[0].desc.dtype));
      }
      OPJIT_ASSIGN_OR_RETURN(uint64_t nbytes, tensor::ByteSize(d.dtype, d.shape));
      if (!group[k].is_null()) c->input_bytes += nbytes;
      c->input_params.push_back(&param);
    }
    if (!group.empty()) group_dtype[i] = &group[0].desc.dtype;
  }
  // The first dtype_format whose input dtypes match gives the output dtypes.
  // An empty dtype (MindSpore's DataType.None_None) at a required or dynamic
  // input matches any dtype (the kernel checks); at an optional input it
  // matches only its absence; at an output it is the output rule's dtype,
  // else the dtype of the call's first input given.
  const size_t n_in = def.inputs.size();
  for (const auto& df : def.dtype_formats) {
    bool match = true;
    for (size_t i = 0; i < n_in && match; ++i) {
      if (!c->present[i]) continue;
      const std::string& want = df.io[i].first;
      if (want.empty() && def.inputs[i].param_type != ParamType::kOptional) continue;
      if (want != *group_dtype[i]) match = false;
    }
    if (!match) continue;
    for (size_t j = 0; j < def.outputs.size(); ++j) {
      const std::string* dtype = &df.io[n_in + j].first;
      if (dtype->empty()) {
        if (j < def.output_rules.size() && !def.output_rules[j].dtype.empty()) {
          dtype = &def.output_rules[j].dtype;
        } else {
          size_t first = 0;
          while (first < n_in && !c->present[first]) ++first;
          dtype = first < n_in ? StableDtype(*group_dtype[first]) : nullptr;
          if (dtype == nullptr) {
            return absl::InvalidArgumentError(absl::StrCat(
                "op ", OpName(def), ": output ", j, " (", def.outputs[j].name,
                ") takes the dtype of the call's first input (its dtype_format is None and its "
                "output rule gives no dtype), but the call gives no input"));
          }
        }
      }
      c->output_dtypes.push_back(dtype);
    }
    return absl::OkStatus();
  }
  std::vector<std::string> got, accepted;
  for (size_t i = 0; i < n_in; ++i) got.push_back(c->present[i] ? *group_dtype[i] : "absent");
  for (const auto& df : def.dtype_formats) accepted.push_back(ComboString(df, n_in));
  return absl::InvalidArgumentError(absl::StrCat(
      "op ", OpName(def), " does not accept input dtypes (", absl::StrJoin(got, ", "),
      "); accepted combinations: ", absl::StrJoin(accepted, "; ")));
}

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
      return absl::InvalidArgumentError(absl::StrCat("op ", OpName(def), " has no attr \"",
                                                     Excerpt(name),
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

std::string InstanceKey(const std::string& ns, const std::string& kernel_key, const std::string& entry,
                        absl::Span<const TensorDesc* const> inputs,
                        const std::map<std::string, registry::AttrValue>& attrs) {
  std::string key;
  key.reserve(128);
  AppendKeyValue(&key, ns);
  AppendKeyValue(&key, kernel_key);
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
      AppendKeyValue(&key, arg.is_null());
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

}  // namespace opjit::exec

#include "server/registry/canonical.h"

#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/registry/json_kind.h"
#include "server/common/sha256.h"
#include "server/common/text.h"
#include "server/common/status_macros.h"

namespace opjit::registry {
namespace {

using Json = nlohmann::ordered_json;

Json TensorParamsJson(const std::vector<TensorParam>& params) {
  Json out = Json::array();
  for (const TensorParam& p : params) {
    Json j = Json::object();
    j["index"] = p.index;
    j["name"] = p.name;
    j["param_type"] = ParamTypeName(p.param_type);
    out.push_back(std::move(j));
  }
  return out;
}

Json StringsJson(const std::vector<std::string>& v) {
  Json out = Json::array();
  for (const auto& s : v) out.push_back(s);
  return out;
}

// ---- Reading --------------------------------------------------------------

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}


absl::Status Expect(const Json& j, const std::string& path, bool ok, const char* want) {
  if (ok) return absl::OkStatus();
  return Bad(path, absl::StrCat("expected ", want, ", got ", JsonKindName(j)));
}

// Reads the members of an object, refusing keys not in `known`.
absl::Status CheckObject(const Json& j, const std::string& path,
                         std::initializer_list<const char*> known) {
  OPJIT_RETURN_IF_ERROR(Expect(j, path, j.is_object(), "an object"));
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool found = false;
    for (const char* k : known) found = found || it.key() == k;
    if (!found) {
      return Bad(path.empty() ? it.key() : absl::StrCat(path, ".", it.key()), "unknown key");
    }
  }
  return absl::OkStatus();
}

std::string Join(const std::string& path, const char* key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}

absl::Status ReadString(const Json& obj, const std::string& path, const char* key,
                        std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  std::string p = Join(path, key);
  OPJIT_RETURN_IF_ERROR(Expect(*it, p, it->is_string(), "a string"));
  *out = it->get_ref<const std::string&>();
  return absl::OkStatus();
}

absl::Status ReadBool(const Json& obj, const std::string& path, const char* key, bool* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  OPJIT_RETURN_IF_ERROR(Expect(*it, Join(path, key), it->is_boolean(), "a bool"));
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status ReadInt64(const Json& j, const std::string& path, int64_t* out) {
  if (j.is_number_unsigned()) {
    if (j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Bad(path, "integer out of range");
    }
    *out = static_cast<int64_t>(j.get<uint64_t>());
    return absl::OkStatus();
  }
  OPJIT_RETURN_IF_ERROR(Expect(j, path, j.is_number_integer(), "an integer"));
  *out = j.get<int64_t>();
  return absl::OkStatus();
}

absl::Status ReadIntField(const Json& obj, const std::string& path, const char* key, int* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  int64_t v = 0;
  OPJIT_RETURN_IF_ERROR(ReadInt64(*it, Join(path, key), &v));
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    return Bad(Join(path, key), "integer out of range");
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

// Calls read(element, element_path) for each element of array `key`.
template <typename F>
absl::Status ReadArray(const Json& obj, const std::string& path, const char* key, F read) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  std::string p = Join(path, key);
  OPJIT_RETURN_IF_ERROR(Expect(*it, p, it->is_array(), "an array"));
  for (size_t i = 0; i < it->size(); ++i) {
    OPJIT_RETURN_IF_ERROR(read((*it)[i], absl::StrCat(p, "[", i, "]")));
  }
  return absl::OkStatus();
}

absl::Status ReadStrings(const Json& obj, const std::string& path, const char* key,
                         std::vector<std::string>* out) {
  out->clear();
  return ReadArray(obj, path, key, [&](const Json& e, const std::string& p) {
    OPJIT_RETURN_IF_ERROR(Expect(e, p, e.is_string(), "a string"));
    out->push_back(e.get<std::string>());
    return absl::OkStatus();
  });
}

template <typename T>
absl::Status ReadEnum(const Json& obj, const std::string& path, const char* key,
                      std::optional<T> (*parse)(const std::string&), const char* want, T* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  std::string p = Join(path, key);
  OPJIT_RETURN_IF_ERROR(Expect(*it, p, it->is_string(), want));
  std::optional<T> v = parse(it->get<std::string>());
  if (!v) return Bad(p, absl::StrCat("expected ", want, ", got \"", it->get<std::string>(), "\""));
  *out = *v;
  return absl::OkStatus();
}

absl::Status ReadTensorParams(const Json& obj, const char* key, std::vector<TensorParam>* out) {
  return ReadArray(obj, "", key, [&](const Json& e, const std::string& p) {
    OPJIT_RETURN_IF_ERROR(CheckObject(e, p, {"index", "name", "param_type"}));
    TensorParam tp;
    OPJIT_RETURN_IF_ERROR(ReadIntField(e, p, "index", &tp.index));
    OPJIT_RETURN_IF_ERROR(ReadString(e, p, "name", &tp.name));
    OPJIT_RETURN_IF_ERROR(ReadEnum(e, p, "param_type", &ParseParamType,
                                   "required, optional or dynamic", &tp.param_type));
    out->push_back(std::move(tp));
    return absl::OkStatus();
  });
}

}  // namespace

const char* OutputRuleKindName(OutputRule::Kind kind) {
  switch (kind) {
    case OutputRule::Kind::kSameAsInput:
      return "same_as_input";
    case OutputRule::Kind::kBroadcast:
      return "broadcast";
    case OutputRule::Kind::kReduce:
      return "reduce";
    case OutputRule::Kind::kExplicit:
      return "explicit";
    case OutputRule::Kind::kInferShape:
      return "infer_shape";
  }
  return "unknown";
}

std::optional<OutputRule::Kind> ParseOutputRuleKind(const std::string& s) {
  for (auto k :
       {OutputRule::Kind::kSameAsInput, OutputRule::Kind::kBroadcast, OutputRule::Kind::kReduce,
        OutputRule::Kind::kExplicit, OutputRule::Kind::kInferShape}) {
    if (s == OutputRuleKindName(k)) return k;
  }
  return std::nullopt;
}

std::string ToJson(const OpDef& def) {
  Json j = Json::object();
  j["ns"] = def.ns;
  j["name"] = def.name;
  j["inputs"] = TensorParamsJson(def.inputs);
  j["outputs"] = TensorParamsJson(def.outputs);
  Json attrs = Json::array();
  for (const AttrDef& a : def.attrs) {
    Json ja = Json::object();
    ja["name"] = a.name;
    ja["param_type"] = ParamTypeName(a.param_type);
    ja["value_type"] = ValueTypeName(a.value_type);
    ja["default_value"] = a.default_value;
    attrs.push_back(std::move(ja));
  }
  j["attrs"] = std::move(attrs);
  Json dfs = Json::array();
  for (const DtypeFormat& df : def.dtype_formats) {
    Json jdf = Json::array();
    for (const auto& [dtype, format] : df.io) jdf.push_back(Json::array({dtype, format}));
    dfs.push_back(std::move(jdf));
  }
  j["dtype_formats"] = std::move(dfs);
  Json impls = Json::array();
  for (const Implementation& impl : def.implementations) {
    Json ji = Json::object();
    ji["target"] = TargetName(impl.target);
    ji["language"] = impl.language;
    ji["source"] = impl.source;
    ji["entry"] = impl.entry;
    ji["compile_options"] = StringsJson(impl.compile_options);
    ji["libraries"] = StringsJson(impl.libraries);
    ji["attr_names"] = StringsJson(impl.attr_names);
    // Written only when set, so the canonical form (and content hash) of
    // definitions without one is what it was before launch specs existed.
    if (!impl.launch.empty()) {
      Json jl = Json::object();
      jl["kernel"] = impl.launch.kernel;
      jl["grid"] = StringsJson(impl.launch.grid);
      jl["block"] = StringsJson(impl.launch.block);
      jl["shared_mem"] = impl.launch.shared_mem;
      jl["args"] = StringsJson(impl.launch.args);
      jl["archs"] = StringsJson(impl.launch.archs);
      ji["launch"] = std::move(jl);
    }
    // Only when there are any, for the same reason: a one-file kernel keeps
    // its hash. In the order given (a name is unique; the order is the
    // client's, and the compile's key follows it too).
    if (!impl.files.empty()) {
      Json jf = Json::array();
      for (const SourceFile& f : impl.files) {
        Json e = Json::object();
        e["name"] = f.name;
        e["content"] = f.content;
        jf.push_back(std::move(e));
      }
      ji["files"] = std::move(jf);
    }
    impls.push_back(std::move(ji));
  }
  j["implementations"] = std::move(impls);
  Json rules = Json::array();
  for (const OutputRule& r : def.output_rules) {
    Json jr = Json::object();
    jr["kind"] = OutputRuleKindName(r.kind);
    jr["input"] = r.input;
    jr["inputs"] = r.inputs;
    jr["axis_attr"] = r.axis_attr;
    jr["keep_dim"] = r.keep_dim;
    jr["keep_dim_attr"] = r.keep_dim_attr;
    jr["shape"] = r.shape;
    jr["dtype"] = r.dtype;
    rules.push_back(std::move(jr));
  }
  j["output_rules"] = std::move(rules);
  Json bw = Json::object();
  bw["op"] = def.backward.op;
  bw["save_for_backward"] = StringsJson(def.backward.save_for_backward);
  bw["non_differentiable"] = StringsJson(def.backward.non_differentiable);
  bw["materialize_grads"] = def.backward.materialize_grads;
  // Only when set, so the hashes of ops that predate them stay the same.
  if (!def.backward.inputs.empty()) bw["inputs"] = StringsJson(def.backward.inputs);
  if (def.backward.stop_gradient_grads == Backward::StopGradientGrads::kError) {
    bw["stop_gradient_grads"] = "error";
  }
  j["backward"] = std::move(bw);
  j["doc"] = def.doc;
  return j.dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

absl::StatusOr<OpDef> FromJson(std::string_view text) {
  Json j = Json::parse(text.begin(), text.end(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("op definition is not valid JSON");
  OPJIT_RETURN_IF_ERROR(CheckObject(j, "",
                                    {"ns", "name", "inputs", "outputs", "attrs", "dtype_formats",
                                     "implementations", "output_rules", "backward", "doc"}));
  OpDef def;
  OPJIT_RETURN_IF_ERROR(ReadString(j, "", "ns", &def.ns));
  OPJIT_RETURN_IF_ERROR(ReadString(j, "", "name", &def.name));
  OPJIT_RETURN_IF_ERROR(ReadTensorParams(j, "inputs", &def.inputs));
  OPJIT_RETURN_IF_ERROR(ReadTensorParams(j, "outputs", &def.outputs));
  OPJIT_RETURN_IF_ERROR(ReadArray(j, "", "attrs", [&](const Json& e, const std::string& p) {
    OPJIT_RETURN_IF_ERROR(CheckObject(e, p, {"name", "param_type", "value_type", "default_value"}));
    AttrDef a;
    OPJIT_RETURN_IF_ERROR(ReadString(e, p, "name", &a.name));
    OPJIT_RETURN_IF_ERROR(ReadEnum(e, p, "param_type", &ParseParamType,
                                   "required, optional or dynamic", &a.param_type));
    OPJIT_RETURN_IF_ERROR(
        ReadEnum(e, p, "value_type", &ParseValueType, "a value type", &a.value_type));
    OPJIT_RETURN_IF_ERROR(ReadString(e, p, "default_value", &a.default_value));
    def.attrs.push_back(std::move(a));
    return absl::OkStatus();
  }));
  OPJIT_RETURN_IF_ERROR(ReadArray(j, "", "dtype_formats", [&](const Json& e, const std::string& p) {
    OPJIT_RETURN_IF_ERROR(Expect(e, p, e.is_array(), "an array of [dtype, format] pairs"));
    DtypeFormat df;
    for (size_t k = 0; k < e.size(); ++k) {
      const Json& pair = e[k];
      std::string pp = absl::StrCat(p, "[", k, "]");
      OPJIT_RETURN_IF_ERROR(
          Expect(pair, pp,
                 pair.is_array() && pair.size() == 2 && pair[0].is_string() && pair[1].is_string(),
                 "a [dtype, format] pair of strings"));
      df.io.emplace_back(pair[0].get<std::string>(), pair[1].get<std::string>());
    }
    def.dtype_formats.push_back(std::move(df));
    return absl::OkStatus();
  }));
  OPJIT_RETURN_IF_ERROR(
      ReadArray(j, "", "implementations", [&](const Json& e, const std::string& p) {
        OPJIT_RETURN_IF_ERROR(CheckObject(e, p,
                                          {"target", "language", "source", "entry",
                                           "compile_options", "libraries", "attr_names",
                                           "launch", "files"}));
        Implementation impl;
        OPJIT_RETURN_IF_ERROR(ReadEnum(e, p, "target", &ParseTarget, "CPU or GPU", &impl.target));
        OPJIT_RETURN_IF_ERROR(ReadString(e, p, "language", &impl.language));
        OPJIT_RETURN_IF_ERROR(ReadString(e, p, "source", &impl.source));
        OPJIT_RETURN_IF_ERROR(ReadString(e, p, "entry", &impl.entry));
        OPJIT_RETURN_IF_ERROR(ReadStrings(e, p, "compile_options", &impl.compile_options));
        OPJIT_RETURN_IF_ERROR(ReadStrings(e, p, "libraries", &impl.libraries));
        OPJIT_RETURN_IF_ERROR(ReadStrings(e, p, "attr_names", &impl.attr_names));
        if (e.contains("launch")) {
          const Json& l = e["launch"];
          const std::string lp = p + ".launch";
          OPJIT_RETURN_IF_ERROR(CheckObject(
              l, lp, {"kernel", "grid", "block", "shared_mem", "args", "archs"}));
          OPJIT_RETURN_IF_ERROR(ReadString(l, lp, "kernel", &impl.launch.kernel));
          OPJIT_RETURN_IF_ERROR(ReadStrings(l, lp, "grid", &impl.launch.grid));
          OPJIT_RETURN_IF_ERROR(ReadStrings(l, lp, "block", &impl.launch.block));
          OPJIT_RETURN_IF_ERROR(ReadString(l, lp, "shared_mem", &impl.launch.shared_mem));
          OPJIT_RETURN_IF_ERROR(ReadStrings(l, lp, "args", &impl.launch.args));
          OPJIT_RETURN_IF_ERROR(ReadStrings(l, lp, "archs", &impl.launch.archs));
        }
        OPJIT_RETURN_IF_ERROR(ReadArray(e, p, "files", [&](const Json& f, const std::string& fp) {
          OPJIT_RETURN_IF_ERROR(CheckObject(f, fp, {"name", "content"}));
          SourceFile file;
          OPJIT_RETURN_IF_ERROR(ReadString(f, fp, "name", &file.name));
          OPJIT_RETURN_IF_ERROR(ReadString(f, fp, "content", &file.content));
          impl.files.push_back(std::move(file));
          return absl::OkStatus();
        }));
        def.implementations.push_back(std::move(impl));
        return absl::OkStatus();
      }));
  OPJIT_RETURN_IF_ERROR(ReadArray(j, "", "output_rules", [&](const Json& e, const std::string& p) {
    OPJIT_RETURN_IF_ERROR(CheckObject(
        e, p,
        {"kind", "input", "inputs", "axis_attr", "keep_dim", "keep_dim_attr", "shape", "dtype"}));
    OutputRule r;
    OPJIT_RETURN_IF_ERROR(ReadEnum(e, p, "kind", &ParseOutputRuleKind,
                                   "same_as_input, broadcast, reduce, explicit or infer_shape",
                                   &r.kind));
    OPJIT_RETURN_IF_ERROR(ReadIntField(e, p, "input", &r.input));
    OPJIT_RETURN_IF_ERROR(ReadArray(e, p, "inputs", [&](const Json& x, const std::string& xp) {
      int64_t v = 0;
      OPJIT_RETURN_IF_ERROR(ReadInt64(x, xp, &v));
      if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
        return Bad(xp, "integer out of range");
      }
      r.inputs.push_back(static_cast<int>(v));
      return absl::OkStatus();
    }));
    OPJIT_RETURN_IF_ERROR(ReadString(e, p, "axis_attr", &r.axis_attr));
    OPJIT_RETURN_IF_ERROR(ReadBool(e, p, "keep_dim", &r.keep_dim));
    OPJIT_RETURN_IF_ERROR(ReadString(e, p, "keep_dim_attr", &r.keep_dim_attr));
    OPJIT_RETURN_IF_ERROR(ReadArray(e, p, "shape", [&](const Json& x, const std::string& xp) {
      int64_t v = 0;
      OPJIT_RETURN_IF_ERROR(ReadInt64(x, xp, &v));
      r.shape.push_back(v);
      return absl::OkStatus();
    }));
    OPJIT_RETURN_IF_ERROR(ReadString(e, p, "dtype", &r.dtype));
    def.output_rules.push_back(std::move(r));
    return absl::OkStatus();
  }));
  if (auto it = j.find("backward"); it != j.end()) {
    OPJIT_RETURN_IF_ERROR(CheckObject(
        *it, "backward", {"op", "save_for_backward", "non_differentiable", "materialize_grads",
                          "inputs", "stop_gradient_grads"}));
    OPJIT_RETURN_IF_ERROR(ReadString(*it, "backward", "op", &def.backward.op));
    OPJIT_RETURN_IF_ERROR(
        ReadStrings(*it, "backward", "save_for_backward", &def.backward.save_for_backward));
    OPJIT_RETURN_IF_ERROR(
        ReadStrings(*it, "backward", "non_differentiable", &def.backward.non_differentiable));
    OPJIT_RETURN_IF_ERROR(
        ReadBool(*it, "backward", "materialize_grads", &def.backward.materialize_grads));
    OPJIT_RETURN_IF_ERROR(ReadStrings(*it, "backward", "inputs", &def.backward.inputs));
    std::string sgg;
    OPJIT_RETURN_IF_ERROR(ReadString(*it, "backward", "stop_gradient_grads", &sgg));
    if (sgg == "error") {
      def.backward.stop_gradient_grads = Backward::StopGradientGrads::kError;
    } else if (!sgg.empty() && sgg != "warn") {
      return absl::InvalidArgumentError(absl::StrCat(
          "backward.stop_gradient_grads: \"", Excerpt(sgg), "\" is not warn or error"));
    }
  }
  OPJIT_RETURN_IF_ERROR(ReadString(j, "", "doc", &def.doc));
  return def;
}

std::string ContentHash(const OpDef& def) { return Sha256Hex(ToJson(def)); }

}  // namespace opjit::registry

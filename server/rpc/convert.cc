#include "server/rpc/convert.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/common/error_info.h"
#include "server/common/text.h"
#include "server/core/defaults.h"

namespace opjit::rpc {
namespace {

using registry::OutputRule;

absl::Status Unknown(const std::string& field, const std::string& value, const char* expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown \"", Excerpt(value), "\" (expected ", expected, ")"));
}

absl::StatusOr<registry::ParamType> ParamTypeFrom(const std::string& field, const std::string& s) {
  if (s.empty()) return registry::ParamType::kRequired;
  auto t = registry::ParseParamType(s);
  if (!t) return Unknown(field, s, "required, optional or dynamic");
  return *t;
}

absl::StatusOr<registry::TensorParam> TensorParamFrom(const std::string& field,
                                                      const v1::TensorParam& p) {
  registry::TensorParam out;
  out.index = p.index();
  out.name = p.name();
  auto t = ParamTypeFrom(field + ".param_type", p.param_type());
  if (!t.ok()) return t.status();
  out.param_type = *t;
  return out;
}

struct RuleKindName {
  OutputRule::Kind kind;
  const char* name;
};
constexpr RuleKindName kRuleKinds[] = {
    {OutputRule::Kind::kSameAsInput, "same_as"},   {OutputRule::Kind::kBroadcast, "broadcast"},
    {OutputRule::Kind::kReduce, "reduce"},         {OutputRule::Kind::kExplicit, "explicit"},
    {OutputRule::Kind::kInferShape, "infer_shape"},
};

const char* RuleKindToString(OutputRule::Kind kind) {
  for (const auto& k : kRuleKinds) {
    if (k.kind == kind) return k.name;
  }
  return "same_as";
}

absl::StatusOr<registry::OpDef> ConvertOpDef(const v1::OpDef& proto);

}  // namespace

// A spec that does not even convert is an invalid spec, like one that does
// not validate (Registry::Register): INVALID_ARGUMENT with reason INVALID_SPEC.
absl::StatusOr<registry::OpDef> OpDefFromProto(const v1::OpDef& proto) {
  auto def = ConvertOpDef(proto);
  if (!def.ok() && def.status().code() == absl::StatusCode::kInvalidArgument) {
    return WithReason(def.status(), reason::kInvalidSpec);
  }
  return def;
}

namespace {

absl::StatusOr<registry::OpDef> ConvertOpDef(const v1::OpDef& proto) {
  registry::OpDef def;
  def.ns = proto.namespace_().empty() ? "default" : proto.namespace_();
  def.name = proto.name();
  def.doc = proto.doc();
  for (int i = 0; i < proto.inputs_size(); ++i) {
    auto p = TensorParamFrom(absl::StrCat("inputs[", i, "]"), proto.inputs(i));
    if (!p.ok()) return p.status();
    def.inputs.push_back(*std::move(p));
  }
  for (int i = 0; i < proto.outputs_size(); ++i) {
    auto p = TensorParamFrom(absl::StrCat("outputs[", i, "]"), proto.outputs(i));
    if (!p.ok()) return p.status();
    def.outputs.push_back(*std::move(p));
  }
  for (int i = 0; i < proto.attrs_size(); ++i) {
    const auto& a = proto.attrs(i);
    const std::string field = absl::StrCat("attrs[", i, "]");
    registry::AttrDef attr;
    attr.name = a.name();
    auto pt = ParamTypeFrom(field + ".param_type", a.param_type());
    if (!pt.ok()) return pt.status();
    attr.param_type = *pt;
    auto vt = registry::ParseValueType(a.value_type());
    if (!vt) {
      return Unknown(field + ".value_type", a.value_type(),
                     "bool, int, float, str, listInt, listFloat, listBool, listStr, "
                     "listListInt, listListFloat or all");
    }
    attr.value_type = *vt;
    attr.default_value = a.default_value();
    def.attrs.push_back(std::move(attr));
  }
  for (int i = 0; i < proto.dtype_formats_size(); ++i) {
    const auto& df = proto.dtype_formats(i);
    if (df.formats_size() != 0 && df.formats_size() != df.dtypes_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dtype_formats[", i, "].formats has ", df.formats_size(),
                       " entries but dtypes has ", df.dtypes_size(),
                       "; give one format per dtype, or none for DefaultFormat"));
    }
    registry::DtypeFormat out;
    for (int j = 0; j < df.dtypes_size(); ++j) {
      out.io.emplace_back(df.dtypes(j), df.formats_size() ? df.formats(j) : "DefaultFormat");
    }
    def.dtype_formats.push_back(std::move(out));
  }
  for (int i = 0; i < proto.implementations_size(); ++i) {
    const auto& im = proto.implementations(i);
    const std::string field = absl::StrCat("implementations[", i, "]");
    registry::Implementation impl;
    auto target = registry::ParseTarget(im.target().empty() ? "CPU" : im.target());
    if (!target) return Unknown(field + ".target", im.target(), "CPU or GPU");
    impl.target = *target;
    impl.language = core::LanguageOrDefault(im.language(), impl.target);
    if (im.source().empty() && !im.source_file().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".source is empty but source_file \"", Excerpt(im.source_file()),
          "\" is set; clients read source_file and send its text as source"));
    }
    impl.source = im.source();
    impl.entry = im.entry();
    impl.compile_options.assign(im.compile_options().begin(), im.compile_options().end());
    impl.libraries.assign(im.libraries().begin(), im.libraries().end());
    impl.attr_names.assign(im.attr_names().begin(), im.attr_names().end());
    if (im.has_launch()) {
      const auto& l = im.launch();
      impl.launch.kernel = l.kernel();
      impl.launch.grid.assign(l.grid().begin(), l.grid().end());
      impl.launch.block.assign(l.block().begin(), l.block().end());
      impl.launch.shared_mem = l.shared_mem();
      impl.launch.args.assign(l.args().begin(), l.args().end());
      impl.launch.archs.assign(l.archs().begin(), l.archs().end());
    }
    for (int k = 0; k < im.files_size(); ++k) {
      const auto& f = im.files(k);
      // `path` is the client's: the server never opens one.
      if (f.content().empty() && !f.path().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".files[", k, "].content is empty but path \"", Excerpt(f.path()),
            "\" is set; clients read path and send its text as content"));
      }
      impl.files.push_back(registry::SourceFile{f.name(), f.content()});
    }
    def.implementations.push_back(std::move(impl));
  }
  for (int i = 0; i < proto.output_rules_size(); ++i) {
    const auto& r = proto.output_rules(i);
    OutputRule rule;
    const std::string kind = r.kind().empty() ? "same_as" : r.kind();
    bool found = false;
    for (const auto& k : kRuleKinds) {
      if (kind == k.name) {
        rule.kind = k.kind;
        found = true;
      }
    }
    if (!found) {
      return Unknown(absl::StrCat("output_rules[", i, "].kind"), r.kind(),
                     "same_as, broadcast, reduce, explicit or infer_shape");
    }
    rule.input = r.input();
    rule.inputs.assign(r.inputs().begin(), r.inputs().end());
    rule.axis_attr = r.axis_attr();
    rule.keep_dim = r.keep_dim();
    rule.keep_dim_attr = r.keep_dim_attr();
    rule.shape.assign(r.shape().begin(), r.shape().end());
    rule.dtype = r.dtype();
    def.output_rules.push_back(std::move(rule));
  }
  const auto& b = proto.backward();
  def.backward.op = b.op();
  def.backward.save_for_backward.assign(b.save_for_backward().begin(),
                                        b.save_for_backward().end());
  def.backward.non_differentiable.assign(b.non_differentiable().begin(),
                                         b.non_differentiable().end());
  def.backward.materialize_grads = b.has_materialize_grads() ? b.materialize_grads() : true;
  def.backward.inputs.assign(b.inputs().begin(), b.inputs().end());
  if (b.stop_gradient_grads().empty() || b.stop_gradient_grads() == "warn") {
    def.backward.stop_gradient_grads = registry::Backward::StopGradientGrads::kWarn;
  } else if (b.stop_gradient_grads() == "error") {
    def.backward.stop_gradient_grads = registry::Backward::StopGradientGrads::kError;
  } else {
    return Unknown("backward.stop_gradient_grads", b.stop_gradient_grads(), "warn or error");
  }
  return def;
}

}  // namespace

void OpDefToProto(const registry::OpDef& def, v1::OpDef* proto) {
  proto->set_namespace_(def.ns);
  proto->set_name(def.name);
  proto->set_doc(def.doc);
  auto put_param = [](const registry::TensorParam& p, v1::TensorParam* out) {
    out->set_index(p.index);
    out->set_name(p.name);
    out->set_param_type(registry::ParamTypeName(p.param_type));
  };
  for (const auto& p : def.inputs) put_param(p, proto->add_inputs());
  for (const auto& p : def.outputs) put_param(p, proto->add_outputs());
  for (const auto& a : def.attrs) {
    auto* out = proto->add_attrs();
    out->set_name(a.name);
    out->set_param_type(registry::ParamTypeName(a.param_type));
    out->set_value_type(registry::ValueTypeName(a.value_type));
    out->set_default_value(a.default_value);
  }
  for (const auto& df : def.dtype_formats) {
    auto* out = proto->add_dtype_formats();
    for (const auto& [dtype, format] : df.io) {
      out->add_dtypes(dtype);
      out->add_formats(format);
    }
  }
  for (const auto& im : def.implementations) {
    auto* out = proto->add_implementations();
    out->set_target(registry::TargetName(im.target));
    out->set_language(im.language);
    out->set_source(im.source);
    out->set_entry(im.entry);
    for (const auto& o : im.compile_options) out->add_compile_options(o);
    for (const auto& l : im.libraries) out->add_libraries(l);
    for (const auto& n : im.attr_names) out->add_attr_names(n);
    if (!im.launch.empty()) {
      auto* l = out->mutable_launch();
      l->set_kernel(im.launch.kernel);
      for (const auto& e : im.launch.grid) l->add_grid(e);
      for (const auto& e : im.launch.block) l->add_block(e);
      l->set_shared_mem(im.launch.shared_mem);
      for (const auto& e : im.launch.args) l->add_args(e);
      for (const auto& e : im.launch.archs) l->add_archs(e);
    }
    for (const auto& f : im.files) {
      auto* pf = out->add_files();
      pf->set_name(f.name);
      pf->set_content(f.content);
    }
  }
  for (const auto& r : def.output_rules) {
    auto* out = proto->add_output_rules();
    out->set_kind(RuleKindToString(r.kind));
    out->set_input(r.input);
    for (int i : r.inputs) out->add_inputs(i);
    out->set_axis_attr(r.axis_attr);
    out->set_keep_dim(r.keep_dim);
    out->set_keep_dim_attr(r.keep_dim_attr);
    for (int64_t d : r.shape) out->add_shape(d);
    out->set_dtype(r.dtype);
  }
  auto* b = proto->mutable_backward();
  b->set_op(def.backward.op);
  for (const auto& s : def.backward.save_for_backward) b->add_save_for_backward(s);
  for (const auto& s : def.backward.non_differentiable) b->add_non_differentiable(s);
  b->set_materialize_grads(def.backward.materialize_grads);
  for (const auto& s : def.backward.inputs) b->add_inputs(s);
  if (def.backward.stop_gradient_grads == registry::Backward::StopGradientGrads::kError) {
    b->set_stop_gradient_grads("error");
  }
}

void OpRecordToProto(const registry::OpRecord& record, bool with_sources, v1::OpRecord* proto) {
  OpDefToProto(record.def, proto->mutable_op());
  if (!with_sources) {
    for (auto& im : *proto->mutable_op()->mutable_implementations()) {
      im.clear_source();
      for (auto& f : *im.mutable_files()) f.clear_content();  // names stay
    }
  }
  proto->set_version(record.version);
  proto->set_content_hash(record.content_hash);
  proto->set_created_unix_ms(record.created_unix_ms);
}

}  // namespace opjit::rpc

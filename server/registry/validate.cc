#include "server/registry/validate.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "server/common/error_info.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"
#include "server/compiler/compile_options.h"
#include "server/gpu/launch_spec.h"
#include "server/registry/attr_value.h"
#include "server/registry/bprop_args.h"

namespace opjit::registry {
namespace {

absl::Status ValidateLaunch(const OpDef& def, const Implementation& impl, const std::string& path);

constexpr size_t kMaxNameLen = 128;

bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// [A-Za-z_][A-Za-z0-9_]{0,127}; with `allow_dot`, '.' is allowed after the first.
bool IsIdent(absl::string_view s, bool allow_dot = false) {
  if (s.empty() || s.size() > kMaxNameLen || !IsAlpha(s[0])) return false;
  for (char c : s.substr(1)) {
    if (!IsAlpha(c) && !IsDigit(c) && !(allow_dot && c == '.')) return false;
  }
  return true;
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong encodings, surrogates and values past U+10FFFF.
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

absl::Status Invalid(absl::string_view path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

std::string Q(absl::string_view s) {
  return absl::StrCat("\"", Excerpt(s, 80), "\"");
}

absl::Status CheckUtf8(absl::string_view path, absl::string_view s) {
  if (!IsValidUtf8(s)) return Invalid(path, "is not valid UTF-8");
  return absl::OkStatus();
}

bool IsKnownFormat(const std::string& f) {
  if (f.empty()) return true;
  const auto& known = KnownFormats();
  return std::find(known.begin(), known.end(), f) != known.end();
}

absl::Status CheckTensorParams(const std::vector<TensorParam>& params, const char* kind,
                               bool is_output, std::set<std::string>* names) {
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorParam& p = params[i];
    std::string path = absl::StrCat(kind, "[", i, "]");
    if (p.index != static_cast<int>(i)) {
      return Invalid(absl::StrCat(path, ".index"),
                     absl::StrCat("is ", p.index, ", expected ", i, " (", kind,
                                  " are indexed 0..n-1 in order)"));
    }
    if (p.name.empty()) return Invalid(absl::StrCat(path, ".name"), "must not be empty");
    if (!IsIdent(p.name)) {
      return Invalid(absl::StrCat(path, ".name"),
                     absl::StrCat(Q(p.name),
                                  " is not an identifier ([A-Za-z_][A-Za-z0-9_]*, at "
                                  "most 128 characters)"));
    }
    if (!names->insert(p.name).second) {
      return Invalid(absl::StrCat(path, ".name"),
                     absl::StrCat(Q(p.name),
                                  " is used twice (names are unique across inputs "
                                  "and outputs)"));
    }
    switch (p.param_type) {
      case ParamType::kRequired:
      case ParamType::kDynamic:
        break;
      case ParamType::kOptional:
        if (is_output) {
          return Invalid(absl::StrCat(path, ".param_type"),
                         "an output cannot be optional (use required or dynamic)");
        }
        break;
      default:
        return Invalid(absl::StrCat(path, ".param_type"), "is not required, optional or dynamic");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAttrs(const std::vector<AttrDef>& attrs) {
  std::set<std::string> names;
  for (size_t i = 0; i < attrs.size(); ++i) {
    const AttrDef& a = attrs[i];
    std::string path = absl::StrCat("attrs[", i, "]");
    if (a.name.empty()) return Invalid(absl::StrCat(path, ".name"), "must not be empty");
    if (!IsIdent(a.name)) {
      return Invalid(absl::StrCat(path, ".name"),
                     absl::StrCat(Q(a.name),
                                  " is not an identifier ([A-Za-z_][A-Za-z0-9_]*, at "
                                  "most 128 characters)"));
    }
    if (!names.insert(a.name).second) {
      return Invalid(absl::StrCat(path, ".name"), absl::StrCat(Q(a.name), " is used twice"));
    }
    if (a.param_type != ParamType::kRequired && a.param_type != ParamType::kOptional) {
      return Invalid(
          absl::StrCat(path, ".param_type"),
          absl::StrCat("an attr must be required or optional, not ", ParamTypeName(a.param_type)));
    }
    if (static_cast<int>(a.value_type) < 0 ||
        static_cast<int>(a.value_type) > static_cast<int>(ValueType::kAll)) {
      return Invalid(absl::StrCat(path, ".value_type"), "is not a known value type");
    }
    OPJIT_RETURN_IF_ERROR(CheckUtf8(absl::StrCat(path, ".default_value"), a.default_value));
    if (!a.default_value.empty()) {
      auto parsed = ParseAttrValue(a.value_type, a.default_value);
      if (!parsed.ok()) {
        return Invalid(
            absl::StrCat(path, ".default_value"),
            absl::StrCat(Q(a.default_value), " is not a valid ", ValueTypeName(a.value_type), " (",
                         parsed.status().message(), ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDtypeFormats(const OpDef& def) {
  if (def.dtype_formats.empty()) {
    return Invalid("dtype_formats", "at least one (dtype, format) combination is required");
  }
  const size_t want = def.inputs.size() + def.outputs.size();
  std::set<std::vector<std::pair<std::string, std::string>>> seen;
  for (size_t i = 0; i < def.dtype_formats.size(); ++i) {
    const DtypeFormat& df = def.dtype_formats[i];
    std::string path = absl::StrCat("dtype_formats[", i, "]");
    if (df.io.size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " has ", df.io.size(), " (dtype, format) pairs, but the op has ",
                       def.inputs.size(), " inputs + ", def.outputs.size(), " outputs = ", want));
    }
    for (size_t k = 0; k < df.io.size(); ++k) {
      const auto& [dtype, format] = df.io[k];
      const bool is_input = k < def.inputs.size();
      const std::string& pname =
          is_input ? def.inputs[k].name : def.outputs[k - def.inputs.size()].name;
      std::string ppath =
          absl::StrCat(path, "[", k, "] (", is_input ? "input " : "output ", pname, ")");
      if (dtype.empty()) {
        // MindSpore's DataType.None_*: any dtype (and format) at a required or
        // dynamic input, matched at call time, the kernel checks; an absent
        // optional input; at an output, its rule's dtype, else the dtype of the
        // call's first input (exec/checks.cc).
        if (is_input) continue;
        const size_t j = k - def.inputs.size();
        if (!def.inputs.empty() ||
            (j < def.output_rules.size() && !def.output_rules[j].dtype.empty())) {
          continue;
        }
        return Invalid(ppath, absl::StrCat(
            "an empty dtype (MindSpore's DataType.None_None) at an output means its output "
            "rule's dtype, else the dtype of the call's first input; the op has no inputs and no "
            "output rule dtype for output ", Q(pname),
            "; known dtypes: ", absl::StrJoin(KnownDtypes(), ", ")));
      }
      if (!IsKnownDtype(dtype)) {
        return Invalid(ppath, absl::StrCat("unknown dtype ", Q(dtype),
                                           "; known dtypes: ", absl::StrJoin(KnownDtypes(), ", ")));
      }
      if (!IsKnownFormat(format)) {
        return Invalid(ppath, absl::StrCat("unknown format ", Q(format),
                                           "; known formats: ", absl::StrJoin(KnownFormats(), ", "),
                                           " (empty means DefaultFormat)"));
      }
    }
    if (!seen.insert(df.io).second) {
      size_t first = 0;
      while (!(def.dtype_formats[first] == df)) ++first;
      return Invalid(path, absl::StrCat("duplicates dtype_formats[", first, "]"));
    }
  }
  return absl::OkStatus();
}

// "" when `target`'s backend compiles `language`; otherwise why not:
// `quoted` "is not a CPU language (<expected_prefix>c++ or c)", or "no compile
// backend for target X" when `rules` have none.
std::string LanguageRefusal(const TargetRules& rules, Target target, const std::string& language,
                            const std::string& quoted, const char* expected_prefix) {
  std::vector<std::string> langs = rules.Languages(target);
  if (std::find(langs.begin(), langs.end(), language) != langs.end()) return "";
  if (langs.empty()) return absl::StrCat("no compile backend for target ", TargetName(target));
  return absl::StrCat(quoted, " is not a ", TargetName(target), " language (", expected_prefix,
                      absl::StrJoin(langs, " or "), ")");
}

// `s` with control characters and NUL shown as '?', for a message.
std::string Printable(absl::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return out;
}

// Why `name` is not a usable extra-file name; "" when it is.
std::string FileNameRefusal(absl::string_view name) {
  if (name.empty()) return "must not be empty";
  if (name.size() > kMaxFileNameBytes) {
    return absl::StrCat("is ", name.size(), " bytes; the limit is ", kMaxFileNameBytes);
  }
  if (name[0] == '/') return "must be a relative path (it starts with '/')";
  for (char c : name) {
    if (c == '\\') return "must use '/' between directories, not a backslash";
    if (c == '\0') return "must not contain NUL";
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return "must not contain control characters";
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty()) return "must not have an empty path part (\"//\" or a trailing '/')";
    if (part == ".") return "must not have a \".\" path part";
    if (part == "..") return "must not have a \"..\" path part (files stay below the source)";
  }
  if (!IsValidUtf8(name)) return "is not valid UTF-8";
  return "";
}

absl::Status CheckSourceFiles(Target target, size_t source_bytes,
                              const std::vector<SourceFile>& files, const std::string& path) {
  if (files.empty()) return absl::OkStatus();
  if (files.size() > kMaxFiles) {
    return Invalid(absl::StrCat(path, ".files"),
                   absl::StrCat("has ", files.size(), " files; the limit is ", kMaxFiles,
                                " (put small headers together)"));
  }
  std::map<std::string, size_t> seen;
  uint64_t total = source_bytes;
  for (size_t k = 0; k < files.size(); ++k) {
    const SourceFile& f = files[k];
    const std::string fpath = absl::StrCat(path, ".files[", k, "]");
    if (std::string why = FileNameRefusal(f.name); !why.empty()) {
      return Invalid(absl::StrCat(fpath, ".name"),
                     f.name.empty() ? why : absl::StrCat(Q(Printable(f.name)), " ", why));
    }
    if (auto [it, first] = seen.emplace(f.name, k); !first) {
      return Invalid(absl::StrCat(fpath, ".name"),
                     absl::StrCat(Q(f.name), " is also files[", it->second, "]; names are unique"));
    }
    if (target == Target::kGpu && (IsTranslationUnit(f.name) || absl::EndsWith(f.name, ".cu"))) {
      return Invalid(absl::StrCat(fpath, ".name"),
                     absl::StrCat(Q(f.name),
                                  " is a translation unit; a GPU implementation takes headers "
                                  "only (include it from the source, or rename it, e.g. .cuh)"));
    }
    OPJIT_RETURN_IF_ERROR(CheckUtf8(absl::StrCat(fpath, ".content"), f.content));
    total += f.content.size();
  }
  if (total > kMaxSourceBytes) {
    return Invalid(absl::StrCat(path, ".files"),
                   absl::StrCat("the source and its ", files.size(), " files are ", total,
                                " bytes together; the limit is ", kMaxSourceBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckImplementations(const OpDef& def, const TargetRules& rules) {
  if (def.implementations.empty()) {
    return Invalid("implementations", "at least one implementation is required");
  }
  std::set<std::string> op_attrs;
  for (const AttrDef& a : def.attrs) op_attrs.insert(a.name);
  std::map<Target, size_t> first_of_target;
  for (size_t i = 0; i < def.implementations.size(); ++i) {
    const Implementation& impl = def.implementations[i];
    std::string path = absl::StrCat("implementations[", i, "]");
    if (impl.target != Target::kCpu && impl.target != Target::kGpu) {
      return Invalid(absl::StrCat(path, ".target"), "is not CPU or GPU");
    }
    if (auto [it, first] = first_of_target.emplace(impl.target, i); !first) {
      return Invalid(absl::StrCat(path, ".target"),
                     absl::StrCat(TargetName(impl.target), " already has implementations[",
                                  it->second, "] (at most one per target)"));
    }
    // The target's backend says which languages and options it takes.
    if (std::string why = LanguageRefusal(rules, impl.target, impl.language, Q(impl.language), "");
        !why.empty()) {
      return Invalid(absl::StrCat(path, rules.Languages(impl.target).empty() ? ".target" : ".language"),
                     why);
    }
    if (!IsIdent(impl.entry)) {
      return Invalid(absl::StrCat(path, ".entry"),
                     absl::StrCat(Q(impl.entry),
                                  " is not a C identifier ([A-Za-z_][A-Za-z0-9_]*, "
                                  "at most 128 characters)"));
    }
    if (impl.source.empty()) return Invalid(absl::StrCat(path, ".source"), "must not be empty");
    if (impl.source.size() > kMaxSourceBytes) {
      return Invalid(
          absl::StrCat(path, ".source"),
          absl::StrCat("is ", impl.source.size(), " bytes; the limit is ", kMaxSourceBytes));
    }
    OPJIT_RETURN_IF_ERROR(CheckUtf8(absl::StrCat(path, ".source"), impl.source));
    OPJIT_RETURN_IF_ERROR(CheckSourceFiles(impl.target, impl.source.size(), impl.files, path));
    OPJIT_RETURN_IF_ERROR(ValidateLaunch(def, impl, path));
    for (size_t k = 0; k < impl.compile_options.size(); ++k) {
      const std::string& opt = impl.compile_options[k];
      std::string opath = absl::StrCat(path, ".compile_options[", k, "]");
      OPJIT_RETURN_IF_ERROR(CheckUtf8(opath, opt));
      std::string why = rules.OptionRefusal(impl.target, impl.language, opt);
      if (!why.empty()) {
        return Invalid(opath, absl::StrCat("option ", Q(opt), " is refused: ", why,
                                           " (see the allow-list in "
                                           "server/compiler/compile_options.h)"));
      }
    }
    for (size_t k = 0; k < impl.libraries.size(); ++k) {
      std::string lpath = absl::StrCat(path, ".libraries[", k, "]");
      if (impl.libraries[k].empty()) return Invalid(lpath, "must not be empty");
      OPJIT_RETURN_IF_ERROR(CheckUtf8(lpath, impl.libraries[k]));
    }
    if (!impl.attr_names.empty()) {
      std::string apath = absl::StrCat(path, ".attr_names");
      std::set<std::string> names;
      for (size_t k = 0; k < impl.attr_names.size(); ++k) {
        if (!names.insert(impl.attr_names[k]).second) {
          return Invalid(absl::StrCat(apath, "[", k, "]"),
                         absl::StrCat(Q(impl.attr_names[k]), " is listed twice"));
        }
      }
      std::string context =
          absl::StrCat(" (op attrs: [", Excerpt(absl::StrJoin(op_attrs, ", "), 128), "]; ",
                       TargetName(impl.target), " implementation reads: [",
                       Excerpt(absl::StrJoin(names, ", "), 128), "])");
      for (const std::string& n : names) {
        if (!op_attrs.count(n)) {
          return Invalid(
              apath, absl::StrCat("the ", TargetName(impl.target), " implementation reads attr ",
                                  Q(n), ", which the op does not declare", context));
        }
      }
      for (const std::string& n : op_attrs) {
        if (!names.count(n)) {
          return Invalid(apath, absl::StrCat("the ", TargetName(impl.target),
                                             " implementation does not read attr ", Q(n),
                                             ", which the op declares (every target must read the "
                                             "same attrs)",
                                             context));
        }
      }
    }
  }
  return absl::OkStatus();
}

const AttrDef* FindAttr(const OpDef& def, const std::string& name) {
  for (const AttrDef& a : def.attrs) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

absl::Status CheckInputIndex(const std::string& path, int index, const OpDef& def) {
  if (index < 0 || static_cast<size_t>(index) >= def.inputs.size()) {
    return Invalid(path, absl::StrCat("input ", index, " is out of range; the op has ",
                                      def.inputs.size(), " inputs"));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputRules(const OpDef& def) {
  if (def.output_rules.empty()) {
    if (def.inputs.empty()) {
      return Invalid("output_rules",
                     "is empty, so every output takes the shape of input 0, but the op has no "
                     "inputs; give one rule per output");
    }
    return absl::OkStatus();
  }
  if (def.output_rules.size() != def.outputs.size()) {
    return Invalid("output_rules",
                   absl::StrCat("has ", def.output_rules.size(), " rules, but the op has ",
                                def.outputs.size(), " outputs (give one per output, or none)"));
  }
  for (size_t i = 0; i < def.output_rules.size(); ++i) {
    const OutputRule& r = def.output_rules[i];
    std::string path = absl::StrCat("output_rules[", i, "]");
    switch (r.kind) {
      case OutputRule::Kind::kSameAsInput:
        OPJIT_RETURN_IF_ERROR(CheckInputIndex(absl::StrCat(path, ".input"), r.input, def));
        break;
      case OutputRule::Kind::kBroadcast:
        if (r.inputs.empty() && def.inputs.empty()) {
          return Invalid(absl::StrCat(path, ".inputs"),
                         "is empty (broadcast all inputs), but the op has no inputs");
        }
        for (size_t k = 0; k < r.inputs.size(); ++k) {
          OPJIT_RETURN_IF_ERROR(
              CheckInputIndex(absl::StrCat(path, ".inputs[", k, "]"), r.inputs[k], def));
        }
        break;
      case OutputRule::Kind::kReduce: {
        OPJIT_RETURN_IF_ERROR(CheckInputIndex(absl::StrCat(path, ".input"), r.input, def));
        const AttrDef* axis = FindAttr(def, r.axis_attr);
        if (axis == nullptr) {
          return Invalid(absl::StrCat(path, ".axis_attr"),
                         absl::StrCat(Q(r.axis_attr), " is not an attr of the op"));
        }
        if (axis->value_type != ValueType::kInt && axis->value_type != ValueType::kListInt) {
          return Invalid(
              absl::StrCat(path, ".axis_attr"),
              absl::StrCat("attr ", Q(r.axis_attr), " is ", ValueTypeName(axis->value_type),
                           "; reduce axes need int or listInt"));
        }
        if (!r.keep_dim_attr.empty()) {
          const AttrDef* keep = FindAttr(def, r.keep_dim_attr);
          if (keep == nullptr) {
            return Invalid(absl::StrCat(path, ".keep_dim_attr"),
                           absl::StrCat(Q(r.keep_dim_attr), " is not an attr of the op"));
          }
          if (keep->value_type != ValueType::kBool) {
            return Invalid(absl::StrCat(path, ".keep_dim_attr"),
                           absl::StrCat("attr ", Q(r.keep_dim_attr), " is ",
                                        ValueTypeName(keep->value_type), "; expected bool"));
          }
        }
        break;
      }
      case OutputRule::Kind::kExplicit:
        if (!IsKnownDtype(r.dtype)) {
          return Invalid(absl::StrCat(path, ".dtype"),
                         absl::StrCat(r.dtype.empty() ? "an explicit rule needs a dtype"
                                                      : absl::StrCat("unknown dtype ", Q(r.dtype)),
                                      "; known dtypes: ", absl::StrJoin(KnownDtypes(), ", ")));
        }
        for (size_t k = 0; k < r.shape.size(); ++k) {
          if (r.shape[k] < 0) {
            return Invalid(absl::StrCat(path, ".shape[", k, "]"),
                           absl::StrCat("is ", r.shape[k], "; explicit dims must be >= 0"));
          }
        }
        break;
      case OutputRule::Kind::kInferShape:
        break;
      default:
        return Invalid(absl::StrCat(path, ".kind"), "is not a known rule kind");
    }
    if (r.kind != OutputRule::Kind::kExplicit && !r.dtype.empty() && !IsKnownDtype(r.dtype)) {
      return Invalid(absl::StrCat(path, ".dtype"),
                     absl::StrCat("unknown dtype ", Q(r.dtype),
                                  "; known dtypes: ", absl::StrJoin(KnownDtypes(), ", ")));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBackward(const OpDef& def) {
  const Backward& b = def.backward;
  if (!b.op.empty()) {
    if (!IsValidOpName(b.op)) {
      return Invalid("backward.op", absl::StrCat(Q(b.op), " is not a valid op name"));
    }
    if (b.op == def.name) {
      return Invalid("backward.op", "an op cannot be its own backward");
    }
  }
  std::set<std::string> io;
  std::set<std::string> outputs;
  for (const auto& p : def.inputs) io.insert(p.name);
  for (const auto& p : def.outputs) {
    io.insert(p.name);
    outputs.insert(p.name);
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < b.save_for_backward.size(); ++i) {
    const std::string& n = b.save_for_backward[i];
    std::string path = absl::StrCat("backward.save_for_backward[", i, "]");
    if (!io.count(n)) {
      return Invalid(path, absl::StrCat(Q(n), " is not an input or output of the op"));
    }
    if (!seen.insert(n).second) return Invalid(path, absl::StrCat(Q(n), " is listed twice"));
  }
  seen.clear();
  for (size_t i = 0; i < b.non_differentiable.size(); ++i) {
    const std::string& n = b.non_differentiable[i];
    std::string path = absl::StrCat("backward.non_differentiable[", i, "]");
    if (!outputs.count(n)) {
      return Invalid(path, absl::StrCat(Q(n), " is not an output of the op"));
    }
    if (!seen.insert(n).second) return Invalid(path, absl::StrCat(Q(n), " is listed twice"));
  }
  if (!b.inputs.empty() && b.op.empty()) {
    return Invalid("backward.inputs", "is set but backward.op names no bprop op");
  }
  // Every input, output and grad at most once each is the longest sensible list.
  const size_t most = def.inputs.size() + 2 * def.outputs.size();
  if (b.inputs.size() > most) {
    return Invalid("backward.inputs", absl::StrCat("has ", b.inputs.size(), " entries; the op's ",
                                                   def.inputs.size(), " input(s), ",
                                                   def.outputs.size(), " output(s) and their ",
                                                   "grads are ", most));
  }
  if (auto args = ResolveBpropArgs(def); !args.ok()) return args.status();
  return absl::OkStatus();
}

// A GPU implementation with a launch spec is an NVRTC kernel; its
// expressions may name the op's tensors and its int and float attrs.
absl::Status ValidateLaunch(const OpDef& def, const Implementation& impl, const std::string& path) {
  const GpuLaunch& l = impl.launch;
  if (l.empty()) return absl::OkStatus();
  const std::string lpath = absl::StrCat(path, ".launch");
  if (impl.target != Target::kGpu) return Invalid(lpath, "is for GPU implementations only");
  if (l.grid.empty() || l.block.empty()) {
    return Invalid(lpath, "needs grid and block (1 to 3 expressions each)");
  }
  for (size_t k = 0; k < l.archs.size(); ++k) {
    const std::string& a = l.archs[k];
    bool ok = a.size() >= 5 && a.size() <= 7 && a.rfind("sm_", 0) == 0;
    for (size_t c = 3; ok && c < a.size(); ++c) {
      ok = IsDigit(a[c]) || (c + 1 == a.size() && a[c] == 'a');
    }
    if (!ok) {
      return Invalid(absl::StrCat(lpath, ".archs[", k, "]"), absl::StrCat(Q(a), " is not sm_NN"));
    }
  }
  gpu::LaunchSpec spec;
  spec.kernel = l.kernel.empty() ? impl.entry : l.kernel;
  spec.grid = l.grid;
  spec.block = l.block;
  spec.shared_mem = l.shared_mem.empty() ? "0" : l.shared_mem;
  spec.args = l.args;
  std::vector<std::string> ins, outs, attrs;
  for (const auto& p : def.inputs) ins.push_back(p.name);
  for (const auto& p : def.outputs) outs.push_back(p.name);
  for (const auto& a : def.attrs) {
    if (a.value_type == ValueType::kInt || a.value_type == ValueType::kFloat) attrs.push_back(a.name);
  }
  absl::Status s = gpu::ValidateLaunchSpec(spec, ins, outs, attrs);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ".", s.message()));
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& KnownFormats() {
  static const std::vector<std::string>* const kFormats =
      new std::vector<std::string>{"DefaultFormat", "ND",   "NCHW",  "NHWC",
                                   "NCDHW",         "NDHWC", "HWCN", "DHWCN", "ChannelLast"};
  return *kFormats;
}

bool IsValidOpName(const std::string& name) { return IsIdent(name, /*allow_dot=*/true); }

bool IsValidNamespace(const std::string& ns) {
  if (ns.empty() || ns.size() > 64) return false;
  return std::all_of(ns.begin(), ns.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || IsDigit(c) || c == '_' || c == '-';
  });
}

const TargetRules& BuiltinTargetRules() {
  // The built-in backends' rules, as compiler::CpuBackend and GpuBackend
  // state them (server/compiler/compile_options.h).
  class Builtin : public TargetRules {
   public:
    std::vector<std::string> Languages(Target target) const override {
      switch (target) {
        case Target::kCpu:
          return compiler::CpuLanguages();
        case Target::kGpu:
          return compiler::CudaLanguages();
      }
      return {};
    }
    std::string OptionRefusal(Target target, const std::string& language,
                              std::string_view option) const override {
      return target == Target::kGpu ? compiler::CudaOptionRefusal(option)
                                    : compiler::CpuOptionRefusal(language, option);
    }
  };
  static const Builtin* rules = new Builtin;
  return *rules;
}

absl::Status ValidateCompileOptions(Target target, const std::string& language,
                                    const std::vector<std::string>& options,
                                    const std::string& field, const TargetRules& rules) {
  if (std::string why = LanguageRefusal(rules, target, language,
                                        absl::StrCat("\"", Excerpt(language), "\""), "expected ");
      !why.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("language: ", why));
  }
  for (size_t k = 0; k < options.size(); ++k) {
    std::string why = rules.OptionRefusal(target, language, options[k]);
    if (!why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", k, "]: option \"",
                                                     Excerpt(options[k]), "\" is refused: ", why));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status ValidateOpDefFields(const OpDef& def, const TargetRules& rules) {
  if (!IsValidNamespace(def.ns)) {
    return Invalid("ns", absl::StrCat(Q(def.ns), " is not a valid namespace ([a-z0-9_-]{1,64})"));
  }
  if (!IsValidOpName(def.name)) {
    return Invalid("name", absl::StrCat(Q(def.name),
                                        " is not a valid op name ([A-Za-z_][A-Za-z0-9_.]{0,127})"));
  }
  if (def.outputs.empty()) {
    return Invalid("outputs", absl::StrCat(
        "an op needs at least one output",
        def.attrs.empty() || !def.inputs.empty()
            ? ""
            : "; an attr-only registration (like MindSpore's attr-only reg_info) is merged with "
              "one that declares the op's inputs and outputs before it is registered: in "
              "Python, client.register([io_info, attr_info])"));
  }
  std::set<std::string> io_names;
  OPJIT_RETURN_IF_ERROR(CheckTensorParams(def.inputs, "inputs", /*is_output=*/false, &io_names));
  OPJIT_RETURN_IF_ERROR(CheckTensorParams(def.outputs, "outputs", /*is_output=*/true, &io_names));
  OPJIT_RETURN_IF_ERROR(CheckAttrs(def.attrs));
  OPJIT_RETURN_IF_ERROR(CheckDtypeFormats(def));
  OPJIT_RETURN_IF_ERROR(CheckImplementations(def, rules));
  OPJIT_RETURN_IF_ERROR(CheckOutputRules(def));
  OPJIT_RETURN_IF_ERROR(CheckBackward(def));
  if (def.doc.size() > kMaxDocBytes) {
    return Invalid("doc",
                   absl::StrCat("is ", def.doc.size(), " bytes; the limit is ", kMaxDocBytes));
  }
  OPJIT_RETURN_IF_ERROR(CheckUtf8("doc", def.doc));
  return absl::OkStatus();
}

}  // namespace

bool IsTranslationUnit(std::string_view name) {
  const absl::string_view n(name.data(), name.size());
  return absl::EndsWith(n, ".c") || absl::EndsWith(n, ".cc") || absl::EndsWith(n, ".cpp") ||
         absl::EndsWith(n, ".cxx");
}

absl::Status ValidateSourceFiles(Target target, size_t source_bytes,
                                 const std::vector<SourceFile>& files, const std::string& path) {
  absl::Status s = CheckSourceFiles(target, source_bytes, files, path);
  if (s.ok()) return s;
  return WithReason(std::move(s), reason::kInvalidSpec);
}

absl::Status ValidateOpDef(const OpDef& def, const TargetRules& rules) {
  absl::Status s = ValidateOpDefFields(def, rules);
  if (s.ok()) return s;
  return WithReason(std::move(s), reason::kInvalidSpec);
}

}  // namespace opjit::registry

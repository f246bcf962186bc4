// Validation of op definitions at registration.
//
// ValidateOpDef() checks every rule below and returns the first violation as
// INVALID_ARGUMENT. Each message begins with the path of the offending field
// (`name`, `inputs[1].name`, `attrs[0].default_value`, `dtype_formats[2][1]`,
// `implementations[1].compile_options[0]`, `output_rules[0].axis_attr`,
// `backward.non_differentiable[0]`, ...), then says what was expected.
//
// Rules
//
//  Names
//   - `ns` matches [a-z0-9_-]{1,64}.
//   - `name` matches [A-Za-z_][A-Za-z0-9_.]{0,127}.
//  Inputs and outputs
//   - At least one output; inputs may be empty.
//   - inputs[i].index == i and outputs[i].index == i (0..n-1, in order).
//   - Every name is an identifier, [A-Za-z_][A-Za-z0-9_]{0,127}, and names are
//     unique across inputs and outputs together.
//   - Inputs may be required, optional or dynamic; outputs required or dynamic
//     (never optional).
//  Attrs
//   - Names are identifiers as above and unique among attrs.
//   - param_type is required or optional (never dynamic).
//   - value_type is one of the ValueType spellings, "all" included.
//   - A non-empty default_value parses as the attr's value_type (see
//     attr_value.h for the text forms). A required attr may have a default; the
//     default is used when a call leaves the attr out.
//  dtype_formats
//   - At least one combination.
//   - Each has exactly one (dtype, format) pair per input and per output.
//   - dtype is one of KnownDtypes(): float16 float32 float64 int8 int16 int32
//     int64 uint8 uint16 uint32 uint64 bool; or, for an optional input only,
//     empty (MindSpore's DataType.None_None / None_Default): the combination
//     then applies when that input is absent. An empty dtype anywhere else is
//     refused (opjit picks output dtypes from the matching combination, so
//     MindSpore's all-None "any dtype" rows have no meaning here).
//   - format is one of DefaultFormat, ND, NCHW, NHWC, NCDHW, NDHWC, HWCN,
//     DHWCN, ChannelLast (plain layouts: labels, the data is not converted),
//     or empty (which means DefaultFormat; it is kept as given, not
//     rewritten). Ascend's blocked layouts (NC1HWC0, FRACTAL_Z, ...) are
//     refused.
//   - No combination appears twice.
//  Implementations
//   - At least one, and at most one per target.
//   - language: one the target's compile backend compiles: "c++" or "c" for
//     CPU, "cuda" for GPU (exact spellings).
//   - entry is a C identifier, [A-Za-z_][A-Za-z0-9_]{0,127}.
//   - source is non-empty and at most 1 MiB.
//   - Every compile option is on the target's allow-list, which its compile
//     backend owns (the built-in ones: server/compiler/compile_options.h);
//     anything else (-I, -L, -l, -o, -include, -fplugin, -Xclang, -Wl,...,
//     -fopenmp, ...) is refused.
//   - files (extra files of the kernel, see SourceFile): at most kMaxFiles;
//     each name at most kMaxFileNameBytes, a relative path of '/'-separated
//     parts ("helper.h", "detail/x.h") without "", "." or ".." parts, a
//     leading '/', backslashes, control characters or NUL, unique; each
//     content valid UTF-8; the source and every file's content together at
//     most kMaxSourceBytes. A .c/.cc/.cpp/.cxx file is a translation unit:
//     compiled and linked with the source for CPU; refused for GPU, as is
//     a .cu file (headers only there: .h, .cuh, ...).
//   - Every entry of libraries is non-empty (the server's allow-list is checked
//     later, by the compiler).
//   - attr_names, when non-empty, has no duplicates and equals the set of the
//     op's attr names (so all implementations read the same attrs).
//  output_rules
//   - Empty (every output is kSameAsInput(0), which needs at least one input),
//     or exactly one rule per output.
//   - Input indexes (`input`, `inputs[j]`) are in range where the kind uses
//     them: kSameAsInput and kReduce use `input`, kBroadcast uses `inputs`
//     (empty: all inputs, so the op needs at least one).
//   - kReduce: axis_attr names an attr of value_type int or listInt;
//     keep_dim_attr, if set, names a bool attr.
//   - kExplicit: dtype is a known dtype and every dim of shape is >= 0.
//   - For the other kinds, dtype (an override) is empty or a known dtype.
//  Backward
//   - backward.op, if set, is a valid op name and differs from the op's name.
//   - save_for_backward names existing inputs or outputs; non_differentiable
//     names existing outputs; neither repeats a name.
//  Text
//   - doc is at most 64 KiB.
//   - Every free-text field (source, doc, defaults, options, libraries) is
//     valid UTF-8, so the canonical JSON form is exact.
//
// Thread-safe (pure functions).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "server/registry/op_def.h"

namespace opjit::registry {

// What each target's compile backend accepts: its languages and its
// compile-option allow-list. The backends own these rules
// (compiler::CompileBackend); the registry depends on no compiler, so it asks
// through this interface. KernelCompiler::Rules() answers for the backends a
// compiler has; BuiltinTargetRules() for the built-in CPU and GPU backends,
// without starting them. Implementations are thread-safe.
class TargetRules {
 public:
  virtual ~TargetRules() = default;
  // The languages `target` compiles, in the order messages list them; empty
  // when no backend compiles for it.
  virtual std::vector<std::string> Languages(Target target) const = 0;
  // "" when `option` is allowed for `language` on `target`; otherwise why not.
  virtual std::string OptionRefusal(Target target, const std::string& language,
                                    std::string_view option) const = 0;
};

// The rules of the built-in backends (CPU: c++ and c; GPU: cuda).
const TargetRules& BuiltinTargetRules();

// Limits, exposed for clients and tests.
inline constexpr size_t kMaxSourceBytes = 1 << 20;  // 1 MiB
inline constexpr size_t kMaxDocBytes = 64 << 10;    // 64 KiB
// Extra files of one implementation: how many, and the bytes of one name.
// Their contents count toward kMaxSourceBytes with the source.
inline constexpr size_t kMaxFiles = 64;
inline constexpr size_t kMaxFileNameBytes = 255;

// Checks an implementation's extra files as ValidateOpDef does: the names,
// the count, the contents' UTF-8 and total size (with `source_bytes`), and
// translation units by target. `path` prefixes messages, e.g.
// "implementations[0]" (then ".files[2].name: ...").
absl::Status ValidateSourceFiles(Target target, size_t source_bytes,
                                 const std::vector<SourceFile>& files, const std::string& path);

// Whether an extra file named `name` is a C/C++ translation unit (.c .cc
// .cpp .cxx), which the CPU compiler compiles and links with the source.
bool IsTranslationUnit(std::string_view name);

// OK when `def` satisfies every rule above, languages and compile options as
// `rules` say; otherwise INVALID_ARGUMENT naming the first offending field,
// with reason INVALID_SPEC.
absl::Status ValidateOpDef(const OpDef& def, const TargetRules& rules = BuiltinTargetRules());

// Checks `language` and `options` against `target`'s rules, as ValidateOpDef
// does for an implementation; `field` prefixes the message, e.g.
// "compile_options". Used by the bare compile call.
absl::Status ValidateCompileOptions(Target target, const std::string& language,
                                    const std::vector<std::string>& options,
                                    const std::string& field,
                                    const TargetRules& rules = BuiltinTargetRules());

// The formats a dtype_format pair may name, "DefaultFormat" first.
const std::vector<std::string>& KnownFormats();

// Whether `name` matches [A-Za-z_][A-Za-z0-9_.]{0,127}, the op-name rule.
bool IsValidOpName(const std::string& name);
// Whether `ns` matches [a-z0-9_-]{1,64}, the namespace rule.
bool IsValidNamespace(const std::string& ns);

}  // namespace opjit::registry

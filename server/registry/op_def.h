// Domain types of the op-info registry. These mirror opjit.v1.OpDef (see
// proto/opjit/v1/registry.proto) but carry no protobuf dependency, so every
// core library and its tests can use them without gRPC.
//
// The model follows MindSpore's CustomRegOp: typed inputs/outputs/attrs,
// (dtype, format) combinations, one implementation per target, and the name of
// a backward (bprop) op.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace opjit::registry {

// How an input, output or attr must be supplied.
//   kRequired: exactly one tensor / the attr must be given (or defaulted).
//   kOptional: may be absent.
//   kDynamic: a variable number (>= 1) of tensors of the same dtype (AddN).
//             Not allowed for attrs.
enum class ParamType { kRequired, kOptional, kDynamic };

// Attribute value types, spelled as in CustomRegOp ("bool", "int", "float",
// "str", "listInt", "listFloat", "listBool", "listStr"). "listListInt" and
// "listListFloat" back AotExtra::Attr<std::vector<std::vector<T>>>. "all" is
// MindSpore's "any kind" (`.attr("axis", "required", "all", value=1)`): a
// value keeps the kind it comes with, and text is read by its form (see
// attr_value.h). No AttrValue holds kAll; it only ever describes an attr.
enum class ValueType {
  kBool,
  kInt,
  kFloat,
  kStr,
  kListInt,
  kListFloat,
  kListBool,
  kListStr,
  kListListInt,
  kListListFloat,
  kAll,  // last: the AttrValue alternatives follow the order above
};

enum class Target { kCpu, kGpu };

// A parsed attribute value. The alternative matches the ValueType above in
// declaration order.
using AttrValue =
    std::variant<bool, int64_t, double, std::string, std::vector<int64_t>, std::vector<double>,
                 std::vector<bool>, std::vector<std::string>, std::vector<std::vector<int64_t>>,
                 std::vector<std::vector<double>>>;

struct TensorParam {
  int index = 0;  // position among the op's inputs (or outputs), 0-based
  std::string name;
  ParamType param_type = ParamType::kRequired;
  bool operator==(const TensorParam&) const = default;
};

struct AttrDef {
  std::string name;
  ParamType param_type = ParamType::kRequired;  // kRequired or kOptional
  ValueType value_type = ValueType::kFloat;
  // The default as text, parsed according to value_type: "true", "3", "0.1",
  // "relu", "[1, 2]", "[[1, 2], [3]]", "[\"a\", \"b\"]". Empty: no default.
  std::string default_value;
  bool operator==(const AttrDef&) const = default;
};

// One supported combination: (dtype, format) for each input, then each output,
// in index order. Dtypes: float16 float32 float64 int8 int16 int32 int64 uint8
// uint16 uint32 uint64 bool. Formats: "DefaultFormat" (the CustomRegOp
// spelling), "NCHW", "NHWC", "ND".
struct DtypeFormat {
  std::vector<std::pair<std::string, std::string>> io;  // (dtype, format)
  bool operator==(const DtypeFormat&) const = default;
};

// How to launch an NVRTC-compiled GPU kernel (see opjit.v1.GpuLaunch).
// Empty grid: the source is a MindSpore aot .cu file compiled by nvcc.
struct GpuLaunch {
  std::string kernel;  // name expression; empty: the implementation's entry
  std::vector<std::string> grid, block;
  std::string shared_mem;
  std::vector<std::string> args;
  std::vector<std::string> archs;
  bool empty() const {
    return kernel.empty() && grid.empty() && block.empty() && shared_mem.empty() && args.empty() &&
           archs.empty();
  }
  bool operator==(const GpuLaunch&) const = default;
};

// One extra file of a kernel (opjit.v1.SourceFile): a header its source
// includes ("helper.h", "detail/math.h"), or, for CPU C/C++, an extra
// translation unit (.c .cc .cpp .cxx) compiled and linked with it. The
// compiler sees it in memory under its relative `name`, for that compile
// only; the server never opens a path (validate.h has the name rules).
struct SourceFile {
  std::string name;
  std::string content;
  bool operator==(const SourceFile&) const = default;
};

// The implementation of an op for one target.
struct Implementation {
  Target target = Target::kCpu;
  std::string language;  // "c++" or "c" for CPU; "cuda" for GPU
  std::string source;    // kernel source text
  std::string entry;     // entry symbol, e.g. "CustomLeakyRelu"
  std::vector<std::string> compile_options;  // e.g. "-DBLOCK=4", "-ffast-math"
  // Names (or paths) of shared libraries the kernel calls; each must be on the
  // server's allow-list.
  std::vector<std::string> libraries;
  // Attr names this implementation reads. Empty: all of the op's attrs. When
  // given, the set must equal the op's attr names (checked at registration).
  std::vector<std::string> attr_names;
  GpuLaunch launch;  // GPU only
  // Extra files beside the source (headers; CPU: also translation units).
  // Part of the content hash and of the compile's cache key.
  std::vector<SourceFile> files;
  bool operator==(const Implementation&) const = default;
};

// How the shape and dtype of one output are derived.
struct OutputRule {
  enum class Kind {
    kSameAsInput,  // shape and dtype of input `input`
    kBroadcast,    // numpy broadcast of `inputs` (all inputs when empty); dtype of the first
    kReduce,       // input `input` reduced over the axes in attr `axis_attr`
    kExplicit,     // `shape` and `dtype` given literally; -1 dims resolve to 0-size errors
    kInferShape,   // the kernel's own `<entry>InferShape` function decides
  };
  Kind kind = Kind::kSameAsInput;
  int input = 0;
  std::vector<int> inputs;
  std::string axis_attr;      // kReduce: attr holding int or listInt axes
  bool keep_dim = false;      // kReduce: keep reduced axes with size 1
  std::string keep_dim_attr;  // kReduce: attr overriding keep_dim when set
  std::vector<int64_t> shape;  // kExplicit
  std::string dtype;           // kExplicit; for other kinds, overrides the dtype when set
  bool operator==(const OutputRule&) const = default;
};

// Backward (bprop) description: MindSpore's bprop convention. The bprop op's
// inputs are (forward inputs..., forward outputs..., output grads...), its
// outputs one grad per forward input.
struct Backward {
  std::string op;  // bprop op name in the same namespace; empty: no backward
  // Names of forward inputs/outputs the bprop reads; empty: all of them.
  std::vector<std::string> save_for_backward;
  // Output names that carry no gradient.
  std::vector<std::string> non_differentiable;
  // Fill missing output grads with zeros (default) or pass them as null
  // slots (params[i] == nullptr, ndims[i] == 0), keeping every position.
  bool materialize_grads = true;
  // The bprop op's inputs, in order (MindSpore's bprop(x, out, dout) and its
  // subsets): forward input names, output names, "grad:NAME", "in:NAME",
  // "out:NAME", or "out"/"dout" alone (every output / output grad). Empty:
  // (every input, every output, every output grad). Resolved by
  // ResolveBpropArgs (bprop_args.h).
  std::vector<std::string> inputs;
  // What a nonzero grad returned for an input that needs none does: a
  // warning in the backward's answer (default), or an error.
  enum class StopGradientGrads { kWarn, kError };
  StopGradientGrads stop_gradient_grads = StopGradientGrads::kWarn;
  bool operator==(const Backward&) const = default;
};

// A complete op definition as submitted by a client.
struct OpDef {
  std::string ns = "default";  // namespace
  std::string name;
  std::vector<TensorParam> inputs;
  std::vector<TensorParam> outputs;
  std::vector<AttrDef> attrs;
  std::vector<DtypeFormat> dtype_formats;
  std::vector<Implementation> implementations;  // at most one per target
  // One rule per output, or empty: every output is kSameAsInput(0).
  std::vector<OutputRule> output_rules;
  Backward backward;
  std::string doc;
  bool operator==(const OpDef&) const = default;
};

// A stored version of an op.
struct OpRecord {
  OpDef def;
  int64_t version = 0;          // 1, 2, ... per (ns, name)
  std::string content_hash;     // SHA-256 hex of the canonical definition
  int64_t created_unix_ms = 0;  // when this version was first registered
};

// Names as the wire and specs spell them.
const char* ParamTypeName(ParamType t);
const char* ValueTypeName(ValueType t);
const char* TargetName(Target t);
std::optional<ParamType> ParseParamType(const std::string& s);
std::optional<ValueType> ParseValueType(const std::string& s);
std::optional<Target> ParseTarget(const std::string& s);

// The dtype strings kernels see, in the order of the aot ABI.
const std::vector<std::string>& KnownDtypes();
bool IsKnownDtype(const std::string& dtype);
// Size in bytes of one element; 0 for unknown dtypes.
size_t DtypeSize(const std::string& dtype);

}  // namespace opjit::registry

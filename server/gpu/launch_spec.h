// Launch specs: how an op's GPU implementation turns the shapes and attributes
// of one call into a kernel launch (grid, block, dynamic shared memory and the
// kernel's arguments).
//
// Expressions (grid, block, shared_mem, "expr:" arguments) are integer
// arithmetic over int64 with overflow checks:
//   expr    := term (('+' | '-') term)*
//   term    := unary (('*' | '/' | '%') unary)*
//   unary   := '-' unary | primary
//   primary := INTEGER | ATTR | '(' expr ')' | FUNC '(' args ')'
// FUNC is ceil_div(a, b), min(a, b), max(a, b), numel(T), rank(T) or
// dim(T, i) (i may be negative: -1 is the last dim). T is a tensor: an input
// or output name, or positional in0, in1, ..., out0, ... (a real name wins).
// ATTR is an int or float attribute whose value is integral. '/' and '%'
// truncate towards zero, like C; ceil_div needs b > 0 and a >= 0.
//
// Argument bindings, one per kernel parameter, in order:
//   T             the device pointer of tensor T
//   numel(T), dim(T, i), rank(T)   that value as int64
//   attr:NAME     the attribute, as int64 or as float (32-bit) for a float attr
//   expr:EXPR     an integer expression, as int64
//
// Every function here is pure and thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace opjit::gpu {

struct LaunchSpec {
  std::string kernel;             // kernel name or NVRTC name expression ("axpy<float>")
  std::vector<std::string> grid;  // 1-3 expressions (x, y, z); missing ones are 1
  std::vector<std::string> block;
  std::string shared_mem = "0";   // dynamic shared memory in bytes
  std::vector<std::string> args;  // argument bindings
};

// Checks the syntax of every field and that every name it uses exists:
// tensors among `input_names`/`output_names` (or in0/out0 positional within
// their counts), variables and attr: among `attr_names` (the op's int and
// float attributes). INVALID_ARGUMENT naming the field and the column, e.g.
// "launch.grid[0]: unknown function 'ceil_dv' at column 1".
absl::Status ValidateLaunchSpec(const LaunchSpec& spec, const std::vector<std::string>& input_names,
                                const std::vector<std::string>& output_names,
                                const std::vector<std::string>& attr_names);

// The values of one call.
struct LaunchEnv {
  std::vector<std::string> input_names, output_names;  // as registered
  std::vector<std::vector<int64_t>> input_shapes, output_shapes;
  std::map<std::string, double> attrs;  // int and float attrs
  std::set<std::string> float_attrs;    // which of `attrs` are floats
};

// Parses and evaluates one expression. INVALID_ARGUMENT for a syntax error,
// an unknown name, division by zero, overflow, a dim index out of range or a
// non-integral attribute, with the column.
absl::StatusOr<int64_t> EvalExpr(const std::string& expr, const LaunchEnv& env);

struct LaunchConfig {
  unsigned grid[3] = {1, 1, 1};
  unsigned block[3] = {1, 1, 1};
  unsigned shared_mem = 0;
};

// Largest dynamic shared memory a spec may ask for (sm_90's opt-in limit);
// the device's own limit is checked at launch.
inline constexpr int64_t kMaxDynamicSharedMem = 227 * 1024;

// Evaluates grid, block and shared_mem. INVALID_ARGUMENT when an expression
// fails, a dim is <= 0 or above CUDA's limits (grid x < 2^31, grid y/z and
// block limits 65535; block x/y <= 1024, z <= 64, x*y*z <= 1024), or
// shared_mem is negative or above kMaxDynamicSharedMem.
absl::StatusOr<LaunchConfig> Resolve(const LaunchSpec& spec, const LaunchEnv& env);

// One kernel argument, resolved for a call.
struct KernelArg {
  enum class Kind { kInputPointer, kOutputPointer, kInt64, kFloat32 };
  Kind kind = Kind::kInt64;
  int tensor = -1;  // input or output index, for the pointer kinds
  int64_t i64 = 0;
  float f32 = 0;
};

// Resolves spec.args for a call; the executor fills in the pointers.
// INVALID_ARGUMENT as for EvalExpr, naming "launch.args[i]".
absl::StatusOr<std::vector<KernelArg>> ResolveArgs(const LaunchSpec& spec, const LaunchEnv& env);

}  // namespace opjit::gpu

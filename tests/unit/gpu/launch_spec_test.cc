#include "server/gpu/launch_spec.h"

#include <gtest/gtest.h>

#include <string>

namespace opjit::gpu {
namespace {

using ::absl::StatusCode;

LaunchEnv Env() {
  LaunchEnv env;
  env.input_names = {"x", "y"};
  env.output_names = {"out"};
  env.input_shapes = {{4, 1000}, {1000}};
  env.output_shapes = {{4, 1000}};
  env.attrs = {{"n", 7}, {"tile", 32}, {"alpha", 0.5}, {"beta", 2.0}};
  env.float_attrs = {"alpha", "beta"};
  return env;
}

int64_t Eval(const std::string& e) {
  absl::StatusOr<int64_t> v = EvalExpr(e, Env());
  EXPECT_TRUE(v.ok()) << e << ": " << v.status();
  return v.ok() ? *v : -999999;
}

std::string EvalError(const std::string& e) {
  absl::StatusOr<int64_t> v = EvalExpr(e, Env());
  EXPECT_FALSE(v.ok()) << e << " = " << (v.ok() ? *v : 0);
  if (v.ok()) return "";
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument) << v.status();
  return std::string(v.status().message());
}

TEST(LaunchExprTest, Arithmetic) {
  EXPECT_EQ(Eval("42"), 42);
  EXPECT_EQ(Eval("1 + 2 * 3"), 7);
  EXPECT_EQ(Eval("(1 + 2) * 3"), 9);
  EXPECT_EQ(Eval("10 - 4 - 3"), 3);  // left-associative
  EXPECT_EQ(Eval("100 / 10 / 5"), 2);
  EXPECT_EQ(Eval("17 % 5"), 2);
  EXPECT_EQ(Eval("-7 / 2"), -3);  // truncates like C
  EXPECT_EQ(Eval("-7 % 2"), -1);
  EXPECT_EQ(Eval("--3"), 3);
  EXPECT_EQ(Eval("2*-3"), -6);
  EXPECT_EQ(Eval("  ( ( 5 ) )  "), 5);
  EXPECT_EQ(Eval("9223372036854775807"), INT64_MAX);
}

TEST(LaunchExprTest, Functions) {
  EXPECT_EQ(Eval("ceil_div(1000, 256)"), 4);
  EXPECT_EQ(Eval("ceil_div(1024, 256)"), 4);
  EXPECT_EQ(Eval("ceil_div(0, 256)"), 0);
  EXPECT_EQ(Eval("min(3, 9)"), 3);
  EXPECT_EQ(Eval("max(3, 9)"), 9);
  EXPECT_EQ(Eval("max(min(1, 2), -5)"), 1);
  EXPECT_EQ(Eval("numel(x)"), 4000);
  EXPECT_EQ(Eval("numel(y)"), 1000);
  EXPECT_EQ(Eval("numel(out)"), 4000);
  EXPECT_EQ(Eval("rank(x)"), 2);
  EXPECT_EQ(Eval("dim(x, 0)"), 4);
  EXPECT_EQ(Eval("dim(x, 1)"), 1000);
  EXPECT_EQ(Eval("dim(x, -1)"), 1000);
  EXPECT_EQ(Eval("dim(x, -2)"), 4);
  EXPECT_EQ(Eval("dim(x, rank(x) - 1)"), 1000);
  EXPECT_EQ(Eval("ceil_div(numel(out), 256)"), 16);
}

TEST(LaunchExprTest, PositionalTensorsAndAttrs) {
  EXPECT_EQ(Eval("numel(in0)"), 4000);
  EXPECT_EQ(Eval("numel(in1)"), 1000);
  EXPECT_EQ(Eval("dim(out0, 0)"), 4);
  EXPECT_EQ(Eval("n * tile"), 224);
  EXPECT_EQ(Eval("beta + 1"), 3);  // a float attr with an integral value
  EXPECT_NE(EvalError("numel(in2)").find("unknown tensor 'in2' at column 7"), std::string::npos);
  EXPECT_NE(EvalError("numel(out1)").find("unknown tensor 'out1'"), std::string::npos);
  EXPECT_NE(EvalError("numel(in01)").find("unknown tensor"), std::string::npos);
}

TEST(LaunchExprTest, ScalarShapeHasNumelOne) {
  LaunchEnv env = Env();
  env.input_shapes[1] = {};
  EXPECT_EQ(*EvalExpr("numel(y)", env), 1);
  EXPECT_EQ(*EvalExpr("rank(y)", env), 0);
  EXPECT_FALSE(EvalExpr("dim(y, 0)", env).ok());
  env.input_shapes[1] = {0, 3};
  EXPECT_EQ(*EvalExpr("numel(y)", env), 0);
}

// Registration parses attacker-supplied expressions: deep nesting and huge
// inputs are refused with INVALID_ARGUMENT instead of exhausting the stack.
TEST(LaunchExprTest, DepthAndLengthAreBounded) {
  EXPECT_EQ(Eval(std::string(60, '(') + "1" + std::string(60, ')')), 1);
  EXPECT_NE(EvalError(std::string(5000, '(') + "1" + std::string(5000, ')')).find("characters long"),
            std::string::npos);
  EXPECT_NE(EvalError(std::string(200, '(') + "1" + std::string(200, ')')).find("nested deeper"),
            std::string::npos);
  EXPECT_NE(EvalError(std::string(100, '-') + "1").find("nested deeper"), std::string::npos);
  EXPECT_NE(EvalError(std::string(1000000, '-') + "1").find("characters long"), std::string::npos);
  // A long flat chain is fine up to the length bound.
  std::string chain = "1";
  for (int i = 0; i < 300; ++i) chain += "+1";
  EXPECT_EQ(Eval(chain), 301);
}

TEST(LaunchExprTest, SyntaxErrorsHaveColumns) {
  EXPECT_NE(EvalError("ceil_dv(1, 2)").find("unknown function 'ceil_dv' at column 1"),
            std::string::npos);
  EXPECT_NE(
      EvalError("1 + foo").find("unknown variable 'foo' (not an int or float attr) at column 5"),
      std::string::npos);
  EXPECT_NE(EvalError("1 +").find("unexpected end of expression at column 4"), std::string::npos);
  EXPECT_NE(EvalError("(1 + 2").find("expected ')' but found 'end of expression' at column 7"),
            std::string::npos);
  EXPECT_NE(EvalError("1 + 2)").find("unexpected ')' at column 6"), std::string::npos);
  EXPECT_NE(EvalError("1 $ 2").find("unexpected character '$' at column 3"), std::string::npos);
  EXPECT_NE(EvalError("1.5").find("unexpected character '.' at column 2"), std::string::npos);
  EXPECT_NE(EvalError("12abc").find("after a number at column 3"), std::string::npos);
  EXPECT_NE(EvalError("").find("empty expression"), std::string::npos);
  EXPECT_NE(EvalError("   ").find("empty expression"), std::string::npos);
  EXPECT_NE(EvalError("1 2").find("unexpected '2' at column 3"), std::string::npos);
  EXPECT_NE(EvalError("* 2").find("unexpected '*' at column 1"), std::string::npos);
  EXPECT_NE(EvalError("99999999999999999999").find("integer literal out of range at column 1"),
            std::string::npos);
  EXPECT_NE(EvalError("x + 1").find("'x' is a tensor; use numel(x)"), std::string::npos);
  EXPECT_NE(EvalError("1 + \x01").find("unexpected byte 0x1 at column 5"), std::string::npos);
}

TEST(LaunchExprTest, CallArityAndArguments) {
  EXPECT_NE(EvalError("min(1)").find("min() takes 2 arguments, got 1 at column 1"),
            std::string::npos);
  EXPECT_NE(EvalError("min(1, 2, 3)").find("min() takes 2 arguments at column 11"),
            std::string::npos);
  EXPECT_NE(EvalError("ceil_div()").find("takes 2 arguments, got 0"), std::string::npos);
  EXPECT_NE(EvalError("numel(x, 1)").find("numel() takes 1 argument at column 10"),
            std::string::npos);
  EXPECT_NE(EvalError("numel(3)").find("numel() expects a tensor name, found '3' at column 7"),
            std::string::npos);
  EXPECT_NE(EvalError("numel(nosuch)").find("unknown tensor 'nosuch' at column 7"),
            std::string::npos);
  EXPECT_NE(EvalError("dim(x)").find("dim() takes 2 arguments, got 1"), std::string::npos);
  EXPECT_NE(EvalError("min(1,)").find("unexpected ')' at column 7"), std::string::npos);
  EXPECT_NE(EvalError("min 1").find("unknown variable 'min'"), std::string::npos);
}

TEST(LaunchExprTest, EvaluationErrors) {
  EXPECT_NE(EvalError("1 / 0").find("division by zero at column 3"), std::string::npos);
  EXPECT_NE(EvalError("1 % (n - 7)").find("division by zero at column 3"), std::string::npos);
  EXPECT_NE(EvalError("9223372036854775807 + 1").find("integer overflow at column 21"),
            std::string::npos);
  EXPECT_NE(EvalError("4611686018427387904 * 2").find("integer overflow"), std::string::npos);
  EXPECT_NE(EvalError("-9223372036854775807 - 2").find("integer overflow"), std::string::npos);
  EXPECT_NE(EvalError("dim(x, 2)").find("dim index 2 out of range for rank 2 at column 8"),
            std::string::npos);
  EXPECT_NE(EvalError("dim(x, -3)").find("dim index -3 out of range"), std::string::npos);
  EXPECT_NE(EvalError("alpha * 2").find("attr 'alpha' = 0.5 is not an integer at column 1"),
            std::string::npos);
  EXPECT_NE(EvalError("ceil_div(5, 0)").find("ceil_div divisor 0 is not positive"),
            std::string::npos);
  EXPECT_NE(EvalError("ceil_div(-5, 2)").find("ceil_div dividend -5 is negative"),
            std::string::npos);
  LaunchEnv env = Env();
  env.input_shapes = {{1ll << 40, 1ll << 40}};
  EXPECT_FALSE(EvalExpr("numel(x)", env).ok());
  // A shape for a tensor that the call did not supply.
  EXPECT_NE(std::string(EvalExpr("numel(y)", env).status().message()).find("no shape for input 1"),
            std::string::npos);
}

LaunchSpec Spec() {
  LaunchSpec s;
  s.kernel = "axpy<float>";
  s.grid = {"ceil_div(numel(x), 256)"};
  s.block = {"256"};
  s.shared_mem = "0";
  s.args = {"attr:alpha", "x", "out", "numel(x)"};
  return s;
}

absl::Status Validate(const LaunchSpec& s) {
  return ValidateLaunchSpec(s, {"x", "y"}, {"out"}, {"n", "tile", "alpha", "beta"});
}

std::string ValidateError(const LaunchSpec& s) {
  absl::Status st = Validate(s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  return std::string(st.message());
}

TEST(LaunchSpecTest, ValidSpecs) {
  EXPECT_TRUE(Validate(Spec()).ok()) << Validate(Spec());
  LaunchSpec s = Spec();
  s.kernel = "ns::tiled<float, 32>";
  s.grid = {"ceil_div(dim(x, -1), tile)", "dim(x, 0)", "1"};
  s.block = {"tile", "8"};
  s.shared_mem = "tile * tile * 4";
  s.args = {"in0",     "in1",    "out0",       "dim(x, 0)",
            "rank(y)", "attr:n", "expr:n * 2", "expr: numel(out) / 4"};
  EXPECT_TRUE(Validate(s).ok()) << Validate(s);
  s.shared_mem = "";  // means 0
  EXPECT_TRUE(Validate(s).ok()) << Validate(s);
}

TEST(LaunchSpecTest, ValidationNamesTheField) {
  LaunchSpec s = Spec();
  s.grid = {"ceil_dv(numel(x), 256)"};
  EXPECT_EQ(ValidateError(s), "launch.grid[0]: unknown function 'ceil_dv' at column 1");
  s = Spec();
  s.block = {"256", "nosuch"};
  EXPECT_EQ(ValidateError(s),
            "launch.block[1]: unknown variable 'nosuch' (not an int or float attr) at column 1");
  s = Spec();
  s.shared_mem = "4 *";
  EXPECT_EQ(ValidateError(s), "launch.shared_mem: unexpected end of expression at column 4");
  s = Spec();
  s.grid = {};
  EXPECT_EQ(ValidateError(s), "launch.grid: needs 1 to 3 expressions (x, y, z), got 0");
  s.grid = {"1", "1", "1", "1"};
  EXPECT_EQ(ValidateError(s), "launch.grid: needs 1 to 3 expressions (x, y, z), got 4");
  s = Spec();
  s.kernel = "";
  EXPECT_NE(ValidateError(s).find("launch.kernel:"), std::string::npos);
  s.kernel = "k; system(\"rm\")";
  EXPECT_NE(ValidateError(s).find("launch.kernel:"), std::string::npos);
  s.kernel = "9k";
  EXPECT_NE(ValidateError(s).find("launch.kernel:"), std::string::npos);
}

TEST(LaunchSpecTest, ArgBindingErrors) {
  LaunchSpec s = Spec();
  s.args = {"x", "attr:nosuch"};
  EXPECT_EQ(ValidateError(s),
            "launch.args[1]: unknown attr 'nosuch' (not an int or float attr) at column 6");
  s.args = {"attr:"};
  EXPECT_EQ(ValidateError(s), "launch.args[0]: attr: needs a name at column 6");
  s.args = {"expr:1 +"};
  EXPECT_EQ(ValidateError(s), "launch.args[0]: unexpected end of expression at column 9");
  s.args = {"expr:ceil_dv(1, 2)"};
  EXPECT_EQ(ValidateError(s), "launch.args[0]: unknown function 'ceil_dv' at column 6");
  s.args = {"alpha"};
  EXPECT_EQ(ValidateError(s),
            "launch.args[0]: 'alpha' is an attr; bind it as attr:alpha at column 1");
  s.args = {"z"};
  EXPECT_NE(ValidateError(s).find("launch.args[0]: unknown variable 'z'"), std::string::npos);
  s.args = {"1 + 2"};
  EXPECT_NE(ValidateError(s).find("a general expression needs expr:"), std::string::npos);
  s.args = {""};
  EXPECT_NE(ValidateError(s).find("launch.args[0]: empty binding"), std::string::npos);
  s.args = {"ptr:x"};
  EXPECT_NE(ValidateError(s).find("launch.args[0]:"), std::string::npos);
}

TEST(LaunchSpecTest, PositionalNamesRespectCounts) {
  LaunchSpec s = Spec();
  s.args = {"in2"};
  EXPECT_NE(ValidateError(s).find("launch.args[0]"), std::string::npos);
  s.args = {"out1"};
  EXPECT_NE(ValidateError(s).find("launch.args[0]"), std::string::npos);
  s.args = {"in1", "out0"};
  EXPECT_TRUE(Validate(s).ok());
}

TEST(LaunchSpecTest, ResolveConfig) {
  absl::StatusOr<LaunchConfig> c = Resolve(Spec(), Env());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->grid[0], 16u);
  EXPECT_EQ(c->grid[1], 1u);
  EXPECT_EQ(c->grid[2], 1u);
  EXPECT_EQ(c->block[0], 256u);
  EXPECT_EQ(c->block[1], 1u);
  EXPECT_EQ(c->shared_mem, 0u);

  LaunchSpec s = Spec();
  s.grid = {"ceil_div(dim(x, -1), tile)", "dim(x, 0)", "2"};
  s.block = {"tile", "8", "2"};
  s.shared_mem = "tile * tile * 4";
  c = Resolve(s, Env());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->grid[0], 32u);
  EXPECT_EQ(c->grid[1], 4u);
  EXPECT_EQ(c->grid[2], 2u);
  EXPECT_EQ(c->block[0], 32u);
  EXPECT_EQ(c->block[1], 8u);
  EXPECT_EQ(c->block[2], 2u);
  EXPECT_EQ(c->shared_mem, 4096u);
}

std::string ResolveError(const LaunchSpec& s, const LaunchEnv& env = Env()) {
  absl::StatusOr<LaunchConfig> c = Resolve(s, env);
  EXPECT_FALSE(c.ok());
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}

TEST(LaunchSpecTest, ResolveLimits) {
  LaunchSpec s = Spec();
  s.grid = {"n - 7"};
  EXPECT_EQ(ResolveError(s), "launch.grid[0]: grid.x = 0 (`n - 7`) must be positive");
  s = Spec();
  s.block = {"-32"};
  EXPECT_EQ(ResolveError(s), "launch.block[0]: block.x = -32 (`-32`) must be positive");
  s.block = {"2048"};
  EXPECT_EQ(ResolveError(s), "launch.block[0]: block.x = 2048 (`2048`) exceeds CUDA's limit 1024");
  s.block = {"1", "1", "65"};
  EXPECT_EQ(ResolveError(s), "launch.block[2]: block.z = 65 (`65`) exceeds CUDA's limit 64");
  s.block = {"64", "32"};
  EXPECT_EQ(ResolveError(s), "launch.block: 2048 threads per block (64 x 32 x 1) exceeds 1024");
  s = Spec();
  s.grid = {"1", "65536"};
  EXPECT_EQ(ResolveError(s), "launch.grid[1]: grid.y = 65536 (`65536`) exceeds CUDA's limit 65535");
  s.grid = {"2147483648"};
  EXPECT_NE(ResolveError(s).find("exceeds CUDA's limit 2147483647"), std::string::npos);
  s.grid = {"2147483647"};
  EXPECT_TRUE(Resolve(s, Env()).ok());
  s = Spec();
  s.shared_mem = "-1";
  EXPECT_EQ(ResolveError(s), "launch.shared_mem: -1 bytes is outside [0, 232448]");
  s.shared_mem = "232449";
  EXPECT_EQ(ResolveError(s), "launch.shared_mem: 232449 bytes is outside [0, 232448]");
  s.shared_mem = "1 / 0";
  EXPECT_EQ(ResolveError(s), "launch.shared_mem: division by zero at column 3");
  s = Spec();
  s.grid = {"ceil_div(numel(x), 0)"};
  EXPECT_NE(ResolveError(s).find("launch.grid[0]: ceil_div divisor 0"), std::string::npos);
}

TEST(LaunchSpecTest, ResolveArgs) {
  LaunchSpec s = Spec();
  s.args = {"attr:alpha", "x",        "out", "numel(x)", "in1", "attr:n", "expr:dim(x, 0) * tile",
            "dim(x, -1)", "rank(out)"};
  absl::StatusOr<std::vector<KernelArg>> args = ResolveArgs(s, Env());
  ASSERT_TRUE(args.ok()) << args.status();
  ASSERT_EQ(args->size(), 9u);
  using K = KernelArg::Kind;
  EXPECT_EQ((*args)[0].kind, K::kFloat32);
  EXPECT_FLOAT_EQ((*args)[0].f32, 0.5f);
  EXPECT_EQ((*args)[1].kind, K::kInputPointer);
  EXPECT_EQ((*args)[1].tensor, 0);
  EXPECT_EQ((*args)[2].kind, K::kOutputPointer);
  EXPECT_EQ((*args)[2].tensor, 0);
  EXPECT_EQ((*args)[3].kind, K::kInt64);
  EXPECT_EQ((*args)[3].i64, 4000);
  EXPECT_EQ((*args)[4].kind, K::kInputPointer);
  EXPECT_EQ((*args)[4].tensor, 1);
  EXPECT_EQ((*args)[5].kind, K::kInt64);
  EXPECT_EQ((*args)[5].i64, 7);
  EXPECT_EQ((*args)[6].i64, 128);
  EXPECT_EQ((*args)[7].i64, 1000);
  EXPECT_EQ((*args)[8].i64, 2);
}

TEST(LaunchSpecTest, ResolveArgsErrors) {
  LaunchSpec s = Spec();
  s.args = {"x", "expr:1 / (n - 7)"};
  absl::StatusOr<std::vector<KernelArg>> args = ResolveArgs(s, Env());
  ASSERT_FALSE(args.ok());
  EXPECT_EQ(std::string(args.status().message()), "launch.args[1]: division by zero at column 8");
  LaunchEnv env = Env();
  env.float_attrs.clear();  // alpha is now an int attr with a fractional value
  s.args = {"attr:alpha"};
  args = ResolveArgs(s, env);
  ASSERT_FALSE(args.ok());
  EXPECT_NE(std::string(args.status().message()).find("int attr 'alpha' = 0.5 is not an integer"),
            std::string::npos);
}

// A real name wins over the positional spelling.
TEST(LaunchSpecTest, NamedTensorShadowsPositional) {
  LaunchEnv env = Env();
  env.input_names = {"in1", "y"};
  EXPECT_EQ(*EvalExpr("numel(in1)", env), 4000);
}

}  // namespace
}  // namespace opjit::gpu

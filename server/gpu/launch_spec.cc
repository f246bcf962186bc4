#include "server/gpu/launch_spec.h"

#include <cctype>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"

namespace opjit::gpu {
namespace {

// ---------------------------------------------------------------- names ---

// The names an expression may use. Built from the op's declaration (for
// validation) or from a call's environment (for evaluation).
struct Scope {
  const std::vector<std::string>* inputs = nullptr;
  const std::vector<std::string>* outputs = nullptr;
  std::set<std::string> attrs;
};

struct TensorRef {
  bool output = false;
  int index = 0;
};

// A name, or in<N>/out<N> positional.
std::optional<TensorRef> FindTensor(const Scope& scope, const std::string& name) {
  for (size_t i = 0; i < scope.inputs->size(); ++i) {
    if ((*scope.inputs)[i] == name) return TensorRef{false, static_cast<int>(i)};
  }
  for (size_t i = 0; i < scope.outputs->size(); ++i) {
    if ((*scope.outputs)[i] == name) return TensorRef{true, static_cast<int>(i)};
  }
  auto positional = [&](const char* prefix, size_t count, bool output) -> std::optional<TensorRef> {
    const size_t n = std::char_traits<char>::length(prefix);
    if (name.size() <= n || name.size() > n + 4 || name.compare(0, n, prefix) != 0)
      return std::nullopt;
    int index = 0;
    for (size_t i = n; i < name.size(); ++i) {
      if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
      index = index * 10 + (name[i] - '0');
    }
    if (name.size() > n + 1 && name[n] == '0') return std::nullopt;  // "in01"
    if (static_cast<size_t>(index) >= count) return std::nullopt;
    return TensorRef{output, index};
  };
  if (auto t = positional("in", scope.inputs->size(), false)) return t;
  return positional("out", scope.outputs->size(), true);
}

// ---------------------------------------------------------------- lexer ---

enum class Tok { kEnd, kInt, kIdent, kPunct };

struct Token {
  Tok kind = Tok::kEnd;
  std::string text;
  int64_t value = 0;
  int column = 1;  // 1-based
};

// ---------------------------------------------------------------- AST -----

struct Node {
  enum class Kind { kInt, kAttr, kNeg, kBinary, kCall };
  Kind kind = Kind::kInt;
  int column = 1;
  int64_t value = 0;                        // kInt
  std::string name;                         // kAttr; kCall: the function
  char op = 0;                              // kBinary
  TensorRef tensor;                         // kCall of numel/dim/rank
  std::vector<std::unique_ptr<Node>> kids;  // operands / call arguments
};

const std::set<std::string>& Functions() {
  static const auto* kFunctions =
      new std::set<std::string>{"ceil_div", "min", "max", "numel", "dim", "rank"};
  return *kFunctions;
}

// Recursive-descent parser over one expression. Errors carry 1-based columns
// of the original field (`column_offset` shifts them past a prefix such as
// "expr:").
class Parser {
 public:
  Parser(const std::string& text, const Scope& scope, int column_offset)
      : text_(text), scope_(scope), offset_(column_offset) {}

  // Bounds on what a registration may make the daemon parse (an attacker's
  // "((((...1))))" or "----...1" must not exhaust the stack).
  static constexpr size_t kMaxChars = 1024;
  static constexpr int kMaxDepth = 64;

  absl::StatusOr<std::unique_ptr<Node>> ParseAll() {
    if (text_.size() > kMaxChars) {
      return absl::InvalidArgumentError(absl::StrCat("expression is ", text_.size(),
                                                     " characters long; at most ", kMaxChars));
    }
    OPJIT_RETURN_IF_ERROR(Next());
    if (tok_.kind == Tok::kEnd) return absl::InvalidArgumentError("empty expression");
    OPJIT_ASSIGN_OR_RETURN(auto node, ParseExpr());
    if (tok_.kind != Tok::kEnd)
      return Error(absl::StrCat("unexpected '", tok_.text, "'"), tok_.column);
    return node;
  }

 private:
  absl::Status Error(const std::string& what, int column) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " at column ", column + offset_));
  }

  absl::Status Next() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    tok_ = Token{};
    tok_.column = static_cast<int>(pos_) + 1;
    if (pos_ >= text_.size()) {
      tok_.text = "end of expression";
      return absl::OkStatus();
    }
    const char c = text_[pos_];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      tok_.kind = Tok::kInt;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        const int d = text_[pos_] - '0';
        if (tok_.value > (INT64_MAX - d) / 10)
          return Error("integer literal out of range", tok_.column);
        tok_.value = tok_.value * 10 + d;
        tok_.text.push_back(text_[pos_++]);
      }
      if (pos_ < text_.size() &&
          (std::isalpha(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
        return Error(absl::StrCat("unexpected '", std::string(1, text_[pos_]), "' after a number"),
                     static_cast<int>(pos_) + 1);
      }
      return absl::OkStatus();
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      tok_.kind = Tok::kIdent;
      while (pos_ < text_.size() &&
             (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
        tok_.text.push_back(text_[pos_++]);
      }
      return absl::OkStatus();
    }
    if (std::string_view("+-*/%(),").find(c) != std::string_view::npos) {
      tok_.kind = Tok::kPunct;
      tok_.text = std::string(1, c);
      ++pos_;
      return absl::OkStatus();
    }
    if (std::isprint(static_cast<unsigned char>(c))) {
      return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"), tok_.column);
    }
    return Error(absl::StrCat("unexpected byte 0x", absl::Hex(static_cast<unsigned char>(c))),
                 tok_.column);
  }

  bool IsPunct(char c) const { return tok_.kind == Tok::kPunct && tok_.text[0] == c; }

  absl::Status Expect(char c) {
    if (!IsPunct(c)) {
      return Error(absl::StrCat("expected '", std::string(1, c), "' but found '", tok_.text, "'"),
                   tok_.column);
    }
    return Next();
  }

  absl::StatusOr<std::unique_ptr<Node>> ParseExpr() {
    OPJIT_ASSIGN_OR_RETURN(auto lhs, ParseTerm());
    while (IsPunct('+') || IsPunct('-')) {
      OPJIT_ASSIGN_OR_RETURN(lhs, Binary(std::move(lhs), &Parser::ParseTerm));
    }
    return lhs;
  }

  absl::StatusOr<std::unique_ptr<Node>> ParseTerm() {
    OPJIT_ASSIGN_OR_RETURN(auto lhs, ParseUnary());
    while (IsPunct('*') || IsPunct('/') || IsPunct('%')) {
      OPJIT_ASSIGN_OR_RETURN(lhs, Binary(std::move(lhs), &Parser::ParseUnary));
    }
    return lhs;
  }

  absl::StatusOr<std::unique_ptr<Node>> Binary(
      std::unique_ptr<Node> lhs, absl::StatusOr<std::unique_ptr<Node>> (Parser::*rhs)()) {
    auto node = std::make_unique<Node>();
    node->kind = Node::Kind::kBinary;
    node->op = tok_.text[0];
    node->column = tok_.column;
    OPJIT_RETURN_IF_ERROR(Next());
    OPJIT_ASSIGN_OR_RETURN(auto r, (this->*rhs)());
    node->kids.push_back(std::move(lhs));
    node->kids.push_back(std::move(r));
    return node;
  }

  // Counts one level of nesting while alive.
  struct Nest {
    explicit Nest(int* depth) : depth_(depth) { ++*depth_; }
    ~Nest() { --*depth_; }
    int* depth_;
  };
  absl::Status CheckDepth() {
    if (depth_ > kMaxDepth) {
      return Error(absl::StrCat("expression nested deeper than ", kMaxDepth, " levels"), tok_.column);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Node>> ParseUnary() {
    Nest nest(&depth_);
    OPJIT_RETURN_IF_ERROR(CheckDepth());
    if (IsPunct('-')) {
      auto node = std::make_unique<Node>();
      node->kind = Node::Kind::kNeg;
      node->column = tok_.column;
      OPJIT_RETURN_IF_ERROR(Next());
      OPJIT_ASSIGN_OR_RETURN(auto operand, ParseUnary());
      node->kids.push_back(std::move(operand));
      return node;
    }
    return ParsePrimary();
  }

  absl::StatusOr<std::unique_ptr<Node>> ParsePrimary() {
    auto node = std::make_unique<Node>();
    node->column = tok_.column;
    if (tok_.kind == Tok::kInt) {
      node->kind = Node::Kind::kInt;
      node->value = tok_.value;
      OPJIT_RETURN_IF_ERROR(Next());
      return node;
    }
    if (IsPunct('(')) {
      OPJIT_RETURN_IF_ERROR(Next());
      OPJIT_ASSIGN_OR_RETURN(auto inner, ParseExpr());
      OPJIT_RETURN_IF_ERROR(Expect(')'));
      return inner;
    }
    if (tok_.kind != Tok::kIdent) {
      if (tok_.kind == Tok::kEnd) return Error("unexpected end of expression", tok_.column);
      return Error(absl::StrCat("unexpected '", tok_.text, "'"), tok_.column);
    }
    const std::string name = tok_.text;
    const int column = tok_.column;
    OPJIT_RETURN_IF_ERROR(Next());
    if (!IsPunct('(')) {
      if (scope_.attrs.count(name) == 0) {
        if (FindTensor(scope_, name)) {
          return Error(absl::StrCat("'", name, "' is a tensor; use numel(", name, "), dim(", name,
                                    ", i) or rank(", name, ")"),
                       column);
        }
        return Error(absl::StrCat("unknown variable '", name, "' (not an int or float attr)"),
                     column);
      }
      node->kind = Node::Kind::kAttr;
      node->name = name;
      return node;
    }
    if (Functions().count(name) == 0)
      return Error(absl::StrCat("unknown function '", name, "'"), column);
    node->kind = Node::Kind::kCall;
    node->name = name;
    OPJIT_RETURN_IF_ERROR(Next());  // '('
    const bool tensor_fn = name == "numel" || name == "dim" || name == "rank";
    const size_t arity = (name == "numel" || name == "rank") ? 1 : 2;
    size_t nargs = 0;
    if (tensor_fn) {
      if (tok_.kind != Tok::kIdent) {
        return Error(absl::StrCat(name, "() expects a tensor name, found '", tok_.text, "'"),
                     tok_.column);
      }
      std::optional<TensorRef> t = FindTensor(scope_, tok_.text);
      if (!t) return Error(absl::StrCat("unknown tensor '", tok_.text, "'"), tok_.column);
      node->tensor = *t;
      OPJIT_RETURN_IF_ERROR(Next());
      nargs = 1;
    }
    while (!IsPunct(')')) {
      if (nargs > 0) OPJIT_RETURN_IF_ERROR(Expect(','));
      if (nargs >= arity) {
        return Error(absl::StrCat(name, "() takes ", arity, " argument", arity == 1 ? "" : "s"),
                     tok_.column);
      }
      OPJIT_ASSIGN_OR_RETURN(auto arg, ParseExpr());
      node->kids.push_back(std::move(arg));
      ++nargs;
    }
    if (nargs != arity) {
      return Error(absl::StrCat(name, "() takes ", arity, " argument", arity == 1 ? "" : "s",
                                ", got ", nargs),
                   column);
    }
    OPJIT_RETURN_IF_ERROR(Next());  // ')'
    return node;
  }

  const std::string text_;  // a copy: callers pass temporaries (arg.substr(5))
  const Scope& scope_;
  const int offset_;
  size_t pos_ = 0;
  Token tok_;
  int depth_ = 0;  // nesting of unary minus, parentheses and calls now
};

// ------------------------------------------------------------ evaluator ---

class Evaluator {
 public:
  Evaluator(const LaunchEnv& env, int column_offset) : env_(env), offset_(column_offset) {}

  absl::StatusOr<int64_t> Eval(const Node& n) const {
    switch (n.kind) {
      case Node::Kind::kInt:
        return n.value;
      case Node::Kind::kAttr: {
        const double v = env_.attrs.at(n.name);  // the scope came from env_.attrs
        if (!std::isfinite(v) || v != std::trunc(v) || v < -9.2e18 || v > 9.2e18) {
          return Error(absl::StrCat("attr '", n.name, "' = ", v, " is not an integer"), n.column);
        }
        return static_cast<int64_t>(v);
      }
      case Node::Kind::kNeg: {
        OPJIT_ASSIGN_OR_RETURN(int64_t v, Eval(*n.kids[0]));
        if (v == INT64_MIN) return Error("integer overflow", n.column);
        return -v;
      }
      case Node::Kind::kBinary:
        return EvalBinary(n);
      case Node::Kind::kCall:
        return EvalCall(n);
    }
    return absl::InternalError("unreachable");
  }

 private:
  absl::Status Error(const std::string& what, int column) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " at column ", column + offset_));
  }

  absl::StatusOr<int64_t> EvalBinary(const Node& n) const {
    OPJIT_ASSIGN_OR_RETURN(int64_t a, Eval(*n.kids[0]));
    OPJIT_ASSIGN_OR_RETURN(int64_t b, Eval(*n.kids[1]));
    int64_t r = 0;
    switch (n.op) {
      case '+':
        if (__builtin_add_overflow(a, b, &r)) return Error("integer overflow", n.column);
        return r;
      case '-':
        if (__builtin_sub_overflow(a, b, &r)) return Error("integer overflow", n.column);
        return r;
      case '*':
        if (__builtin_mul_overflow(a, b, &r)) return Error("integer overflow", n.column);
        return r;
      case '/':
      case '%':
        if (b == 0) return Error("division by zero", n.column);
        if (a == INT64_MIN && b == -1) return Error("integer overflow", n.column);
        return n.op == '/' ? a / b : a % b;
    }
    return absl::InternalError("unreachable");
  }

  const std::vector<int64_t>& Shape(const TensorRef& t) const {
    static const std::vector<int64_t> kEmpty;
    const auto& shapes = t.output ? env_.output_shapes : env_.input_shapes;
    return static_cast<size_t>(t.index) < shapes.size() ? shapes[t.index] : kEmpty;
  }

  absl::StatusOr<int64_t> EvalCall(const Node& n) const {
    if (n.name == "numel" || n.name == "rank" || n.name == "dim") {
      const auto& shapes = n.tensor.output ? env_.output_shapes : env_.input_shapes;
      if (static_cast<size_t>(n.tensor.index) >= shapes.size()) {
        return Error(
            absl::StrCat("no shape for ", n.tensor.output ? "output " : "input ", n.tensor.index),
            n.column);
      }
      const std::vector<int64_t>& shape = Shape(n.tensor);
      if (n.name == "rank") return static_cast<int64_t>(shape.size());
      if (n.name == "numel") {
        int64_t r = 1;
        for (int64_t d : shape) {
          if (d < 0) return Error("numel() of a shape with an unknown (negative) dim", n.column);
          if (__builtin_mul_overflow(r, d, &r)) return Error("integer overflow", n.column);
        }
        return r;
      }
      OPJIT_ASSIGN_OR_RETURN(int64_t i, Eval(*n.kids[0]));
      const int64_t rank = static_cast<int64_t>(shape.size());
      const int64_t k = i < 0 ? i + rank : i;
      if (k < 0 || k >= rank) {
        return Error(absl::StrCat("dim index ", i, " out of range for rank ", rank),
                     n.kids[0]->column);
      }
      return shape[k];
    }
    OPJIT_ASSIGN_OR_RETURN(int64_t a, Eval(*n.kids[0]));
    OPJIT_ASSIGN_OR_RETURN(int64_t b, Eval(*n.kids[1]));
    if (n.name == "min") return std::min(a, b);
    if (n.name == "max") return std::max(a, b);
    // ceil_div
    if (b <= 0) return Error(absl::StrCat("ceil_div divisor ", b, " is not positive"), n.column);
    if (a < 0) return Error(absl::StrCat("ceil_div dividend ", a, " is negative"), n.column);
    return a / b + (a % b != 0 ? 1 : 0);
  }

  const LaunchEnv& env_;
  const int offset_;
};

Scope ScopeOf(const LaunchEnv& env) {
  Scope s{&env.input_names, &env.output_names, {}};
  for (const auto& [name, value] : env.attrs) s.attrs.insert(name);
  return s;
}

absl::Status WithField(const std::string& field, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
}

absl::StatusOr<int64_t> EvalWith(const std::string& text, const Scope& scope, const LaunchEnv& env,
                                 int column_offset) {
  Parser parser(text, scope, column_offset);
  OPJIT_ASSIGN_OR_RETURN(auto node, parser.ParseAll());
  return Evaluator(env, column_offset).Eval(*node);
}

// An argument binding, parsed.
struct ArgBinding {
  enum class Kind { kTensor, kAttr, kExpr } kind = Kind::kExpr;
  TensorRef tensor;            // kTensor
  std::string attr;            // kAttr
  std::unique_ptr<Node> expr;  // kExpr
  int column_offset = 0;       // kExpr: columns before the expression
};

constexpr char kArgHelp[] =
    "expected a tensor name, numel(T), dim(T, i), rank(T), attr:NAME or expr:EXPR";

absl::StatusOr<ArgBinding> ParseArg(const std::string& arg, const Scope& scope) {
  ArgBinding b;
  if (arg.rfind("attr:", 0) == 0) {
    b.kind = ArgBinding::Kind::kAttr;
    b.attr = arg.substr(5);
    if (b.attr.empty()) return absl::InvalidArgumentError("attr: needs a name at column 6");
    if (scope.attrs.count(b.attr) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown attr '", b.attr, "' (not an int or float attr) at column 6"));
    }
    return b;
  }
  if (arg.rfind("expr:", 0) == 0) {
    b.kind = ArgBinding::Kind::kExpr;
    b.column_offset = 5;
    Parser p(arg.substr(5), scope, b.column_offset);
    OPJIT_ASSIGN_OR_RETURN(b.expr, p.ParseAll());
    return b;
  }
  // A bare tensor name (surrounding spaces allowed).
  const size_t first = arg.find_first_not_of(" \t");
  const size_t last = arg.find_last_not_of(" \t");
  const std::string trimmed = first == std::string::npos ? "" : arg.substr(first, last - first + 1);
  if (trimmed.empty()) return absl::InvalidArgumentError(absl::StrCat("empty binding; ", kArgHelp));
  if (std::optional<TensorRef> t = FindTensor(scope, trimmed)) {
    b.kind = ArgBinding::Kind::kTensor;
    b.tensor = *t;
    return b;
  }
  if (scope.attrs.count(trimmed) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", trimmed, "' is an attr; bind it as attr:", trimmed, " at column ", first + 1));
  }
  Parser p(arg, scope, 0);
  absl::StatusOr<std::unique_ptr<Node>> node = p.ParseAll();
  if (!node.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(node.status().message(), " (", kArgHelp, ")"));
  }
  const Node& n = **node;
  if (n.kind != Node::Kind::kCall || (n.name != "numel" && n.name != "dim" && n.name != "rank")) {
    return absl::InvalidArgumentError(
        absl::StrCat(kArgHelp, " (a general expression needs expr:) at column ", first + 1));
  }
  b.kind = ArgBinding::Kind::kExpr;
  b.expr = std::move(*node);
  return b;
}

bool ValidKernelName(const std::string& name) {
  if (name.empty()) return false;
  const unsigned char c0 = static_cast<unsigned char>(name[0]);
  if (!std::isalpha(c0) && c0 != '_' && c0 != ':') return false;
  for (unsigned char c : name) {
    if (!std::isalnum(c) &&
        std::string_view("_:<>,*& ()[]-+.").find(static_cast<char>(c)) == std::string_view::npos) {
      return false;
    }
  }
  return true;
}

absl::Status CheckDimCount(const char* field, const std::vector<std::string>& exprs) {
  if (exprs.empty() || exprs.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("launch.", field, ": needs 1 to 3 expressions (x, y, z), got ", exprs.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLaunchSpec(const LaunchSpec& spec, const std::vector<std::string>& input_names,
                                const std::vector<std::string>& output_names,
                                const std::vector<std::string>& attr_names) {
  if (!ValidKernelName(spec.kernel)) {
    return absl::InvalidArgumentError(
        absl::StrCat("launch.kernel: '", spec.kernel, "' is not a kernel name or name expression"));
  }
  Scope scope{&input_names, &output_names, {attr_names.begin(), attr_names.end()}};
  OPJIT_RETURN_IF_ERROR(CheckDimCount("grid", spec.grid));
  OPJIT_RETURN_IF_ERROR(CheckDimCount("block", spec.block));
  auto check = [&](const std::string& field, const std::string& text) -> absl::Status {
    Parser p(text, scope, 0);
    return WithField(field, p.ParseAll().status());
  };
  for (size_t i = 0; i < spec.grid.size(); ++i) {
    OPJIT_RETURN_IF_ERROR(check(absl::StrCat("launch.grid[", i, "]"), spec.grid[i]));
  }
  for (size_t i = 0; i < spec.block.size(); ++i) {
    OPJIT_RETURN_IF_ERROR(check(absl::StrCat("launch.block[", i, "]"), spec.block[i]));
  }
  OPJIT_RETURN_IF_ERROR(
      check("launch.shared_mem", spec.shared_mem.empty() ? "0" : spec.shared_mem));
  for (size_t i = 0; i < spec.args.size(); ++i) {
    OPJIT_RETURN_IF_ERROR(
        WithField(absl::StrCat("launch.args[", i, "]"), ParseArg(spec.args[i], scope).status()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> EvalExpr(const std::string& expr, const LaunchEnv& env) {
  return EvalWith(expr, ScopeOf(env), env, 0);
}

absl::StatusOr<LaunchConfig> Resolve(const LaunchSpec& spec, const LaunchEnv& env) {
  OPJIT_RETURN_IF_ERROR(CheckDimCount("grid", spec.grid));
  OPJIT_RETURN_IF_ERROR(CheckDimCount("block", spec.block));
  const Scope scope = ScopeOf(env);
  LaunchConfig cfg;
  static constexpr int64_t kGridMax[3] = {2147483647, 65535, 65535};
  static constexpr int64_t kBlockMax[3] = {1024, 1024, 64};
  static constexpr char kAxis[3] = {'x', 'y', 'z'};
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<std::string>& exprs = pass == 0 ? spec.grid : spec.block;
    const char* field = pass == 0 ? "grid" : "block";
    unsigned* out = pass == 0 ? cfg.grid : cfg.block;
    const int64_t* limit = pass == 0 ? kGridMax : kBlockMax;
    for (size_t i = 0; i < exprs.size(); ++i) {
      const std::string name = absl::StrCat("launch.", field, "[", i, "]");
      absl::StatusOr<int64_t> v = EvalWith(exprs[i], scope, env, 0);
      if (!v.ok()) return WithField(name, v.status());
      if (*v <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": ", field, ".",
                                                       std::string(1, kAxis[i]), " = ", *v, " (`",
                                                       exprs[i], "`) must be positive"));
      }
      if (*v > limit[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": ", field, ".", std::string(1, kAxis[i]), " = ", *v, " (`",
                         exprs[i], "`) exceeds CUDA's limit ", limit[i]));
      }
      out[i] = static_cast<unsigned>(*v);
    }
  }
  const int64_t threads = int64_t{cfg.block[0]} * cfg.block[1] * cfg.block[2];
  if (threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("launch.block: ", threads, " threads per block (", cfg.block[0], " x ",
                     cfg.block[1], " x ", cfg.block[2], ") exceeds 1024"));
  }
  absl::StatusOr<int64_t> shm =
      EvalWith(spec.shared_mem.empty() ? "0" : spec.shared_mem, scope, env, 0);
  if (!shm.ok()) return WithField("launch.shared_mem", shm.status());
  if (*shm < 0 || *shm > kMaxDynamicSharedMem) {
    return absl::InvalidArgumentError(absl::StrCat(
        "launch.shared_mem: ", *shm, " bytes is outside [0, ", kMaxDynamicSharedMem, "]"));
  }
  cfg.shared_mem = static_cast<unsigned>(*shm);
  return cfg;
}

absl::StatusOr<std::vector<KernelArg>> ResolveArgs(const LaunchSpec& spec, const LaunchEnv& env) {
  const Scope scope = ScopeOf(env);
  std::vector<KernelArg> out;
  out.reserve(spec.args.size());
  for (size_t i = 0; i < spec.args.size(); ++i) {
    const std::string field = absl::StrCat("launch.args[", i, "]");
    absl::StatusOr<ArgBinding> b = ParseArg(spec.args[i], scope);
    if (!b.ok()) return WithField(field, b.status());
    KernelArg a;
    switch (b->kind) {
      case ArgBinding::Kind::kTensor:
        a.kind =
            b->tensor.output ? KernelArg::Kind::kOutputPointer : KernelArg::Kind::kInputPointer;
        a.tensor = b->tensor.index;
        break;
      case ArgBinding::Kind::kAttr: {
        const double v = env.attrs.at(b->attr);
        if (env.float_attrs.count(b->attr) != 0) {
          a.kind = KernelArg::Kind::kFloat32;
          a.f32 = static_cast<float>(v);
        } else {
          if (!std::isfinite(v) || v != std::trunc(v) || v < -9.2e18 || v > 9.2e18) {
            return absl::InvalidArgumentError(
                absl::StrCat(field, ": int attr '", b->attr, "' = ", v, " is not an integer"));
          }
          a.kind = KernelArg::Kind::kInt64;
          a.i64 = static_cast<int64_t>(v);
        }
        break;
      }
      case ArgBinding::Kind::kExpr: {
        absl::StatusOr<int64_t> v = Evaluator(env, b->column_offset).Eval(*b->expr);
        if (!v.ok()) return WithField(field, v.status());
        a.kind = KernelArg::Kind::kInt64;
        a.i64 = *v;
        break;
      }
    }
    out.push_back(a);
  }
  return out;
}

}  // namespace opjit::gpu

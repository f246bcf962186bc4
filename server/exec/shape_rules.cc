#include "server/exec/shape_rules.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace opjit::exec {
namespace {

std::string ShapeStr(const Shape& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

absl::Status NeedInput(int output, int input, const std::vector<bool>& present) {
  if (input < 0 || input >= static_cast<int>(present.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("output_rules[", output, "] refers to input ", input, ", which the op lacks"));
  }
  if (!present[input]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output ", output, " takes its shape from input ", input,
        ", which was left absent or has no data (in a bprop: a forward tensor not saved for "
        "backward; save it, or take the shape from another input)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Shape> BroadcastShapes(const std::vector<Shape>& shapes) {
  size_t rank = 0;
  for (const auto& s : shapes) rank = std::max(rank, s.size());
  Shape out(rank, 1);
  for (const auto& s : shapes) {
    for (size_t i = 0; i < s.size(); ++i) {
      const size_t o = rank - s.size() + i;
      const int64_t d = s[i];
      if (d == out[o] || d == 1) continue;
      if (out[o] == 1) {
        out[o] = d;
        continue;
      }
      std::vector<std::string> all;
      for (const auto& t : shapes) all.push_back(ShapeStr(t));
      return absl::InvalidArgumentError(absl::StrCat("shapes ", absl::StrJoin(all, ", "),
                                                     " do not broadcast (dim ", o, ": ", out[o],
                                                     " vs ", d, ")"));
    }
  }
  return out;
}

absl::StatusOr<Shape> ApplyShapeRule(const registry::OutputRule& rule, int output,
                                     const std::vector<Shape>& inputs,
                                     const std::vector<bool>& present,
                                     const std::map<std::string, registry::AttrValue>& attrs) {
  using Kind = registry::OutputRule::Kind;
  switch (rule.kind) {
    case Kind::kSameAsInput: {
      if (absl::Status s = NeedInput(output, rule.input, present); !s.ok()) return s;
      return inputs[rule.input];
    }
    case Kind::kBroadcast: {
      std::vector<Shape> shapes;
      if (rule.inputs.empty()) {
        for (size_t i = 0; i < inputs.size(); ++i) {
          if (present[i]) shapes.push_back(inputs[i]);
        }
      } else {
        for (int i : rule.inputs) {
          if (absl::Status s = NeedInput(output, i, present); !s.ok()) return s;
          shapes.push_back(inputs[i]);
        }
      }
      return BroadcastShapes(shapes);
    }
    case Kind::kReduce: {
      if (absl::Status s = NeedInput(output, rule.input, present); !s.ok()) return s;
      const Shape& in = inputs[rule.input];
      const int64_t rank = static_cast<int64_t>(in.size());
      std::vector<int64_t> axes;
      auto it = attrs.find(rule.axis_attr);
      if (it != attrs.end()) {
        if (const auto* one = std::get_if<int64_t>(&it->second)) {
          axes.push_back(*one);
        } else if (const auto* many = std::get_if<std::vector<int64_t>>(&it->second)) {
          axes = *many;
        }
      }
      bool keep = rule.keep_dim;
      if (!rule.keep_dim_attr.empty()) {
        auto k = attrs.find(rule.keep_dim_attr);
        if (k != attrs.end()) {
          if (const auto* b = std::get_if<bool>(&k->second)) keep = *b;
        }
      }
      std::set<int64_t> reduce;
      if (axes.empty()) {  // no axis: reduce everything, as numpy does
        for (int64_t i = 0; i < rank; ++i) reduce.insert(i);
      }
      for (int64_t a : axes) {
        const int64_t norm = a < 0 ? a + rank : a;
        if (norm < 0 || norm >= rank) {
          return absl::InvalidArgumentError(absl::StrCat("attr ", rule.axis_attr, ": axis ", a,
                                                         " is out of range for rank ", rank));
        }
        reduce.insert(norm);
      }
      Shape out;
      for (int64_t i = 0; i < rank; ++i) {
        if (!reduce.count(i)) {
          out.push_back(in[i]);
        } else if (keep) {
          out.push_back(1);
        }
      }
      return out;
    }
    case Kind::kExplicit:
      return rule.shape;
    case Kind::kInferShape:
      return absl::FailedPreconditionError("infer_shape is the kernel's; ask the executor");
  }
  return absl::InternalError("unknown output rule");
}

}  // namespace opjit::exec

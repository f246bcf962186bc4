#include "server/registry/bprop_args.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/error_info.h"
#include "server/common/text.h"

namespace opjit::registry {
namespace {

std::optional<size_t> IndexOf(const std::vector<TensorParam>& params, absl::string_view name) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == name) return i;
  }
  return std::nullopt;
}

absl::Status Unknown(size_t i, absl::string_view entry, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("backward.inputs[", i, "]: \"", Excerpt(entry, 80),
                                                 "\" ", why));
}

// One entry of backward.inputs, appended to `out`.
absl::Status ResolveOne(const OpDef& fwd, size_t i, const std::string& entry,
                        std::vector<BpropArg>* out) {
  using Kind = BpropArg::Kind;
  const auto in = IndexOf(fwd.inputs, entry);
  const auto outp = IndexOf(fwd.outputs, entry);
  if (in) {
    out->push_back({Kind::kInput, *in});
    return absl::OkStatus();
  }
  if (outp) {
    out->push_back({Kind::kOutput, *outp});
    return absl::OkStatus();
  }
  if (entry == "out" || entry == "dout") {
    for (size_t j = 0; j < fwd.outputs.size(); ++j) {
      out->push_back({entry == "out" ? Kind::kOutput : Kind::kGrad, j});
    }
    return absl::OkStatus();
  }
  const size_t colon = entry.find(':');
  if (colon == std::string::npos) {
    return Unknown(i, entry, absl::StrCat(
        "is not an input or output of the op (inputs: ",
        absl::StrJoin(fwd.inputs, ", ", [](std::string* s, const TensorParam& p) { s->append(p.name); }),
        "; outputs: ",
        absl::StrJoin(fwd.outputs, ", ", [](std::string* s, const TensorParam& p) { s->append(p.name); }),
        "; an output's grad is \"grad:NAME\", every output \"out\", every grad \"dout\")"));
  }
  const std::string prefix = entry.substr(0, colon);
  const std::string name = entry.substr(colon + 1);
  if (prefix == "in") {
    if (auto k = IndexOf(fwd.inputs, name)) {
      out->push_back({Kind::kInput, *k});
      return absl::OkStatus();
    }
    return Unknown(i, entry, "names no input of the op");
  }
  if (prefix == "out" || prefix == "grad" || prefix == "dout") {
    if (auto k = IndexOf(fwd.outputs, name)) {
      out->push_back({prefix == "out" ? Kind::kOutput : Kind::kGrad, *k});
      return absl::OkStatus();
    }
    return Unknown(i, entry, "names no output of the op");
  }
  return Unknown(i, entry, "has an unknown prefix (known: in:, out:, grad:, dout:)");
}

std::string DtypeOr(const std::string& d) { return d.empty() ? "None" : d; }

}  // namespace

absl::StatusOr<std::vector<BpropArg>> ResolveBpropArgs(const OpDef& fwd) {
  std::vector<BpropArg> out;
  if (fwd.backward.inputs.empty()) {
    for (size_t i = 0; i < fwd.inputs.size(); ++i) out.push_back({BpropArg::Kind::kInput, i});
    for (size_t j = 0; j < fwd.outputs.size(); ++j) out.push_back({BpropArg::Kind::kOutput, j});
    for (size_t j = 0; j < fwd.outputs.size(); ++j) out.push_back({BpropArg::Kind::kGrad, j});
    return out;
  }
  for (size_t i = 0; i < fwd.backward.inputs.size(); ++i) {
    if (absl::Status s = ResolveOne(fwd, i, fwd.backward.inputs[i], &out); !s.ok()) return s;
  }
  return out;
}

std::string BpropArgName(const OpDef& fwd, const BpropArg& arg) {
  switch (arg.kind) {
    case BpropArg::Kind::kInput:
      return arg.index < fwd.inputs.size() ? fwd.inputs[arg.index].name : "?";
    case BpropArg::Kind::kOutput:
      return absl::StrCat("out:", arg.index < fwd.outputs.size() ? fwd.outputs[arg.index].name : "?");
    case BpropArg::Kind::kGrad:
      return absl::StrCat("grad:", arg.index < fwd.outputs.size() ? fwd.outputs[arg.index].name : "?");
  }
  return "?";
}

absl::Status CheckBpropSignature(const OpDef& fwd, const OpDef& bprop) {
  auto args = ResolveBpropArgs(fwd);
  if (!args.ok()) return args.status();
  const std::string fname = absl::StrCat(fwd.ns, "/", fwd.name);
  const std::string bname = absl::StrCat(bprop.ns, "/", bprop.name);
  auto mismatch = [&](const std::string& what) {
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          "op ", fname, " names ", bname, " as its backward, but ", what)),
                      reason::kBpropMismatch, {{"op", fname}, {"bprop", bname}});
  };
  std::vector<std::string> names;
  for (const BpropArg& a : *args) names.push_back(BpropArgName(fwd, a));
  const std::string signature = absl::StrCat("(", absl::StrJoin(names, ", "), ")");
  if (bprop.inputs.size() != args->size()) {
    return mismatch(absl::StrCat(
        "the bprop takes ", signature, " = ", args->size(), " input(s) (backward.inputs",
        fwd.backward.inputs.empty() ? " is empty: every input, every output, every output grad"
                                    : "",
        ") and ", bname, " declares ", bprop.inputs.size(),
        "; set backward.inputs to the ones it takes, e.g. [\"x\", \"dout\"]"));
  }
  if (bprop.outputs.size() != fwd.inputs.size()) {
    return mismatch(absl::StrCat("a bprop gives one grad per forward input (", fwd.inputs.size(),
                                 ") and ", bname, " declares ", bprop.outputs.size(),
                                 " output(s)"));
  }
  if (fwd.dtype_formats.empty() || bprop.dtype_formats.empty()) return absl::OkStatus();
  const size_t n_in = fwd.inputs.size();
  for (const DtypeFormat& row : fwd.dtype_formats) {
    if (row.io.size() != n_in + fwd.outputs.size()) continue;  // validated elsewhere
    std::vector<std::string> want;
    for (const BpropArg& a : *args) {
      want.push_back(row.io[a.kind == BpropArg::Kind::kInput ? a.index : n_in + a.index].first);
    }
    for (size_t i = 0; i < n_in; ++i) want.push_back(row.io[i].first);
    bool found = false;
    for (const DtypeFormat& b : bprop.dtype_formats) {
      if (b.io.size() != want.size()) continue;
      bool ok = true;
      for (size_t k = 0; k < want.size() && ok; ++k) {
        const std::string& have = b.io[k].first;
        ok = want[k].empty() || have.empty() || have == want[k];
      }
      if (ok) {
        found = true;
        break;
      }
    }
    if (!found) {
      std::vector<std::string> ins(want.begin(), want.begin() + static_cast<long>(args->size()));
      std::vector<std::string> outs(want.begin() + static_cast<long>(args->size()), want.end());
      for (auto& d : ins) d = DtypeOr(d);
      for (auto& d : outs) d = DtypeOr(d);
      return mismatch(absl::StrCat(
          "for its dtype row (",
          absl::StrJoin(row.io, ", ",
                        [](std::string* s, const auto& p) { s->append(DtypeOr(p.first)); }),
          ") the bprop ", signature, " needs a dtype_formats row (", absl::StrJoin(ins, ", "),
          ") -> (", absl::StrJoin(outs, ", "), "), and ", bname, " has none"));
    }
  }
  return absl::OkStatus();
}

}  // namespace opjit::registry

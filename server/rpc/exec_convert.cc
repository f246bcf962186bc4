// proto <-> exec domain types for the Executor and Evaluator services.
#include "server/rpc/exec_convert.h"

#include "absl/strings/str_cat.h"

namespace opjit::rpc {
namespace {

absl::StatusOr<registry::AttrValue> TypedAttr(const v1::AttrValue& v) {
  using VC = v1::AttrValue::ValueCase;
  switch (v.value_case()) {
    case VC::kB:
      return registry::AttrValue(v.b());
    case VC::kI:
      return registry::AttrValue(static_cast<int64_t>(v.i()));
    case VC::kF:
      return registry::AttrValue(v.f());
    case VC::kS:
      return registry::AttrValue(v.s());
    case VC::kInts:
      return registry::AttrValue(
          std::vector<int64_t>(v.ints().values().begin(), v.ints().values().end()));
    case VC::kFloats:
      return registry::AttrValue(
          std::vector<double>(v.floats().values().begin(), v.floats().values().end()));
    case VC::kBools:
      return registry::AttrValue(
          std::vector<bool>(v.bools().values().begin(), v.bools().values().end()));
    case VC::kStrs:
      return registry::AttrValue(
          std::vector<std::string>(v.strs().values().begin(), v.strs().values().end()));
    case VC::kIntLists: {
      std::vector<std::vector<int64_t>> out;
      for (const auto& l : v.int_lists().values()) out.emplace_back(l.values().begin(), l.values().end());
      return registry::AttrValue(std::move(out));
    }
    case VC::kFloatLists: {
      std::vector<std::vector<double>> out;
      for (const auto& l : v.float_lists().values()) out.emplace_back(l.values().begin(), l.values().end());
      return registry::AttrValue(std::move(out));
    }
    case VC::kText:
    case VC::VALUE_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("attr value is not set");
}

}  // namespace

// `what` names the tensor in messages; called only on error.
absl::StatusOr<exec::TensorArg> TensorFromProto(const v1::Tensor& t,
                                                absl::FunctionRef<std::string()> what) {
  exec::TensorArg arg;
  arg.desc.dtype = t.dtype();
  arg.desc.shape.assign(t.shape().begin(), t.shape().end());
  for (int64_t d : arg.desc.shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ": negative dim ", d, " in the shape"));
    }
  }
  if (t.has_shm()) {
    arg.data = exec::ShmRef{t.shm().region(), t.shm().offset()};
  } else {
    arg.data = exec::InlineBytes{t.inline_data()};
  }
  return arg;
}

absl::StatusOr<std::vector<std::vector<exec::TensorArg>>> InputsFromProto(
    const google::protobuf::RepeatedPtrField<v1::InputArg>& inputs) {
  std::vector<std::vector<exec::TensorArg>> out;
  out.reserve(inputs.size());
  for (int i = 0; i < inputs.size(); ++i) {
    std::vector<exec::TensorArg> group;
    group.reserve(inputs[i].tensors_size());
    for (int k = 0; k < inputs[i].tensors_size(); ++k) {
      auto arg = TensorFromProto(inputs[i].tensors(k),
                                 [&] { return absl::StrCat("inputs[", i, "][", k, "]"); });
      if (!arg.ok()) return arg.status();
      group.push_back(*std::move(arg));
    }
    out.push_back(std::move(group));
  }
  return out;
}

absl::StatusOr<std::map<std::string, exec::AttrArg>> AttrsFromProto(
    const google::protobuf::Map<std::string, v1::AttrValue>& attrs) {
  std::map<std::string, exec::AttrArg> out;
  for (const auto& [name, v] : attrs) {
    exec::AttrArg arg;
    if (v.value_case() == v1::AttrValue::kText) {
      arg.is_text = true;
      arg.text = v.text();
    } else {
      auto typed = TypedAttr(v);
      if (!typed.ok()) return absl::InvalidArgumentError(absl::StrCat("attrs[", name, "]: not set"));
      arg.value = *std::move(typed);
    }
    out[name] = std::move(arg);
  }
  return out;
}

std::chrono::steady_clock::time_point SteadyDeadline(const grpc::CallbackServerContext& ctx) {
  const auto deadline = ctx.deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    const auto left = deadline - std::chrono::system_clock::now();
    if (left < std::chrono::hours(24 * 365)) {
      return std::chrono::steady_clock::now() +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
    }
  }
  return std::chrono::steady_clock::time_point::max();
}

}  // namespace opjit::rpc

#include "server/registry/op_def.h"

#include <algorithm>
#include <cctype>
#include <utility>

namespace opjit::registry {

const char* ParamTypeName(ParamType t) {
  switch (t) {
    case ParamType::kRequired:
      return "required";
    case ParamType::kOptional:
      return "optional";
    case ParamType::kDynamic:
      return "dynamic";
  }
  return "unknown";
}

const char* ValueTypeName(ValueType t) {
  switch (t) {
    case ValueType::kBool:
      return "bool";
    case ValueType::kInt:
      return "int";
    case ValueType::kFloat:
      return "float";
    case ValueType::kStr:
      return "str";
    case ValueType::kListInt:
      return "listInt";
    case ValueType::kListFloat:
      return "listFloat";
    case ValueType::kListBool:
      return "listBool";
    case ValueType::kListStr:
      return "listStr";
    case ValueType::kListListInt:
      return "listListInt";
    case ValueType::kListListFloat:
      return "listListFloat";
    case ValueType::kAll:
      return "all";
  }
  return "unknown";
}

const char* TargetName(Target t) {
  switch (t) {
    case Target::kCpu:
      return "CPU";
    case Target::kGpu:
      return "GPU";
  }
  return "unknown";
}

std::optional<ParamType> ParseParamType(const std::string& s) {
  for (ParamType t : {ParamType::kRequired, ParamType::kOptional, ParamType::kDynamic}) {
    if (s == ParamTypeName(t)) return t;
  }
  return std::nullopt;
}

std::optional<ValueType> ParseValueType(const std::string& s) {
  for (ValueType t : {ValueType::kBool, ValueType::kInt, ValueType::kFloat, ValueType::kStr,
                      ValueType::kListInt, ValueType::kListFloat, ValueType::kListBool,
                      ValueType::kListStr, ValueType::kListListInt, ValueType::kListListFloat,
                      ValueType::kAll}) {
    if (s == ValueTypeName(t)) return t;
  }
  return std::nullopt;
}

std::optional<Target> ParseTarget(const std::string& s) {
  // The wire spells targets in upper case; accept the lower-case spelling too.
  if (s == "CPU" || s == "cpu") return Target::kCpu;
  if (s == "GPU" || s == "gpu") return Target::kGpu;
  return std::nullopt;
}

namespace {

struct DtypeInfo {
  const char* name;
  size_t size;
};

// In the order of the aot ABI.
constexpr DtypeInfo kDtypes[] = {
    {"float16", 2}, {"float32", 4}, {"float64", 8}, {"int8", 1},   {"int16", 2},  {"int32", 4},
    {"int64", 8},   {"uint8", 1},   {"uint16", 2},  {"uint32", 4}, {"uint64", 8}, {"bool", 1},
};

}  // namespace

const std::vector<std::string>& KnownDtypes() {
  static const std::vector<std::string>* const kNames = [] {
    auto* names = new std::vector<std::string>();
    for (const DtypeInfo& d : kDtypes) names->emplace_back(d.name);
    return names;
  }();
  return *kNames;
}

bool IsKnownDtype(const std::string& dtype) { return DtypeSize(dtype) != 0; }

size_t DtypeSize(const std::string& dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (dtype == d.name) return d.size;
  }
  return 0;
}

}  // namespace opjit::registry

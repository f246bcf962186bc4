// What kind of JSON value `j` is, for error messages ("a string", "a list").
// Internal to the registry (it speaks nlohmann::json).
#pragma once

#include <nlohmann/json.hpp>

namespace opjit::registry {

inline const char* JsonKindName(const nlohmann::json& j) {
  using T = nlohmann::json::value_t;
  switch (j.type()) {
    case T::null:
      return "null";
    case T::object:
      return "an object";
    case T::array:
      return "a list";
    case T::string:
      return "a string";
    case T::boolean:
      return "a bool";
    case T::number_integer:
    case T::number_unsigned:
      return "an int";
    case T::number_float:
      return "a float";
    default:
      return "an unsupported value";
  }
}

}  // namespace opjit::registry

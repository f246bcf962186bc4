#include "server/registry/attr_value.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "server/registry/json_kind.h"
#include "server/common/status_macros.h"
#include "server/common/text.h"

namespace opjit::registry {
namespace {

using Json = nlohmann::json;

absl::string_view Trim(absl::string_view s) {
  size_t b = 0;
  size_t e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\n' || s[b] == '\r')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\n' || s[e - 1] == '\r')) {
    --e;
  }
  return s.substr(b, e - b);
}

// Quotes `s` for an error message, cut to a readable length.
std::string Quote(absl::string_view s) {
  return absl::StrCat("\"", Excerpt(s), "\"");
}

bool LooksLikeFloat(absl::string_view s) {
  double d;
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), d);
  return ec == std::errc() && ptr == s.data() + s.size();
}

absl::StatusOr<bool> ParseBool(absl::string_view s) {
  if (s == "true" || s == "True") return true;
  if (s == "false" || s == "False") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("expected a bool (true or false), got ", Quote(s)));
}

absl::StatusOr<int64_t> ParseInt(absl::string_view s) {
  absl::string_view digits = s;
  if (!digits.empty() && digits[0] == '+') digits.remove_prefix(1);
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec == std::errc::result_out_of_range) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected an int, got ", Quote(s), " which is out of the int64 range"));
  }
  if (ec == std::errc() && ptr == digits.data() + digits.size() && !digits.empty()) return v;
  if (LooksLikeFloat(s)) {
    return absl::InvalidArgumentError(absl::StrCat("expected an int, got a float ", Quote(s)));
  }
  return absl::InvalidArgumentError(absl::StrCat("expected an int, got ", Quote(s)));
}

absl::StatusOr<double> ParseFloat(absl::string_view s) {
  absl::string_view num = s;
  if (!num.empty() && num[0] == '+') num.remove_prefix(1);
  double v = 0;
  auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
  if (ec == std::errc::result_out_of_range) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a float, got ", Quote(s), " which is out of the double range"));
  }
  if (ec != std::errc() || ptr != num.data() + num.size() || num.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("expected a float, got ", Quote(s)));
  }
  return v;
}


// Element readers for JSON lists; `where` is the element's position, e.g. "[1]".
absl::StatusOr<int64_t> JsonInt(const Json& j, const std::string& where) {
  if (j.is_number_integer() && !j.is_number_unsigned()) return j.get<int64_t>();
  if (j.is_number_unsigned()) {
    uint64_t u = j.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return static_cast<int64_t>(u);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("element ", where, " (", u, ") is out of the int64 range"));
  }
  if (j.is_number_float()) {
    return absl::InvalidArgumentError(
        absl::StrCat("element ", where, " is a float (", j.dump(), "), expected an int"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("element ", where, " is ", JsonKindName(j), ", expected an int"));
}

absl::StatusOr<double> JsonFloat(const Json& j, const std::string& where) {
  if (j.is_number()) return j.get<double>();
  return absl::InvalidArgumentError(
      absl::StrCat("element ", where, " is ", JsonKindName(j), ", expected a float"));
}

absl::StatusOr<bool> JsonBool(const Json& j, const std::string& where) {
  if (j.is_boolean()) return j.get<bool>();
  return absl::InvalidArgumentError(
      absl::StrCat("element ", where, " is ", JsonKindName(j), ", expected a bool"));
}

absl::StatusOr<std::string> JsonStr(const Json& j, const std::string& where) {
  if (j.is_string()) return j.get<std::string>();
  return absl::InvalidArgumentError(
      absl::StrCat("element ", where, " is ", JsonKindName(j), ", expected a string"));
}

template <typename T, typename Reader>
absl::StatusOr<std::vector<T>> JsonList(const Json& j, const std::string& where, Reader read) {
  if (!j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("element ", where, " is ", JsonKindName(j), ", expected a list"));
  }
  std::vector<T> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    OPJIT_ASSIGN_OR_RETURN(T v, read(j[i], absl::StrCat(where, "[", i, "]")));
    out.push_back(std::move(v));
  }
  return out;
}

template <typename T, typename Reader>
absl::StatusOr<AttrValue> ParseList(ValueType type, absl::string_view text, Reader read) {
  Json j = Json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected ", ValueTypeName(type), " as a JSON list like [1, 2], got ", Quote(text)));
  }
  if (!j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", ValueTypeName(type), ", got ", JsonKindName(j), " ", Quote(text)));
  }
  auto list = JsonList<T>(j, "", read);
  if (!list.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", ValueTypeName(type), ": ", list.status().message()));
  }
  return AttrValue(std::move(*list));
}

std::string FormatDouble(double d, bool force_point) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  std::string s(buf, ec == std::errc() ? ptr : buf);
  if (force_point && s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string JsonString(const std::string& s) {
  // replace: an AttrValue built in code may hold invalid UTF-8; never throw.
  return Json(s).dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

template <typename T, typename F>
std::string FormatList(const std::vector<T>& v, F format_one) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ", ";
    out += format_one(v[i]);
  }
  out += "]";
  return out;
}

std::string FormatInt(int64_t v) { return std::to_string(v); }
std::string FormatBool(bool v) { return v ? "true" : "false"; }
// In a JSON list a bare "-0" reads back as the integer 0, so negative zero
// keeps its point; every other integral value stays short ("[1, 2]").
std::string FormatListDouble(double d) {
  if (d == 0 && std::signbit(d)) return "-0.0";
  return FormatDouble(d, /*force_point=*/false);
}

// The list type a JSON array's elements make: one kind throughout (ints with
// floats make floats; lists of numbers make listListInt / listListFloat). An
// empty list is a listInt, which coerces to any list type.
std::optional<ValueType> InferListType(const Json& j) {
  if (j.empty()) return ValueType::kListInt;
  bool all_bool = true, all_int = true, all_num = true, all_str = true, all_list = true;
  bool rows_int = true, rows_num = true;
  for (const Json& e : j) {
    all_bool = all_bool && e.is_boolean();
    all_int = all_int && e.is_number_integer();
    all_num = all_num && e.is_number();
    all_str = all_str && e.is_string();
    all_list = all_list && e.is_array();
    if (e.is_array()) {
      for (const Json& x : e) {
        rows_int = rows_int && x.is_number_integer();
        rows_num = rows_num && x.is_number();
      }
    }
  }
  if (all_bool) return ValueType::kListBool;
  if (all_int) return ValueType::kListInt;
  if (all_num) return ValueType::kListFloat;
  if (all_str) return ValueType::kListStr;
  if (all_list && rows_int) return ValueType::kListListInt;
  if (all_list && rows_num) return ValueType::kListListFloat;
  return std::nullopt;
}

// "all": the kind the text's form says. true/false -> bool, an int64 -> int,
// a float -> float, a JSON array -> the list type of its elements, anything
// else -> str (verbatim).
absl::StatusOr<AttrValue> ParseAnyKind(const std::string& text) {
  absl::string_view s = Trim(text);
  if (auto b = ParseBool(s); b.ok()) return AttrValue(*b);
  if (auto i = ParseInt(s); i.ok()) return AttrValue(*i);
  if (auto f = ParseFloat(s); f.ok()) return AttrValue(*f);
  if (!s.empty() && s.front() == '[') {
    Json j = Json::parse(s, /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.is_array()) {
      std::optional<ValueType> t = InferListType(j);
      if (!t) {
        return absl::InvalidArgumentError(
            absl::StrCat("expected a value of any kind (bool, int, float, str or a list of one "
                         "kind), got a list that mixes kinds ",
                         Quote(s)));
      }
      return ParseAttrValue(*t, std::string(s));
    }
  }
  return AttrValue(text);
}

}  // namespace

absl::StatusOr<AttrValue> ParseAttrValue(ValueType type, const std::string& text) {
  if (type == ValueType::kStr) return AttrValue(text);
  if (type == ValueType::kAll) return ParseAnyKind(text);
  absl::string_view s = Trim(text);
  switch (type) {
    case ValueType::kBool: {
      OPJIT_ASSIGN_OR_RETURN(bool b, ParseBool(s));
      return AttrValue(b);
    }
    case ValueType::kInt: {
      OPJIT_ASSIGN_OR_RETURN(int64_t v, ParseInt(s));
      return AttrValue(v);
    }
    case ValueType::kFloat: {
      OPJIT_ASSIGN_OR_RETURN(double v, ParseFloat(s));
      return AttrValue(v);
    }
    case ValueType::kStr:
    case ValueType::kAll:
      break;  // handled above
    case ValueType::kListInt:
      return ParseList<int64_t>(type, s, JsonInt);
    case ValueType::kListFloat:
      return ParseList<double>(type, s, JsonFloat);
    case ValueType::kListBool:
      return ParseList<bool>(type, s, JsonBool);
    case ValueType::kListStr:
      return ParseList<std::string>(type, s, JsonStr);
    case ValueType::kListListInt:
      return ParseList<std::vector<int64_t>>(type, s, [](const Json& j, const std::string& w) {
        return JsonList<int64_t>(j, w, JsonInt);
      });
    case ValueType::kListListFloat:
      return ParseList<std::vector<double>>(type, s, [](const Json& j, const std::string& w) {
        return JsonList<double>(j, w, JsonFloat);
      });
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown value type ", static_cast<int>(type)));
}

std::string FormatAttrValue(const AttrValue& value) {
  switch (ValueTypeOf(value)) {
    case ValueType::kBool:
      return FormatBool(std::get<bool>(value));
    case ValueType::kInt:
      return FormatInt(std::get<int64_t>(value));
    case ValueType::kFloat:
      return FormatDouble(std::get<double>(value), /*force_point=*/true);
    case ValueType::kStr:
      return std::get<std::string>(value);
    case ValueType::kListInt:
      return FormatList(std::get<std::vector<int64_t>>(value), FormatInt);
    case ValueType::kListFloat:
      return FormatList(std::get<std::vector<double>>(value), FormatListDouble);
    case ValueType::kListBool: {
      const auto& v = std::get<std::vector<bool>>(value);
      std::string out = "[";
      for (size_t i = 0; i < v.size(); ++i) {
        if (i > 0) out += ", ";
        out += FormatBool(v[i]);
      }
      return out + "]";
    }
    case ValueType::kListStr:
      return FormatList(std::get<std::vector<std::string>>(value), JsonString);
    case ValueType::kListListInt:
      return FormatList(std::get<std::vector<std::vector<int64_t>>>(value),
                        [](const std::vector<int64_t>& v) { return FormatList(v, FormatInt); });
    case ValueType::kListListFloat:
      return FormatList(
          std::get<std::vector<std::vector<double>>>(value),
          [](const std::vector<double>& v) { return FormatList(v, FormatListDouble); });
    case ValueType::kAll:
      break;  // no value holds kAll
  }
  return "";
}

ValueType ValueTypeOf(const AttrValue& value) {
  // The variant's alternatives are declared in ValueType order.
  return static_cast<ValueType>(value.index());
}

namespace {

int ListDepth(ValueType t) {
  switch (t) {
    case ValueType::kListInt:
    case ValueType::kListFloat:
    case ValueType::kListBool:
    case ValueType::kListStr:
      return 1;
    case ValueType::kListListInt:
    case ValueType::kListListFloat:
      return 2;
    default:
      return 0;
  }
}

bool IsEmptyList(const AttrValue& value) {
  return std::visit(
      [](const auto& v) -> bool {
        using T = std::decay_t<decltype(v)>;
        if constexpr (requires { v.empty(); } && !std::is_same_v<T, std::string>) {
          return v.empty();
        } else {
          return false;
        }
      },
      value);
}

AttrValue EmptyListOf(ValueType t) {
  switch (t) {
    case ValueType::kListInt:
      return std::vector<int64_t>();
    case ValueType::kListFloat:
      return std::vector<double>();
    case ValueType::kListBool:
      return std::vector<bool>();
    case ValueType::kListStr:
      return std::vector<std::string>();
    case ValueType::kListListInt:
      return std::vector<std::vector<int64_t>>();
    case ValueType::kListListFloat:
      return std::vector<std::vector<double>>();
    default:
      return std::vector<int64_t>();  // not reached: callers check ListDepth
  }
}

}  // namespace

bool AttrValueMatches(ValueType type, const AttrValue& value) {
  if (type == ValueType::kAll) return true;
  ValueType have = ValueTypeOf(value);
  if (have == type) return true;
  if (type == ValueType::kFloat && have == ValueType::kInt) return true;
  if (type == ValueType::kListFloat && have == ValueType::kListInt) return true;
  if (type == ValueType::kListListFloat && have == ValueType::kListListInt) return true;
  return ListDepth(type) != 0 && ListDepth(type) == ListDepth(have) && IsEmptyList(value);
}

absl::StatusOr<AttrValue> CoerceAttrValue(ValueType type, AttrValue value) {
  ValueType have = ValueTypeOf(value);
  if (have == type || type == ValueType::kAll) return value;
  if (!AttrValueMatches(type, value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", ValueTypeName(type), ", got ", ValueTypeName(have)));
  }
  if (IsEmptyList(value)) return EmptyListOf(type);
  if (type == ValueType::kFloat) return AttrValue(static_cast<double>(std::get<int64_t>(value)));
  if (type == ValueType::kListFloat) {
    const auto& in = std::get<std::vector<int64_t>>(value);
    return AttrValue(std::vector<double>(in.begin(), in.end()));
  }
  // kListListFloat from kListListInt.
  const auto& in = std::get<std::vector<std::vector<int64_t>>>(value);
  std::vector<std::vector<double>> out;
  out.reserve(in.size());
  for (const auto& row : in) out.emplace_back(row.begin(), row.end());
  return AttrValue(std::move(out));
}

}  // namespace opjit::registry

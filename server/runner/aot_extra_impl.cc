#include "server/runner/aot_extra_impl.h"

#include <string_view>
#include <utility>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace opjit::runner {
namespace {

using registry::AttrValue;

template <typename To, typename From>
std::vector<To> ConvertList(const std::vector<From>& from) {
  return std::vector<To>(from.begin(), from.end());
}

template <typename To, typename From>
std::vector<std::vector<To>> ConvertNested(const std::vector<std::vector<From>>& from) {
  std::vector<std::vector<To>> out;
  out.reserve(from.size());
  for (const auto& row : from) out.push_back(ConvertList<To>(row));
  return out;
}

// MindSpore's conversions (issue 29): a float that is a whole number in
// int64_t's range reads as an integer (reduce.cc declares reduce_axis
// "float" and reads it as int64_t); a bool reads as 0 or 1.
bool WholeNumber(double d, int64_t* out) {
  // [-2^63, 2^63): the doubles that convert to int64_t exactly when whole.
  if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0)) return false;
  const auto i = static_cast<int64_t>(d);
  if (static_cast<double>(i) != d) return false;
  *out = i;
  return true;
}

bool WholeNumbers(const std::vector<double>& in, std::vector<int64_t>* out) {
  out->clear();
  out->reserve(in.size());
  for (double d : in) {
    int64_t i;
    if (!WholeNumber(d, &i)) return false;
    out->push_back(i);
  }
  return true;
}

}  // namespace

const char* AttrValueTypeName(const AttrValue& value) {
  static constexpr const char* kNames[] = {"bool",        "int",          "float",    "str",
                                           "listInt",     "listFloat",    "listBool", "listStr",
                                           "listListInt", "listListFloat"};
  static_assert(std::size(kNames) == std::variant_size_v<AttrValue>);
  return kNames[value.index()];
}

AotExtraImpl::AotExtraImpl(std::map<std::string, AttrValue> attrs) : attrs_(std::move(attrs)) {}

AotExtraImpl::~AotExtraImpl() = default;

std::vector<std::string> AotExtraImpl::TakeErrors() {
  MutexLock lock(&mu_);
  return std::exchange(errors_, {});
}

absl::Status AotExtraImpl::TakeStatus(const std::string& what) {
  std::vector<std::string> errors = TakeErrors();
  if (errors.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", absl::StrJoin(errors, "; ")));
}

const AttrValue* AotExtraImpl::Lookup(const std::string& name, const char* as) const {
  auto it = attrs_.find(name);
  if (it != attrs_.end()) return &it->second;
  MutexLock lock(&mu_);
  errors_.push_back(absl::StrCat("kernel read attr '", name, "' as ", as,
                                 " but the op instance has no such attr"));
  return nullptr;
}

void AotExtraImpl::RecordMismatch(const std::string& name, const char* as,
                                  const AttrValue& v) const {
  MutexLock lock(&mu_);
  const bool floats = std::holds_alternative<double>(v) ||
                      std::holds_alternative<std::vector<double>>(v) ||
                      std::holds_alternative<std::vector<std::vector<double>>>(v);
  const bool as_int = absl::StrContains(as, "int64_t") || std::string_view(as) == "int";
  errors_.push_back(absl::StrCat(
      "kernel read attr '", name, "' as ", as, " but it is ", AttrValueTypeName(v),
      floats && as_int ? " (a float reads as an integer only when it is a whole number)" : ""));
}

bool AotExtraImpl::HasAttrImpl(const std::string& name) const { return attrs_.count(name) != 0; }

bool AotExtraImpl::GetAttrBool(const std::string& name) const {
  const char* as = "bool";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return false;
  if (const auto* b = std::get_if<bool>(v)) return *b;
  if (const auto* i = std::get_if<int64_t>(v); i != nullptr && (*i == 0 || *i == 1)) {
    return *i == 1;
  }
  RecordMismatch(name, as, *v);
  return false;
}

int64_t AotExtraImpl::GetAttrInt(const std::string& name) const {
  const char* as = "int64_t";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return 0;
  if (const auto* i = std::get_if<int64_t>(v)) return *i;
  if (const auto* b = std::get_if<bool>(v)) return *b ? 1 : 0;
  if (const auto* d = std::get_if<double>(v)) {
    int64_t whole;
    if (WholeNumber(*d, &whole)) return whole;
  }
  RecordMismatch(name, as, *v);
  return 0;
}

float AotExtraImpl::GetAttrFloat(const std::string& name) const {
  const char* as = "float";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return 0.0f;
  if (const auto* d = std::get_if<double>(v)) return static_cast<float>(*d);
  if (const auto* i = std::get_if<int64_t>(v)) return static_cast<float>(*i);
  RecordMismatch(name, as, *v);
  return 0.0f;
}

double AotExtraImpl::GetAttrDouble(const std::string& name) const {
  const char* as = "double";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return 0.0;
  if (const auto* d = std::get_if<double>(v)) return *d;
  if (const auto* i = std::get_if<int64_t>(v)) return static_cast<double>(*i);
  RecordMismatch(name, as, *v);
  return 0.0;
}

std::string AotExtraImpl::GetAttrStr(const std::string& name) const {
  const char* as = "std::string";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* s = std::get_if<std::string>(v)) return *s;
  RecordMismatch(name, as, *v);
  return {};
}

std::vector<int64_t> AotExtraImpl::GetAttrListInt(const std::string& name) const {
  const char* as = "std::vector<int64_t>";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* l = std::get_if<std::vector<int64_t>>(v)) return *l;
  if (const auto* l = std::get_if<std::vector<double>>(v)) {
    std::vector<int64_t> whole;
    if (WholeNumbers(*l, &whole)) return whole;
  }
  RecordMismatch(name, as, *v);
  return {};
}

std::vector<float> AotExtraImpl::GetAttrListFloat(const std::string& name) const {
  const char* as = "std::vector<float>";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* l = std::get_if<std::vector<double>>(v)) return ConvertList<float>(*l);
  if (const auto* l = std::get_if<std::vector<int64_t>>(v)) return ConvertList<float>(*l);
  RecordMismatch(name, as, *v);
  return {};
}

std::vector<bool> AotExtraImpl::GetAttrListBool(const std::string& name) const {
  const char* as = "std::vector<bool>";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* l = std::get_if<std::vector<bool>>(v)) return *l;
  RecordMismatch(name, as, *v);
  return {};
}

std::vector<std::string> AotExtraImpl::GetAttrListStr(const std::string& name) const {
  const char* as = "std::vector<std::string>";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* l = std::get_if<std::vector<std::string>>(v)) return *l;
  RecordMismatch(name, as, *v);
  return {};
}

std::vector<std::vector<int64_t>> AotExtraImpl::GetAttrListListInt(const std::string& name) const {
  const char* as = "std::vector<std::vector<int64_t>>";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* l = std::get_if<std::vector<std::vector<int64_t>>>(v)) return *l;
  if (const auto* l = std::get_if<std::vector<std::vector<double>>>(v)) {
    std::vector<std::vector<int64_t>> whole(l->size());
    bool ok = true;
    for (size_t r = 0; r < l->size() && ok; ++r) ok = WholeNumbers((*l)[r], &whole[r]);
    if (ok) return whole;
  }
  RecordMismatch(name, as, *v);
  return {};
}

std::vector<std::vector<float>> AotExtraImpl::GetAttrListListFloat(const std::string& name) const {
  const char* as = "std::vector<std::vector<float>>";
  const AttrValue* v = Lookup(name, as);
  if (v == nullptr) return {};
  if (const auto* l = std::get_if<std::vector<std::vector<double>>>(v)) {
    return ConvertNested<float>(*l);
  }
  if (const auto* l = std::get_if<std::vector<std::vector<int64_t>>>(v)) {
    return ConvertNested<float>(*l);
  }
  RecordMismatch(name, as, *v);
  return {};
}

}  // namespace opjit::runner

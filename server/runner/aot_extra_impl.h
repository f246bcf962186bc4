// The daemon's side of AotExtra (kernels/include/custom_aot_extra.h): serves a
// kernel's Attr<T>() reads from the op instance's attribute values.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "custom_aot_extra.h"
#include "server/common/mutex.h"
#include "server/registry/op_def.h"

namespace opjit::runner {

// Attribute access for one kernel instance. A kernel's read of a missing
// attribute or one of another type must not take the daemon down: the getter
// returns a zero value, records the error, and the caller turns the recorded
// errors into INVALID_ARGUMENT after the kernel returns (TakeStatus).
//
// Conversions (MindSpore's, issue 29): int64 -> int64_t/int (and to
// float/double); double -> float/double, and to int64_t/int when it is a
// whole number in range (lossless; 0.5 is an error); bool -> bool, and to
// int64_t/int as 0 or 1; int64 0 or 1 -> bool; listFloat ->
// std::vector<float>, and to std::vector<int64_t> when every element is
// whole; listInt -> std::vector<int64_t> (and to std::vector<float>);
// listListInt/listListFloat -> the nested vectors, the same way; str,
// listBool, listStr as themselves.
//
// Thread-safe: the getters may run on many threads; errors are collected under
// a mutex, so with concurrent calls an error may be reported by a call other
// than the one that caused it (AotKernelInstance serialises runs by default).
class AotExtraImpl final : public AotExtra {
 public:
  explicit AotExtraImpl(std::map<std::string, registry::AttrValue> attrs);
  ~AotExtraImpl() override;

  const std::map<std::string, registry::AttrValue>& attrs() const { return attrs_; }

  // The errors recorded since the last call, oldest first; clears them.
  std::vector<std::string> TakeErrors();
  // OK, or INVALID_ARGUMENT listing what TakeErrors() returns (`what` names the
  // call, e.g. "CustomAdd Init").
  absl::Status TakeStatus(const std::string& what);

 protected:
  bool HasAttrImpl(const std::string& name) const override;
  bool GetAttrBool(const std::string& name) const override;
  int64_t GetAttrInt(const std::string& name) const override;
  float GetAttrFloat(const std::string& name) const override;
  double GetAttrDouble(const std::string& name) const override;
  std::string GetAttrStr(const std::string& name) const override;
  std::vector<int64_t> GetAttrListInt(const std::string& name) const override;
  std::vector<float> GetAttrListFloat(const std::string& name) const override;
  std::vector<bool> GetAttrListBool(const std::string& name) const override;
  std::vector<std::string> GetAttrListStr(const std::string& name) const override;
  std::vector<std::vector<int64_t>> GetAttrListListInt(const std::string& name) const override;
  std::vector<std::vector<float>> GetAttrListListFloat(const std::string& name) const override;

 private:
  // The value of `name`, or nullptr after recording that it is missing.
  const registry::AttrValue* Lookup(const std::string& name, const char* as) const;
  void RecordMismatch(const std::string& name, const char* as, const registry::AttrValue& v) const;

  const std::map<std::string, registry::AttrValue> attrs_;
  mutable Mutex mu_;
  mutable std::vector<std::string> errors_ ABSL_GUARDED_BY(mu_);
};

// The registry's name of the type an AttrValue holds ("int", "listFloat", ...).
const char* AttrValueTypeName(const registry::AttrValue& value);

}  // namespace opjit::runner

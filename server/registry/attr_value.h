// Attribute values: parsing the text form used for defaults (and by clients
// that send attrs as text), formatting back to text, and type checks.
//
// Text forms, per ValueType (MindSpore CustomRegOp spelling):
//   bool            true | false            (True / False also accepted)
//   int             -3, 42                  (a decimal int64; "1.5" is refused)
//   float           0.1, 3, 1e-3, inf, nan  (an int is widened to float)
//   str             the text itself, verbatim
//   listInt         [1, 2, 3]               (JSON array; [] is an empty list)
//   listFloat       [0.5, 1]                (ints are widened)
//   listBool        [true, false]
//   listStr         ["a", "b"]              (JSON strings, with JSON escapes)
//   listListInt     [[1, 2], [3]]
//   listListFloat   [[0.5], [1, 2.5]]
//   all             any of the above, by its form: true/false -> bool, an
//                   int64 -> int, a float -> float, a JSON array of one kind
//                   -> that list type ([] -> listInt; ints with floats ->
//                   listFloat), anything else -> str (verbatim). A JSON array
//                   that mixes kinds ([1, "a"]) is refused.
// Leading and trailing whitespace is ignored for every type but str.
// Non-finite floats are only representable as scalars (JSON has no inf/nan).
//
// All functions are pure and thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/registry/op_def.h"

namespace opjit::registry {

// Parses `text` as a value of type `type`. On failure returns INVALID_ARGUMENT
// whose message says what was expected and what was found, e.g.
//   expected an int, got a float "1.5"
//   expected listInt: element [1] is a string, expected an int
absl::StatusOr<AttrValue> ParseAttrValue(ValueType type, const std::string& text);

// The text form of `value`, such that ParseAttrValue(ValueTypeOf(value), text)
// returns `value` again (for floats: bit-exact, using the shortest round-trip
// representation; non-finite floats inside lists excepted). Scalar floats
// always carry a '.' or an exponent ("3.0"), so they read as floats.
std::string FormatAttrValue(const AttrValue& value);

// The ValueType that the held alternative represents.
ValueType ValueTypeOf(const AttrValue& value);

// Whether `value` is acceptable where `type` is expected: the same type, or a
// widening conversion (int -> float, listInt -> listFloat, listListInt ->
// listListFloat), or an empty list of any kind where a list of the same depth
// is expected (an empty list carries no element type on the wire). Anything
// matches kAll.
bool AttrValueMatches(ValueType type, const AttrValue& value);

// `value` converted to exactly `type` by the conversions AttrValueMatches
// allows (kAll: `value` as it is). INVALID_ARGUMENT ("expected float, got
// str") when it does not match.
absl::StatusOr<AttrValue> CoerceAttrValue(ValueType type, AttrValue value);

}  // namespace opjit::registry

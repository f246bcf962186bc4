// Small helpers for absl::Status propagation. The Debian abseil has no
// RETURN_IF_ERROR, so opjit defines its own once, here.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define OPJIT_CONCAT_INNER_(a, b) a##b
#define OPJIT_CONCAT_(a, b) OPJIT_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function
// when it is not OK.
#define OPJIT_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status opjit_status_ = (expr);           \
    if (!opjit_status_.ok()) return opjit_status_;   \
  } while (0)

// `lhs = *expr` when `expr` (an absl::StatusOr<T>) holds a value; otherwise
// returns its status from the enclosing function. `lhs` may declare a variable:
//   OPJIT_ASSIGN_OR_RETURN(auto db, Store::Open(path));
#define OPJIT_ASSIGN_OR_RETURN(lhs, expr) \
  OPJIT_ASSIGN_OR_RETURN_IMPL_(OPJIT_CONCAT_(opjit_statusor_, __LINE__), lhs, expr)

#define OPJIT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

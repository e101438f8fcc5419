// Status helpers shared by every component.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns from the current function when `expr` (an absl::Status) is not OK.
#define RAGSHARD_RETURN_IF_ERROR(expr)       \
  do {                                       \
    ::absl::Status _rs_status = (expr);      \
    if (!_rs_status.ok()) return _rs_status; \
  } while (0)

#define RAGSHARD_CONCAT_INNER(a, b) a##b
#define RAGSHARD_CONCAT(a, b) RAGSHARD_CONCAT_INNER(a, b)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status from the function.
#define RAGSHARD_ASSIGN_OR_RETURN(lhs, rexpr) \
  RAGSHARD_ASSIGN_OR_RETURN_IMPL(RAGSHARD_CONCAT(_rs_statusor_, __LINE__), lhs, rexpr)

// `tmp` and `lhs` name variables (lhs may be a declaration), which parentheses would break.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define RAGSHARD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                   \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)

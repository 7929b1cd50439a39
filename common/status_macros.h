// Status propagation helpers. Abseil 20220623 ships no RETURN_IF_ERROR /
// ASSIGN_OR_RETURN, so pdserve keeps its own here. Header-only, thread-safe.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PDSERVE_CONCAT_INNER(a, b) a##b
#define PDSERVE_CONCAT(a, b) PDSERVE_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::absl::Status pdserve_status_ = (expr);           \
    if (!pdserve_status_.ok()) return pdserve_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` declares/assigns x from a StatusOr or
// returns its error status.
#define ASSIGN_OR_RETURN(lhs, expr)                                          \
  ASSIGN_OR_RETURN_IMPL(PDSERVE_CONCAT(pdserve_statusor_, __COUNTER__), lhs, \
                        expr)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

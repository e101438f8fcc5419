// Formatting and exit codes shared by ragshardctl's commands.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/strings/string_view.h"
#include "engine/planner.h"

namespace ragshard {

// ragshardctl's exit codes: 0 success, 1 other failures, 2 bad input (flags, files, shapes).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;

// n with a decimal unit suffix and two decimals: 1234567 -> "1.23M"; below 1000, the number.
std::string Human(int64_t n);

// part / whole in percent; 0 when whole is 0.
double Pct(int64_t part, int64_t whole);

// A message on one line (newlines become spaces), for one-line errors and table cells.
std::string OneLine(absl::string_view msg);

// A policy's plan (or baseline layout) as a table per unit, then its totals ("total: ...").
void PrintPlanTable(const PolicyResult& r, std::ostream& out);

}  // namespace ragshard

// Number formatting shared by ragshardctl's commands.
#pragma once

#include <cstdint>
#include <string>

namespace ragshard {

// n with a decimal unit suffix and two decimals: 1234567 -> "1.23M"; below 1000, the number.
std::string Human(int64_t n);

}  // namespace ragshard

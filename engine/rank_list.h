// Ranks as errors and the CLI name them.
#pragma once

#include <cstdint>
#include <string>

#include "absl/types/span.h"

namespace ragshard {

// Sorted ranks as runs: runs of 3 or more as "a-b", the others one by one ("0, 1",
// "0-7, 16-23"); the first 8 pieces and how many ranks more ("... and 12 more").
std::string RankList(absl::Span<const int64_t> ranks);

}  // namespace ragshard

// Internal to the strategy model (common/strategy_model.cc, common/strategy_cost.cc): what the
// model keeps per grouping and group size. Not part of its interface.
#pragma once

#include <vector>

#include "common/strategy_model.h"

namespace ragshard {

// Shard sizes of every grouped unit at one group size n, from the ragged planner.
struct StrategyModel::GroupStats {
  std::vector<double> shard_elems;  // per unit, summed over dtypes
  std::vector<double> shard_bytes;
  std::vector<double> numel;
  double padding_elems = 0, total_elems = 0;
  double max_unsharded_bytes = 0;  // n * shard_bytes of the largest unit
};

}  // namespace ragshard

// Internal to the strategy model (engine/strategy_model.cc, engine/strategy_cost.cc): what the
// model keeps per grouping and group size. Not part of its interface.
#pragma once

#include <vector>

#include "engine/strategy_model.h"
#include "engine/unit_solver.h"

namespace ragshard {

// Shard sizes of every grouped unit at one group size n, from the ragged planner.
struct StrategyModel::GroupStats {
  std::vector<double> shard_elems;  // per unit, summed over dtypes
  std::vector<double> shard_bytes;
  std::vector<double> numel;
  std::vector<double> lb2_elems;  // per unit: the solver's LB2 (docs/design.md), summed
  double padding_elems = 0, total_elems = 0;
  // n * LB2 - numel over the units: no plan of these units over n positions pads less.
  double lb_padding_elems = 0;
  double max_unsharded_bytes = 0;  // n * shard_bytes of the largest unit
};

// The distinct units of a grouping: units with the same (dtype, numel, granule) lists plan the
// same, so each is solved once per group size.
struct StrategyModel::Signatures {
  struct Group {
    v1::DType dtype = v1::DTYPE_UNSPECIFIED;
    std::vector<UnitItem> items;
  };
  std::vector<std::vector<Group>> distinct;
  std::vector<int> of_unit;
  std::vector<double> unit_numel;
};

}  // namespace ragshard

// The strategy search: every candidate the rules allow, costed by the model
// (engine/strategy_model.h), and policy auto's plan from the best one.
//
// Thread-safe: the functions are pure apart from the StrategyModel they are given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/cluster.h"
#include "engine/inventory.h"
#include "engine/planner.h"
#include "engine/strategy_model.h"

namespace ragshard {

struct Advice {
  Evaluation recommendation;
  std::vector<Evaluation> top;       // the best accepted candidates, best first
  std::vector<Evaluation> rejected;  // every candidate set aside, with its reason
  int64_t considered = 0;
  bool padding_target_met = true;
  // The least padding of a candidate that fits (the recommendation's when the target is not
  // met), and the least padding any candidate that could fit the budget unpadded can have (the
  // planner's LB2 of each of its units over |os| positions): when that bound is above the
  // target, no strategy of the search fits and meets it. `padding_bound_why` names the
  // candidate of the bound, the units that pad and the granules that force it; it is set when
  // the target is not met.
  double best_padding_pct = 0;
  double padding_bound_pct = 0;
  std::string padding_bound_why;
  // When the target is not met: the bound over any grouping of consecutive layer units
  // (StrategyModel::PaddingBoundAnyGrouping; -1 when it is not computed or nothing fits).
  double any_grouping_bound_pct = -1;
  std::string any_grouping_bound_why;
  double search_seconds = 0;
  int64_t planner_runs = 0;
};

// Exhaustive search over the candidates. The objective, in order: padding above the target
// (options().max_padding_pct; to 0.01 percentage points), then the predicted step; among
// candidates within 1 % of the fastest (the model's resolution) the one that sends the fewest
// bytes (AMSP's objective), then the one with the least memory. When no candidate meets the
// padding target the search widens the unit groupings (StrategyModel::WidenGroupings) and
// bounds the padding that any candidate could reach. FAILED_PRECONDITION when nothing fits the
// budget, naming the smallest memory any candidate needs.
absl::StatusOr<Advice> Advise(StrategyModel* model);

// Policy auto: the plan of the best strategy of the search for a job of nodes x
// devices_per_node ranks, numbered node by node, or of `pinned` when it is set; every strategy
// the rules allow runs (separate factors and groups inside a node included). The os plan is
// planned over |os| positions and nested into the g and p plans (engine/plan_nesting.h).
// `plan_options` gives the job id, version and alignment; its world and policy are set here.
// The plan records the strategy (PlanStrategy), and each UnitPlan the client units it covers.
// `shard` is |p| (the plan's world) and `replicate` W / |p|: the job's mesh.
struct AutoPlan {
  v1::Plan plan;
  int64_t shard = 0;
  int64_t replicate = 0;
};
absl::StatusOr<AutoPlan> PlanAuto(const Inventory& inventory, absl::string_view model,
                                  const ClusterProfile& profile, int64_t nodes,
                                  int64_t devices_per_node, const CostOptions& options,
                                  const std::string& pinned, PlanOptions plan_options);

}  // namespace ragshard

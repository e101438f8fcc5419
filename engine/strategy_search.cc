#include "engine/strategy_search.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/plan_nesting.h"
#include "engine/unit_grouping.h"
#include "infra/status_macros.h"

namespace ragshard {

absl::StatusOr<Advice> Advise(StrategyModel* model) {
  const auto t0 = std::chrono::steady_clock::now();
  Advice advice;
  const CostOptions& o = model->options();
  const double budget = static_cast<double>(model->budget_bytes());
  std::vector<Evaluation> fits, all_rejected;
  const Evaluation* smallest = nullptr;
  std::vector<Evaluation> evaluated;
  const std::vector<Strategy> candidates = model->Candidates();
  evaluated.reserve(candidates.size());
  RAGSHARD_RETURN_IF_ERROR(model->PrecomputeFor(candidates));
  for (const Strategy& s : candidates) {
    RAGSHARD_ASSIGN_OR_RETURN(Evaluation e, model->Evaluate(s, false, /*budget_check=*/true));
    evaluated.push_back(std::move(e));
  }
  auto meets_target = [&](const Evaluation& e) {
    return e.memory.total() <= budget && e.padding_pct <= o.max_padding_pct;
  };
  if (std::none_of(evaluated.begin(), evaluated.end(), meets_target)) {
    // Padding is the first term of the objective: before settling for more, try every larger
    // unit grouping that could fit.
    const std::vector<Strategy> wider = model->WidenGroupings();
    RAGSHARD_RETURN_IF_ERROR(model->PrecomputeFor(wider));
    for (const Strategy& s : wider) {
      RAGSHARD_ASSIGN_OR_RETURN(Evaluation e, model->Evaluate(s, false, /*budget_check=*/true));
      evaluated.push_back(std::move(e));
    }
  }
  advice.considered = static_cast<int64_t>(evaluated.size());
  for (const Evaluation& e : evaluated) {
    if (smallest == nullptr || e.memory.total() < smallest->memory.total()) smallest = &e;
  }
  if (smallest == nullptr) return absl::InvalidArgumentError("no candidate strategy to consider");
  Evaluation exact_smallest;
  bool found = false;
  if (smallest->memory.total() > budget && smallest->memory_lower_bound) {
    // Name the true smallest: cost exactly, in order of their lower bounds, the candidates whose
    // bound is below the best exact figure found so far.
    std::vector<const Evaluation*> order;
    order.reserve(evaluated.size());
    for (const Evaluation& e : evaluated) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const Evaluation* a, const Evaluation* b) {
      return a->memory.total() < b->memory.total();
    });
    for (const Evaluation* e : order) {
      if (found && e->memory.total() >= exact_smallest.memory.total()) {
        break;
      }
      RAGSHARD_ASSIGN_OR_RETURN(Evaluation x, model->Evaluate(e->strategy));
      if (!found || x.memory.total() < exact_smallest.memory.total()) {
        exact_smallest = std::move(x);
        found = true;
      }
    }
    smallest = &exact_smallest;
  }
  if (smallest->memory.total() > budget) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "no strategy fits the memory budget of %s (%.0f bytes) per device; the smallest needs "
        "%s%s (%.0f bytes): %s (params %s, grads %s, optimizer %s, transient %s, activations %s)",
        FormatBytes(budget), budget, smallest->memory_lower_bound ? "at least " : "",
        FormatBytes(smallest->memory.total()), std::ceil(smallest->memory.total()),
        StrategyName(smallest->strategy), FormatBytes(smallest->memory.params),
        FormatBytes(smallest->memory.grads), FormatBytes(smallest->memory.optimizer),
        FormatBytes(smallest->memory.transient), FormatBytes(smallest->memory.activations)));
  }
  const bool any_good = std::any_of(evaluated.begin(), evaluated.end(), meets_target);
  advice.padding_target_met = any_good;
  // Every candidate that could fit was planned; none of them pads less than its LB2 bound.
  const Evaluation* bound = nullptr;
  int64_t could_fit = 0, narrowest_os = 0;
  advice.best_padding_pct = -1;
  for (const Evaluation& e : evaluated) {
    if (e.memory_lower_bound || e.memory_at_bound > budget) continue;
    ++could_fit;
    narrowest_os =
        narrowest_os == 0 ? e.strategy.os.size() : std::min(narrowest_os, e.strategy.os.size());
    if (bound == nullptr || e.padding_bound_pct < bound->padding_bound_pct) bound = &e;
    if (e.memory.total() <= budget &&
        (advice.best_padding_pct < 0 || e.padding_pct < advice.best_padding_pct)) {
      advice.best_padding_pct = e.padding_pct;
    }
  }
  if (bound != nullptr) advice.padding_bound_pct = bound->padding_bound_pct;
  if (!any_good && bound != nullptr) {
    RAGSHARD_ASSIGN_OR_RETURN(std::string why, model->ExplainPaddingBound(bound->strategy));
    advice.padding_bound_why = absl::StrFormat(
        "%d candidates could fit %s per device with their units at the planner's lower bound "
        "LB2 (units of more than %d layers do not fit even unpadded, of any grouping up to the "
        "model's %d layers; optimizer states over at least %d devices); the least padding any "
        "of them can have is %.3f%%, by %s",
        could_fit, FormatBytes(budget), model->MaxFittingLayersPerUnit(), model->shape().layers,
        narrowest_os, bound->padding_bound_pct, why);
    const StrategyModel::GroupingBound any = model->PaddingBoundAnyGrouping();
    advice.any_grouping_bound_pct = any.pct;
    advice.any_grouping_bound_why = absl::StrFormat(
        "any grouping of consecutive layer units into units whose LB2-padded buffers fit, "
        "other units alone: %s",
        any.why);
  }
  std::vector<Evaluation> accepted;
  accepted.reserve(evaluated.size());
  advice.rejected.reserve(evaluated.size());
  for (Evaluation& e : evaluated) {
    if (e.memory.total() > budget) {
      e.rejected = absl::StrFormat("memory %s%s exceeds the budget %s",
                                   e.memory_lower_bound ? "of at least " : "",
                                   FormatBytes(e.memory.total()), FormatBytes(budget));
    } else if (any_good && e.padding_pct > o.max_padding_pct) {
      e.rejected = absl::StrFormat("padding %.3f%% exceeds the %.2f%% target", e.padding_pct,
                                   o.max_padding_pct);
    }
    (e.rejected.empty() ? accepted : advice.rejected).push_back(std::move(e));
  }
  // The objective's first term: padding above the target, to 0.01 percentage points (below the
  // model's resolution: a hundredth of a percent more padding does not outweigh a faster step).
  auto excess = [&](const Evaluation& e) {
    return std::llround(std::max(0.0, e.padding_pct - o.max_padding_pct) * 100);
  };
  auto better = [&](const Evaluation& a, const Evaluation& b) {
    // Without a candidate under the padding target, the least padding wins.
    if (excess(a) != excess(b)) return excess(a) < excess(b);
    if (a.step_seconds != b.step_seconds) return a.step_seconds < b.step_seconds;
    if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
    return StrategyName(a.strategy) < StrategyName(b.strategy);
  };
  std::sort(accepted.begin(), accepted.end(), better);
  // Within 1 % of the fastest the model cannot tell candidates apart: prefer fewer bytes sent,
  // then less memory.
  if (!accepted.empty()) {
    const double limit = accepted.front().step_seconds * 1.01;
    auto band_end = std::find_if(accepted.begin(), accepted.end(),
                                 [&](const Evaluation& e) { return e.step_seconds > limit; });
    std::stable_sort(accepted.begin(), band_end, [&](const Evaluation& a, const Evaluation& b) {
      if (excess(a) != excess(b)) return excess(a) < excess(b);
      if (a.wire_bytes != b.wire_bytes) return a.wire_bytes < b.wire_bytes;
      if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
      return StrategyName(a.strategy) < StrategyName(b.strategy);
    });
  }
  const size_t top = std::min(accepted.size(), static_cast<size_t>(std::max(o.top_k, 1)));
  for (size_t i = 0; i < top; ++i) advice.top.push_back(accepted[i]);
  RAGSHARD_ASSIGN_OR_RETURN(advice.recommendation,
                            model->Evaluate(advice.top.front().strategy, /*detail=*/true));
  advice.planner_runs = model->planner_runs();
  advice.search_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return advice;
}

absl::StatusOr<AutoPlan> PlanAuto(const Inventory& inventory, absl::string_view model,
                                  const ClusterProfile& profile, int64_t nodes,
                                  int64_t devices_per_node, const CostOptions& options,
                                  const std::string& pinned, PlanOptions plan_options) {
  ClusterProfile sized = profile;
  sized.nodes = nodes;
  sized.devices_per_node = devices_per_node;
  const ModelShape shape = DeriveModelShape(inventory, model);
  RAGSHARD_ASSIGN_OR_RETURN(auto m, StrategyModel::Create(inventory, shape, sized, options));
  v1::PlanStrategy record;
  record.set_cluster_profile(profile.name);
  Evaluation chosen;
  if (!pinned.empty()) {
    RAGSHARD_ASSIGN_OR_RETURN(Strategy s, ParseStrategy(pinned));
    RAGSHARD_ASSIGN_OR_RETURN(chosen, m->Evaluate(s));
    record.set_reason("pinned by the job");
    record.set_recommended(StrategyName(s));
  } else {
    RAGSHARD_ASSIGN_OR_RETURN(Advice advice, Advise(m.get()));
    chosen = advice.recommendation;
    record.set_reason(absl::StrCat("best of ", advice.considered,
                                   " candidates (cost model, cluster profile ", profile.name, ")"));
    record.set_recommended(StrategyName(chosen.strategy));
  }
  const Strategy& st = chosen.strategy;
  record.set_executed(StrategyName(st));
  record.set_predicted_step_seconds(chosen.step_seconds);
  record.set_predicted_memory_bytes(chosen.memory.total());
  record.set_predicted_padding_pct(chosen.padding_pct);
  AutoPlan out;
  out.shard = st.p.size();
  out.replicate = sized.world() / out.shard;
  std::vector<std::vector<std::string>> members;
  Inventory grouped = GroupUnits(inventory, st.layers_per_unit, &members, st.lead);
  // The finest factor (os) is planned; the g and p plans are its coarsenings (plan_nesting.h).
  plan_options.policy = Policy::kRagged;
  plan_options.world = st.os.size();
  RAGSHARD_ASSIGN_OR_RETURN(v1::Plan finest, BuildPlan(grouped, plan_options));
  const Sharding sharding{nodes, devices_per_node, st.p, st.g, st.os};
  RAGSHARD_ASSIGN_OR_RETURN(out.plan, NestPlan(finest, sharding));
  std::map<std::string, const std::vector<std::string>*> by_unit;
  for (int u = 0; u < grouped.units_size(); ++u) by_unit[grouped.units(u).name()] = &members[u];
  auto add_members = [&](v1::UnitPlan& up) {
    const auto* mem = by_unit.at(up.unit());
    if (mem->size() > 1) {
      for (const std::string& name : *mem) up.add_members(name);
    }
  };
  for (v1::UnitPlan& up : *out.plan.mutable_units()) add_members(up);
  for (v1::FactorPlan& fp : *out.plan.mutable_factors()) {
    for (v1::UnitPlan& up : *fp.mutable_units()) add_members(up);
  }
  *out.plan.mutable_strategy() = record;
  return out;
}

}  // namespace ragshard

#include "ctl/strategy_render.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

using json = nlohmann::json;

json MemoryJson(const MemoryBreakdown& m) {
  return json{{"params", m.params},           {"grads", m.grads},
              {"optimizer", m.optimizer},     {"transient", m.transient},
              {"activations", m.activations}, {"total", m.total()}};
}

json StrategyJson(const Strategy& s, const ClusterProfile& p) {
  auto shape = [](const GroupShape& g) {
    return json{{"within_node", g.intra}, {"across_nodes", g.inter}, {"size", g.size()}};
  };
  json j{{"spec", StrategyName(s)},
         {"layers_per_unit", s.layers_per_unit},
         {"params", shape(s.p)},
         {"grads", shape(s.g)},
         {"optimizer_states", shape(s.os)}};
  if (s.uniform()) {
    j["mesh"] = json{{"shard", s.p.size()}, {"replicate", p.world() / s.p.size()}};
  }
  j["executable"] = true;  // the data plane runs every strategy the rules allow
  return j;
}

json EvalJson(const Evaluation& e, const ClusterProfile& p) {
  json j{{"strategy", StrategyJson(e.strategy, p)},
         {"predicted_step_seconds", e.step_seconds},
         {"compute_seconds", e.compute_seconds},
         {"exposed_comm_seconds", e.exposed_comm_seconds},
         {"padding_pct", e.padding_pct},
         {"grad_padding_pct", e.grad_padding_pct},
         {"memory_bytes", e.memory.total()},
         {"memory", MemoryJson(e.memory)},
         {"wire_bytes_per_step", e.wire_bytes},
         {"comm_bytes_per_step", json{{"all_gather", e.ag_bytes},
                                      {"reduce_scatter", e.rs_bytes},
                                      {"all_reduce", e.ar_bytes},
                                      {"owner", e.owner_bytes},
                                      {"update", e.update_bytes}}}};
  if (!e.rejected.empty()) j["rejected"] = e.rejected;
  return j;
}

// A unit's traffic of each kind, as "<kind>_bytes" and "<kind>_seconds" in its JSON.
struct UnitTraffic {
  const char* kind;
  double UnitCost::*bytes;
  double UnitCost::*seconds;
};
constexpr UnitTraffic kUnitTraffic[] = {
    {"all_gather", &UnitCost::ag_bytes, &UnitCost::ag_seconds},
    {"reduce_scatter", &UnitCost::rs_bytes, &UnitCost::rs_seconds},
    {"all_reduce", &UnitCost::ar_bytes, &UnitCost::ar_seconds},
    {"owner", &UnitCost::owner_bytes, &UnitCost::owner_seconds},
    {"update", &UnitCost::update_bytes, &UnitCost::update_seconds},
};

}  // namespace

std::string AdviceJson(const Advice& advice, const StrategyModel& model, int max_rejected) {
  const ClusterProfile& p = model.profile();
  json j;
  j["cluster"] = json{{"name", p.name},
                      {"nodes", p.nodes},
                      {"devices_per_node", p.devices_per_node},
                      {"world", p.world()}};
  j["memory_budget_bytes"] = model.budget_bytes();
  j["recommendation"] = EvalJson(advice.recommendation, p);
  j["padding_target_met"] = advice.padding_target_met;
  j["best_padding_pct"] = advice.best_padding_pct;
  j["padding_bound_pct"] = advice.padding_bound_pct;
  if (!advice.padding_bound_why.empty()) j["padding_bound_why"] = advice.padding_bound_why;
  if (!advice.padding_target_met) {
    j["any_grouping_bound_pct"] = advice.any_grouping_bound_pct;
    j["any_grouping_bound_why"] = advice.any_grouping_bound_why;
  }
  j["candidates"] = json::array();
  for (const Evaluation& e : advice.top) j["candidates"].push_back(EvalJson(e, p));
  j["considered"] = advice.considered;
  j["rejected_count"] = advice.rejected.size();
  std::map<std::string, int64_t> reasons;
  for (const Evaluation& e : advice.rejected) {
    reasons[absl::StrContains(e.rejected, "memory") ? "memory" : "padding"]++;
  }
  j["rejected_by_reason"] = reasons;
  j["rejected"] = json::array();
  for (size_t i = 0; i < advice.rejected.size() && static_cast<int>(i) < max_rejected; ++i) {
    j["rejected"].push_back(json{{"spec", StrategyName(advice.rejected[i].strategy)},
                                 {"reason", advice.rejected[i].rejected}});
  }
  j["search_seconds"] = advice.search_seconds;
  j["planner_runs"] = advice.planner_runs;
  return j.dump(2);
}

std::string EvaluationJson(const Evaluation& e) {
  json j{{"spec", StrategyName(e.strategy)},     {"predicted_step_seconds", e.step_seconds},
         {"compute_seconds", e.compute_seconds}, {"exposed_comm_seconds", e.exposed_comm_seconds},
         {"padding_pct", e.padding_pct},         {"memory_bytes", e.memory.total()},
         {"memory", MemoryJson(e.memory)}};
  j["units"] = json::array();
  for (const UnitCost& c : e.units) {
    json unit{{"name", c.name},
              {"numel", c.numel},
              {"forward_seconds", c.fwd_seconds},
              {"backward_seconds", c.bwd_seconds}};
    for (const UnitTraffic& t : kUnitTraffic) {
      unit[absl::StrCat(t.kind, "_bytes")] = c.*t.bytes;
      unit[absl::StrCat(t.kind, "_seconds")] = c.*t.seconds;
    }
    j["units"].push_back(std::move(unit));
  }
  j["timeline"] = json::array();
  for (const TimelineEvent& t : e.timeline) {
    j["timeline"].push_back(
        json{{"stream", t.stream}, {"label", t.label}, {"start", t.start}, {"end", t.end}});
  }
  return j.dump(2);
}

std::string AdviceTable(const Advice& advice, const StrategyModel& model, int max_rejected) {
  const ClusterProfile& p = model.profile();
  const Evaluation& r = advice.recommendation;
  std::string out = absl::StrFormat(
      "cluster %s: %d nodes x %d devices (W=%d), budget %s per device\n"
      "recommendation: %s\n  predicted step %.4f s (compute %.4f s, exposed communication "
      "%.4f s), memory %s, padding %.3f%%%s\n",
      p.name, p.nodes, p.devices_per_node, p.world(), FormatBytes(model.budget_bytes()),
      StrategyName(r.strategy), r.step_seconds, r.compute_seconds, r.exposed_comm_seconds,
      FormatBytes(r.memory.total()), r.padding_pct,
      advice.padding_target_met ? "" : " (no fitting candidate meets the padding target)");
  if (!advice.padding_target_met) {
    absl::StrAppend(
        &out, absl::StrFormat(
                  "padding target %.2f%% %s within the budget: best reachable padding "
                  "%.3f%%, lower bound %.3f%% over the search's candidates, %.3f%% over "
                  "any grouping\n  why: %s\n  beyond the search: %s\n",
                  model.options().max_padding_pct,
                  advice.padding_bound_pct > model.options().max_padding_pct ? "cannot be met"
                                                                             : "not met",
                  advice.best_padding_pct, advice.padding_bound_pct, advice.any_grouping_bound_pct,
                  advice.padding_bound_why, advice.any_grouping_bound_why));
  }
  absl::StrAppend(&out,
                  absl::StrFormat("\n%-32s %10s %10s %12s %9s %12s %12s\n", "candidate", "step s",
                                  "exposed s", "memory", "padding", "AG/step", "RS/step"));
  for (const Evaluation& e : advice.top) {
    absl::StrAppend(
        &out,
        absl::StrFormat("%-32s %10.4f %10.4f %12s %8.3f%% %12s %12s\n", StrategyName(e.strategy),
                        e.step_seconds, e.exposed_comm_seconds, FormatBytes(e.memory.total()),
                        e.padding_pct, FormatBytes(e.ag_bytes), FormatBytes(e.rs_bytes)));
  }
  absl::StrAppend(&out, absl::StrFormat("\n%d candidates considered, %d rejected, search %.3f s "
                                        "(%d planner runs)\n",
                                        advice.considered, advice.rejected.size(),
                                        advice.search_seconds, advice.planner_runs));
  for (size_t i = 0; i < advice.rejected.size() && static_cast<int>(i) < max_rejected; ++i) {
    absl::StrAppend(&out, "  rejected ", StrategyName(advice.rejected[i].strategy), ": ",
                    advice.rejected[i].rejected, "\n");
  }
  if (static_cast<int>(advice.rejected.size()) > max_rejected) {
    absl::StrAppend(&out, "  ... (", advice.rejected.size() - max_rejected,
                    " more; --json lists them with --max-rejected)\n");
  }
  return out;
}

std::string SimulationReport(const Evaluation& e, const StrategyModel& model, int width) {
  const ClusterProfile& p = model.profile();
  std::string out = absl::StrFormat(
      "strategy %s on %s (%d nodes x %d devices)\n"
      "step %.4f s: compute %.4f s, exposed communication %.4f s\n"
      "peak memory per device %s: params %s, grads %s, optimizer %s, transient %s, "
      "activations %s\npadding: parameters %.3f%%, gradients %.3f%%\n\n",
      StrategyName(e.strategy), p.name, p.nodes, p.devices_per_node, e.step_seconds,
      e.compute_seconds, e.exposed_comm_seconds, FormatBytes(e.memory.total()),
      FormatBytes(e.memory.params), FormatBytes(e.memory.grads), FormatBytes(e.memory.optimizer),
      FormatBytes(e.memory.transient), FormatBytes(e.memory.activations), e.padding_pct,
      e.grad_padding_pct);
  absl::StrAppend(&out, absl::StrFormat("%-16s %10s %10s %11s %10s %11s %10s %11s %10s\n", "unit",
                                        "fwd ms", "bwd ms", "AG bytes", "AG ms", "RS bytes",
                                        "RS ms", "AR bytes", "AR ms"));
  for (const UnitCost& c : e.units) {
    absl::StrAppend(
        &out, absl::StrFormat("%-16s %10.3f %10.3f %11s %10.3f %11s %10.3f %11s %10.3f\n", c.name,
                              c.fwd_seconds * 1e3, c.bwd_seconds * 1e3, FormatBytes(c.ag_bytes),
                              c.ag_seconds * 1e3, FormatBytes(c.rs_bytes), c.rs_seconds * 1e3,
                              FormatBytes(c.ar_bytes), c.ar_seconds * 1e3));
  }
  absl::StrAppend(
      &out,
      absl::StrFormat("per step: all-gather %s (forward and backward), reduce-scatter %s, "
                      "all-reduce %s, owner %s, update %s\n\n",
                      FormatBytes(e.ag_bytes), FormatBytes(e.rs_bytes), FormatBytes(e.ar_bytes),
                      FormatBytes(e.owner_bytes), FormatBytes(e.update_bytes)));
  // ASCII timeline: one character per step/width seconds.
  const double span = std::max(e.step_seconds, 1e-12);
  std::string compute(width, '.'), comm(width, '.');
  for (const TimelineEvent& t : e.timeline) {
    std::string& row = t.stream == "compute" ? compute : comm;
    char c = '?';
    if (absl::StartsWith(t.label, "F ")) c = 'F';
    if (absl::StartsWith(t.label, "B ")) c = 'B';
    if (absl::StartsWith(t.label, "NS")) c = 'N';
    if (absl::StartsWith(t.label, "AG ")) c = 'g';
    if (absl::StartsWith(t.label, "RS ")) c = 'r';
    if (absl::StartsWith(t.label, "AR ")) c = 'a';
    if (absl::StartsWith(t.label, "OWN ")) c = 'o';
    if (absl::StartsWith(t.label, "UPD ")) c = 'u';
    int a = static_cast<int>(t.start / span * width);
    int b = std::max(a + 1, static_cast<int>(std::ceil(t.end / span * width)));
    for (int i = std::max(a, 0); i < std::min(b, width); ++i) row[i] = c;
  }
  absl::StrAppend(&out, absl::StrFormat("timeline of one step (0 .. %.4f s, %d columns)\n",
                                        e.step_seconds, width));
  absl::StrAppend(&out, "compute |", compute, "|\ncomm    |", comm, "|\n");
  absl::StrAppend(&out,
                  "F forward, B backward, N Newton-Schulz; g all-gather, r reduce-scatter, "
                  "a replica all-reduce, o owner gather/scatter, u update gather, . idle\n");
  return out;
}

}  // namespace ragshard

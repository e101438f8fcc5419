#include "engine/plan_json.h"

#include "engine/dtype.h"

namespace ragshard {

using nlohmann::json;

json MetricsToJson(const v1::LayoutMetrics& m) {
  auto pct = [](int64_t part, int64_t whole) {
    return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
  };
  return json{{"total_elems", m.total_elems()},
              {"padding_elems", m.padding_elems()},
              {"padding_pct", m.padding_pct()},
              {"imbalance", m.imbalance()},
              {"blocks128_split", m.blocks128_split()},
              {"blocks128_total", m.blocks128_total()},
              {"blocks128_split_pct", pct(m.blocks128_split(), m.blocks128_total())},
              {"blocks32_split", m.blocks32_split()},
              {"blocks32_total", m.blocks32_total()},
              {"blocks32_split_pct", pct(m.blocks32_split(), m.blocks32_total())},
              {"matrices_split", m.matrices_split()},
              {"matrices_total", m.matrices_total()},
              {"copy_bytes_per_step", m.copy_bytes_per_step()},
              {"lb1_elems", m.lb1_elems()},
              {"lb2_elems", m.lb2_elems()},
              {"lower_bound1_gap_pct", m.lb1_gap_pct()},
              {"lower_bound_gap_pct", m.lb2_gap_pct()},
              {"owner_load_max_over_mean", m.owner_load_max_over_mean()},
              {"owner_locality", m.owner_locality()}};
}

json PolicyResultToJson(const PolicyResult& result, int64_t max_segments) {
  json j;
  j["policy"] = std::string(PolicyName(result.policy));
  if (result.plan) {
    const v1::Plan& plan = *result.plan;
    j["world"] = plan.world_size();
    j["align_bytes"] = plan.align_bytes();
    j["planner_version"] = plan.planner_version();
    j["units"] = json::array();
    for (const v1::UnitPlan& up : plan.units()) {
      json ju = {{"name", up.unit()},
                 {"dtype", std::string(DTypeName(up.dtype()))},
                 {"shard_elems", up.shard_elems()},
                 {"tensors", json::array()}};
      for (const v1::TensorPlacement& tp : up.tensors()) {
        json jt = {
            {"name", tp.name()},
            {"offset", tp.offset()},
            {"numel", tp.numel()},
            {"granule_elems", tp.granule_elems()},
            {"first_rank", tp.first_rank()},
            {"rank_elems", std::vector<int64_t>(tp.rank_elems().begin(), tp.rank_elems().end())}};
        if (tp.owner_rank() >= 0) jt["owner_rank"] = tp.owner_rank();
        ju["tensors"].push_back(std::move(jt));
      }
      ju["metrics"] = MetricsToJson(up.metrics());
      j["units"].push_back(std::move(ju));
    }
  } else {
    const Layout& layout = result.layout;
    j["world"] = layout.world;
    int64_t segments = 0;
    for (const GroupLayout& g : layout.groups) {
      for (const TensorLayout& t : g.tensors) {
        segments += (t.start + t.numel - 1) / t.period - t.start / t.period + 1;
      }
    }
    const bool with_segments = segments <= max_segments;
    j["segment_count"] = segments;
    if (!with_segments) {
      j["segments_omitted"] = "more segments than --max-segments; figures are still exact";
    }
    j["groups"] = json::array();
    for (const GroupLayout& g : layout.groups) {
      json jg;
      jg["name"] = g.name;
      jg["dtype"] = std::string(DTypeName(g.dtype));
      jg["per_rank_elems"] = g.per_rank_elems;
      jg["copy_bytes_per_step"] = g.copy_bytes_per_step;
      if (with_segments) {
        // Per-rank segment lists: rank -> [[tensor, tensor_begin, count], ...] in tensor order.
        std::vector<json> ranks(static_cast<size_t>(layout.world), json::array());
        for (const TensorLayout& t : g.tensors) {
          for (const Segment& s : TensorSegments(t)) {
            ranks[static_cast<size_t>(s.rank)].push_back(
                json::array({*t.name, s.tensor_begin, s.count}));
          }
        }
        jg["segments"] = json::array();
        for (int64_t r = 0; r < layout.world; ++r) {
          jg["segments"].push_back({{"rank", r}, {"segments", std::move(ranks[r])}});
        }
      }
      j["groups"].push_back(std::move(jg));
    }
  }
  j["metrics"] = MetricsToJson(result.metrics);
  j["timing"] = {{"plan_seconds", result.plan_seconds}};
  return j;
}

}  // namespace ragshard

// JSON renderings of plans, baseline layouts and metrics, for `ragshardctl --json` and the
// benchmarks. Timings are kept apart from the plan, under "timing".
#pragma once

#include <cstdint>
#include <string>

#include "engine/planner.h"
#include "nlohmann/json.hpp"

namespace ragshard {

nlohmann::json MetricsToJson(const v1::LayoutMetrics& m);

// {"policy", "world", "align_bytes", "units": [...] (ragged) or "groups": [...] (baselines, with
// per-rank segment lists when there are at most `max_segments` of them in all), "metrics",
// "timing": {"plan_seconds"}}.
nlohmann::json PolicyResultToJson(const PolicyResult& result, int64_t max_segments);

}  // namespace ragshard

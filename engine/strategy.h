// Sharding strategies: the grammar and its rules.
//
// A strategy is written "k=K,p=AxB,g=AxB,os=AxB": K decoder layers per unit, and for each
// component a group of A devices in each of B nodes over which it is sharded (replicated over
// the rest). The dependency rules (AMSP): at each level p <= g <= os <= the whole cluster, and
// each divides the next, so that a device's optimizer-state shard lies inside its gradient shard,
// which lies inside its parameter shard. "k=K,shard=AxB" means p = g = os = AxB: HSDP with
// replicate = W / (A*B), the only form the data plane executes today.
//
// The cost model that judges strategies is engine/strategy_model.h, the search over them
// engine/strategy_search.h, and their renderings for ragshardctl ctl/strategy_render.h.
//
// Thread-safe: the functions are pure.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/cluster.h"

namespace ragshard {

struct Strategy {
  int64_t layers_per_unit = 1;
  GroupShape p, g, os;
  // Units gathered ahead of the one computing: 1 overlaps each gather with the previous
  // unit's compute; 0 gathers on demand and holds one unsharded unit less.
  int prefetch = 1;
  // When above 0, the first `lead` layers form one unit of their own before the groups of k:
  // for models whose first layers differ from the rest (DeepSeek-V3's 3 dense layers), whose
  // granules would otherwise pad their own small units heavily.
  int64_t lead = 0;
  // One number per unit grouping, for caches.
  int64_t grouping() const { return lead * 100000 + layers_per_unit; }
  bool uniform() const { return p == g && g == os; }
};

std::string StrategyName(const Strategy& s);
// Parses "k=2,p=8x4,g=8x4,os=8x16" or "k=2,shard=8x4", with optional ",prefetch=D" and
// ",lead=L";
// errors name the part.
absl::StatusOr<Strategy> ParseStrategy(absl::string_view text);
// The divisibility and dependency rules against a cluster of nodes x devices_per_node.
absl::Status CheckStrategy(const Strategy& s, int64_t nodes, int64_t devices_per_node);

enum class OptimizerKind { kAdam, kMuon };
absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);

// Bytes with a binary unit and two decimals: "1.50 GiB", "12.00 MiB"; below 1 KiB, "N B".
std::string FormatBytes(double bytes);

}  // namespace ragshard

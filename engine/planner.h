// Policies: the RaggedShard planners (`ragged`, `ragged-paper`) and the baselines we compare
// with (`fsdp2`, `fsdp1`, `zero3`, `megatron-do`, `megatron-fsdp`), all judged by the same
// metric code (engine/layout.h).
//
// Thread-safe: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/inventory.h"
#include "engine/layout.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

// The version stamped into every plan. A plan is a pure function of (inventory, world, options,
// this version).
inline constexpr absl::string_view kPlannerVersion = "ragshard-planner/1";

enum class Policy { kRagged, kRaggedPaper, kFsdp2, kFsdp1, kZero3, kMegatronDO, kMegatronFsdp };

absl::StatusOr<Policy> ParsePolicy(absl::string_view name);
absl::string_view PolicyName(Policy policy);
const std::vector<Policy>& AllPolicies();
inline bool IsRaggedPolicy(Policy p) { return p == Policy::kRagged || p == Policy::kRaggedPaper; }

inline constexpr int64_t kMaxWorld = 1 << 20;

struct PlanOptions {
  Policy policy = Policy::kRagged;
  int64_t world = 1;
  // Alignment of S * itemsize and of every tensor start, in bytes; 1 turns it off.
  int32_t align_bytes = 16;
  std::string job_id;
  uint64_t version = 1;
  // Only for testing the heuristic: plan every unit with the path that large units take.
  bool force_heuristic = false;
};

absl::Status ValidatePlanOptions(const PlanOptions& options);

// Alignment in elements of a dtype: align_bytes / gcd(align_bytes, itemsize).
int64_t AlignElems(int32_t align_bytes, v1::DType dtype);

// Builds a RaggedShard plan (policy ragged or ragged-paper), metrics included. The inventory
// must be valid (ValidateInventory). One UnitPlan per (unit, dtype), in inventory order and
// dtype first-appearance order; tensors in buffer order.
absl::StatusOr<v1::Plan> BuildPlan(const Inventory& inventory, const PlanOptions& options);

// The layout of a plan (pointers into `plan`).
Layout PlanLayout(const v1::Plan& plan);

// Sum over (unit, dtype) groups of W * LB1 and W * LB2, in elements.
struct LowerBoundTotals {
  int64_t lb1 = 0;
  int64_t lb2 = 0;
};
LowerBoundTotals ComputeLowerBounds(const Inventory& inventory, int64_t world, int32_t align_bytes);

// The layout of a baseline policy (pointers into `inventory`).
absl::StatusOr<Layout> BuildBaselineLayout(const Inventory& inventory, const PlanOptions& options);

// Any policy: its plan (ragged policies) or layout (baselines), and its metrics.
struct PolicyResult {
  Policy policy = Policy::kRagged;
  v1::LayoutMetrics metrics;
  std::optional<v1::Plan> plan;
  Layout layout;  // baselines only
  double plan_seconds = 0;
};
absl::StatusOr<PolicyResult> RunPolicy(const Inventory& inventory, const PlanOptions& options);

}  // namespace ragshard

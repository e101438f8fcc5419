// The per-unit RaggedShard planning problem (docs/design.md, "Plan invariants").
//
// Given the tensors of one (unit, dtype) as (numel, granule) pairs, a world size W and an
// alignment of `align` elements, choose an order, offsets and a shard size S that minimise
// W*S - sum(numel) subject to the plan invariants: every cut k*S strictly inside a tensor is a
// multiple of its granule from the tensor's start; offsets and S are multiples of `align`;
// tensors do not overlap and end by W*S.
//
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace ragshard {

struct UnitItem {
  int64_t numel = 0;
  int64_t granule = 1;  // elements; 1 <= granule <= numel
};

enum class SolverMode {
  // Exact feasibility (every distinct order of the tensors) for units with at most
  // kExactMaxOrders distinct orders, the heuristic otherwise. Candidates are scanned upward from
  // LB2; when every candidate below the result was tested, the result is optimal (`exact`).
  // Never worse than kPaper.
  kRagged,
  // The heuristic path that large units take, forced for every unit (for testing it).
  kRaggedHeuristic,
  // The veScale-FSDP paper's method: binary search over multiples of L = lcm(align, granules of
  // the tensors that contain a whole shard), greedy earliest placement in model order. The set
  // of such tensors depends on S; L is taken at the fixed point reached from S = LB1.
  kPaper,
};

inline constexpr double kExactMaxOrders = 20000;

struct UnitSolution {
  int64_t shard_elems = 0;
  std::vector<int64_t> offsets;  // per item, in input order
  int64_t lb1 = 0;
  int64_t lb2 = 0;
  bool exact = false;  // the search proved S optimal
  int feasibility_tests = 0;
};

// Lower bounds (docs/design.md): LB1 = max(ceil(sum/W), largest granule) rounded up to `align`;
// LB2 = the smallest S >= LB1 that is a multiple of lcm(align, granules of tensors with
// numel >= 2S).
int64_t LowerBound1(const std::vector<UnitItem>& items, int64_t world, int64_t align);
int64_t LowerBound2(const std::vector<UnitItem>& items, int64_t world, int64_t align);

// The earliest offset p >= lo, multiple of `align`, with p + numel <= hi, at which a tensor of
// (numel, granule) satisfies the cut rule for shard size `shard`; -1 when there is none.
int64_t EarliestPlacement(int64_t lo, int64_t hi, int64_t numel, int64_t granule, int64_t shard,
                          int64_t align);

// Solves one unit. Errors: INVALID_ARGUMENT for an empty unit, bad sizes or world, OUT_OF_RANGE
// when W*S would overflow int64.
absl::StatusOr<UnitSolution> SolveUnit(const std::vector<UnitItem>& items, int64_t world,
                                       int64_t align, SolverMode mode);

}  // namespace ragshard

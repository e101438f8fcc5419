// The plans of a job with separate AMSP factors (engine/sharding.h): one RaggedShard plan per
// factor over the same units. The finest (os) plan is planned; the coarser ones (g, then p) are
// its coarsenings: the same tensor offsets, every |x|-th cut kept, so that each coarser cut is a
// cut of the finer plan and falls on its granules, and a rank's os range lies inside its g
// range, inside its p range.
//
// Thread-safe: the functions are pure.
#pragma once

#include "absl/status/statusor.h"
#include "engine/sharding.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

// `finest` is a RaggedShard plan over |os| = s.os.size() positions. Returns the job's plan:
// Plan.units the p plan (world |p|), the "g" and "os" factor plans (the os one with the
// owners of whole-matrix tensors) and the sharding. A sharding of whole nodes with p = g = os
// returns `finest` unchanged (the shape every plan without a ShardingSpec has).
absl::StatusOr<v1::Plan> NestPlan(const v1::Plan& finest, const Sharding& s);

}  // namespace ragshard

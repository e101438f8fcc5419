// Checks the five plan invariants of docs/design.md on a RaggedShard plan.
//   1. Every element of every tensor is owned by exactly one rank (the sparse split agrees with
//      offset, numel and S), and tensors do not overlap.
//   2. Every cut k*S strictly inside a tensor is a multiple of its granule from its start.
//   3. S is one number for all ranks; S * itemsize and every start's byte offset are multiples
//      of the alignment.
//   4. offset + numel <= W * S.
//   5. Determinism: the plan has no map fields and no timings by construction (plan.proto); a
//      test plans twice and compares the deterministic serializations.
// When `inventory` is given, the plan must also hold each of its tensors exactly once, with the
// same numel, granule, shape and dtype.
#pragma once

#include "absl/status/status.h"
#include "engine/inventory.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

// The error is FAILED_PRECONDITION and names the invariant, the unit and the tensor, e.g.
// "invariant 2 (granule cuts): unit 'layers.0' (bf16) tensor 'w': cut at 640 is 128 elements
// into a 512-element granule".
absl::Status ValidatePlan(const v1::Plan& plan, const Inventory* inventory = nullptr);

}  // namespace ragshard

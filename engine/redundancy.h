// A job's redundancy across nodes (planner.proto JobOptions.redundancy; docs/recovery.md, "A
// lost node"), parsed and checked as the planner, the daemon and ragshardctl all do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ragshard {

// The most K of "parity:K".
inline constexpr int kMaxParityK = 16;

struct Redundancy {
  // kHsdp: the other HSDP replica groups' copy of the same shards (no memory of its own).
  enum class Kind { kNone, kParity, kReplica, kHsdp };
  Kind kind = Kind::kNone;
  int k = 0;  // parity:K's K; 0 for the others

  bool enabled() const { return kind != Kind::kNone; }
  // The fewest nodes a job of this redundancy runs on: K + 1 (parity:K), 2 (replica, hsdp), 1
  // (none).
  int64_t min_nodes() const;
  // Its canonical spelling: "none", "parity:K", "replica" or "hsdp".
  std::string name() const;
  // Whether it holds each node's state whole on another node (replica, or parity:1), from which
  // a shrink's survivors may re-cut the shards of one shard group (docs/recovery.md).
  bool whole_copies() const { return kind == Kind::kReplica || (kind == Kind::kParity && k == 1); }
};

// "" or "none" (none), "parity:K" with 1 <= K <= kMaxParityK, "replica" or "hsdp". Anything else
// is INVALID_ARGUMENT naming `field` and the value.
absl::StatusOr<Redundancy> ParseRedundancy(absl::string_view field, absl::string_view value);

// Whether a job of redundancy `r` can run on `nodes` nodes: parity:K needs a positive multiple
// of K + 1 (its groups), replica at least 2. FAILED_PRECONDITION naming the redundancy, the node
// count and what it needs; OK for none.
absl::Status CheckRedundancyNodes(const Redundancy& r, int64_t nodes);

// Whether HSDP's replicas cover the loss of any one node: every rank q (of rank_nodes.size(), on
// node rank_nodes[q]) has a replica q' = q mod `shard` (the shard group's size) on another node.
// FAILED_PRECONDITION naming a rank without one, and the layout.
absl::Status CheckHsdpLayout(int64_t shard, const std::vector<std::string>& rank_nodes);

}  // namespace ragshard

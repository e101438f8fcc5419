// The strategy cost model: a strategy's step time, bytes on the wire, padding and memory per
// device for a model inventory on a cluster profile (common/cluster.h).
//
// Cost model, per device and step (docs/strategy.md derives it):
//   forward and backward: one all-gather of every unit over p (2 per unit per step);
//   gradients: a reduce-scatter over g (fp32 on the wire, as the data plane reduces), then an
//     all-reduce of the gradient shard over the W/|g| replicas;
//   optimizer: Muon moves each matrix's fp32 gradient to its owner and back;
//   updates: when os is larger than p, the updated parameter shard is all-gathered over os/p
//     (AMSP's broadcast of updates).
// Compute is 6 x active non-embedding parameters x tokens per device / (peak x MFU), a third in
// forward; the timeline overlaps each unit's compute with the next unit's prefetched gather and
// the previous unit's reduce-scatter on one communication stream. Memory counts the shards, the
// unsharded buffers of the prefetch depth, optimizer state by kind and activations. The padding
// of every shard comes from the real ragged planner on the grouped units.
//
// Thread-safe: a StrategyModel is used by one thread at a time; the free functions are pure.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cluster.h"
#include "common/inventory.h"
#include "common/strategy.h"
#include "common/unit_grouping.h"
#include "google/protobuf/arena.h"

namespace ragshard {

struct CostOptions {
  OptimizerKind optimizer = OptimizerKind::kAdam;
  int64_t tokens_per_step = int64_t{4} << 20;  // global batch in tokens
  int64_t micro_batch_tokens = 4096;           // per device, for the activation term
  int64_t memory_budget_bytes = 0;             // 0: the profile's device memory
  // Prefetch depths the search tries.
  std::vector<int> prefetch_depths = {1, 0};
  int32_t align_bytes = 16;
  double grad_wire_bytes = 4;  // the data plane reduce-scatters in fp32
  double grad_shard_bytes = 4;
  // 0: 6 x active non-embedding parameters.
  double flops_per_token = 0;
  // 0: the profile's.
  double mfu = 0;
  // Candidate unit groupings; lead groupings are tried when the first layers differ from the
  // rest (DistinctLeadingLayers): the distinct block alone and with one more layer.
  std::vector<int64_t> layer_groupings = {1, 2, 3, 4, 5, 6, 7, 8};
  bool try_lead = true;
  // Only p = g = os (what the data plane executes), and shard groups of whole nodes (the host
  // data plane's rule) when set.
  bool uniform_only = false;
  bool whole_nodes = false;
  // Candidates padding more than this are kept only when nothing else fits.
  double max_padding_pct = 1.0;
  int top_k = 5;
};

struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, transient = 0, activations = 0;
  double total() const { return params + grads + optimizer + transient + activations; }
};

struct UnitCost {
  std::string name;
  int64_t numel = 0;
  double fwd_seconds = 0, bwd_seconds = 0;
  double ag_bytes = 0, rs_bytes = 0, ar_bytes = 0, owner_bytes = 0, update_bytes = 0;
  double ag_seconds = 0, rs_seconds = 0, ar_seconds = 0, owner_seconds = 0, update_seconds = 0;
};

struct TimelineEvent {
  std::string stream;  // "compute" or "comm"
  std::string label;   // "F layers.0-1", "AG layers.0-1", ...
  double start = 0, end = 0;
};

struct Evaluation {
  Strategy strategy;
  double step_seconds = 0;
  double compute_seconds = 0;
  double exposed_comm_seconds = 0;
  double padding_pct = 0;       // of the parameter plan (p)
  double grad_padding_pct = 0;  // of the gradient shards (g)
  MemoryBreakdown memory;
  // Per device and step, bytes each collective moves in total (the nccl-tests "size").
  double ag_bytes = 0, rs_bytes = 0, ar_bytes = 0, owner_bytes = 0, update_bytes = 0;
  // What one device sends per step over all of them (ring: (n-1)/n of a gather's or
  // reduce-scatter's buffer, 2(n-1)/n of an all-reduce's).
  double wire_bytes = 0;
  std::vector<UnitCost> units;
  std::vector<TimelineEvent> timeline;
  std::string rejected;  // why the search set it aside; empty when accepted
  // Set when the memory was bounded from below without planning (the candidate cannot fit
  // even without padding); step time and padding are then not computed.
  bool memory_lower_bound = false;
};

class StrategyModel {
 public:
  ~StrategyModel();
  // `inventory` with its granules applied; `profile` sized to the job (WithWorld).
  static absl::StatusOr<std::unique_ptr<StrategyModel>> Create(const Inventory& inventory,
                                                               const ModelShape& shape,
                                                               const ClusterProfile& profile,
                                                               const CostOptions& options);

  // Checks the rules, then costs the strategy. `detail` fills units and timeline.
  // `budget_check` lets it stop at a lower bound when even an unpadded layout exceeds the
  // budget.
  absl::StatusOr<Evaluation> Evaluate(const Strategy& s, bool detail = false,
                                      bool budget_check = false);

  // Every strategy the rules allow, in a fixed order.
  std::vector<Strategy> Candidates() const;

  int64_t budget_bytes() const { return budget_; }
  const ClusterProfile& profile() const { return profile_; }
  const CostOptions& options() const { return options_; }
  int64_t planner_runs() const { return planner_runs_; }

  // Plans, on all cores, every (grouping, group size) the candidates that may fit need.
  absl::Status PrecomputeFor(const std::vector<Strategy>& candidates);

 private:
  struct GroupStats;  // per (k, n): shard sizes of each grouped unit
  struct Signatures;  // per k: the distinct units
  StrategyModel() = default;
  void PrepareSignatures(int64_t k);
  void AddGrouping(int64_t key);
  absl::Status PrecomputeStats(const std::set<std::pair<int64_t, int64_t>>& pairs);
  MemoryBreakdown UnpaddedMemory(const Strategy& s) const;
  absl::StatusOr<const GroupStats*> Stats(int64_t k, int64_t n);
  // The stats of a group of n devices whose plan is the coarsening of the finest factor's
  // (common/plan_nesting.h), as the data plane executes separate factors.
  absl::StatusOr<const GroupStats*> Nested(int64_t k, int64_t n, int64_t finest);
  absl::StatusOr<const std::vector<UnitCost>*> Overlapped(const Strategy& s, double* step,
                                                          std::vector<TimelineEvent>* timeline);

  Inventory inventory_;
  ModelShape shape_;
  ClusterProfile profile_;
  CostOptions options_;
  int64_t budget_ = 0;
  double flops_per_token_ = 0;
  double tokens_per_device_ = 0;
  std::vector<int64_t> groupings_;  // grouping keys the search tries
  // The grouped inventories live on the arena: built and freed in bulk (each grouping copies
  // every tensor's spec, thousands per candidate k on the largest models).
  google::protobuf::Arena arena_;
  std::map<int64_t, Inventory*> grouped_;                   // by k, on arena_
  std::map<int64_t, std::vector<double>> compute_share_;    // by k: per unit, of the total
  std::map<int64_t, std::vector<double>> matrix_fraction_;  // by k: per unit
  double largest_matrix_ = 0;                               // elements of the largest matrix
  // Muon's owner holds the largest matrix's fp32 gradient and two Newton-Schulz iterates.
  double muon_owner_bytes() const { return largest_matrix_ * 4 * 3; }
  std::vector<double> unit_active_;  // active parameters per inventory unit
  double active_ = 0;
  std::map<int64_t, std::pair<double, double>> unpadded_;  // by k: total and largest unit bytes
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<GroupStats>> stats_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<GroupStats>> nested_;
  std::map<int64_t, std::unique_ptr<Signatures>> signatures_;
  std::map<std::string, std::pair<double, std::vector<UnitCost>>> overlapped_;
  int64_t planner_runs_ = 0;
  double newton_schulz_flops_ = 0;
  double inventory_elems_ = 0;
};

}  // namespace ragshard

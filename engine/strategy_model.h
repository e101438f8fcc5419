// The strategy cost model: a strategy's step time, bytes on the wire, padding and memory per
// device for a model inventory on a cluster profile (engine/cluster.h).
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
#include "engine/cluster.h"
#include "engine/inventory.h"
#include "engine/strategy.h"
#include "engine/unit_grouping.h"
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
  double padding_pct = 0;  // of the parameter plan (p)
  // No plan of this candidate's units over |os| positions pads less (the planner's LB2 per
  // unit; the p and g plans are coarsenings of the os plan and pad the same).
  double padding_bound_pct = 0;
  // The memory per device with every unit at its LB2 shard: no plan of this candidate needs
  // less.
  double memory_at_bound = 0;
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

  // Adds the unit groupings beyond the options' (more layers per unit, up to the model's
  // layers, with each lead grouping) that could fit the budget unpadded, and returns their
  // candidates. The search widens so when no candidate meets the padding target.
  std::vector<Strategy> WidenGroupings();
  // The most layers per unit (without a lead block) that could fit the budget unpadded, over
  // every grouping up to the model's layers: larger units need more even without padding.
  int64_t MaxFittingLayersPerUnit() const;

  // Why no plan of s's units over |os| positions pads less than s's padding bound: the units
  // that pad most, the shard size their LB2 forces and the tensors whose granules force it
  // (engine/strategy_bound.cc).
  absl::StatusOr<std::string> ExplainPaddingBound(const Strategy& s);

  // A bound beyond the search's groupings: the least padding of any grouping of consecutive
  // layer units ("layers.<i>", "attn.<i>") into FSDP units of any sizes, each small enough to
  // fit the budget unpadded (the other units alone), over every |os| the rules allow; the LB2
  // of each unit, minimised over the groupings exactly by dynamic programming. `pct` is -1 when
  // no |os| leaves room for the units; `why` lists the figure at each |os|.
  struct GroupingBound {
    double pct = -1;
    int64_t os = 0;
    std::string why;
  };
  GroupingBound PaddingBoundAnyGrouping() const;

  int64_t budget_bytes() const { return budget_; }
  const ClusterProfile& profile() const { return profile_; }
  const CostOptions& options() const { return options_; }
  const ModelShape& shape() const { return shape_; }
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
  // UnpaddedMemory with the grouping's total and largest unit bytes given.
  MemoryBreakdown UnpaddedMemoryOf(const Strategy& s, double total, double largest) const;
  // The total and largest unit bytes of a grouping, from the units' sizes alone (cheap: no
  // tensor is copied).
  std::pair<double, double> GroupedBytes(int64_t key) const;
  // The least unpadded memory any candidate of a grouping needs: every factor over the whole
  // cluster, the smallest prefetch depth.
  double LeastUnpaddedMemory(int64_t key) const;
  std::vector<Strategy> CandidatesOf(const std::vector<int64_t>& keys) const;
  absl::StatusOr<const GroupStats*> Stats(int64_t k, int64_t n);
  // The stats of a group of n devices whose plan is the coarsening of the finest factor's
  // (engine/plan_nesting.h), as the data plane executes separate factors.
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
  std::vector<int64_t> leads_;      // lead groupings tried (0: none)
  Inventory skeleton_;              // the units' names without tensors, for GroupedBytes
  std::vector<double> unit_bytes_;  // per inventory unit
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

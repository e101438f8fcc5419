// Sharding strategy search: AMSP-style sharding factors for parameters, gradients and optimizer
// states, unit grouping (k consecutive layers per unit) and the HSDP shape, judged by a cost
// model over a cluster profile (common/cluster.h) under a memory budget.
//
// A strategy is written "k=K,p=AxB,g=AxB,os=AxB": K decoder layers per unit, and for each
// component a group of A devices in each of B nodes over which it is sharded (replicated over
// the rest). The dependency rules (AMSP): at each level p <= g <= os <= the whole cluster, and
// each divides the next, so that a device's optimizer-state shard lies inside its gradient shard,
// which lies inside its parameter shard. "k=K,shard=AxB" means p = g = os = AxB: HSDP with
// replicate = W / (A*B), the only form the data plane executes today.
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
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cluster.h"
#include "common/inventory.h"
#include "common/planner.h"

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

// What the cost model knows about the model besides its inventory.
struct ModelShape {
  int64_t hidden = 0;                     // H: from the embedding table (or the widest vector)
  int64_t layers = 0;                     // units named layers.<i>
  double active_fraction_of_experts = 1;  // experts_per_token / routed_experts
};
// Derives the shape; `model` is a zoo name (or empty for an inventory file: dense).
ModelShape DeriveModelShape(const Inventory& inventory, absl::string_view model);

// Groups consecutive "layers.<i>" units k at a time ("layers.0-3" holding the tensors of
// layers.0..3, in order); other units stay as they are. `members` gets, per grouped unit, the
// names of the inventory units it covers.
// With lead > 0 the first `lead` layer units form one unit first.
Inventory GroupUnits(const Inventory& inventory, int64_t k,
                     std::vector<std::vector<std::string>>* members = nullptr, int64_t lead = 0);

// The number of leading layer units whose tensors differ from the last layer's (0 when the
// layers are alike): the lead groupings worth trying.
int64_t DistinctLeadingLayers(const Inventory& inventory);

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
  absl::StatusOr<const std::vector<UnitCost>*> Overlapped(const Strategy& s, double* step,
                                                          std::vector<TimelineEvent>* timeline);

  Inventory inventory_;
  ModelShape shape_;
  ClusterProfile profile_;
  CostOptions options_;
  int64_t budget_ = 0;
  double flops_per_token_ = 0;
  double tokens_per_device_ = 0;
  std::vector<int64_t> groupings_;                          // grouping keys the search tries
  std::map<int64_t, Inventory> grouped_;                    // by k
  std::map<int64_t, std::vector<double>> compute_share_;    // by k: per unit, of the total
  std::map<int64_t, std::vector<double>> matrix_fraction_;  // by k: per unit
  double largest_matrix_ = 0;                               // elements of the largest matrix
  // Muon's owner holds the largest matrix's fp32 gradient and two Newton-Schulz iterates.
  double muon_owner_bytes() const { return largest_matrix_ * 4 * 3; }
  std::vector<double> unit_active_;  // active parameters per inventory unit
  double active_ = 0;
  std::map<int64_t, std::pair<double, double>> unpadded_;  // by k: total and largest unit bytes
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<GroupStats>> stats_;
  std::map<int64_t, std::unique_ptr<Signatures>> signatures_;
  std::map<std::string, std::pair<double, std::vector<UnitCost>>> overlapped_;
  int64_t planner_runs_ = 0;
  double newton_schulz_flops_ = 0;
  double inventory_elems_ = 0;
};

struct Advice {
  Evaluation recommendation;
  std::vector<Evaluation> top;       // the best accepted candidates, best first
  std::vector<Evaluation> rejected;  // every candidate set aside, with its reason
  int64_t considered = 0;
  bool padding_target_met = true;
  double search_seconds = 0;
  int64_t planner_runs = 0;
};

// Exhaustive search over the candidates. The fastest predicted step wins; among candidates
// within 1 % of it (the model's resolution), the one that sends the fewest bytes (AMSP's
// objective), then the one with the least memory. FAILED_PRECONDITION when nothing fits the
// budget, naming the smallest memory any candidate needs.
absl::StatusOr<Advice> Advise(StrategyModel* model);

// JSON of an advice ({"recommendation": {...}, "candidates": [...], "rejected": [...]}) and of
// one evaluation.
std::string AdviceJson(const Advice& advice, const StrategyModel& model, int max_rejected);
std::string EvaluationJson(const Evaluation& e);

// Human-readable forms for ragshardctl.
std::string AdviceTable(const Advice& advice, const StrategyModel& model, int max_rejected);
std::string SimulationReport(const Evaluation& e, const StrategyModel& model, int width = 100);

std::string FormatBytes(double bytes);

// Policy auto: the plan of the best strategy the data plane executes (p = g = os, shard groups
// of whole nodes) for a job of nodes x devices_per_node ranks, numbered node by node, or of
// `pinned` when it is set. `plan_options` gives the job id, version and alignment; its world
// and policy are set here. The plan records the strategy (PlanStrategy), and each UnitPlan the
// client units it covers.
struct AutoPlan {
  v1::Plan plan;
  int64_t shard = 0;
  int64_t replicate = 0;
};
absl::StatusOr<AutoPlan> PlanAuto(const Inventory& inventory, absl::string_view model,
                                  const ClusterProfile& profile, int64_t nodes,
                                  int64_t devices_per_node, const CostOptions& options,
                                  const std::string& pinned, PlanOptions plan_options);

}  // namespace ragshard

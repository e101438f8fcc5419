#include "engine/planner.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "engine/unit_solver.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

constexpr std::array<std::pair<Policy, absl::string_view>, 7> kPolicies = {{
    {Policy::kRagged, "ragged"},
    {Policy::kRaggedPaper, "ragged-paper"},
    {Policy::kFsdp2, "fsdp2"},
    {Policy::kFsdp1, "fsdp1"},
    {Policy::kZero3, "zero3"},
    {Policy::kMegatronDO, "megatron-do"},
    {Policy::kMegatronFsdp, "megatron-fsdp"},
}};

// A (unit, dtype) group of an inventory, tensors in inventory order.
struct DTypeGroup {
  int unit = 0;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int> tensors;
};

std::vector<DTypeGroup> GroupByDType(const Inventory& inventory) {
  std::vector<DTypeGroup> out;
  for (int u = 0; u < inventory.units_size(); ++u) {
    std::vector<DTypeGroup> unit_groups;
    const UnitSpec& unit = inventory.units(u);
    for (int t = 0; t < unit.tensors_size(); ++t) {
      v1::DType dt = unit.tensors(t).dtype();
      auto it = std::find_if(unit_groups.begin(), unit_groups.end(),
                             [&](const DTypeGroup& g) { return g.dtype == dt; });
      if (it == unit_groups.end()) {
        unit_groups.push_back({u, dt, {}});
        it = unit_groups.end() - 1;
      }
      it->tensors.push_back(t);
    }
    for (auto& g : unit_groups) out.push_back(std::move(g));
  }
  return out;
}

std::vector<UnitItem> Items(const Inventory& inventory, const DTypeGroup& group) {
  std::vector<UnitItem> items;
  for (int t : group.tensors) {
    const TensorSpec& spec = inventory.units(group.unit).tensors(t);
    items.push_back({*TensorNumel(spec), GranuleElems(spec)});
  }
  return items;
}

// Newton-Schulz cost of a matrix tensor: m^2 * n per iteration for each m x n matrix, m <= n.
double NewtonSchulzCost(const v1::TensorPlacement& t) {
  int n = t.shape_size();
  if (n < 2) return static_cast<double>(t.numel());
  double r = static_cast<double>(t.shape(n - 2)), c = static_cast<double>(t.shape(n - 1));
  double m = std::min(r, c), k = std::max(r, c);
  double count = static_cast<double>(t.numel()) / (r * c);
  return count * m * m * k;
}

// Shampoo's cost of a matrix tensor (seen as numel / shape[-1] rows of shape[-1] columns),
// summed over its blocks of at most B x B (B = shampoo_block; 0: one block), r x c each: per
// step the statistics G G^T and G^T G and the preconditioned P_L G P_R, 4 r c (r + c)
// multiply-adds, and the inverse fourth roots of the two factors, modelled as r^3 + c^3 (an
// eigendecomposition's ~10 n^3 every 10 steps, Shampoo's usual precondition frequency).
double ShampooCost(const v1::TensorPlacement& t) {
  int n = t.shape_size();
  if (n < 2) return static_cast<double>(t.numel());
  const int64_t cols = t.shape(n - 1), rows = t.numel() / std::max<int64_t>(cols, 1);
  const int64_t b = t.shampoo_block() > 0 ? t.shampoo_block() : std::max(rows, cols);
  auto block = [](double r, double c) { return 4 * r * c * (r + c) + r * r * r + c * c * c; };
  // Full blocks and the partial last ones along each side.
  const int64_t full_rows = rows / b, full_cols = cols / b;  // whole blocks along each side
  const double fr = static_cast<double>(full_rows), fc = static_cast<double>(full_cols);
  const double er = static_cast<double>(rows % b), ec = static_cast<double>(cols % b);
  const double bb = static_cast<double>(b);
  return fr * fc * block(bb, bb) + (er > 0 ? fc * block(er, bb) : 0) +
         (ec > 0 ? fr * block(bb, ec) : 0) + (er > 0 && ec > 0 ? block(er, ec) : 0);
}

// A whole-matrix tensor's cost on its owner: Newton-Schulz's (Muon) or Shampoo's.
double OwnerCost(const v1::TensorPlacement& t) {
  return t.optimizer() == v1::OPTIMIZER_SHAMPOO ? ShampooCost(t) : NewtonSchulzCost(t);
}

// Greedy longest-processing-time assignment of matrix tensors to owner ranks, preferring a rank
// that already holds a piece of the matrix when that does not raise the makespan beyond what
// the plain LPT choice gives.
void AssignOwners(v1::Plan* plan) {
  struct Job {
    double cost;
    int unit;
    int tensor;
  };
  std::vector<Job> jobs;
  for (int u = 0; u < plan->units_size(); ++u) {
    for (int t = 0; t < plan->units(u).tensors_size(); ++t) {
      auto* tp = plan->mutable_units(u)->mutable_tensors(t);
      tp->set_owner_rank(-1);
      if (WholeMatrix(tp->optimizer())) jobs.push_back({OwnerCost(*tp), u, t});
    }
  }
  v1::LayoutMetrics* m = plan->mutable_metrics();
  if (jobs.empty()) return;
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const Job& a, const Job& b) { return a.cost > b.cost; });
  const int64_t w = plan->world_size();
  std::vector<double> load(static_cast<size_t>(w), 0.0);
  std::set<std::pair<double, int64_t>> by_load;
  for (int64_t r = 0; r < w; ++r) by_load.insert({0.0, r});
  // No assignment can beat max(total / W, largest job); a holder is preferred while it stays
  // within 5 % of that bound (or of the makespan so far, when that is already larger).
  double total = 0;
  for (const Job& job : jobs) total += job.cost;
  const double target = 1.05 * std::max(total / static_cast<double>(w), jobs.front().cost);
  double makespan = 0;
  int64_t local = 0;
  constexpr int64_t kMaxHolderScan = 256;
  for (const Job& job : jobs) {
    auto* tp = plan->mutable_units(job.unit)->mutable_tensors(job.tensor);
    int64_t first = tp->first_rank();
    int64_t last = first + tp->rank_elems_size() - 1;
    int64_t pick = by_load.begin()->second;
    if (pick < first || pick > last) {
      if (last - first < kMaxHolderScan) {
        int64_t holder = first;
        for (int64_t r = first + 1; r <= last; ++r) {
          if (load[r] < load[holder]) holder = r;
        }
        if (load[holder] + job.cost <= std::max({makespan, target, load[pick] + job.cost})) {
          pick = holder;
        }
      }
    }
    if (pick >= first && pick <= last) ++local;
    by_load.erase({load[pick], pick});
    load[pick] += job.cost;
    by_load.insert({load[pick], pick});
    makespan = std::max(makespan, load[pick]);
    tp->set_owner_rank(pick);
  }
  m->set_owner_load_max_over_mean(makespan / (total / static_cast<double>(w)));
  m->set_owner_locality(static_cast<double>(local) / static_cast<double>(jobs.size()));
}

void SetGaps(const LowerBoundTotals& lb, int64_t allocated, v1::LayoutMetrics* m) {
  m->set_lb1_elems(lb.lb1);
  m->set_lb2_elems(lb.lb2);
  auto gap = [&](int64_t bound) {
    return bound > 0 ? 100.0 * static_cast<double>(allocated - bound) / static_cast<double>(bound)
                     : 0.0;
  };
  m->set_lb1_gap_pct(gap(lb.lb1));
  m->set_lb2_gap_pct(gap(lb.lb2));
}

}  // namespace

absl::StatusOr<Policy> ParsePolicy(absl::string_view name) {
  for (const auto& [p, n] : kPolicies) {
    if (n == name) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown policy '", name,
      "' (expected ragged, ragged-paper, fsdp2, fsdp1, zero3, megatron-do or megatron-fsdp)"));
}

absl::string_view PolicyName(Policy policy) {
  for (const auto& [p, n] : kPolicies) {
    if (p == policy) return n;
  }
  return "?";
}

const std::vector<Policy>& AllPolicies() {
  static const std::vector<Policy> all = [] {
    std::vector<Policy> v;
    v.reserve(std::size(kPolicies));
    for (const auto& [p, n] : kPolicies) v.push_back(p);
    return v;
  }();
  return all;
}

absl::Status ValidatePlanOptions(const PlanOptions& options) {
  if (options.world < 1 || options.world > kMaxWorld) {
    return absl::InvalidArgumentError(
        absl::StrCat("world: must be in [1, ", kMaxWorld, "], got ", options.world));
  }
  if (options.align_bytes < 1 || options.align_bytes > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("align_bytes: must be in [1, 4096], got ", options.align_bytes));
  }
  return absl::OkStatus();
}

int64_t AlignElems(int32_t align_bytes, v1::DType dtype) {
  int64_t size = DTypeSize(dtype);
  return align_bytes / std::gcd<int64_t>(align_bytes, size);
}

absl::StatusOr<v1::Plan> BuildPlan(const Inventory& inventory, const PlanOptions& options) {
  RAGSHARD_RETURN_IF_ERROR(ValidatePlanOptions(options));
  if (!IsRaggedPolicy(options.policy)) {
    return absl::InvalidArgumentError(absl::StrCat("policy '", PolicyName(options.policy),
                                                   "' is a baseline and has no RaggedShard plan"));
  }
  const SolverMode mode = options.policy == Policy::kRaggedPaper ? SolverMode::kPaper
                          : options.force_heuristic              ? SolverMode::kRaggedHeuristic
                                                                 : SolverMode::kRagged;
  v1::Plan plan;
  plan.set_job_id(options.job_id);
  plan.set_version(options.version);
  plan.set_policy(std::string(PolicyName(options.policy)));
  plan.set_world_size(options.world);
  plan.set_align_bytes(options.align_bytes);
  plan.set_planner_version(std::string(kPlannerVersion));
  LowerBoundTotals lb;
  int64_t allocated = 0;
  std::map<std::vector<int64_t>, absl::StatusOr<UnitSolution>> solved;
  for (const DTypeGroup& group : GroupByDType(inventory)) {
    const UnitSpec& unit = inventory.units(group.unit);
    std::vector<UnitItem> items = Items(inventory, group);
    const int64_t align = AlignElems(options.align_bytes, group.dtype);
    // Units with the same tensor sizes (the decoder layers, usually) have the same solution.
    std::vector<int64_t> key = {align};
    for (const UnitItem& it : items) {
      key.push_back(it.numel);
      key.push_back(it.granule);
    }
    auto cached = solved.find(key);
    if (cached == solved.end()) {
      cached = solved.emplace(key, SolveUnit(items, options.world, align, mode)).first;
    }
    const absl::StatusOr<UnitSolution>& sol = cached->second;
    if (!sol.ok()) {
      return absl::Status(sol.status().code(),
                          absl::StrCat("unit '", unit.name(), "' (", DTypeName(group.dtype),
                                       "): ", sol.status().message()));
    }
    const int64_t s = sol->shard_elems;
    v1::UnitPlan* up = plan.add_units();
    up->set_unit(unit.name());
    up->set_dtype(group.dtype);
    up->set_shard_elems(s);
    up->set_align_bytes(options.align_bytes);
    std::vector<int> order(items.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return sol->offsets[a] < sol->offsets[b]; });
    for (int i : order) {
      const TensorSpec& spec = unit.tensors(group.tensors[i]);
      v1::TensorPlacement* tp = up->add_tensors();
      tp->set_name(spec.name());
      const int64_t off = sol->offsets[i], e = items[i].numel;
      tp->set_offset(off);
      tp->set_numel(e);
      tp->set_granule_elems(items[i].granule);
      const int64_t first = off / s, last = (off + e - 1) / s;
      tp->set_first_rank(first);
      for (int64_t r = first; r <= last; ++r) {
        tp->add_rank_elems(std::min(off + e, (r + 1) * s) - std::max(off, r * s));
      }
      tp->set_owner_rank(-1);
      tp->set_optimizer(spec.optimizer());
      tp->set_shampoo_block(spec.shampoo_block());
      *tp->mutable_shape() = spec.shape();
    }
    lb.lb1 += sol->lb1 * options.world;
    lb.lb2 += sol->lb2 * options.world;
    allocated += s * options.world;
    up->mutable_metrics()->set_lb1_elems(sol->lb1 * options.world);
    up->mutable_metrics()->set_lb2_elems(sol->lb2 * options.world);
  }
  AssignOwners(&plan);
  // Layout metrics, per unit and in total.
  Layout layout = PlanLayout(plan);
  v1::LayoutMetrics owner = plan.metrics();
  RAGSHARD_RETURN_IF_ERROR(ComputeLayoutMetrics(layout, plan.mutable_metrics()));
  plan.mutable_metrics()->set_owner_load_max_over_mean(owner.owner_load_max_over_mean());
  plan.mutable_metrics()->set_owner_locality(owner.owner_locality());
  SetGaps(lb, allocated, plan.mutable_metrics());
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    v1::UnitPlan* up = plan.mutable_units(static_cast<int>(g));
    LowerBoundTotals ulb{up->metrics().lb1_elems(), up->metrics().lb2_elems()};
    RAGSHARD_RETURN_IF_ERROR(ComputeGroupMetrics(layout, g, up->mutable_metrics()));
    SetGaps(ulb, up->shard_elems() * options.world, up->mutable_metrics());
  }
  return plan;
}

Layout PlanLayout(const v1::Plan& plan) {
  Layout layout;
  layout.world = plan.world_size();
  for (const v1::UnitPlan& up : plan.units()) {
    GroupLayout g;
    g.name = up.unit();
    g.dtype = up.dtype();
    g.per_rank_elems = up.shard_elems();
    g.copy_bytes_per_step = 0;  // views into the buffers: nothing is copied in or out
    for (const v1::TensorPlacement& tp : up.tensors()) {
      g.tensors.push_back({&tp.name(), &tp.shape(), tp.numel(), tp.offset(), up.shard_elems(), 0});
    }
    layout.groups.push_back(std::move(g));
  }
  return layout;
}

LowerBoundTotals ComputeLowerBounds(const Inventory& inventory, int64_t world,
                                    int32_t align_bytes) {
  LowerBoundTotals lb;
  for (const DTypeGroup& group : GroupByDType(inventory)) {
    std::vector<UnitItem> items = Items(inventory, group);
    const int64_t align = AlignElems(align_bytes, group.dtype);
    lb.lb1 += LowerBound1(items, world, align) * world;
    lb.lb2 += LowerBound2(items, world, align) * world;
  }
  return lb;
}

absl::StatusOr<PolicyResult> RunPolicy(const Inventory& inventory, const PlanOptions& options) {
  RAGSHARD_RETURN_IF_ERROR(ValidatePlanOptions(options));
  PolicyResult result;
  result.policy = options.policy;
  const auto start = std::chrono::steady_clock::now();
  if (IsRaggedPolicy(options.policy)) {
    RAGSHARD_ASSIGN_OR_RETURN(result.plan, BuildPlan(inventory, options));
    result.plan_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.metrics = result.plan->metrics();
    return result;
  }
  RAGSHARD_ASSIGN_OR_RETURN(result.layout, BuildBaselineLayout(inventory, options));
  RAGSHARD_RETURN_IF_ERROR(ComputeLayoutMetrics(result.layout, &result.metrics));
  result.plan_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t allocated = 0;
  for (const GroupLayout& g : result.layout.groups) allocated += g.per_rank_elems * options.world;
  SetGaps(ComputeLowerBounds(inventory, options.world, options.align_bytes), allocated,
          &result.metrics);
  return result;
}

}  // namespace ragshard

#include "engine/strategy_model.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/dtype.h"
#include "engine/models.h"
#include "engine/planner.h"
#include "engine/strategy_model_internal.h"
#include "engine/unit_grouping.h"
#include "engine/unit_solver.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

constexpr int kNewtonSchulzSteps = 5;

std::vector<int64_t> Divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

// Non-decreasing chains a | b | c | top.
std::vector<std::array<int64_t, 3>> Chains(int64_t top, bool only_top) {
  std::vector<std::array<int64_t, 3>> out;
  for (int64_t a : Divisors(top)) {
    for (int64_t b : Divisors(top)) {
      if (b % a != 0) continue;
      for (int64_t c : Divisors(top)) {
        if (c % b != 0) continue;
        if (only_top && (a != top || b != top || c != top)) continue;
        out.push_back({a, b, c});
      }
    }
  }
  return out;
}

// Newton-Schulz FLOPs of one step for a matrix tensor (per matrix of a 3-D tensor):
// each iteration X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n), m <= n.
double NewtonSchulzFlops(const TensorSpec& t) {
  if (t.optimizer() != v1::OPTIMIZER_MATRIX || t.shape_size() < 2) return 0;
  const int r = t.shape_size();
  double m = static_cast<double>(t.shape(r - 2)), n = static_cast<double>(t.shape(r - 1));
  if (m > n) std::swap(m, n);
  double count = 1;
  for (int i = 0; i < r - 2; ++i) count *= static_cast<double>(t.shape(i));
  return count * kNewtonSchulzSteps * (4 * m * m * n + 2 * m * m * m);
}

double Numel(const TensorSpec& t) {
  double n = 1;
  for (int64_t d : t.shape()) n *= static_cast<double>(d);
  return n;
}

}  // namespace

StrategyModel::~StrategyModel() = default;

absl::StatusOr<std::unique_ptr<StrategyModel>> StrategyModel::Create(const Inventory& inventory,
                                                                     const ModelShape& shape,
                                                                     const ClusterProfile& profile,
                                                                     const CostOptions& options) {
  RAGSHARD_RETURN_IF_ERROR(ValidateInventory(inventory));
  if (options.tokens_per_step < 1) {
    return absl::InvalidArgumentError("tokens per step must be at least 1");
  }
  if (options.micro_batch_tokens < 1) {
    return absl::InvalidArgumentError("micro-batch tokens must be at least 1");
  }
  if (options.memory_budget_bytes < 0) {
    return absl::InvalidArgumentError("the memory budget must not be negative");
  }
  if (options.prefetch_depths.empty()) return absl::InvalidArgumentError("no prefetch depth");
  for (int d : options.prefetch_depths) {
    if (d < 0 || d > 8) return absl::InvalidArgumentError("prefetch depths must be in [0, 8]");
  }
  if (options.mfu < 0 || options.mfu > 1) {
    return absl::InvalidArgumentError("MFU must be in (0, 1]");
  }
  if (options.layer_groupings.empty()) {
    return absl::InvalidArgumentError("no unit grouping to try");
  }
  for (int64_t k : options.layer_groupings) {
    if (k < 1 || k > 4096) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers per unit ", k, " is outside [1, 4096]"));
    }
  }
  std::unique_ptr<StrategyModel> m(new StrategyModel());
  m->inventory_ = inventory;
  m->shape_ = shape;
  m->profile_ = profile;
  m->options_ = options;
  m->budget_ =
      options.memory_budget_bytes > 0 ? options.memory_budget_bytes : profile.device_memory_bytes;
  const double mfu = options.mfu > 0 ? options.mfu : profile.mfu;
  // One pass over the tensors: compute per unit is 6 x active parameters (routed experts count
  // by their active fraction; embedding lookups cost nothing), plus the figures that do not
  // depend on the grouping.
  for (const UnitSpec& u : inventory.units()) {
    double a = 0;
    for (const TensorSpec& t : u.tensors()) {
      const double numel = Numel(t);
      if (u.name() != "embed") {
        a += numel *
             (absl::StrContains(t.name(), ".experts.") ? shape.active_fraction_of_experts : 1.0);
      }
      m->inventory_elems_ += numel;
      m->newton_schulz_flops_ += NewtonSchulzFlops(t);
      if (WholeMatrix(t.optimizer()) && t.shape_size() >= 2) {
        const int r = t.shape_size();
        m->largest_matrix_ = std::max(m->largest_matrix_, static_cast<double>(t.shape(r - 1)) *
                                                              static_cast<double>(t.shape(r - 2)));
      }
    }
    m->unit_active_.push_back(a);
    m->active_ += a;
    double bytes = 0;
    for (const TensorSpec& t : u.tensors()) {
      bytes += Numel(t) * static_cast<double>(DTypeSize(t.dtype()));
    }
    m->unit_bytes_.push_back(bytes);
    m->skeleton_.add_units()->set_name(u.name());
  }
  m->flops_per_token_ = options.flops_per_token > 0 ? options.flops_per_token : 6 * m->active_;
  m->tokens_per_device_ =
      static_cast<double>(options.tokens_per_step) / static_cast<double>(profile.world());
  m->options_.mfu = mfu;
  std::vector<int64_t> leads = {0};
  if (options.try_lead) {
    if (const int64_t d = DistinctLeadingLayers(inventory); d > 0) {
      leads.push_back(d);
      leads.push_back(d + 1);
    }
  }
  for (int64_t lead : leads) {
    if (lead > 0 && shape.layers > 0 && lead >= shape.layers) continue;
    m->leads_.push_back(lead);
    for (int64_t k : options.layer_groupings) {
      const int64_t key = lead * 100000 + k;
      if (m->grouped_.count(key)) continue;
      m->groupings_.push_back(key);
      m->AddGrouping(key);
    }
  }
  return m;
}

// Groups the inventory for one grouping key (Strategy::grouping()) and derives what the cost
// model needs of it.
void StrategyModel::AddGrouping(int64_t key) {
  const int64_t k = key % 100000, lead = key / 100000;
  std::vector<std::vector<std::string>> members;
  Inventory& g = *google::protobuf::Arena::CreateMessage<Inventory>(&arena_);
  GroupUnitsInto(inventory_, k, &members, lead, &g);
  std::vector<double> share, frac;
  double total = 0, largest_unit = 0;
  size_t next = 0;
  for (int u = 0; u < g.units_size(); ++u) {
    double a = 0, mat = 0, all = 0, bytes = 0;
    for (size_t j = 0; j < members[u].size(); ++j) a += unit_active_[next++];
    for (const TensorSpec& t : g.units(u).tensors()) {
      all += Numel(t);
      if (WholeMatrix(t.optimizer())) mat += Numel(t);
      bytes += Numel(t) * static_cast<double>(DTypeSize(t.dtype()));
    }
    share.push_back(active_ > 0 ? a / active_ : 0);
    frac.push_back(all > 0 ? mat / all : 0);
    total += bytes;
    largest_unit = std::max(largest_unit, bytes);
  }
  compute_share_[key] = std::move(share);
  matrix_fraction_[key] = std::move(frac);
  unpadded_[key] = {total, largest_unit};
  grouped_[key] = &g;
}

void StrategyModel::PrepareSignatures(int64_t k) {
  const Inventory& g = *grouped_.at(k);
  auto sig = std::make_unique<Signatures>();
  std::map<std::vector<int64_t>, int> index;
  for (const UnitSpec& u : g.units()) {
    std::vector<Signatures::Group> groups;
    double numel = 0;
    for (const TensorSpec& t : u.tensors()) {
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const Signatures::Group& x) { return x.dtype == t.dtype(); });
      if (it == groups.end()) {
        groups.push_back({t.dtype(), {}});
        it = groups.end() - 1;
      }
      it->items.push_back({*TensorNumel(t), GranuleElems(t)});
      numel += Numel(t);
    }
    std::vector<int64_t> key;
    for (const auto& grp : groups) {
      key.push_back(-static_cast<int64_t>(grp.dtype) - 1);
      for (const UnitItem& item : grp.items) {
        key.push_back(item.numel);
        key.push_back(item.granule);
      }
    }
    auto [it, added] = index.emplace(key, static_cast<int>(sig->distinct.size()));
    if (added) sig->distinct.push_back(std::move(groups));
    sig->of_unit.push_back(it->second);
    sig->unit_numel.push_back(numel);
  }
  signatures_[k] = std::move(sig);
}

// Solves every distinct unit of the listed (k, n) pairs that are not cached yet, on all cores:
// the ragged planner is the search's main cost.
absl::Status StrategyModel::PrecomputeStats(const std::set<std::pair<int64_t, int64_t>>& pairs) {
  struct Task {
    int64_t k, n;
    size_t sig;
    absl::StatusOr<std::array<double, 3>> result = std::array<double, 3>{};  // S, bytes, LB2
  };
  std::vector<Task> tasks;
  for (const auto& [k, n] : pairs) {
    if (stats_.count({k, n})) continue;
    if (!signatures_.count(k)) PrepareSignatures(k);
    for (size_t i = 0; i < signatures_.at(k)->distinct.size(); ++i) tasks.push_back({k, n, i});
  }
  if (tasks.empty()) return absl::OkStatus();
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t t = next++; t < tasks.size(); t = next++) {
      Task& task = tasks[t];
      double elems = 0, bytes = 0, lb2 = 0;
      for (const auto& grp : signatures_.at(task.k)->distinct[task.sig]) {
        auto sol = SolveUnit(grp.items, task.n, AlignElems(options_.align_bytes, grp.dtype),
                             SolverMode::kRagged);
        if (!sol.ok()) {
          task.result = sol.status();
          break;
        }
        elems += static_cast<double>(sol->shard_elems);
        bytes += static_cast<double>(sol->shard_elems * DTypeSize(grp.dtype));
        lb2 += static_cast<double>(sol->lb2);
      }
      if (task.result.ok()) task.result = std::array<double, 3>{elems, bytes, lb2};
    }
  };
  const unsigned threads =
      std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 16));
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads && i < tasks.size(); ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  planner_runs_ += static_cast<int64_t>(tasks.size());
  std::map<std::pair<int64_t, int64_t>, std::vector<std::array<double, 3>>> solved;
  for (const Task& t : tasks) {
    if (!t.result.ok()) {
      return absl::Status(t.result.status().code(),
                          absl::StrCat("planning ", t.k, " layers per unit over ", t.n,
                                       " devices: ", t.result.status().message()));
    }
    auto& v = solved[{t.k, t.n}];
    v.resize(signatures_.at(t.k)->distinct.size());
    v[t.sig] = *t.result;
  }
  for (const auto& [key, per_sig] : solved) {
    const Signatures& sig = *signatures_.at(key.first);
    const double n = static_cast<double>(key.second);
    auto stats = std::make_unique<GroupStats>();
    for (size_t u = 0; u < sig.of_unit.size(); ++u) {
      const auto [elems, bytes, lb2] = per_sig[static_cast<size_t>(sig.of_unit[u])];
      const double numel = sig.unit_numel[u];
      stats->shard_elems.push_back(elems);
      stats->shard_bytes.push_back(bytes);
      stats->lb2_elems.push_back(lb2);
      stats->numel.push_back(numel);
      stats->total_elems += numel;
      stats->padding_elems += n * elems - numel;
      stats->lb_padding_elems += n * lb2 - numel;
      stats->max_unsharded_bytes = std::max(stats->max_unsharded_bytes, n * bytes);
    }
    stats_[key] = std::move(stats);
  }
  return absl::OkStatus();
}

absl::StatusOr<const StrategyModel::GroupStats*> StrategyModel::Stats(int64_t k, int64_t n) {
  if (auto it = stats_.find({k, n}); it != stats_.end()) return it->second.get();
  RAGSHARD_RETURN_IF_ERROR(PrecomputeStats({{k, n}}));
  return stats_.at({k, n}).get();
}

absl::StatusOr<const StrategyModel::GroupStats*> StrategyModel::Nested(int64_t k, int64_t n,
                                                                       int64_t finest) {
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* fine, Stats(k, finest));
  if (n == finest) return fine;
  const std::tuple<int64_t, int64_t, int64_t> key{k, n, finest};
  if (auto it = nested_.find(key); it != nested_.end()) return it->second.get();
  // The data plane's plans nest (engine/plan_nesting.h): the finest factor is planned and the
  // coarser ones hold finest / n of its shards each, with the same padding.
  const double ratio = static_cast<double>(finest) / static_cast<double>(n);
  auto stats = std::make_unique<GroupStats>(*fine);
  for (double& e : stats->shard_elems) e *= ratio;
  for (double& b : stats->shard_bytes) b *= ratio;
  return (nested_[key] = std::move(stats)).get();
}

absl::Status StrategyModel::PrecomputeFor(const std::vector<Strategy>& candidates) {
  std::set<std::pair<int64_t, int64_t>> pairs;
  for (const Strategy& s : candidates) {
    if (!grouped_.count(s.grouping())) continue;
    if (UnpaddedMemory(s).total() > static_cast<double>(budget_)) continue;
    pairs.insert({s.grouping(), s.os.size()});  // the others are its coarsenings
  }
  return PrecomputeStats(pairs);
}

std::pair<double, double> StrategyModel::GroupedBytes(int64_t key) const {
  if (auto it = unpadded_.find(key); it != unpadded_.end()) return it->second;
  std::vector<std::vector<std::string>> members;
  Inventory grouped;
  GroupUnitsInto(skeleton_, key % 100000, &members, key / 100000, &grouped);
  double total = 0, largest = 0;
  size_t next = 0;
  for (const auto& names : members) {
    double bytes = 0;
    for (size_t j = 0; j < names.size(); ++j) bytes += unit_bytes_[next++];
    total += bytes;
    largest = std::max(largest, bytes);
  }
  return {total, largest};
}

double StrategyModel::LeastUnpaddedMemory(int64_t key) const {
  Strategy s;
  s.layers_per_unit = key % 100000;
  s.lead = key / 100000;
  s.p = s.g = s.os = {profile_.devices_per_node, profile_.nodes};
  s.prefetch = *std::min_element(options_.prefetch_depths.begin(), options_.prefetch_depths.end());
  const auto [total, largest] = GroupedBytes(key);
  return UnpaddedMemoryOf(s, total, largest).total();
}

std::vector<Strategy> StrategyModel::WidenGroupings() {
  std::vector<int64_t> added;
  const int64_t widest =
      *std::max_element(options_.layer_groupings.begin(), options_.layer_groupings.end());
  for (int64_t lead : leads_) {
    for (int64_t k = widest + 1; k <= shape_.layers - lead; ++k) {
      const int64_t key = lead * 100000 + k;
      if (grouped_.count(key)) continue;
      // Larger units only need more: the first k that cannot fit ends this lead's groupings.
      if (LeastUnpaddedMemory(key) > static_cast<double>(budget_)) break;
      groupings_.push_back(key);
      AddGrouping(key);
      added.push_back(key);
    }
  }
  return CandidatesOf(added);
}

int64_t StrategyModel::MaxFittingLayersPerUnit() const {
  int64_t best = 0;
  for (int64_t k = 1; k <= std::max<int64_t>(shape_.layers, 1); ++k) {
    if (LeastUnpaddedMemory(k) > static_cast<double>(budget_)) break;
    best = k;
  }
  return best;
}

std::vector<Strategy> StrategyModel::Candidates() const { return CandidatesOf(groupings_); }

std::vector<Strategy> StrategyModel::CandidatesOf(const std::vector<int64_t>& keys) const {
  std::vector<Strategy> out;
  const int64_t d = profile_.devices_per_node, nodes = profile_.nodes;
  const auto intra = Chains(d, options_.whole_nodes);
  const auto inter = Chains(nodes, false);
  for (int64_t key : keys) {
    const int64_t k = key % 100000, lead = key / 100000;
    if (shape_.layers > 0 && k > 1 && k > shape_.layers - lead) continue;
    for (const auto& a : intra) {
      for (const auto& b : inter) {
        for (int d : options_.prefetch_depths) {
          Strategy s;
          s.layers_per_unit = k;
          s.lead = lead;
          s.p = {a[0], b[0]};
          s.g = {a[1], b[1]};
          s.os = {a[2], b[2]};
          s.prefetch = d;
          if (options_.uniform_only && !s.uniform()) continue;
          out.push_back(s);
        }
      }
    }
  }
  return out;
}

}  // namespace ragshard

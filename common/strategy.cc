#include "common/strategy.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/data_plane_memory.h"
#include "common/dtype.h"
#include "common/models.h"
#include "common/planner.h"
#include "common/status_macros.h"
#include "common/unit_solver.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

using json = nlohmann::json;

constexpr double kAdamStateBytes = 12;  // fp32 master, m and v
constexpr double kMuonStateBytes = 8;   // fp32 master and momentum
constexpr int kNewtonSchulzSteps = 5;

bool IsLayerUnit(const std::string& name, int64_t* index) {
  if (!absl::StartsWith(name, "layers.")) return false;
  return absl::SimpleAtoi(absl::string_view(name).substr(7), index) && *index >= 0;
}

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

absl::StatusOr<GroupShape> ParseShape(absl::string_view text, absl::string_view what) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, 'x');
  GroupShape s;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &s.intra) ||
      !absl::SimpleAtoi(parts[1], &s.inter) || s.intra < 1 || s.inter < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strategy: ", what, "='", text, "' is not A x B (devices per node x nodes), e.g. 8x4"));
  }
  return s;
}

double Gib(double bytes) { return bytes / static_cast<double>(int64_t{1} << 30); }

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

std::string StrategyName(const Strategy& s) {
  std::string out = s.uniform() ? absl::StrCat("k=", s.layers_per_unit, ",shard=", ShapeName(s.p))
                                : absl::StrCat("k=", s.layers_per_unit, ",p=", ShapeName(s.p),
                                               ",g=", ShapeName(s.g), ",os=", ShapeName(s.os));
  if (s.prefetch != 1) absl::StrAppend(&out, ",prefetch=", s.prefetch);
  if (s.lead > 0) absl::StrAppend(&out, ",lead=", s.lead);
  return out;
}

absl::StatusOr<Strategy> ParseStrategy(absl::string_view text) {
  Strategy s;
  bool have_k = false, have_shard = false, have_p = false, have_g = false, have_os = false;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("strategy: '", part, "' is not key=value (keys: k, shard, p, g, os)"));
    }
    if (kv[0] == "k") {
      if (!absl::SimpleAtoi(kv[1], &s.layers_per_unit) || s.layers_per_unit < 1 ||
          s.layers_per_unit > 4096) {
        return absl::InvalidArgumentError(
            absl::StrCat("strategy: k='", kv[1], "' is not a layer count in [1, 4096]"));
      }
      have_k = true;
    } else if (kv[0] == "lead") {
      if (!absl::SimpleAtoi(kv[1], &s.lead) || s.lead < 0 || s.lead > 4096) {
        return absl::InvalidArgumentError(
            absl::StrCat("strategy: lead='", kv[1], "' is not a layer count in [0, 4096]"));
      }
    } else if (kv[0] == "prefetch") {
      if (!absl::SimpleAtoi(kv[1], &s.prefetch) || s.prefetch < 0 || s.prefetch > 8) {
        return absl::InvalidArgumentError(
            absl::StrCat("strategy: prefetch='", kv[1], "' is not a depth in [0, 8]"));
      }
    } else if (kv[0] == "shard") {
      RAGSHARD_ASSIGN_OR_RETURN(s.p, ParseShape(kv[1], "shard"));
      s.g = s.os = s.p;
      have_shard = true;
    } else if (kv[0] == "p") {
      RAGSHARD_ASSIGN_OR_RETURN(s.p, ParseShape(kv[1], "p"));
      have_p = true;
    } else if (kv[0] == "g") {
      RAGSHARD_ASSIGN_OR_RETURN(s.g, ParseShape(kv[1], "g"));
      have_g = true;
    } else if (kv[0] == "os") {
      RAGSHARD_ASSIGN_OR_RETURN(s.os, ParseShape(kv[1], "os"));
      have_os = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy: unknown key '", kv[0], "' (keys: k, shard, p, g, os, prefetch, lead)"));
    }
  }
  if (!have_k) return absl::InvalidArgumentError("strategy: k (layers per unit) is missing");
  if (have_shard && (have_p || have_g || have_os)) {
    return absl::InvalidArgumentError("strategy: give either shard= or all of p=, g= and os=");
  }
  if (!have_shard && !(have_p && have_g && have_os)) {
    return absl::InvalidArgumentError("strategy: give shard=AxB, or all of p=, g= and os=");
  }
  return s;
}

absl::Status CheckStrategy(const Strategy& s, int64_t nodes, int64_t devices_per_node) {
  const GroupShape dp{devices_per_node, nodes};
  const std::array<std::pair<const char*, GroupShape>, 4> chain = {
      {{"p", s.p}, {"g", s.g}, {"os", s.os}, {"the cluster", dp}}};
  for (size_t i = 0; i + 1 < chain.size(); ++i) {
    const auto& [a, x] = chain[i];
    const auto& [b, y] = chain[i + 1];
    if (y.intra % x.intra != 0 || y.inter % x.inter != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy ", StrategyName(s), ": ", a, "=", ShapeName(x), " must divide ", b, "=",
          ShapeName(y), " at each level (AMSP: s_p <= s_g <= s_os <= s_dp, nested) on ",
          devices_per_node, " devices x ", nodes, " nodes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "adam" || name == "adamw") return OptimizerKind::kAdam;
  if (name == "muon") return OptimizerKind::kMuon;
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer '", name, "' is not one of adam, muon"));
}

ModelShape DeriveModelShape(const Inventory& inventory, absl::string_view model) {
  ModelShape shape;
  for (const UnitSpec& u : inventory.units()) {
    int64_t i = 0;
    if (IsLayerUnit(u.name(), &i)) ++shape.layers;
    for (const TensorSpec& t : u.tensors()) {
      // The hidden size: the embedding table's row width, else the widest vector (a norm).
      if (u.name() == "embed" && t.shape_size() == 2) shape.hidden = t.shape(1);
      if (shape.hidden == 0 && t.shape_size() == 1) {
        shape.hidden = std::max<int64_t>(shape.hidden, t.shape(0));
      }
    }
  }
  if (const ModelInfo* info = FindModel(model); info != nullptr && info->routed_experts > 0) {
    shape.active_fraction_of_experts =
        static_cast<double>(info->experts_per_token) / static_cast<double>(info->routed_experts);
  }
  return shape;
}

Inventory GroupUnits(const Inventory& inventory, int64_t k,
                     std::vector<std::vector<std::string>>* members, int64_t lead) {
  Inventory out;
  int64_t layers_seen = 0;
  if (members != nullptr) members->clear();
  UnitSpec* open = nullptr;
  int64_t first = 0, last = 0, count = 0;
  std::vector<std::string> names;
  auto close = [&] {
    if (open == nullptr) return;
    open->set_name(count == 1 ? names.front() : absl::StrCat("layers.", first, "-", last));
    if (members != nullptr) members->push_back(names);
    open = nullptr;
    names.clear();
    count = 0;
  };
  for (const UnitSpec& u : inventory.units()) {
    int64_t index = 0;
    const bool is_layer = IsLayerUnit(u.name(), &index);
    const bool in_lead = is_layer && layers_seen < lead;
    if (is_layer) ++layers_seen;
    const int64_t size = in_lead ? lead : k;
    const bool layer = is_layer && (size > 1);
    // The lead block closes when it is complete; groups of k do not mix with it.
    const bool lead_done = is_layer && layers_seen == lead + 1 && lead > 0;
    if (!layer || lead_done || (open != nullptr && (count == size || index != last + 1))) {
      close();
    }
    if (!layer) {
      *out.add_units() = u;
      if (members != nullptr) members->push_back({u.name()});
      continue;
    }
    if (open == nullptr) {
      open = out.add_units();
      first = index;
    }
    last = index;
    ++count;
    names.push_back(u.name());
    for (const TensorSpec& t : u.tensors()) *open->add_tensors() = t;
  }
  close();
  return out;
}

int64_t DistinctLeadingLayers(const Inventory& inventory) {
  std::vector<const UnitSpec*> layers;
  for (const UnitSpec& u : inventory.units()) {
    int64_t i = 0;
    if (IsLayerUnit(u.name(), &i)) layers.push_back(&u);
  }
  auto shapes = [](const UnitSpec& u) {
    std::vector<int64_t> v;
    for (const TensorSpec& t : u.tensors()) {
      v.push_back(-1);
      v.insert(v.end(), t.shape().begin(), t.shape().end());
    }
    return v;
  };
  if (layers.size() < 3) return 0;
  const auto last = shapes(*layers.back());
  int64_t n = 0;
  while (n + 1 < static_cast<int64_t>(layers.size()) && shapes(*layers[n]) != last) ++n;
  return n < static_cast<int64_t>(layers.size()) / 2 ? n : 0;
}

// Shard sizes of every grouped unit at one group size n, from the ragged planner.
struct StrategyModel::GroupStats {
  std::vector<double> shard_elems;  // per unit, summed over dtypes
  std::vector<double> shard_bytes;
  std::vector<double> numel;
  double padding_elems = 0, total_elems = 0;
  double max_unsharded_bytes = 0;  // n * shard_bytes of the largest unit
};

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
      if (t.optimizer() == v1::OPTIMIZER_MATRIX && t.shape_size() >= 2) {
        const int r = t.shape_size();
        m->largest_matrix_ = std::max(m->largest_matrix_, static_cast<double>(t.shape(r - 1)) *
                                                              static_cast<double>(t.shape(r - 2)));
      }
    }
    m->unit_active_.push_back(a);
    m->active_ += a;
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
  Inventory g = GroupUnits(inventory_, k, &members, lead);
  std::vector<double> share, frac;
  double total = 0, largest_unit = 0;
  size_t next = 0;
  for (int u = 0; u < g.units_size(); ++u) {
    double a = 0, mat = 0, all = 0, bytes = 0;
    for (size_t j = 0; j < members[u].size(); ++j) a += unit_active_[next++];
    for (const TensorSpec& t : g.units(u).tensors()) {
      all += Numel(t);
      if (t.optimizer() == v1::OPTIMIZER_MATRIX) mat += Numel(t);
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
  grouped_[key] = std::move(g);
}

// The distinct units of a grouping: units with the same (dtype, numel, granule) lists plan the
// same, so each is solved once per group size.
struct StrategyModel::Signatures {
  struct Group {
    v1::DType dtype = v1::DTYPE_UNSPECIFIED;
    std::vector<UnitItem> items;
  };
  std::vector<std::vector<Group>> distinct;
  std::vector<int> of_unit;
  std::vector<double> unit_numel;
};

void StrategyModel::PrepareSignatures(int64_t k) {
  const Inventory& g = grouped_.at(k);
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
    absl::StatusOr<std::pair<double, double>> result = std::make_pair(0.0, 0.0);
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
      double elems = 0, bytes = 0;
      for (const auto& grp : signatures_.at(task.k)->distinct[task.sig]) {
        auto sol = SolveUnit(grp.items, task.n, AlignElems(options_.align_bytes, grp.dtype),
                             SolverMode::kRagged);
        if (!sol.ok()) {
          task.result = sol.status();
          break;
        }
        elems += static_cast<double>(sol->shard_elems);
        bytes += static_cast<double>(sol->shard_elems * DTypeSize(grp.dtype));
      }
      if (task.result.ok()) task.result = std::make_pair(elems, bytes);
    }
  };
  const unsigned threads =
      std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 16));
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads && i < tasks.size(); ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  planner_runs_ += static_cast<int64_t>(tasks.size());
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<double, double>>> solved;
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
      const auto [elems, bytes] = per_sig[static_cast<size_t>(sig.of_unit[u])];
      const double numel = sig.unit_numel[u];
      stats->shard_elems.push_back(elems);
      stats->shard_bytes.push_back(bytes);
      stats->numel.push_back(numel);
      stats->total_elems += numel;
      stats->padding_elems += n * elems - numel;
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

// The forward and backward passes with their gathers, reduce-scatters and replica all-reduces,
// which depend on (k, p, g) only; cached.
absl::StatusOr<const std::vector<UnitCost>*> StrategyModel::Overlapped(
    const Strategy& s, double* step, std::vector<TimelineEvent>* timeline) {
  const std::string key =
      absl::StrCat(s.grouping(), "|", ShapeName(s.p), "|", ShapeName(s.g), "|", s.prefetch);
  auto it = overlapped_.find(key);
  if (it != overlapped_.end() && timeline == nullptr) {
    *step = it->second.first;
    return &it->second.second;
  }
  const int64_t k = s.grouping();
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sp, Stats(k, s.p.size()));
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sg, Stats(k, s.g.size()));
  const Inventory& g = grouped_.at(k);
  const std::vector<double>& share = compute_share_.at(k);
  const double compute =
      flops_per_token_ * tokens_per_device_ / (profile_.peak_flops * options_.mfu);
  const GroupShape replicas{profile_.devices_per_node / s.g.intra, profile_.nodes / s.g.inter};
  const size_t n = static_cast<size_t>(g.units_size());
  std::vector<UnitCost> units(n);
  for (size_t u = 0; u < n; ++u) {
    UnitCost& c = units[u];
    c.name = g.units(static_cast<int>(u)).name();
    c.numel = static_cast<int64_t>(sp->numel[u]);
    c.fwd_seconds = compute * share[u] / 3;
    c.bwd_seconds = compute * share[u] * 2 / 3;
    c.ag_bytes = static_cast<double>(s.p.size()) * sp->shard_bytes[u];
    c.ag_seconds = profile_.CollectiveSeconds(Collective::kAllGather, s.p, c.ag_bytes);
    c.rs_bytes = static_cast<double>(s.g.size()) * sg->shard_elems[u] * options_.grad_wire_bytes;
    c.rs_seconds = profile_.CollectiveSeconds(Collective::kReduceScatter, s.g, c.rs_bytes);
    c.ar_bytes = replicas.size() > 1 ? sg->shard_elems[u] * options_.grad_shard_bytes : 0;
    c.ar_seconds = profile_.CollectiveSeconds(Collective::kAllReduce, replicas, c.ar_bytes);
  }
  // One compute stream, one communication stream (FIFO in issue order). A gather is issued
  // `depth` units ahead: when the compute of unit u - depth starts.
  const size_t depth = static_cast<size_t>(s.prefetch);
  double comm = 0, clock = 0;
  // Labels are built only for a timeline: the search runs this thousands of times.
  auto run_comm = [&](double issue, double seconds, const char* kind, const std::string& unit) {
    const double start = std::max(issue, comm);
    comm = start + seconds;
    if (timeline != nullptr && seconds > 0) {
      timeline->push_back({"comm", absl::StrCat(kind, " ", unit), start, comm});
    }
    return comm;
  };
  auto run_compute = [&](double ready, double seconds, const char* kind, const std::string& unit) {
    const double start = std::max(ready, clock);
    clock = start + seconds;
    if (timeline != nullptr && seconds > 0) {
      timeline->push_back({"compute", absl::StrCat(kind, " ", unit), start, clock});
    }
    return start;
  };
  std::vector<double> gathered(n, 0), started(n, 0);
  for (size_t u = 0; u < n; ++u) {
    // Without prefetch a gather starts when the previous unit's compute ends.
    const double issue = depth == 0 ? clock : (u < depth ? 0 : started[u - depth]);
    gathered[u] = run_comm(issue, units[u].ag_seconds, "AG", units[u].name);
    started[u] = run_compute(gathered[u], units[u].fwd_seconds, "F", units[u].name);
  }
  // Backward, last unit first.
  const double forward_end = clock;
  for (size_t j = 0; j < std::min(depth, n); ++j) {
    const size_t u = n - 1 - j;
    gathered[u] = run_comm(forward_end, units[u].ag_seconds, "AG", units[u].name);
  }
  for (size_t j = 0; j < n; ++j) {
    const size_t u = n - 1 - j;
    if (depth == 0) gathered[u] = run_comm(clock, units[u].ag_seconds, "AG", units[u].name);
    const double start = run_compute(gathered[u], units[u].bwd_seconds, "B", units[u].name);
    if (depth > 0 && j + depth < n) {
      const size_t v = n - 1 - (j + depth);
      gathered[v] = run_comm(start, units[v].ag_seconds, "AG", units[v].name);
    }
    run_comm(clock, units[u].rs_seconds, "RS", units[u].name);
    run_comm(comm, units[u].ar_seconds, "AR", units[u].name);
  }
  *step = std::max(clock, comm);
  auto& slot = overlapped_[key];
  slot = {*step, std::move(units)};
  return &slot.second;
}

absl::StatusOr<Evaluation> StrategyModel::Evaluate(const Strategy& s, bool detail,
                                                   bool budget_check) {
  RAGSHARD_RETURN_IF_ERROR(CheckStrategy(s, profile_.nodes, profile_.devices_per_node));
  if (s.prefetch < 0 || s.prefetch > 8) {
    return absl::InvalidArgumentError("strategy: prefetch must be in [0, 8]");
  }
  if (s.lead > 0 && shape_.layers > 0 && s.lead >= shape_.layers) {
    return absl::InvalidArgumentError(absl::StrCat("strategy: lead=", s.lead,
                                                   " leaves no layer "
                                                   "after it (the model has ",
                                                   shape_.layers, ")"));
  }
  const int64_t k = s.grouping();
  if (!grouped_.count(k)) AddGrouping(k);  // a grouping the search did not list (simulate)
  const bool muon = options_.optimizer == OptimizerKind::kMuon;
  Evaluation e;
  e.strategy = s;
  MemoryBreakdown& mem = e.memory;
  const MemoryBreakdown lower = UnpaddedMemory(s);
  if (budget_check && lower.total() > static_cast<double>(budget_)) {
    // Padding only adds: the candidate cannot fit, and needs no planning.
    e.memory = lower;
    e.memory_lower_bound = true;
    return e;
  }
  mem.activations = lower.activations;
  const double muon_transient = muon ? muon_owner_bytes() : 0;
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sp, Stats(k, s.p.size()));
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sg, Stats(k, s.g.size()));
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* so, Stats(k, s.os.size()));
  const std::vector<double>& frac = matrix_fraction_.at(k);
  for (size_t u = 0; u < sp->shard_bytes.size(); ++u) {
    mem.params += sp->shard_bytes[u];
    mem.grads += sg->shard_elems[u] * options_.grad_shard_bytes;
    const double per_elem =
        muon ? frac[u] * kMuonStateBytes + (1 - frac[u]) * kAdamStateBytes : kAdamStateBytes;
    mem.optimizer += so->shard_elems[u] * per_elem;
  }
  // The unsharded buffers in flight and one unit's unsharded gradients, per device, as the data
  // plane allocates them (common/data_plane_memory.h).
  std::vector<DataPlaneUnit> dp_units;
  for (size_t u = 0; u < sp->shard_bytes.size(); ++u) {
    dp_units.push_back({static_cast<int64_t>(sp->shard_elems[u]), static_cast<int64_t>(s.p.size()),
                        sp->shard_elems[u] > 0 ? sp->shard_bytes[u] / sp->shard_elems[u] : 0.0});
  }
  const DataPlaneMemory dp = DataPlanePeak(dp_units, /*ranks=*/1, /*shared=*/false, s.prefetch);
  mem.transient = dp.unsharded + dp.grads + muon_transient;
  e.padding_pct = sp->total_elems > 0 ? 100.0 * sp->padding_elems / sp->total_elems : 0;
  e.grad_padding_pct = sg->total_elems > 0 ? 100.0 * sg->padding_elems / sg->total_elems : 0;

  double overlapped_end = 0;
  std::vector<TimelineEvent> timeline;
  RAGSHARD_ASSIGN_OR_RETURN(const std::vector<UnitCost>* base,
                            Overlapped(s, &overlapped_end, detail ? &timeline : nullptr));
  // Muon: each matrix's fp32 gradient goes to its owner and the update comes back: a device
  // sends and receives about its share of the matrix elements each way (point to point at the
  // all-gather bandwidth of the os group), and the owners run Newton-Schulz. Updates: when os is
  // larger than p, each parameter shard is gathered from the os/p devices that updated it.
  const GroupShape update{s.os.intra / s.p.intra, s.os.inter / s.p.inter};
  std::vector<UnitCost> units;
  if (detail) units = *base;
  double tail = 0, compute = 0;
  for (size_t u = 0; u < base->size(); ++u) {
    const UnitCost& b = (*base)[u];
    double owner_bytes = 0, owner_seconds = 0, update_bytes = 0, update_seconds = 0;
    if (muon && s.os.size() > 1) {
      const double share = so->shard_elems[u] * frac[u] * 4;
      owner_bytes = 2 * share;
      owner_seconds = owner_bytes / profile_.BusBandwidth(Collective::kAllGather, s.os,
                                                          share * static_cast<double>(s.os.size()));
    }
    if (update.size() > 1) {
      update_bytes = sp->shard_bytes[u];
      update_seconds = profile_.CollectiveSeconds(Collective::kAllGather, update, update_bytes);
    }
    tail += owner_seconds + update_seconds;
    compute += b.fwd_seconds + b.bwd_seconds;
    auto ring = [](int64_t n) { return n > 1 ? static_cast<double>(n - 1) / n : 0.0; };
    e.wire_bytes += 2 * b.ag_bytes * ring(s.p.size()) + b.rs_bytes * ring(s.g.size()) +
                    b.ar_bytes * 2 * ring(profile_.world() / s.g.size()) + owner_bytes +
                    update_bytes * ring(update.size());
    e.ag_bytes += 2 * b.ag_bytes;
    e.rs_bytes += b.rs_bytes;
    e.ar_bytes += b.ar_bytes;
    e.owner_bytes += owner_bytes;
    e.update_bytes += update_bytes;
    if (detail) {
      units[u].owner_bytes = owner_bytes;
      units[u].owner_seconds = owner_seconds;
      units[u].update_bytes = update_bytes;
      units[u].update_seconds = update_seconds;
    }
  }
  double ns_seconds = 0;
  if (muon) {
    ns_seconds = newton_schulz_flops_ / static_cast<double>(s.os.size()) /
                 (profile_.peak_flops * options_.mfu);
  }
  if (detail) {
    double t = overlapped_end;
    for (const UnitCost& c : units) {
      if (c.owner_seconds > 0) {
        timeline.push_back({"comm", "OWN " + c.name, t, t + c.owner_seconds});
      }
      t += c.owner_seconds;
    }
    if (ns_seconds > 0) timeline.push_back({"compute", "NS", t, t + ns_seconds});
    t += ns_seconds;
    for (const UnitCost& c : units) {
      if (c.update_seconds > 0) {
        timeline.push_back({"comm", "UPD " + c.name, t, t + c.update_seconds});
      }
      t += c.update_seconds;
    }
    e.units = std::move(units);
    e.timeline = std::move(timeline);
  }
  e.step_seconds = overlapped_end + tail + ns_seconds;
  e.compute_seconds = compute + ns_seconds;
  e.exposed_comm_seconds = e.step_seconds - e.compute_seconds;
  return e;
}

MemoryBreakdown StrategyModel::UnpaddedMemory(const Strategy& s) const {
  const int64_t k = s.grouping();
  const bool muon = options_.optimizer == OptimizerKind::kMuon;
  MemoryBreakdown m;
  // Activations with checkpointing at layer boundaries: a bf16 [tokens, H] per layer, plus one
  // layer's working set being recomputed (34 H bytes per token; Korthikanti et al. 2022, with
  // flash attention).
  const double h = static_cast<double>(shape_.hidden);
  m.activations = static_cast<double>(options_.micro_batch_tokens) *
                  (static_cast<double>(shape_.layers) * 2 * h + 34 * h);
  const auto [total, largest] = unpadded_.at(k);
  const double elems = inventory_elems_;
  m.params = total / static_cast<double>(s.p.size());
  m.grads = elems * options_.grad_shard_bytes / static_cast<double>(s.g.size());
  m.optimizer =
      elems * (muon ? kMuonStateBytes : kAdamStateBytes) / static_cast<double>(s.os.size());
  // The unsharded parameters of the units in flight (the one computing and those prefetched)
  // and one unsharded gradient; Muon's owner holds a whole fp32 matrix and its iterates.
  m.transient = (s.prefetch + 2) * largest + (muon ? muon_owner_bytes() : 0);
  return m;
}

absl::Status StrategyModel::PrecomputeFor(const std::vector<Strategy>& candidates) {
  std::set<std::pair<int64_t, int64_t>> pairs;
  for (const Strategy& s : candidates) {
    if (!grouped_.count(s.grouping())) continue;
    if (UnpaddedMemory(s).total() > static_cast<double>(budget_)) continue;
    pairs.insert({s.grouping(), s.p.size()});
    pairs.insert({s.grouping(), s.g.size()});
    pairs.insert({s.grouping(), s.os.size()});
  }
  return PrecomputeStats(pairs);
}

std::vector<Strategy> StrategyModel::Candidates() const {
  std::vector<Strategy> out;
  const int64_t d = profile_.devices_per_node, nodes = profile_.nodes;
  const auto intra = Chains(d, options_.whole_nodes);
  const auto inter = Chains(nodes, false);
  for (int64_t key : groupings_) {
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

std::string FormatBytes(double bytes) {
  if (bytes >= static_cast<double>(int64_t{1} << 30))
    return absl::StrFormat("%.2f GiB", Gib(bytes));
  if (bytes >= (1 << 20)) return absl::StrFormat("%.2f MiB", bytes / (1 << 20));
  if (bytes >= (1 << 10)) return absl::StrFormat("%.2f KiB", bytes / (1 << 10));
  return absl::StrFormat("%.0f B", bytes);
}

absl::StatusOr<Advice> Advise(StrategyModel* model) {
  const auto t0 = std::chrono::steady_clock::now();
  Advice advice;
  const CostOptions& o = model->options();
  const double budget = static_cast<double>(model->budget_bytes());
  std::vector<Evaluation> fits, all_rejected;
  const Evaluation* smallest = nullptr;
  std::vector<Evaluation> evaluated;
  const std::vector<Strategy> candidates = model->Candidates();
  evaluated.reserve(candidates.size());
  RAGSHARD_RETURN_IF_ERROR(model->PrecomputeFor(candidates));
  for (const Strategy& s : candidates) {
    RAGSHARD_ASSIGN_OR_RETURN(Evaluation e, model->Evaluate(s, false, /*budget_check=*/true));
    evaluated.push_back(std::move(e));
  }
  advice.considered = static_cast<int64_t>(evaluated.size());
  for (const Evaluation& e : evaluated) {
    if (smallest == nullptr || e.memory.total() < smallest->memory.total()) smallest = &e;
  }
  if (smallest == nullptr) return absl::InvalidArgumentError("no candidate strategy to consider");
  Evaluation exact_smallest;
  bool found = false;
  if (smallest->memory.total() > budget && smallest->memory_lower_bound) {
    // Name the true smallest: cost exactly, in order of their lower bounds, the candidates whose
    // bound is below the best exact figure found so far.
    std::vector<const Evaluation*> order;
    for (const Evaluation& e : evaluated) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const Evaluation* a, const Evaluation* b) {
      return a->memory.total() < b->memory.total();
    });
    for (const Evaluation* e : order) {
      if (found && e->memory.total() >= exact_smallest.memory.total()) {
        break;
      }
      RAGSHARD_ASSIGN_OR_RETURN(Evaluation x, model->Evaluate(e->strategy));
      if (!found || x.memory.total() < exact_smallest.memory.total()) {
        exact_smallest = std::move(x);
        found = true;
      }
    }
    smallest = &exact_smallest;
  }
  if (smallest->memory.total() > budget) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "no strategy fits the memory budget of %s (%.0f bytes) per device; the smallest needs "
        "%s%s (%.0f bytes): %s (params %s, grads %s, optimizer %s, transient %s, activations %s)",
        FormatBytes(budget), budget, smallest->memory_lower_bound ? "at least " : "",
        FormatBytes(smallest->memory.total()), std::ceil(smallest->memory.total()),
        StrategyName(smallest->strategy), FormatBytes(smallest->memory.params),
        FormatBytes(smallest->memory.grads), FormatBytes(smallest->memory.optimizer),
        FormatBytes(smallest->memory.transient), FormatBytes(smallest->memory.activations)));
  }
  bool any_good = false;
  for (const Evaluation& e : evaluated) {
    any_good |= e.memory.total() <= budget && e.padding_pct <= o.max_padding_pct;
  }
  advice.padding_target_met = any_good;
  std::vector<Evaluation> accepted;
  for (Evaluation& e : evaluated) {
    if (e.memory.total() > budget) {
      e.rejected = absl::StrFormat("memory %s%s exceeds the budget %s",
                                   e.memory_lower_bound ? "of at least " : "",
                                   FormatBytes(e.memory.total()), FormatBytes(budget));
    } else if (any_good && e.padding_pct > o.max_padding_pct) {
      e.rejected = absl::StrFormat("padding %.3f%% exceeds the %.2f%% target", e.padding_pct,
                                   o.max_padding_pct);
    }
    (e.rejected.empty() ? accepted : advice.rejected).push_back(std::move(e));
  }
  auto better = [&](const Evaluation& a, const Evaluation& b) {
    // Without a candidate under the padding target, the least padding wins.
    if (!any_good && a.padding_pct != b.padding_pct) return a.padding_pct < b.padding_pct;
    if (a.step_seconds != b.step_seconds) return a.step_seconds < b.step_seconds;
    if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
    return StrategyName(a.strategy) < StrategyName(b.strategy);
  };
  std::sort(accepted.begin(), accepted.end(), better);
  // Within 1 % of the fastest the model cannot tell candidates apart: prefer fewer bytes sent,
  // then less memory.
  if (!accepted.empty()) {
    const double limit = accepted.front().step_seconds * 1.01;
    auto band_end = std::find_if(accepted.begin(), accepted.end(),
                                 [&](const Evaluation& e) { return e.step_seconds > limit; });
    std::stable_sort(accepted.begin(), band_end, [&](const Evaluation& a, const Evaluation& b) {
      if (!any_good && a.padding_pct != b.padding_pct) return a.padding_pct < b.padding_pct;
      if (a.wire_bytes != b.wire_bytes) return a.wire_bytes < b.wire_bytes;
      if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
      return StrategyName(a.strategy) < StrategyName(b.strategy);
    });
  }
  const size_t top = std::min(accepted.size(), static_cast<size_t>(std::max(o.top_k, 1)));
  for (size_t i = 0; i < top; ++i) advice.top.push_back(accepted[i]);
  RAGSHARD_ASSIGN_OR_RETURN(advice.recommendation,
                            model->Evaluate(advice.top.front().strategy, /*detail=*/true));
  advice.planner_runs = model->planner_runs();
  advice.search_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return advice;
}

namespace {

json MemoryJson(const MemoryBreakdown& m) {
  return json{{"params", m.params},           {"grads", m.grads},
              {"optimizer", m.optimizer},     {"transient", m.transient},
              {"activations", m.activations}, {"total", m.total()}};
}

json StrategyJson(const Strategy& s, const ClusterProfile& p) {
  auto shape = [](const GroupShape& g) {
    return json{{"within_node", g.intra}, {"across_nodes", g.inter}, {"size", g.size()}};
  };
  json j{{"spec", StrategyName(s)},
         {"layers_per_unit", s.layers_per_unit},
         {"params", shape(s.p)},
         {"grads", shape(s.g)},
         {"optimizer_states", shape(s.os)}};
  if (s.uniform()) {
    j["mesh"] = json{{"shard", s.p.size()}, {"replicate", p.world() / s.p.size()}};
  }
  j["executable"] = s.uniform();
  return j;
}

json EvalJson(const Evaluation& e, const ClusterProfile& p) {
  json j{{"strategy", StrategyJson(e.strategy, p)},
         {"predicted_step_seconds", e.step_seconds},
         {"compute_seconds", e.compute_seconds},
         {"exposed_comm_seconds", e.exposed_comm_seconds},
         {"padding_pct", e.padding_pct},
         {"grad_padding_pct", e.grad_padding_pct},
         {"memory_bytes", e.memory.total()},
         {"memory", MemoryJson(e.memory)},
         {"wire_bytes_per_step", e.wire_bytes},
         {"comm_bytes_per_step", json{{"all_gather", e.ag_bytes},
                                      {"reduce_scatter", e.rs_bytes},
                                      {"all_reduce", e.ar_bytes},
                                      {"owner", e.owner_bytes},
                                      {"update", e.update_bytes}}}};
  if (!e.rejected.empty()) j["rejected"] = e.rejected;
  return j;
}

}  // namespace

std::string AdviceJson(const Advice& advice, const StrategyModel& model, int max_rejected) {
  const ClusterProfile& p = model.profile();
  json j;
  j["cluster"] = json{{"name", p.name},
                      {"nodes", p.nodes},
                      {"devices_per_node", p.devices_per_node},
                      {"world", p.world()}};
  j["memory_budget_bytes"] = model.budget_bytes();
  j["recommendation"] = EvalJson(advice.recommendation, p);
  j["padding_target_met"] = advice.padding_target_met;
  j["candidates"] = json::array();
  for (const Evaluation& e : advice.top) j["candidates"].push_back(EvalJson(e, p));
  j["considered"] = advice.considered;
  j["rejected_count"] = advice.rejected.size();
  std::map<std::string, int64_t> reasons;
  for (const Evaluation& e : advice.rejected) {
    reasons[absl::StrContains(e.rejected, "memory") ? "memory" : "padding"]++;
  }
  j["rejected_by_reason"] = reasons;
  j["rejected"] = json::array();
  for (size_t i = 0; i < advice.rejected.size() && static_cast<int>(i) < max_rejected; ++i) {
    j["rejected"].push_back(json{{"spec", StrategyName(advice.rejected[i].strategy)},
                                 {"reason", advice.rejected[i].rejected}});
  }
  j["search_seconds"] = advice.search_seconds;
  j["planner_runs"] = advice.planner_runs;
  return j.dump(2);
}

std::string EvaluationJson(const Evaluation& e) {
  json j{{"spec", StrategyName(e.strategy)},
         {"predicted_step_seconds", e.step_seconds},
         {"padding_pct", e.padding_pct},
         {"memory_bytes", e.memory.total()},
         {"memory", MemoryJson(e.memory)}};
  j["units"] = json::array();
  for (const UnitCost& c : e.units) {
    j["units"].push_back(json{{"name", c.name},
                              {"numel", c.numel},
                              {"forward_seconds", c.fwd_seconds},
                              {"backward_seconds", c.bwd_seconds},
                              {"all_gather_bytes", c.ag_bytes},
                              {"all_gather_seconds", c.ag_seconds},
                              {"reduce_scatter_bytes", c.rs_bytes},
                              {"reduce_scatter_seconds", c.rs_seconds},
                              {"all_reduce_bytes", c.ar_bytes},
                              {"all_reduce_seconds", c.ar_seconds},
                              {"owner_bytes", c.owner_bytes},
                              {"owner_seconds", c.owner_seconds},
                              {"update_bytes", c.update_bytes},
                              {"update_seconds", c.update_seconds}});
  }
  j["timeline"] = json::array();
  for (const TimelineEvent& t : e.timeline) {
    j["timeline"].push_back(
        json{{"stream", t.stream}, {"label", t.label}, {"start", t.start}, {"end", t.end}});
  }
  return j.dump(2);
}

std::string AdviceTable(const Advice& advice, const StrategyModel& model, int max_rejected) {
  const ClusterProfile& p = model.profile();
  const Evaluation& r = advice.recommendation;
  std::string out = absl::StrFormat(
      "cluster %s: %d nodes x %d devices (W=%d), budget %s per device\n"
      "recommendation: %s\n  predicted step %.4f s (compute %.4f s, exposed communication "
      "%.4f s), memory %s, padding %.3f%%%s\n",
      p.name, p.nodes, p.devices_per_node, p.world(), FormatBytes(model.budget_bytes()),
      StrategyName(r.strategy), r.step_seconds, r.compute_seconds, r.exposed_comm_seconds,
      FormatBytes(r.memory.total()), r.padding_pct,
      advice.padding_target_met ? "" : " (no fitting candidate meets the padding target)");
  if (!r.strategy.uniform()) {
    out +=
        "  (the data plane executes p = g = os today; policy auto uses the best such "
        "strategy)\n";
  }
  absl::StrAppend(&out,
                  absl::StrFormat("\n%-32s %10s %10s %12s %9s %12s %12s\n", "candidate", "step s",
                                  "exposed s", "memory", "padding", "AG/step", "RS/step"));
  for (const Evaluation& e : advice.top) {
    absl::StrAppend(
        &out,
        absl::StrFormat("%-32s %10.4f %10.4f %12s %8.3f%% %12s %12s\n", StrategyName(e.strategy),
                        e.step_seconds, e.exposed_comm_seconds, FormatBytes(e.memory.total()),
                        e.padding_pct, FormatBytes(e.ag_bytes), FormatBytes(e.rs_bytes)));
  }
  absl::StrAppend(&out, absl::StrFormat("\n%d candidates considered, %d rejected, search %.3f s "
                                        "(%d planner runs)\n",
                                        advice.considered, advice.rejected.size(),
                                        advice.search_seconds, advice.planner_runs));
  for (size_t i = 0; i < advice.rejected.size() && static_cast<int>(i) < max_rejected; ++i) {
    absl::StrAppend(&out, "  rejected ", StrategyName(advice.rejected[i].strategy), ": ",
                    advice.rejected[i].rejected, "\n");
  }
  if (static_cast<int>(advice.rejected.size()) > max_rejected) {
    absl::StrAppend(&out, "  ... (", advice.rejected.size() - max_rejected,
                    " more; --json lists them with --max-rejected)\n");
  }
  return out;
}

std::string SimulationReport(const Evaluation& e, const StrategyModel& model, int width) {
  const ClusterProfile& p = model.profile();
  std::string out = absl::StrFormat(
      "strategy %s on %s (%d nodes x %d devices)\n"
      "step %.4f s: compute %.4f s, exposed communication %.4f s\n"
      "peak memory per device %s: params %s, grads %s, optimizer %s, transient %s, "
      "activations %s\npadding: parameters %.3f%%, gradients %.3f%%\n\n",
      StrategyName(e.strategy), p.name, p.nodes, p.devices_per_node, e.step_seconds,
      e.compute_seconds, e.exposed_comm_seconds, FormatBytes(e.memory.total()),
      FormatBytes(e.memory.params), FormatBytes(e.memory.grads), FormatBytes(e.memory.optimizer),
      FormatBytes(e.memory.transient), FormatBytes(e.memory.activations), e.padding_pct,
      e.grad_padding_pct);
  absl::StrAppend(&out, absl::StrFormat("%-16s %10s %10s %11s %10s %11s %10s %11s %10s\n", "unit",
                                        "fwd ms", "bwd ms", "AG bytes", "AG ms", "RS bytes",
                                        "RS ms", "AR bytes", "AR ms"));
  for (const UnitCost& c : e.units) {
    absl::StrAppend(
        &out, absl::StrFormat("%-16s %10.3f %10.3f %11s %10.3f %11s %10.3f %11s %10.3f\n", c.name,
                              c.fwd_seconds * 1e3, c.bwd_seconds * 1e3, FormatBytes(c.ag_bytes),
                              c.ag_seconds * 1e3, FormatBytes(c.rs_bytes), c.rs_seconds * 1e3,
                              FormatBytes(c.ar_bytes), c.ar_seconds * 1e3));
  }
  absl::StrAppend(
      &out,
      absl::StrFormat("per step: all-gather %s (forward and backward), reduce-scatter %s, "
                      "all-reduce %s, owner %s, update %s\n\n",
                      FormatBytes(e.ag_bytes), FormatBytes(e.rs_bytes), FormatBytes(e.ar_bytes),
                      FormatBytes(e.owner_bytes), FormatBytes(e.update_bytes)));
  // ASCII timeline: one character per step/width seconds.
  const double span = std::max(e.step_seconds, 1e-12);
  std::string compute(width, '.'), comm(width, '.');
  for (const TimelineEvent& t : e.timeline) {
    std::string& row = t.stream == "compute" ? compute : comm;
    char c = '?';
    if (absl::StartsWith(t.label, "F ")) c = 'F';
    if (absl::StartsWith(t.label, "B ")) c = 'B';
    if (absl::StartsWith(t.label, "NS")) c = 'N';
    if (absl::StartsWith(t.label, "AG ")) c = 'g';
    if (absl::StartsWith(t.label, "RS ")) c = 'r';
    if (absl::StartsWith(t.label, "AR ")) c = 'a';
    if (absl::StartsWith(t.label, "OWN ")) c = 'o';
    if (absl::StartsWith(t.label, "UPD ")) c = 'u';
    int a = static_cast<int>(t.start / span * width);
    int b = std::max(a + 1, static_cast<int>(std::ceil(t.end / span * width)));
    for (int i = std::max(a, 0); i < std::min(b, width); ++i) row[i] = c;
  }
  absl::StrAppend(&out, absl::StrFormat("timeline of one step (0 .. %.4f s, %d columns)\n",
                                        e.step_seconds, width));
  absl::StrAppend(&out, "compute |", compute, "|\ncomm    |", comm, "|\n");
  absl::StrAppend(&out,
                  "F forward, B backward, N Newton-Schulz; g all-gather, r reduce-scatter, "
                  "a replica all-reduce, o owner gather/scatter, u update gather, . idle\n");
  return out;
}

absl::StatusOr<AutoPlan> PlanAuto(const Inventory& inventory, absl::string_view model,
                                  const ClusterProfile& profile, int64_t nodes,
                                  int64_t devices_per_node, const CostOptions& options,
                                  const std::string& pinned, PlanOptions plan_options) {
  ClusterProfile sized = profile;
  sized.nodes = nodes;
  sized.devices_per_node = devices_per_node;
  const ModelShape shape = DeriveModelShape(inventory, model);
  CostOptions executable = options;
  executable.uniform_only = true;
  executable.whole_nodes = true;
  RAGSHARD_ASSIGN_OR_RETURN(auto m, StrategyModel::Create(inventory, shape, sized, executable));
  v1::PlanStrategy record;
  record.set_cluster_profile(profile.name);
  Evaluation chosen;
  if (!pinned.empty()) {
    RAGSHARD_ASSIGN_OR_RETURN(Strategy s, ParseStrategy(pinned));
    if (!s.uniform() || s.p.intra != devices_per_node) {
      return absl::InvalidArgumentError(
          absl::StrCat("strategy '", pinned, "': the data plane executes shard=AxB with A = the ",
                       devices_per_node, " ranks of each node (p = g = os)"));
    }
    RAGSHARD_ASSIGN_OR_RETURN(chosen, m->Evaluate(s));
    record.set_reason("pinned by the job");
    record.set_recommended(StrategyName(s));
  } else {
    RAGSHARD_ASSIGN_OR_RETURN(Advice advice, Advise(m.get()));
    chosen = advice.recommendation;
    record.set_reason(absl::StrCat("best of ", advice.considered,
                                   " executable candidates (cost model, cluster profile ",
                                   profile.name, ")"));
    // The best strategy with separate factors, recorded for the report.
    RAGSHARD_ASSIGN_OR_RETURN(auto free_model,
                              StrategyModel::Create(inventory, shape, sized, options));
    auto best = Advise(free_model.get());
    record.set_recommended(best.ok() ? StrategyName(best->recommendation.strategy)
                                     : StrategyName(chosen.strategy));
  }
  record.set_executed(StrategyName(chosen.strategy));
  record.set_predicted_step_seconds(chosen.step_seconds);
  record.set_predicted_memory_bytes(chosen.memory.total());
  record.set_predicted_padding_pct(chosen.padding_pct);
  AutoPlan out;
  out.shard = chosen.strategy.p.size();
  out.replicate = sized.world() / out.shard;
  std::vector<std::vector<std::string>> members;
  Inventory grouped =
      GroupUnits(inventory, chosen.strategy.layers_per_unit, &members, chosen.strategy.lead);
  plan_options.policy = Policy::kRagged;
  plan_options.world = out.shard;
  RAGSHARD_ASSIGN_OR_RETURN(out.plan, BuildPlan(grouped, plan_options));
  std::map<std::string, const std::vector<std::string>*> by_unit;
  for (int u = 0; u < grouped.units_size(); ++u) by_unit[grouped.units(u).name()] = &members[u];
  for (v1::UnitPlan& up : *out.plan.mutable_units()) {
    const auto* mem = by_unit.at(up.unit());
    if (mem->size() > 1) {
      for (const std::string& name : *mem) up.add_members(name);
    }
  }
  *out.plan.mutable_strategy() = record;
  return out;
}

}  // namespace ragshard

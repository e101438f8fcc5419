#include "common/strategy_model.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/data_plane_memory.h"
#include "common/dtype.h"
#include "common/models.h"
#include "common/planner.h"
#include "common/status_macros.h"
#include "common/unit_grouping.h"
#include "common/unit_solver.h"

namespace ragshard {
namespace {

constexpr double kAdamStateBytes = 12;  // fp32 master, m and v
constexpr double kMuonStateBytes = 8;   // fp32 master and momentum
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
      if (WholeMatrix(t.optimizer()) && t.shape_size() >= 2) {
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

absl::StatusOr<const StrategyModel::GroupStats*> StrategyModel::Nested(int64_t k, int64_t n,
                                                                       int64_t finest) {
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* fine, Stats(k, finest));
  if (n == finest) return fine;
  const std::tuple<int64_t, int64_t, int64_t> key{k, n, finest};
  if (auto it = nested_.find(key); it != nested_.end()) return it->second.get();
  // The data plane's plans nest (common/plan_nesting.h): the finest factor is planned and the
  // coarser ones hold finest / n of its shards each, with the same padding.
  const double ratio = static_cast<double>(finest) / static_cast<double>(n);
  auto stats = std::make_unique<GroupStats>(*fine);
  for (double& e : stats->shard_elems) e *= ratio;
  for (double& b : stats->shard_bytes) b *= ratio;
  return (nested_[key] = std::move(stats)).get();
}

// The forward and backward passes with their gathers, reduce-scatters and replica all-reduces,
// which depend on (k, p, g) only; cached.
absl::StatusOr<const std::vector<UnitCost>*> StrategyModel::Overlapped(
    const Strategy& s, double* step, std::vector<TimelineEvent>* timeline) {
  const std::string key = absl::StrCat(s.grouping(), "|", ShapeName(s.p), "|", ShapeName(s.g), "|",
                                       s.os.size(), "|", s.prefetch);
  auto it = overlapped_.find(key);
  if (it != overlapped_.end() && timeline == nullptr) {
    *step = it->second.first;
    return &it->second.second;
  }
  const int64_t k = s.grouping();
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sp, Nested(k, s.p.size(), s.os.size()));
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sg, Nested(k, s.g.size(), s.os.size()));
  const Inventory& g = *grouped_.at(k);
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
  // The time each stream is next free.
  double comm = 0, clock = 0;
  // Runs `seconds` of work on a stream once it is free and the work is `ready`; returns when the
  // work starts. Labels are built only for a timeline: the search runs this thousands of times.
  auto run = [&](const char* stream, double* free, double ready, double seconds, const char* kind,
                 const std::string& unit) {
    const double start = std::max(ready, *free);
    *free = start + seconds;
    if (timeline != nullptr && seconds > 0) {
      timeline->push_back({stream, absl::StrCat(kind, " ", unit), start, *free});
    }
    return start;
  };
  // A collective issued at `issue`; returns when it ends.
  auto run_comm = [&](double issue, double seconds, const char* kind, const std::string& unit) {
    run("comm", &comm, issue, seconds, kind, unit);
    return comm;
  };
  auto run_compute = [&](double ready, double seconds, const char* kind, const std::string& unit) {
    return run("compute", &clock, ready, seconds, kind, unit);
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
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sp, Nested(k, s.p.size(), s.os.size()));
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* sg, Nested(k, s.g.size(), s.os.size()));
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
                        sp->shard_elems[u] > 0 ? sp->shard_bytes[u] / sp->shard_elems[u] : 0.0,
                        static_cast<int64_t>(sg->shard_elems[u])});
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
    pairs.insert({s.grouping(), s.os.size()});  // the others are its coarsenings
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

}  // namespace ragshard

// The cost of one strategy: the memory per device (unpadded bound and planned), the overlapped
// forward and backward timeline with its collectives, and Muon's owner and update tail
// (StrategyModel::Evaluate, Overlapped and UnpaddedMemory; engine/strategy_model.h).
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/data_plane_memory.h"
#include "engine/strategy_model.h"
#include "engine/strategy_model_internal.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

constexpr double kAdamStateBytes = 12;  // fp32 master, m and v
constexpr double kMuonStateBytes = 8;   // fp32 master and momentum

}  // namespace

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
  // plane allocates them (engine/data_plane_memory.h).
  std::vector<DataPlaneUnit> dp_units;
  for (size_t u = 0; u < sp->shard_bytes.size(); ++u) {
    dp_units.push_back({static_cast<int64_t>(sp->shard_elems[u]), static_cast<int64_t>(s.p.size()),
                        sp->shard_elems[u] > 0 ? sp->shard_bytes[u] / sp->shard_elems[u] : 0.0,
                        static_cast<int64_t>(sg->shard_elems[u])});
  }
  const DataPlaneMemory dp = DataPlanePeak(dp_units, /*ranks=*/1, /*shared=*/false, s.prefetch);
  mem.transient = dp.unsharded + dp.grads + muon_transient;
  // The same with every unit at its LB2 shard (the p and g plans coarsen the os plan).
  const double ratio_p = static_cast<double>(s.os.size()) / static_cast<double>(s.p.size());
  const double ratio_g = static_cast<double>(s.os.size()) / static_cast<double>(s.g.size());
  std::vector<DataPlaneUnit> lb_units;
  e.memory_at_bound = mem.activations + muon_transient;
  for (size_t u = 0; u < dp_units.size(); ++u) {
    const double lb2 = so->lb2_elems[u];
    const double per_elem =
        muon ? frac[u] * kMuonStateBytes + (1 - frac[u]) * kAdamStateBytes : kAdamStateBytes;
    e.memory_at_bound += lb2 * per_elem;
    lb_units.push_back({static_cast<int64_t>(lb2 * ratio_p), dp_units[u].group,
                        dp_units[u].param_bytes, static_cast<int64_t>(lb2 * ratio_g)});
  }
  const DataPlaneMemory lb_dp = DataPlanePeak(lb_units, 1, false, s.prefetch);
  e.memory_at_bound += lb_dp.shards + lb_dp.grad_shards + lb_dp.unsharded + lb_dp.grads;
  e.padding_pct = sp->total_elems > 0 ? 100.0 * sp->padding_elems / sp->total_elems : 0;
  e.padding_bound_pct = so->total_elems > 0 ? 100.0 * so->lb_padding_elems / so->total_elems : 0;
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
  const auto [total, largest] = unpadded_.at(s.grouping());
  return UnpaddedMemoryOf(s, total, largest);
}

MemoryBreakdown StrategyModel::UnpaddedMemoryOf(const Strategy& s, double total,
                                                double largest) const {
  const bool muon = options_.optimizer == OptimizerKind::kMuon;
  MemoryBreakdown m;
  // Activations with checkpointing at layer boundaries: a bf16 [tokens, H] per layer, plus one
  // layer's working set being recomputed (34 H bytes per token; Korthikanti et al. 2022, with
  // flash attention).
  const double h = static_cast<double>(shape_.hidden);
  m.activations = static_cast<double>(options_.micro_batch_tokens) *
                  (static_cast<double>(shape_.layers) * 2 * h + 34 * h);
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

}  // namespace ragshard

#include "engine/sharding.h"

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"

namespace ragshard {

// Indexed by Factor, whose values are 0, 1, 2 in the order p, g, os.
const char* FactorName(Factor f) {
  static constexpr const char* kNames[] = {"p", "g", "os"};
  return kNames[static_cast<int>(f)];
}

const GroupShape& Sharding::shape(Factor f) const {
  static constexpr GroupShape Sharding::*kShapes[] = {&Sharding::p, &Sharding::g, &Sharding::os};
  return this->*kShapes[static_cast<int>(f)];
}

int64_t Sharding::Position(Factor f, int64_t node, int64_t local) const {
  const int64_t pp = (node % p.inter) * p.intra + (local % p.intra);
  if (f == Factor::kP) return pp;
  // Which p group of its g group the rank is in, then which g group of its os group.
  const int64_t jg =
      ((node % g.inter) / p.inter) * (g.intra / p.intra) + (local % g.intra) / p.intra;
  const int64_t pg = pp * (g.size() / p.size()) + jg;
  if (f == Factor::kG) return pg;
  const int64_t jo =
      ((node % os.inter) / g.inter) * (os.intra / g.intra) + (local % os.intra) / g.intra;
  return pg * (os.size() / g.size()) + jo;
}

std::vector<int> Sharding::GroupNodes(Factor f, int64_t node) const {
  const int64_t b = shape(f).inter, base = node / b * b;
  std::vector<int> out;
  for (int64_t i = 0; i < b; ++i) out.push_back(static_cast<int>(base + i));
  return out;
}

std::vector<int> Sharding::GradReplicaNodes(int64_t node) const {
  std::vector<int> out;
  for (int64_t j = 0; j < nodes / g.inter; ++j) {
    out.push_back(static_cast<int>(j * g.inter + node % g.inter));
  }
  return out;
}

std::vector<int> Sharding::UpdateNodes(int64_t node) const {
  const int64_t base = node / os.inter * os.inter;
  std::vector<int> out;
  for (int64_t i = 0; i < os.inter / p.inter; ++i) {
    out.push_back(static_cast<int>(base + i * p.inter + node % p.inter));
  }
  return out;
}

int64_t Sharding::OsGroup(int64_t node, int64_t local) const {
  return (node / os.inter) * (devices / os.intra) + local / os.intra;
}

std::string Sharding::Describe() const {
  return absl::StrCat("p=", ShapeName(p), ",g=", ShapeName(g), ",os=", ShapeName(os), " on ", nodes,
                      " nodes x ", devices);
}

absl::Status CheckSharding(const Sharding& s) {
  if (s.nodes < 1 || s.devices < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharding: ", s.nodes, " nodes x ", s.devices, " devices is not a cluster"));
  }
  const GroupShape cluster{s.devices, s.nodes};
  const std::pair<const char*, GroupShape> chain[] = {
      {"p", s.p}, {"g", s.g}, {"os", s.os}, {"the cluster", cluster}};
  for (const auto& [name, x] : chain) {
    if (x.intra < 1 || x.inter < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding: ", name, "=", ShapeName(x), " is not a group shape"));
    }
  }
  for (size_t i = 0; i + 1 < std::size(chain); ++i) {
    const auto& [a, x] = chain[i];
    const auto& [b, y] = chain[i + 1];
    if (y.intra % x.intra != 0 || y.inter % x.inter != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sharding: ", a, "=", ShapeName(x), " must divide ", b, "=", ShapeName(y),
                       " at each level (AMSP: p <= g <= os <= the cluster, nested) on ", s.devices,
                       " devices x ", s.nodes, " nodes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Sharding> ShardingOf(const v1::Plan& plan, int64_t world, int64_t devices_per_node) {
  if (world < 1 || devices_per_node < 1 || world % devices_per_node != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("every node must hold the same number of ranks (", devices_per_node,
                     " per node, world ", world, ")"));
  }
  Sharding s;
  s.devices = devices_per_node;
  s.nodes = world / devices_per_node;
  if (plan.has_sharding()) {
    const v1::ShardingSpec& spec = plan.sharding();
    if (spec.nodes() != s.nodes || spec.devices_per_node() != s.devices) {
      return absl::FailedPreconditionError(
          absl::StrCat("the plan is for ", spec.nodes(), " nodes x ", spec.devices_per_node(),
                       " ranks; the job runs ", s.nodes, " nodes x ", s.devices));
    }
    s.p = {spec.p().intra(), spec.p().inter()};
    s.g = {spec.g().intra(), spec.g().inter()};
    s.os = {spec.os().intra(), spec.os().inter()};
    if (absl::Status st = CheckSharding(s); !st.ok()) return st;
    if (plan.world_size() != s.p.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the plan's world_size ", plan.world_size(), " is not |p| = ", s.p.size()));
    }
    if (absl::Status st = CheckFactorPlans(plan); !st.ok()) return st;
    return s;
  }
  if (absl::Status st = CheckFactorPlans(plan); !st.ok()) return st;  // none without a sharding
  const int64_t f = plan.world_size(), k = devices_per_node;
  if (f < 1 || world % f != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shard group of ", f, " ranks does not divide the world of ", world));
  }
  if (f % k == 0) {
    s.p = {k, f / k};  // whole nodes
  } else if (k % f == 0) {
    s.p = {f, 1};  // inside a node: the node holds k / f replicas of the group
  } else {
    return absl::UnimplementedError(absl::StrCat("a shard group (", f,
                                                 " ranks) must be made of whole nodes of ", k,
                                                 " ranks, or divide a node's ranks"));
  }
  s.g = s.os = s.p;
  return s;
}

std::vector<Sharding> AllowedShardings(int64_t nodes, int64_t devices) {
  auto divisors = [](int64_t n) {
    std::vector<int64_t> d;
    for (int64_t i = 1; i <= n; ++i) {
      if (n % i == 0) d.push_back(i);
    }
    return d;
  };
  // Non-decreasing chains a | b | c of divisors of n: the p, g and os sizes at one level.
  auto chains = [&](int64_t n) {
    std::vector<std::array<int64_t, 3>> out;
    for (int64_t a : divisors(n)) {
      for (int64_t b : divisors(n)) {
        for (int64_t c : divisors(n)) {
          if (b % a == 0 && c % b == 0) out.push_back({a, b, c});
        }
      }
    }
    return out;
  };
  std::vector<Sharding> out;
  for (const auto& intra : chains(devices)) {
    for (const auto& inter : chains(nodes)) {
      Sharding s{nodes, devices, {intra[0], inter[0]}, {intra[1], inter[1]}, {intra[2], inter[2]}};
      if (CheckSharding(s).ok()) out.push_back(s);
    }
  }
  return out;
}

v1::ShardingSpec ToSpec(const Sharding& s) {
  v1::ShardingSpec spec;
  spec.set_nodes(s.nodes);
  spec.set_devices_per_node(s.devices);
  auto set = [](const GroupShape& x, v1::GroupShapeSpec* out) {
    out->set_intra(x.intra);
    out->set_inter(x.inter);
  };
  set(s.p, spec.mutable_p());
  set(s.g, spec.mutable_g());
  set(s.os, spec.mutable_os());
  return spec;
}

const google::protobuf::RepeatedPtrField<v1::UnitPlan>& FactorUnits(const v1::Plan& plan,
                                                                    Factor f) {
  if (f != Factor::kP) {
    for (const v1::FactorPlan& fp : plan.factors()) {
      if (fp.component() == FactorName(f)) return fp.units();
    }
  }
  return plan.units();
}

absl::StatusOr<v1::Plan> FactorPlanOf(const v1::Plan& plan, Factor f) {
  v1::Plan out = plan;
  out.clear_factors();
  out.clear_sharding();
  if (f == Factor::kP) return out;
  for (const v1::FactorPlan& fp : plan.factors()) {
    if (fp.component() != FactorName(f)) continue;
    out.set_world_size(fp.world_size());
    *out.mutable_units() = fp.units();
    *out.mutable_metrics() = fp.metrics();
    return out;
  }
  if (plan.factors_size() == 0) return out;  // p = g = os
  return absl::NotFoundError(absl::StrCat("the plan has no '", FactorName(f), "' factor plan"));
}

v1::UnitPlan CoarsenUnit(const v1::UnitPlan& finest, int64_t finest_world, int64_t world) {
  v1::UnitPlan out = finest;
  const int64_t s = finest.shard_elems() * (finest_world / world);
  out.set_shard_elems(s);
  out.clear_metrics();
  for (v1::TensorPlacement& t : *out.mutable_tensors()) {
    t.clear_rank_elems();
    t.set_owner_rank(-1);
    if (t.numel() == 0 || s == 0) {
      t.set_first_rank(s == 0 ? 0 : t.offset() / s);
      continue;
    }
    const int64_t first = t.offset() / s, last = (t.offset() + t.numel() - 1) / s;
    t.set_first_rank(first);
    for (int64_t k = first; k <= last; ++k) {
      const int64_t lo = std::max(t.offset(), k * s);
      const int64_t hi = std::min(t.offset() + t.numel(), (k + 1) * s);
      t.add_rank_elems(hi - lo);
    }
  }
  return out;
}

absl::Status CheckFactorPlans(const v1::Plan& plan) {
  if (!plan.has_sharding()) {
    if (plan.factors_size() != 0) {
      return absl::InvalidArgumentError("the plan has factor plans but no sharding");
    }
    return absl::OkStatus();
  }
  const v1::ShardingSpec& spec = plan.sharding();
  const int64_t p = spec.p().intra() * spec.p().inter();
  const std::pair<Factor, int64_t> factors[] = {
      {Factor::kG, spec.g().intra() * spec.g().inter()},
      {Factor::kOs, spec.os().intra() * spec.os().inter()}};
  for (const auto& [f, size] : factors) {
    const v1::FactorPlan* fp = nullptr;
    for (const v1::FactorPlan& x : plan.factors()) {
      if (x.component() == FactorName(f)) fp = &x;
    }
    if (fp == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("the plan has no '", FactorName(f), "' factor plan for its sharding"));
    }
    if (fp->world_size() != size || size <= 0 || size % p != 0) {
      return absl::InvalidArgumentError(absl::StrCat("the '", FactorName(f), "' plan is over ",
                                                     fp->world_size(), " positions, not ", size));
    }
    if (fp->units_size() != plan.units_size()) {
      return absl::InvalidArgumentError(absl::StrCat("the '", FactorName(f), "' plan has ",
                                                     fp->units_size(), " units, the plan ",
                                                     plan.units_size()));
    }
    for (int u = 0; u < plan.units_size(); ++u) {
      const v1::UnitPlan& a = plan.units(u);
      const v1::UnitPlan& b = fp->units(u);
      bool same = a.unit() == b.unit() && a.dtype() == b.dtype() &&
                  a.tensors_size() == b.tensors_size() &&
                  a.shard_elems() * p == b.shard_elems() * size;
      for (int t = 0; same && t < a.tensors_size(); ++t) {
        same = a.tensors(t).offset() == b.tensors(t).offset() &&
               a.tensors(t).numel() == b.tensors(t).numel();
      }
      if (!same) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit '", a.unit(), "': the '", FactorName(f),
                         "' plan does not nest in the parameters' plan (other tensors, offsets "
                         "or a shard size not in the ratio ",
                         p, ":", size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ragshard

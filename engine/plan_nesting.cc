#include "engine/plan_nesting.h"

#include "absl/strings/str_cat.h"
#include "engine/layout.h"
#include "engine/planner.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

// Units over `world` positions from the finest plan's, with their layout figures.
// Owners of whole-matrix tensors stay only in the os plan (`owners`).
absl::Status Coarsen(const v1::Plan& finest, int64_t world, bool owners,
                     google::protobuf::RepeatedPtrField<v1::UnitPlan>* units,
                     v1::LayoutMetrics* metrics) {
  v1::Plan plan;
  plan.set_world_size(world);
  for (const v1::UnitPlan& up : finest.units()) {
    *plan.add_units() = owners ? up : CoarsenUnit(up, finest.world_size(), world);
  }
  const Layout layout = PlanLayout(plan);
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    v1::UnitPlan* up = plan.mutable_units(static_cast<int>(g));
    const v1::LayoutMetrics kept = up->metrics();
    RAGSHARD_RETURN_IF_ERROR(ComputeGroupMetrics(layout, g, up->mutable_metrics()));
    up->mutable_metrics()->set_lb1_elems(kept.lb1_elems());
    up->mutable_metrics()->set_lb2_elems(kept.lb2_elems());
  }
  RAGSHARD_RETURN_IF_ERROR(ComputeLayoutMetrics(layout, metrics));
  *units = std::move(*plan.mutable_units());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Plan> NestPlan(const v1::Plan& finest, const Sharding& s) {
  RAGSHARD_RETURN_IF_ERROR(CheckSharding(s));
  if (finest.world_size() != s.os.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the finest plan is over ", finest.world_size(),
                                                   " positions, not |os| = ", s.os.size()));
  }
  if (s.uniform() && s.p.intra == s.devices) return finest;
  v1::Plan out = finest;
  out.set_world_size(s.p.size());
  out.clear_units();
  out.clear_factors();
  v1::LayoutMetrics p_metrics;
  RAGSHARD_RETURN_IF_ERROR(Coarsen(finest, s.p.size(), false, out.mutable_units(), &p_metrics));
  // The plan's figures are the parameters' (padding is the same in every factor).
  const v1::LayoutMetrics& kept = finest.metrics();
  *out.mutable_metrics() = p_metrics;
  out.mutable_metrics()->set_lb1_gap_pct(kept.lb1_gap_pct());
  out.mutable_metrics()->set_lb2_gap_pct(kept.lb2_gap_pct());
  out.mutable_metrics()->set_lb1_elems(kept.lb1_elems());
  out.mutable_metrics()->set_lb2_elems(kept.lb2_elems());
  out.mutable_metrics()->set_owner_load_max_over_mean(kept.owner_load_max_over_mean());
  out.mutable_metrics()->set_owner_locality(kept.owner_locality());
  for (const auto& [f, size] :
       {std::pair<Factor, int64_t>{Factor::kG, s.g.size()}, {Factor::kOs, s.os.size()}}) {
    v1::FactorPlan* fp = out.add_factors();
    fp->set_component(FactorName(f));
    fp->set_world_size(size);
    RAGSHARD_RETURN_IF_ERROR(
        Coarsen(finest, size, f == Factor::kOs, fp->mutable_units(), fp->mutable_metrics()));
    if (f == Factor::kOs) {
      fp->mutable_metrics()->set_owner_load_max_over_mean(kept.owner_load_max_over_mean());
      fp->mutable_metrics()->set_owner_locality(kept.owner_locality());
    }
  }
  *out.mutable_sharding() = ToSpec(s);
  RAGSHARD_RETURN_IF_ERROR(CheckFactorPlans(out));
  return out;
}

}  // namespace ragshard

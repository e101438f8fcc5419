#include "server/planner/metrics.h"

namespace ragshard::planner {

PlannerMetrics::PlannerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  registrations_ = &prometheus::BuildCounter()
                        .Name("ragshard_planner_rank_registrations_total")
                        .Help("Rank registrations the planner recorded")
                        .Register(*registry_)
                        .Add({});
  auto& plans = prometheus::BuildCounter()
                    .Name("ragshard_planner_plan_computations_total")
                    .Help("Plan computations, by result (ok, failed)")
                    .Register(*registry_);
  plans_ok_ = &plans.Add({{"result", "ok"}});
  plans_failed_ = &plans.Add({{"result", "failed"}});
  // From a small model's milliseconds to a 671B model's planning at 16k ranks.
  plan_seconds_ = &prometheus::BuildHistogram()
                       .Name("ragshard_planner_plan_seconds")
                       .Help("Wall time of a plan computation (seconds)")
                       .Register(*registry_)
                       .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.005, 0.02, 0.1,
                                                                        0.5, 2, 10, 60});
}

void PlannerMetrics::PlanComputed(bool ok, double seconds) {
  (ok ? plans_ok_ : plans_failed_)->Increment();
  plan_seconds_->Observe(seconds);
}

}  // namespace ragshard::planner

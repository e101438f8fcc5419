#include "server/planner/metrics.h"

namespace ragshard::planner {

PlannerMetrics::PlannerMetrics() {
  registrations_ = &prometheus::BuildCounter()
                        .Name("ragshard_planner_rank_registrations_total")
                        .Help("Rank registrations the planner recorded")
                        .Register(*registry())
                        .Add({});
  auto& calls = prometheus::BuildCounter()
                    .Name("ragshard_planner_registration_calls_total")
                    .Help(
                        "Registration calls admitted, by method: node (RegisterNodeRanks, a "
                        "node's ranks through its daemon) or rank (RegisterRank)")
                    .Register(*registry());
  node_calls_ = &calls.Add({{"method", "node"}});
  rank_calls_ = &calls.Add({{"method", "rank"}});
  auto& plans = prometheus::BuildCounter()
                    .Name("ragshard_planner_plan_computations_total")
                    .Help("Plan computations, by result (ok, failed)")
                    .Register(*registry());
  plans_ok_ = &plans.Add({{"result", "ok"}});
  plans_failed_ = &plans.Add({{"result", "failed"}});
  // From a small model's milliseconds to a 671B model's planning at 16k ranks.
  plan_seconds_ = &prometheus::BuildHistogram()
                       .Name("ragshard_planner_plan_seconds")
                       .Help("Wall time of a plan computation (seconds)")
                       .Register(*registry())
                       .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.005, 0.02, 0.1,
                                                                        0.5, 2, 10, 60});
  // A node's daemon takes each plan version once and its ranks take it from the daemon: a job
  // of N nodes costs N sends of the plan per version, whatever its ranks per node.
  plans_sent_ = &prometheus::BuildCounter()
                     .Name("ragshard_planner_plans_sent_total")
                     .Help("Plan versions handed to WatchPlan streams")
                     .Register(*registry())
                     .Add({});
  plan_bytes_sent_ = &prometheus::BuildCounter()
                          .Name("ragshard_planner_plan_bytes_sent_total")
                          .Help("Bytes of the plan events handed to WatchPlan streams")
                          .Register(*registry())
                          .Add({});
}

void PlannerMetrics::PlanComputed(bool ok, double seconds) {
  (ok ? plans_ok_ : plans_failed_)->Increment();
  plan_seconds_->Observe(seconds);
}

}  // namespace ragshard::planner

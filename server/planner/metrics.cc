#include "server/planner/metrics.h"

namespace ragshard::planner {

PlannerMetrics::PlannerMetrics() {
  registrations_ = Counter("ragshard_planner_rank_registrations_total",
                           "Rank registrations the planner recorded");
  auto& calls = CounterFamily("ragshard_planner_registration_calls_total",
                              "Registration calls admitted, by method: node (RegisterNodeRanks, a "
                              "node's ranks through its daemon) or rank (RegisterRank)");
  node_calls_ = &calls.Add({{"method", "node"}});
  rank_calls_ = &calls.Add({{"method", "rank"}});
  auto& plans = CounterFamily("ragshard_planner_plan_computations_total",
                              "Plan computations, by result (ok, failed)");
  plans_ok_ = &plans.Add({{"result", "ok"}});
  plans_failed_ = &plans.Add({{"result", "failed"}});
  // From a small model's milliseconds to a 671B model's planning at 16k ranks.
  plan_seconds_ =
      &HistogramFamily("ragshard_planner_plan_seconds", "Wall time of a plan computation (seconds)")
           .Add({},
                prometheus::Histogram::BucketBoundaries{0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60});
  // A node's daemon takes each plan version once and its ranks take it from the daemon: a job
  // of N nodes costs N sends of the plan per version, whatever its ranks per node.
  plans_sent_ =
      Counter("ragshard_planner_plans_sent_total", "Plan versions handed to WatchPlan streams");
  plan_bytes_sent_ = Counter("ragshard_planner_plan_bytes_sent_total",
                             "Bytes of the plan events handed to WatchPlan streams");
  auto& recoveries = CounterFamily(
      "ragshard_planner_recoveries_total",
      "Recoveries in place that ended, by outcome: recovered (every node's ranks re-attached), "
      "deadline (JobOptions.recovery_deadline_ms passed first), second_failure (another failure "
      "was reported during it), node_lost (a node of the job stopped heartbeating), shrunk (the "
      "deadline passed with a node "
      "lost, and the job shrank to its other nodes' ranks: JobOptions.on_node_loss shrink)");
  size_t i = 0;
  for (const char* outcome : {"recovered", "deadline", "second_failure", "node_lost", "shrunk"}) {
    recoveries_[i++] = &recoveries.Add({{"outcome", outcome}});
  }
  // From a restarted rank's re-attachment in a second to a slow restart near a long deadline.
  recovery_seconds_ =
      &HistogramFamily("ragshard_planner_recovery_seconds",
                       "Seconds from a recovery's start to its last node's recovery (recovered "
                       "ones)")
           .Add({},
                prometheus::Histogram::BucketBoundaries{0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300});
  rebuilds_ = Counter("ragshard_planner_rebuilds_total",
                      "Lost nodes rebuilt on a replacement daemon from their job's "
                      "redundancy, counted when their recovery ended recovered");
  rebuilt_bytes_ = Counter("ragshard_planner_rebuilt_bytes_total",
                           "Bytes of persistent state the replacement daemons of lost "
                           "nodes rebuilt (their ReportRecovered)");
  shrinks_ = Counter("ragshard_planner_shrinks_total",
                     "Jobs shrunk in place to a successor job of their surviving ranks "
                     "after a node was lost (JobOptions.on_node_loss shrink)");
}

void PlannerMetrics::PlanComputed(bool ok, double seconds) {
  (ok ? plans_ok_ : plans_failed_)->Increment();
  plan_seconds_->Observe(seconds);
}

void PlannerMetrics::RecoveryEnded(RecoveryOutcome outcome, double seconds) {
  recoveries_[static_cast<size_t>(outcome)]->Increment();
  if (outcome == RecoveryOutcome::kRecovered) recovery_seconds_->Observe(seconds);
}

}  // namespace ragshard::planner

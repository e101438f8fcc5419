// The planner's Prometheus figures (served by --metrics-listen, common/metrics.h). Counters and
// the planning-time histogram are updated as the planner works; jobs by state, nodes by state
// and the watch streams are read from the service's state when a scrape comes.
#pragma once

#include <memory>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace ragshard::planner {

class PlannerMetrics {
 public:
  PlannerMetrics();
  PlannerMetrics(const PlannerMetrics&) = delete;
  PlannerMetrics& operator=(const PlannerMetrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // A rank's registration was recorded (a repeat by the same rank counts again).
  void RankRegistered() { registrations_->Increment(); }
  // A plan computation ended, with its result and its wall time.
  void PlanComputed(bool ok, double seconds);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* registrations_ = nullptr;
  prometheus::Counter* plans_ok_ = nullptr;
  prometheus::Counter* plans_failed_ = nullptr;
  prometheus::Histogram* plan_seconds_ = nullptr;
};

}  // namespace ragshard::planner

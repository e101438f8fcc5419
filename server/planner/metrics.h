// The planner's Prometheus figures (served by --metrics-listen, infra/metrics.h). Counters and
// the planning-time and recovery-time histograms are updated as the planner works; jobs by state,
// nodes by state and the watch streams are read from the service's state when a scrape comes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "infra/metrics.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"

namespace ragshard::planner {

// How a recovery in place ended (ragshard_planner_recoveries_total's outcome label): every node
// recovered, the deadline passed first, another failure came during it, a node was lost, or the
// deadline passed with a node lost and the job shrank to its other nodes' ranks
// (JobOptions.on_node_loss "shrink").
enum class RecoveryOutcome { kRecovered, kDeadline, kSecondFailure, kNodeLost, kShrunk };

class PlannerMetrics : public MetricsSet {
 public:
  PlannerMetrics();

  // A rank's registration was recorded (a repeat by the same rank counts again).
  void RankRegistered() { registrations_->Increment(); }
  // A registration call was admitted: a node's ranks through its daemon (RegisterNodeRanks) or
  // one rank of its own (RegisterRank, older clients).
  void RegistrationCall(bool node) { (node ? node_calls_ : rank_calls_)->Increment(); }
  // A plan computation ended, with its result and its wall time.
  void PlanComputed(bool ok, double seconds);
  // A watch stream was handed a plan version, `bytes` of it on the wire (compact or plain).
  void PlanSent(size_t bytes) {
    plans_sent_->Increment();
    plan_bytes_sent_->Increment(static_cast<double>(bytes));
  }
  // A recovery in place ended; `seconds` from its start is observed for recovered ones only.
  void RecoveryEnded(RecoveryOutcome outcome, double seconds);
  // A job shrank to a successor of its surviving ranks (JOB_SHRUNK).
  void JobShrunk() { shrinks_->Increment(); }
  // A recovery that ended recovered rebuilt a lost node on a replacement daemon, `bytes` of
  // persistent state (JobOptions.redundancy).
  void NodeRebuilt(int64_t bytes) {
    rebuilds_->Increment();
    rebuilt_bytes_->Increment(static_cast<double>(bytes));
  }

 private:
  prometheus::Counter* registrations_ = nullptr;
  prometheus::Counter* node_calls_ = nullptr;
  prometheus::Counter* rank_calls_ = nullptr;
  prometheus::Counter* plans_ok_ = nullptr;
  prometheus::Counter* plans_failed_ = nullptr;
  prometheus::Histogram* plan_seconds_ = nullptr;
  prometheus::Counter* plans_sent_ = nullptr;
  prometheus::Counter* plan_bytes_sent_ = nullptr;
  // One per RecoveryOutcome, in its order.
  std::array<prometheus::Counter*, 5> recoveries_{};
  prometheus::Histogram* recovery_seconds_ = nullptr;
  prometheus::Counter* rebuilds_ = nullptr;
  prometheus::Counter* rebuilt_bytes_ = nullptr;
  prometheus::Counter* shrinks_ = nullptr;
};

}  // namespace ragshard::planner

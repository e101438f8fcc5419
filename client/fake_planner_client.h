// An in-memory PlannerClient for tests of code that talks to the planner. It follows the
// service's rules where they matter to callers (registration, plans, watches, rendezvous) and
// computes plans with the real planner, synchronously. Hash-only registration needs the full
// inventory first (the real service waits instead).
#pragma once

#include <map>
#include <memory>
#include <set>

#include "absl/synchronization/mutex.h"
#include "common/inventory.h"
#include "common/planner_client.h"

namespace ragshard {

class FakePlannerClient final : public PlannerClient {
 public:
  FakePlannerClient();
  ~FakePlannerClient() override;

  absl::StatusOr<v1::Job> CreateJob(const v1::CreateJobRequest& request) override;
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) override;
  absl::StatusOr<std::vector<v1::Job>> ListJobs() override;
  absl::Status DeleteJob(const std::string& job_id) override;
  absl::StatusOr<v1::Job> RegisterRank(const v1::RegisterRankRequest& request) override;
  absl::StatusOr<v1::Plan> GetPlan(const std::string& job_id) override;
  std::unique_ptr<PlanWatch> WatchPlan(const std::string& job_id,
                                       PlanWatchCallback callback) override;
  absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(
      const v1::RegisterNodeRequest& request) override;
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request) override;
  absl::StatusOr<std::vector<v1::Node>> ListNodes() override;
  absl::Status Put(const std::string& job_id, const std::string& key,
                   const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& job_id, const std::string& key,
                                  std::chrono::milliseconds wait) override;
  absl::Status ReportFailure(const v1::ReportFailureRequest& request) override;
  absl::Status Health() override;

  // Test controls.
  void SetUnavailable(bool unavailable);

  struct Watcher;

 private:
  struct JobState {
    v1::Job job;
    std::unique_ptr<Inventory> inventory;
    std::unique_ptr<v1::Plan> plan;
    std::map<std::string, std::string> kv;
  };
  void Notify(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Check() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  bool unavailable_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, JobState> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::set<std::shared_ptr<Watcher>> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard

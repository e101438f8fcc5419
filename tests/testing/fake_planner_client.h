// Test helper: a PlannerClient in the test's process. It records the failures reported to it
// (a test can wait for them) and serves Put/Get/GetKeys from a map; every other call answers
// UNIMPLEMENTED, naming the call, so a test finds out at once if the code under test needs more
// of the planner than the test gave it.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "protocol/planner_client.h"

namespace ragshard::testing {

class FakePlannerClient final : public PlannerClient {
 public:
  // The failures reported so far.
  std::vector<v1::ReportFailureRequest> failures() const {
    absl::MutexLock lock(&mu_);
    return failures_;
  }
  // Waits up to `wait` until `n` failures have been reported; false if they have not.
  bool AwaitFailures(size_t n, absl::Duration wait = absl::Seconds(30)) const {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return failures_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), wait);
  }

  // With recovery on, a recoverable report answers a recovery of the epoch after the
  // reporter's (as the planner does for a job with recovery_deadline_ms), `deadline` from now.
  void EnableRecovery(absl::Duration deadline) {
    absl::MutexLock lock(&mu_);
    recovery_deadline_ = deadline;
  }
  // Failure reports wait for `until` (a planner the node cannot reach) before they arrive.
  void HoldReports(absl::Notification* until) {
    absl::MutexLock lock(&mu_);
    hold_reports_ = until;
  }
  // The nodes' ReportRecovered calls so far, once there are `n` (or after `wait`).
  std::vector<v1::ReportRecoveredRequest> recovered(size_t n = 0,
                                                    absl::Duration wait = absl::Seconds(30)) const {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return recovered_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&reached), wait);
    return recovered_;
  }

  absl::StatusOr<v1::ReportFailureResponse> ReportFailure(
      const v1::ReportFailureRequest& request) override {
    absl::Notification* hold = nullptr;
    {
      absl::MutexLock lock(&mu_);
      hold = hold_reports_;
    }
    if (hold != nullptr) hold->WaitForNotification();
    absl::MutexLock lock(&mu_);
    failures_.push_back(request);
    v1::ReportFailureResponse resp;
    if (request.recoverable() && recovery_deadline_ > absl::ZeroDuration()) {
      epoch_ = std::max(epoch_, request.epoch() + 1);
      resp.set_recovery_epoch(epoch_);
      resp.set_recovery_deadline_unix_ms(absl::ToUnixMillis(absl::Now() + recovery_deadline_));
    }
    return resp;
  }
  absl::StatusOr<v1::ReportRecoveredResponse> ReportRecovered(
      const v1::ReportRecoveredRequest& request) override {
    absl::MutexLock lock(&mu_);
    recovered_.push_back(request);
    v1::ReportRecoveredResponse resp;
    resp.set_status(v1::JOB_READY);
    return resp;
  }
  absl::Status Put(const std::string& job_id, const std::string& key,
                   const std::string& value) override {
    absl::MutexLock lock(&mu_);
    keys_[job_id + "/" + key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& job_id, const std::string& key,
                                  std::chrono::milliseconds wait) override {
    absl::MutexLock lock(&mu_);
    const std::string k = job_id + "/" + key;
    auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return keys_.count(k) > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&present), absl::FromChrono(wait))) {
      return absl::DeadlineExceededError("fake planner: no key '" + k + "'");
    }
    return keys_[k];
  }
  absl::StatusOr<std::vector<std::string>> GetKeys(const std::string& job_id,
                                                   const std::vector<std::string>& keys,
                                                   std::chrono::milliseconds wait) override {
    std::vector<std::string> out;
    const absl::Time until = absl::Now() + absl::FromChrono(wait);
    for (const std::string& key : keys) {
      auto v = Get(job_id, key, absl::ToChronoMilliseconds(until - absl::Now()));
      if (!v.ok()) return v.status();
      out.push_back(*v);
    }
    return out;
  }
  absl::Status Health() override { return absl::OkStatus(); }

  absl::StatusOr<v1::Job> CreateJob(const v1::CreateJobRequest&) override {
    return Unimplemented("CreateJob");
  }
  absl::StatusOr<v1::Job> GetJob(const std::string&) override { return Unimplemented("GetJob"); }
  absl::StatusOr<std::string> GetDataSecret(const std::string&) override {
    return Unimplemented("GetDataSecret");
  }
  absl::StatusOr<v1::ListJobsResponse> ListJobsPage(const v1::ListJobsRequest&) override {
    return Unimplemented("ListJobsPage");
  }
  absl::StatusOr<v1::ListRanksResponse> ListRanksPage(const v1::ListRanksRequest&) override {
    return Unimplemented("ListRanksPage");
  }
  absl::Status DeleteJob(const std::string&) override { return Unimplemented("DeleteJob"); }
  absl::StatusOr<v1::ListJobNodesResponse> ListJobNodes(const std::string&) override {
    return Unimplemented("ListJobNodes");
  }
  absl::StatusOr<v1::Job> RegisterRank(const v1::RegisterRankRequest&) override {
    return Unimplemented("RegisterRank");
  }
  absl::StatusOr<v1::Job> RegisterNodeRanks(const v1::RegisterNodeRanksRequest&) override {
    return Unimplemented("RegisterNodeRanks");
  }
  absl::StatusOr<v1::Plan> GetPlan(const std::string&) override { return Unimplemented("GetPlan"); }
  std::unique_ptr<PlanWatch> WatchPlan(const std::string&, PlanWatchCallback) override {
    return nullptr;
  }
  absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(const v1::RegisterNodeRequest&) override {
    return Unimplemented("RegisterNode");
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest&) override {
    return Unimplemented("Heartbeat");
  }
  absl::StatusOr<std::vector<v1::Node>> ListNodes() override { return Unimplemented("ListNodes"); }

 private:
  static absl::Status Unimplemented(const char* call) {
    return absl::UnimplementedError(std::string("fake planner: ") + call + " is not served");
  }

  mutable absl::Mutex mu_;
  std::vector<v1::ReportFailureRequest> failures_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ReportRecoveredRequest> recovered_ ABSL_GUARDED_BY(mu_);
  absl::Duration recovery_deadline_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification* hold_reports_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::map<std::string, std::string> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard::testing

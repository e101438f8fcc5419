// Recovery in place, the planner's side (issue 54): a recoverable failure report turns a READY job
// with a recovery deadline RECOVERING in the next epoch, the other daemons' reports join it, the
// heartbeats of its nodes list it, and the nodes' ReportRecovered make it READY again; a second
// failure, the deadline or a lost node make it DEGRADED instead, naming why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "engine/inventory.h"
#include "protocol/planner_client.h"
#include "tests/server/planner/planner_fixture.h"

namespace ragshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

constexpr char kLost[] = "rank 1 of job 'j' on node 'n1' exited (signal 9)";

class PlannerRecoveryTest : public testing::PlannerFixture {
 protected:
  // Job `id`, 2 ranks (rank 0 on n0, rank 1 on n1), recovering within `deadline_ms`, planned.
  void CreateReady(const std::string& id, int64_t deadline_ms) {
    v1::CreateJobRequest req;
    req.set_job_id(id);
    req.mutable_mesh()->set_shard_size(2);
    req.mutable_mesh()->set_replicate_size(1);
    req.mutable_options()->set_recovery_deadline_ms(deadline_ms);
    auto job = client_->CreateJob(req);
    ASSERT_TRUE(job.ok()) << job.status();
    const Inventory inv = SmallInventory();
    ASSERT_TRUE(RegisterFull(id, 0, inv, "n0").ok());
    ASSERT_TRUE(RegisterFull(id, 1, inv, "n1").ok());
    auto plan = client_->WaitForPlan(id, 30s);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(client_->GetJob(id)->status(), v1::JOB_READY);
  }

  absl::StatusOr<v1::ReportFailureResponse> Report(const std::string& id,
                                                   const std::string& reporter, int64_t epoch,
                                                   bool recoverable = true,
                                                   const std::string& message = kLost) {
    v1::ReportFailureRequest req;
    req.set_job_id(id);
    req.set_reporter_node_id(reporter);
    req.set_lost_peer("rank 1");
    req.set_message(message);
    req.set_recoverable(recoverable);
    req.set_epoch(epoch);
    return client_->ReportFailure(req);
  }

  absl::StatusOr<v1::ReportRecoveredResponse> Recovered(const std::string& id,
                                                        const std::string& node, int64_t epoch) {
    v1::ReportRecoveredRequest req;
    req.set_job_id(id);
    req.set_node_id(node);
    req.set_epoch(epoch);
    return client_->ReportRecovered(req);
  }

  // The job once its status is no longer `status`; the bound is for a hang, not a delay.
  v1::Job AwaitStatusOtherThan(const std::string& id, v1::JobStatus status) {
    const auto give_up = std::chrono::steady_clock::now() + 30s;
    auto job = client_->GetJob(id);
    while (job.ok() && job->status() == status && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(10ms);
      job = client_->GetJob(id);
    }
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  static std::vector<std::string> Ids(const v1::JobRecovery& r) {
    return {r.recovered_node_ids().begin(), r.recovered_node_ids().end()};
  }
};

TEST_F(PlannerRecoveryTest, ARecoverableReportStartsARecoveryThatEveryNodeEnds) {
  CreateReady("j", 60'000);
  auto started = Report("j", "n1", 0);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->recovery_epoch(), 1);
  auto job = client_->GetJob("j");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->status(), v1::JOB_RECOVERING);
  EXPECT_EQ(job->recovery_epoch(), 1);
  const v1::JobRecovery& r = job->recovery();
  EXPECT_EQ(r.job_id(), "j");
  EXPECT_EQ(r.epoch(), 1);
  EXPECT_EQ(r.lost(), kLost);
  EXPECT_EQ(r.reporter_node_id(), "n1");
  EXPECT_GT(r.started_unix_ms(), 0);
  EXPECT_EQ(r.deadline_unix_ms(), r.started_unix_ms() + 60'000);
  EXPECT_EQ(started->recovery_deadline_unix_ms(), r.deadline_unix_ms());
  EXPECT_EQ(r.recovered_node_ids_size(), 0);
  EXPECT_EQ(r.finished_unix_ms(), 0);
  EXPECT_THAT(job->error(), HasSubstr("recovering in place (epoch 1)"));
  EXPECT_THAT(job->error(), HasSubstr(kLost));

  // Another daemon noticed the same loss, in the epoch before: it joins, nothing changes.
  auto joined = Report("j", "n0", 0, true, "peer rank 1 (node 'n1') lost");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->recovery_epoch(), 1);
  EXPECT_EQ(joined->recovery_deadline_unix_ms(), r.deadline_unix_ms());
  auto after_join = client_->GetJob("j");
  EXPECT_EQ(after_join->status(), v1::JOB_RECOVERING);
  EXPECT_EQ(after_join->recovery_epoch(), 1);
  EXPECT_EQ(after_join->recovery().lost(), kLost);

  // Reports for another epoch, or from a node without ranks, are refused naming the state.
  auto wrong = Recovered("j", "n0", 2);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.status().message(), HasSubstr("JOB_RECOVERING in epoch 1"));
  auto stranger = Recovered("j", "n9", 1);
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stranger.status().message(), HasSubstr("node 'n9' holds no rank of job 'j'"));
  EXPECT_EQ(Recovered("nope", "n0", 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Recovered("j", "n0", 0).status().code(), absl::StatusCode::kInvalidArgument);

  auto first = Recovered("j", "n0", 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->status(), v1::JOB_RECOVERING);
  EXPECT_THAT(Ids(client_->GetJob("j")->recovery()), ElementsAre("n0"));
  ASSERT_TRUE(Recovered("j", "n0", 1).ok());  // once per node
  EXPECT_THAT(Ids(client_->GetJob("j")->recovery()), ElementsAre("n0"));

  auto last = Recovered("j", "n1", 1);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->status(), v1::JOB_READY);
  job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->error(), "");
  EXPECT_EQ(job->recoveries(), 1);
  EXPECT_GE(job->recovery_seconds(), 0);
  EXPECT_EQ(job->recovery_epoch(), 1);
  EXPECT_GE(job->recovery().finished_unix_ms(), job->recovery().started_unix_ms());
  EXPECT_THAT(Ids(job->recovery()), ElementsAre("n0", "n1"));
  // A listed job stays O(1): the count of the nodes recovered, not their names.
  auto listed = client_->ListJobs();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].recovery().recovered_node_ids_size(), 0);
  EXPECT_EQ((*listed)[0].recovery().recovered_nodes(), 2);
  // A repeat of a completed recovery's report answers READY; one for a later epoch is refused.
  EXPECT_EQ(Recovered("j", "n1", 1)->status(), v1::JOB_READY);
  auto ahead = Recovered("j", "n1", 2);
  EXPECT_EQ(ahead.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ahead.status().message(), HasSubstr("JOB_READY in epoch 1"));

  // The next loss is recovered in the next epoch.
  auto again = Report("j", "n0", 1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->recovery_epoch(), 2);
  EXPECT_EQ(client_->GetJob("j")->recovery().recovered_node_ids_size(), 0);
}

TEST_F(PlannerRecoveryTest, HeartbeatsOfItsNodesListARecoveringJob) {
  CreateReady("j", 60'000);
  CreateReady("other", 60'000);
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  ASSERT_TRUE(Report("j", "n1", 0).ok());
  v1::HeartbeatRequest hb;
  hb.set_node_id("n1");
  hb.add_jobs("j");
  hb.add_jobs("other");
  auto resp = client_->Heartbeat(hb);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_EQ(resp->recovering_jobs_size(), 1);
  EXPECT_EQ(resp->recovering_jobs(0).job_id(), "j");
  EXPECT_EQ(resp->recovering_jobs(0).epoch(), 1);
  EXPECT_GT(resp->recovering_jobs(0).deadline_unix_ms(), 0);
  EXPECT_EQ(resp->recovering_jobs(0).lost(), kLost);
  EXPECT_EQ(resp->failed_jobs_size(), 0);
  // Of the nodes recovered, a heartbeat's answer names only the node itself.
  ASSERT_TRUE(Recovered("j", "n0", 1).ok());
  resp = client_->Heartbeat(hb);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->recovering_jobs(0).recovered_node_ids_size(), 0);
  ASSERT_TRUE(Recovered("j", "n1", 1).ok());
  ASSERT_TRUE(Report("j", "n0", 1).ok());  // epoch 2
  ASSERT_TRUE(Recovered("j", "n1", 2).ok());
  resp = client_->Heartbeat(hb);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_EQ(resp->recovering_jobs_size(), 1);
  EXPECT_EQ(resp->recovering_jobs(0).epoch(), 2);
  EXPECT_THAT(Ids(resp->recovering_jobs(0)), ElementsAre("n1"));
}

TEST_F(PlannerRecoveryTest, ASecondFailureDuringTheRecoveryDegradesTheJob) {
  CreateReady("j", 60'000);
  ASSERT_TRUE(Report("j", "n1", 0).ok());
  auto second = Report("j", "n0", 1, true, "rank 0 of job 'j' on node 'n0' exited");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->recovery_epoch(), 0);
  auto job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job->error(), HasSubstr("a second failure during the recovery of epoch 1"));
  EXPECT_THAT(job->error(), HasSubstr(kLost));
  EXPECT_THAT(job->error(), HasSubstr("rank 0 of job 'j' on node 'n0' exited"));
  EXPECT_EQ(Recovered("j", "n0", 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PlannerRecoveryTest, TheDeadlineDegradesAJobWhoseNodesDidNotRecover) {
  CreateReady("j", 200);
  ASSERT_TRUE(Report("j", "n1", 0).ok());
  // n0 may or may not make it within 200 ms on a loaded machine; n1 never reports.
  auto n0 = Recovered("j", "n0", 1);
  const v1::Job job = AwaitStatusOtherThan("j", v1::JOB_RECOVERING);
  EXPECT_EQ(job.status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job.error(), HasSubstr("the recovery of epoch 1"));
  EXPECT_THAT(job.error(), HasSubstr(kLost));
  EXPECT_THAT(job.error(), HasSubstr("'n1'"));
  EXPECT_THAT(job.error(), HasSubstr("did not re-attach within 0.2 s"));
  if (n0.ok()) {
    EXPECT_THAT(job.error(), Not(HasSubstr("'n0'")));
  } else {
    EXPECT_EQ(n0.status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto late = Recovered("j", "n1", 1);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("JOB_DEGRADED"));
}

TEST_F(PlannerRecoveryTest, WithoutARecoveryDeadlineAReportDegradesAsBefore) {
  CreateReady("j", 0);
  auto resp = Report("j", "n1", 0);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->recovery_epoch(), 0);
  EXPECT_EQ(resp->recovery_deadline_unix_ms(), 0);
  auto job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_DEGRADED);
  EXPECT_EQ(job->recovery_epoch(), 0);
  EXPECT_EQ(job->error(), std::string("node 'n1' reports: ") + kLost);
  // A report that is not recoverable degrades a job that could recover, too.
  CreateReady("k", 60'000);
  ASSERT_EQ(Report("k", "n0", 0, /*recoverable=*/false)->recovery_epoch(), 0);
  EXPECT_EQ(client_->GetJob("k")->status(), v1::JOB_DEGRADED);
}

TEST_F(PlannerRecoveryTest, ARestartedRankReRegistersWithItsModelOnly) {
  CreateReady("j", 60'000);
  ASSERT_TRUE(Report("j", "n1", 0).ok());
  const std::string sha = InventorySha256(SmallInventory());
  auto same = RegisterHash("j", 1, sha, "n1");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->status(), v1::JOB_RECOVERING);
  const std::string other(32, 'x');
  auto changed = RegisterHash("j", 1, other, "n1");
  EXPECT_EQ(changed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(changed.status().message(),
              HasSubstr("rank 1 registers inventory hash " + HexString(other) +
                        " but registered with " + HexString(sha)));
  EXPECT_THAT(changed.status().message(), HasSubstr("a restarted rank must run the same model"));
  EXPECT_EQ(client_->GetJob("j")->status(), v1::JOB_RECOVERING);
}

TEST_F(PlannerRecoveryTest, ARecoverySurvivesAPlannerRestart) {
  CreateReady("j", 60'000);
  ASSERT_TRUE(Report("j", "n1", 0).ok());
  ASSERT_TRUE(Recovered("j", "n0", 1).ok());
  server_.reset();
  Start();
  auto job = client_->GetJob("j");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_RECOVERING);
  EXPECT_THAT(Ids(job->recovery()), ElementsAre("n0"));
  EXPECT_EQ(Recovered("j", "n1", 1)->status(), v1::JOB_READY);
}

TEST_F(PlannerRecoveryTest, ALostNodeEndsTheRecoveryAndEveryOutcomeIsCounted) {
  node_timeout_ = 300ms;
  RestartWithMetrics();
  const std::string recovered = "ragshard_planner_recoveries_total{outcome=\"recovered\"}";
  const std::string second = "ragshard_planner_recoveries_total{outcome=\"second_failure\"}";
  const std::string node_lost = "ragshard_planner_recoveries_total{outcome=\"node_lost\"}";
  EXPECT_EQ(Figure(recovered), 0);
  EXPECT_EQ(Figure("ragshard_planner_recoveries_total{outcome=\"deadline\"}"), 0);
  EXPECT_EQ(Figure("ragshard_planner_jobs{state=\"recovering\"}"), 0);

  CreateReady("a", 60'000);
  ASSERT_TRUE(Report("a", "n1", 0).ok());
  EXPECT_EQ(Figure("ragshard_planner_jobs{state=\"recovering\"}"), 1);
  ASSERT_TRUE(Recovered("a", "n0", 1).ok());
  ASSERT_TRUE(Recovered("a", "n1", 1).ok());
  EXPECT_EQ(Figure(recovered), 1);
  EXPECT_EQ(Figure("ragshard_planner_recovery_seconds_count"), 1);

  CreateReady("b", 60'000);
  ASSERT_TRUE(Report("b", "n1", 0).ok());
  ASSERT_TRUE(Report("b", "n1", 1).ok());
  EXPECT_EQ(Figure(second), 1);

  // Node n7 holds job c's rank 1 and stops heartbeating during its recovery.
  v1::CreateJobRequest req;
  req.set_job_id("c");
  req.mutable_mesh()->set_shard_size(2);
  req.mutable_mesh()->set_replicate_size(1);
  req.mutable_options()->set_recovery_deadline_ms(60'000);
  ASSERT_TRUE(client_->CreateJob(req).ok());
  ASSERT_TRUE(RegisterFull("c", 0, SmallInventory(), "n6").ok());
  ASSERT_TRUE(RegisterFull("c", 1, SmallInventory(), "n7").ok());
  ASSERT_TRUE(client_->WaitForPlan("c", 30s).ok());
  ASSERT_TRUE(Report("c", "n6", 0).ok());
  v1::RegisterNodeRequest node;
  node.set_node_id("n7");
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  const v1::Job job = AwaitStatusOtherThan("c", v1::JOB_RECOVERING);
  EXPECT_EQ(job.status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job.error(), HasSubstr("node 'n7' lost"));
  EXPECT_THAT(job.error(), HasSubstr("during the recovery of epoch 1"));
  EXPECT_EQ(Figure(node_lost), 1);
  EXPECT_EQ(Figure(recovered), 1);
}

}  // namespace
}  // namespace ragshard

// PlannerServiceTest, continued: nodes and heartbeats, the rendezvous, and failure reports.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "protocol/planner_client.h"
#include "tests/server/planner/planner_fixture.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

using PlannerServiceTest = testing::PlannerFixture;

// A node is LOST after 2 s of silence: far above the heartbeats' 20 ms, so that a loaded
// machine's delays do not lose a node that beats.
class PlannerNodeLossTest : public testing::PlannerFixture {
 protected:
  PlannerNodeLossTest() { node_timeout_ = 2s; }
};

TEST_F(PlannerNodeLossTest, ASilentNodeBecomesLostAndItsJobsDegraded) {
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  node.set_data_address("127.0.0.1:5555");
  node.set_capacity_bytes(1 << 30);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  // Heartbeats keep it up, from the start, until `beating` is cleared.
  std::atomic<bool> beating{true};
  std::atomic<bool> beat_ok{true};
  std::thread beats([&] {
    v1::HeartbeatRequest hb;
    hb.set_node_id("n1");
    hb.mutable_figures()->set_pool_capacity_bytes(1 << 30);
    hb.mutable_figures()->set_pool_used_bytes(4096);
    while (beating.load()) {
      // Each answer carries the node's lease: three quarters of the node timeout (node_lease.h).
      auto resp = client_->Heartbeat(hb);
      if (!resp.ok() || resp->lease_ms() != 1500) beat_ok.store(false);
      std::this_thread::sleep_for(20ms);
    }
  });
  Create("j", 2);
  Inventory inv = SmallInventory();
  EXPECT_TRUE(RegisterFull("j", 0, inv, "n0").ok());
  EXPECT_TRUE(RegisterFull("j", 1, inv, "n1").ok());
  EXPECT_TRUE(client_->WaitForPlan("j", 10s).ok());
  // Beating for longer than the node timeout keeps it up (the sleep is the passing time under
  // test, not a wait for an event).
  std::this_thread::sleep_for(2500ms);
  EXPECT_EQ(client_->GetJob("j")->status(), v1::JOB_READY);
  auto nodes = client_->ListNodes();
  beating.store(false);
  beats.join();
  EXPECT_TRUE(beat_ok.load());
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->size(), 1u);
  EXPECT_EQ((*nodes)[0].figures().pool_used_bytes(), 4096);
  // Then silence, until the planner reports the node lost (polled; the bound only stops a hang).
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (client_->GetJob("j")->status() != v1::JOB_DEGRADED &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(20ms);
  }
  auto job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job->error(), HasSubstr("node 'n1' lost"));
  EXPECT_EQ(client_->ListNodes()->at(0).status(), v1::NODE_LOST);
}

TEST_F(PlannerServiceTest, DeletedJobsAreReleasedThroughHeartbeats) {
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  Create("keep", 1);
  Create("drop", 1);
  ASSERT_TRUE(client_->DeleteJob("drop").ok());
  v1::HeartbeatRequest hb;
  hb.set_node_id("n1");
  hb.add_jobs("keep");
  hb.add_jobs("drop");
  hb.add_jobs("never-existed");
  auto resp = client_->Heartbeat(hb);
  ASSERT_TRUE(resp.ok());
  EXPECT_THAT(std::vector<std::string>(resp->release_jobs().begin(), resp->release_jobs().end()),
              ::testing::ElementsAre("drop", "never-existed"));
  hb.set_node_id("unknown");
  EXPECT_EQ(client_->Heartbeat(hb).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PlannerServiceTest, HeartbeatsTellADaemonWhichOfItsJobsCannotGoOn) {
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  Create("fine", 1);
  Create("broken", 1);
  v1::ReportFailureRequest report;
  report.set_job_id("broken");
  report.set_reporter_node_id("n0");
  report.set_lost_peer("n2");
  report.set_message("connection reset");
  ASSERT_TRUE(client_->ReportFailure(report).ok());
  v1::HeartbeatRequest hb;
  hb.set_node_id("n1");
  hb.add_jobs("fine");
  hb.add_jobs("broken");
  auto resp = client_->Heartbeat(hb);
  ASSERT_TRUE(resp.ok());
  ASSERT_EQ(resp->failed_jobs_size(), 1);
  EXPECT_EQ(resp->failed_jobs(0).job_id(), "broken");
  EXPECT_THAT(resp->failed_jobs(0).error(), HasSubstr("peer 'n2' lost: connection reset"));
  EXPECT_EQ(resp->release_jobs_size(), 0);
}

// A daemon lost without a reset and replaced before the node timeout: the replacement's
// registration (another incarnation of an UP node) counts the node lost at once, and the
// daemon before, when it beats again, is refused as stale. The same incarnation (a daemon that
// registers again after the planner forgot it) and an unknown one (0) replace silently.
TEST_F(PlannerServiceTest, AnotherIncarnationOfAnUpNodeCountsTheOneBeforeLost) {
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  node.set_data_address("10.0.0.1");
  node.set_incarnation(7);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  ASSERT_TRUE(client_->RegisterNode(node).ok());  // the same daemon again: nothing lost
  Create("j", 2);
  Inventory inv = SmallInventory();
  EXPECT_TRUE(RegisterFull("j", 0, inv, "n0").ok());
  EXPECT_TRUE(RegisterFull("j", 1, inv, "n1").ok());
  EXPECT_TRUE(client_->WaitForPlan("j", 10s).ok());
  EXPECT_EQ(client_->GetJob("j")->status(), v1::JOB_READY);

  node.set_data_address("10.0.0.2");
  node.set_incarnation(8);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  auto job = client_->GetJob("j");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_DEGRADED);  // (no redundancy: the job cannot go on)
  EXPECT_THAT(job->error(), HasSubstr("node 'n1' lost (another daemon registered with its id, "
                                      "from '10.0.0.2', while it was up; its daemon at "
                                      "'10.0.0.1' went silent"));
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->size(), 1u);
  EXPECT_EQ(nodes->at(0).status(), v1::NODE_UP);
  EXPECT_EQ(nodes->at(0).incarnation(), 8u);
  EXPECT_EQ(nodes->at(0).data_address(), "10.0.0.2");

  v1::HeartbeatRequest hb;
  hb.set_node_id("n1");
  hb.set_incarnation(7);
  auto stale = client_->Heartbeat(hb);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.status().message(),
              HasSubstr("this daemon (incarnation 7) is stale: another daemon (incarnation 8, "
                        "at '10.0.0.2') registered with its id"));
  hb.set_incarnation(8);
  EXPECT_TRUE(client_->Heartbeat(hb).ok());
  hb.set_incarnation(0);  // a daemon that does not say
  EXPECT_TRUE(client_->Heartbeat(hb).ok());

  // Unknown incarnations replace without a loss, as before.
  Create("k", 1);
  EXPECT_TRUE(RegisterFull("k", 0, inv, "n1").ok());
  EXPECT_TRUE(client_->WaitForPlan("k", 10s).ok());
  node.set_incarnation(0);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  EXPECT_EQ(client_->GetJob("k")->status(), v1::JOB_READY);
}

TEST_F(PlannerServiceTest, AReportFromAStaleDaemonIsRefusedAndChangesNothing) {
  // Node n1's daemon of incarnation 7 was replaced by one of incarnation 8; the old one, back,
  // reports a failure of job "m" (on n0 alone, READY): refused, named, and the job stays READY.
  // A report of the current incarnation, or of one that does not say, still counts.
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  node.set_data_address("10.0.0.1");
  node.set_incarnation(7);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  node.set_data_address("10.0.0.2");
  node.set_incarnation(8);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  Create("m", 1);
  Inventory inv = SmallInventory();
  EXPECT_TRUE(RegisterFull("m", 0, inv, "n0").ok());
  EXPECT_TRUE(client_->WaitForPlan("m", 10s).ok());
  v1::ReportFailureRequest report;
  report.set_job_id("m");
  report.set_reporter_node_id("n1");
  report.set_lost_peer("n0");
  report.set_message("peer 0 (node 'n0') lost (connection closed)");
  report.set_reporter_incarnation(7);
  auto stale = client_->ReportFailure(report);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.status().message(),
              HasSubstr("node 'n1': this daemon (incarnation 7) is stale: another daemon "
                        "(incarnation 8, at '10.0.0.2') registered with its id"));
  auto job = client_->GetJob("m");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->error(), "");
  report.set_reporter_incarnation(8);
  EXPECT_TRUE(client_->ReportFailure(report).ok());
  EXPECT_EQ(client_->GetJob("m")->status(), v1::JOB_DEGRADED);
  EXPECT_THAT(client_->GetJob("m")->error(), HasSubstr("node 'n1' reports"));
}

TEST_F(PlannerServiceTest, RendezvousPutAndWaitingGet) {
  RestartWithMetrics();
  Create("j", 2);
  EXPECT_EQ(client_->Get("j", "nccl-id", 0ms).status().code(), absl::StatusCode::kNotFound);
  auto waiting = std::async(std::launch::async, [&] { return client_->Get("j", "nccl-id", 60s); });
  // The planner reports the Get parked before the Put: the Put answers a waiting Get.
  ASSERT_TRUE(AwaitFigure(kParkedGets, 1));
  EXPECT_EQ(waiting.wait_for(0ms), std::future_status::timeout);
  ASSERT_TRUE(client_->Put("j", "nccl-id", std::string("\0\1\2", 3)).ok());
  auto got = waiting.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, std::string("\0\1\2", 3));
  EXPECT_EQ(Figure(kParkedGets), 0);
  // A wait that ends without the key: the 200 ms is the timeout under test.
  auto late = client_->Get("j", "absent", 200ms);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(client_->Put("nope", "k", "v").code(), absl::StatusCode::kNotFound);
}

TEST_F(PlannerServiceTest, ReportFailureDegradesTheJob) {
  Create("j", 1);
  v1::ReportFailureRequest req;
  req.set_job_id("j");
  req.set_reporter_node_id("n0");
  req.set_lost_peer("n1");
  req.set_message("connection reset");
  ASSERT_TRUE(client_->ReportFailure(req).ok());
  EXPECT_EQ(client_->GetJob("j")->status(), v1::JOB_DEGRADED);
  EXPECT_THAT(client_->GetJob("j")->error(), HasSubstr("peer 'n1' lost"));
  // The first failure is the cause: the reports it provokes elsewhere do not replace it.
  req.set_reporter_node_id("n1");
  req.set_lost_peer("rank 0 of job 'j' detached");
  req.set_message("rank 0 of job 'j' detached before starting operation 4");
  ASSERT_TRUE(client_->ReportFailure(req).ok());
  EXPECT_THAT(client_->GetJob("j")->error(), HasSubstr("node 'n0' reports peer 'n1' lost"));
}

TEST_F(PlannerServiceTest, AReportThatNamesItsPeerIsQuotedOnce) {
  Create("j", 1);
  v1::ReportFailureRequest req;
  req.set_job_id("j");
  req.set_reporter_node_id("n1");
  req.set_lost_peer("rank 3 of job 'j' detached");
  req.set_message("rank 3 of job 'j' detached before starting operation 66");
  ASSERT_TRUE(client_->ReportFailure(req).ok());
  EXPECT_EQ(client_->GetJob("j")->error(),
            "node 'n1' reports: rank 3 of job 'j' detached before starting operation 66");
}

}  // namespace
}  // namespace ragshard

// PlannerServiceTest, continued: nodes and heartbeats, the rendezvous, and failure reports.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

TEST_F(PlannerServiceTest, ASilentNodeBecomesLostAndItsJobsDegraded) {
  v1::RegisterNodeRequest node;
  node.set_node_id("n1");
  node.set_data_address("127.0.0.1:5555");
  node.set_capacity_bytes(1 << 30);
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  Create("j", 2);
  Inventory inv = SmallInventory();
  ASSERT_TRUE(RegisterFull("j", 0, inv, "n0").ok());
  ASSERT_TRUE(RegisterFull("j", 1, inv, "n1").ok());
  ASSERT_TRUE(client_->WaitForPlan("j", 10s).ok());
  // Heartbeats keep it up: five, 100 ms apart, span more than the node timeout (300 ms). The
  // sleep is the passing time under test, not a wait for an event.
  for (int i = 0; i < 5; ++i) {
    v1::HeartbeatRequest hb;
    hb.set_node_id("n1");
    hb.mutable_figures()->set_pool_capacity_bytes(1 << 30);
    hb.mutable_figures()->set_pool_used_bytes(4096);
    ASSERT_TRUE(client_->Heartbeat(hb).ok());
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(client_->GetJob("j")->status(), v1::JOB_READY);
  auto nodes = client_->ListNodes();
  ASSERT_EQ(nodes->size(), 1u);
  EXPECT_EQ((*nodes)[0].figures().pool_used_bytes(), 4096);
  // Then silence, until the planner reports the node lost (polled, 2 s at least).
  for (int i = 0; i < 100 && client_->GetJob("j")->status() != v1::JOB_DEGRADED; ++i) {
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

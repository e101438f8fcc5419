// The fake planner client follows the service's rules that callers depend on.
#include "client/fake_planner_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/validator.h"

namespace ragshard {
namespace {

using namespace std::chrono_literals;

TEST(FakePlannerClientTest, RegistrationWatchAndRendezvous) {
  FakePlannerClient fake;
  v1::CreateJobRequest create;
  create.set_job_id("j");
  create.mutable_mesh()->set_shard_size(2);
  create.mutable_mesh()->set_replicate_size(1);
  ASSERT_TRUE(fake.CreateJob(create).ok());
  std::vector<v1::JobStatus> seen;
  auto watch = fake.WatchPlan("j", [&](const absl::Status& s, const v1::WatchPlanEvent* ev) {
    if (ev) seen.push_back(ev->status());
  });
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "w", "shape": [64, 8], "dtype": "fp32", "granule": "rows:4"}]}]})");
  v1::RegisterRankRequest req;
  req.set_job_id("j");
  req.set_node_id("n");
  req.set_rank(1);
  req.set_inventory_sha256(InventorySha256(*inv));
  EXPECT_EQ(fake.RegisterRank(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.set_rank(0);
  *req.mutable_inventory() = *inv;
  ASSERT_TRUE(fake.RegisterRank(req).ok());
  req.set_rank(1);
  req.set_inventory_sha256(InventorySha256(*inv));
  ASSERT_TRUE(fake.RegisterRank(req).ok());
  auto plan = fake.WaitForPlan("j", 1s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(ValidatePlan(*plan, &*inv).ok());
  EXPECT_THAT(seen, ::testing::Contains(v1::JOB_READY));
  ASSERT_TRUE(fake.Put("j", "k", "v").ok());
  EXPECT_EQ(*fake.Get("j", "k", 0ms), "v");
  EXPECT_EQ(fake.Get("j", "other", 10ms).status().code(), absl::StatusCode::kDeadlineExceeded);
  fake.SetUnavailable(true);
  EXPECT_EQ(fake.ListJobs().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace ragshard

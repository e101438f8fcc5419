// ragshardctl against a running planner: jobs, job show, plan show, plan metrics, nodes, health,
// and a job's recovery in place.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/inventory.h"
#include "nlohmann/json.hpp"
#include "protocol/planner_client.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

class CtlOnlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_ = testing::PlannerProcess::Start(RAGSHARD_PLANNER_PATH, dir_.path());
    ASSERT_FALSE(p_.address.empty());
  }
  struct Result {
    int code;
    std::string out, err;
  };
  Result Ctl(const std::string& args) {
    const std::string out = dir_.path() + "/o", err = dir_.path() + "/e";
    int status = std::system((std::string(RAGSHARDCTL_PATH) + " " + args + " --planner " +
                              p_.address + " >" + out + " 2>" + err)
                                 .c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, testing::ReadAll(out),
            testing::ReadAll(err)};
  }
  testing::TempDir dir_;
  testing::PlannerProcess p_;
};

TEST_F(CtlOnlineTest, ShowsJobsPlansAndNodes) {
  EXPECT_EQ(Ctl("health").out, "SERVING\n");
  Result created = Ctl("job create demo --shard 4 --granule rows:32");
  ASSERT_EQ(created.code, 0) << created.err;
  // Register four ranks through the library.
  PlannerClientOptions o;
  o.address = p_.address;
  o.security.token_file = p_.token_file;
  auto client = std::move(*GrpcPlannerClient::Create(o));
  auto inv = ParseInventoryJson(R"({"units": [{"name": "layers.0", "tensors": [
      {"name": "w", "shape": [512, 64], "dtype": "bf16", "optimizer": "matrix"},
      {"name": "b", "shape": [64], "dtype": "bf16"}]}]})");
  for (int r = 0; r < 4; ++r) {
    v1::RegisterRankRequest req;
    req.set_job_id("demo");
    req.set_rank(r);
    req.set_node_id(r < 2 ? "node-a" : "node-b");
    *req.mutable_inventory() = *inv;
    ASSERT_TRUE(client->RegisterRank(req).ok());
  }
  ASSERT_TRUE(client->WaitForPlan("demo", 10s).ok());
  v1::RegisterNodeRequest node;
  node.set_node_id("node-a");
  node.set_data_address("127.0.0.1:9");
  ASSERT_TRUE(client->RegisterNode(node).ok());

  Result jobs = Ctl("jobs");
  ASSERT_EQ(jobs.code, 0) << jobs.err;
  EXPECT_THAT(jobs.out, HasSubstr("demo"));
  EXPECT_THAT(jobs.out, HasSubstr("READY"));
  EXPECT_THAT(jobs.out, HasSubstr("4/4"));
  Result show = Ctl("job show demo");
  EXPECT_THAT(show.out, HasSubstr("node node-a: 2 rank(s)"));
  EXPECT_THAT(show.out, HasSubstr("rows:32"));
  Result plan = Ctl("plan show demo");
  ASSERT_EQ(plan.code, 0) << plan.err;
  EXPECT_THAT(plan.out, HasSubstr("layers.0"));
  Result unit = Ctl("plan show demo --unit layers.0");
  EXPECT_THAT(unit.out, HasSubstr("granule"));
  EXPECT_THAT(unit.out, HasSubstr("\nw "));
  Result metrics = Ctl("plan metrics demo --json");
  ASSERT_EQ(metrics.code, 0);
  auto m = nlohmann::json::parse(metrics.out);
  EXPECT_EQ(m["blocks32_split"], 0);
  Result jobs_json = Ctl("jobs --json");
  EXPECT_EQ(nlohmann::json::parse(jobs_json.out)["jobs"][0]["jobId"], "demo");
  Result nodes = Ctl("nodes");
  EXPECT_THAT(nodes.out, HasSubstr("node-a"));
  EXPECT_THAT(nodes.out, HasSubstr("127.0.0.1:9"));
  // node stats: the figures of the node's latest heartbeat.
  v1::HeartbeatRequest hb;
  hb.set_node_id("node-a");
  auto* f = hb.mutable_figures();
  f->set_pool_capacity_bytes(int64_t{1} << 30);
  f->set_pool_used_bytes(int64_t{3} << 20);
  f->set_jobs(1);
  f->set_operations(42);
  f->set_staging_bytes(4096);
  auto* k = f->add_operations_by_kind();
  k->set_kind("OP_UNSHARD");
  k->set_count(30);
  ASSERT_TRUE(client->Heartbeat(hb).ok());
  Result stats = Ctl("node stats node-a");
  ASSERT_EQ(stats.code, 0) << stats.err;
  EXPECT_THAT(stats.out, HasSubstr("node node-a: UP, data address 127.0.0.1:9"));
  EXPECT_THAT(stats.out, HasSubstr("pool: capacity 1.07GB, used 3.15MB"));
  EXPECT_THAT(stats.out, HasSubstr("operations run 42, staging bytes 4.10KB"));
  EXPECT_THAT(stats.out, HasSubstr("OP_UNSHARD"));
  auto sj = nlohmann::json::parse(Ctl("node stats node-a --json").out);
  EXPECT_EQ(sj["figures"]["operationsByKind"][0]["count"], "30");
  Result no_node = Ctl("node stats node-z");
  EXPECT_EQ(no_node.code, 1);
  EXPECT_THAT(no_node.err, HasSubstr("no node 'node-z' at the planner (it knows node-a)"));

  Result missing = Ctl("plan show nope");
  EXPECT_EQ(missing.code, 1);
  EXPECT_THAT(missing.err, HasSubstr("job 'nope' not found"));
  Result bad_unit = Ctl("plan show demo --unit layers.9");
  EXPECT_EQ(bad_unit.code, 1);
  EXPECT_THAT(bad_unit.err, HasSubstr("layers.9"));
  Result bad_id = Ctl("job show 'a b'");
  EXPECT_EQ(bad_id.code, 2);
  EXPECT_THAT(bad_id.err, HasSubstr("job_id"));
  Result deleted = Ctl("job delete demo");
  EXPECT_EQ(deleted.code, 0) << deleted.err;
}

TEST_F(CtlOnlineTest, ShowsARecoveryInPlace) {
  Result bad = Ctl("job create r --shard 2 --recovery-deadline -1");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--recovery-deadline: '-1' is not a number of seconds"));
  EXPECT_EQ(Ctl("job create r --shard 2 --recovery-deadline soon").code, 2);
  Result created = Ctl("job create r --shard 2 --recovery-deadline 120");
  ASSERT_EQ(created.code, 0) << created.err;
  PlannerClientOptions o;
  o.address = p_.address;
  o.security.token_file = p_.token_file;
  auto client = std::move(*GrpcPlannerClient::Create(o));
  EXPECT_EQ(client->GetJob("r")->options().recovery_deadline_ms(), 120'000);
  auto inv = ParseInventoryJson(R"({"units": [{"name": "layers.0", "tensors": [
      {"name": "w", "shape": [512, 64], "dtype": "bf16"}]}]})");
  for (int r = 0; r < 2; ++r) {
    v1::RegisterRankRequest req;
    req.set_job_id("r");
    req.set_rank(r);
    req.set_node_id(r == 0 ? "node-a" : "node-b");
    *req.mutable_inventory() = *inv;
    ASSERT_TRUE(client->RegisterRank(req).ok());
  }
  ASSERT_TRUE(client->WaitForPlan("r", 10s).ok());
  v1::ReportFailureRequest report;
  report.set_job_id("r");
  report.set_reporter_node_id("node-b");
  report.set_lost_peer("rank 1");
  report.set_message("rank 1 of job 'r' on node 'node-b' exited");
  report.set_recoverable(true);
  ASSERT_EQ(client->ReportFailure(report)->recovery_epoch(), 1);
  v1::ReportRecoveredRequest recovered;
  recovered.set_job_id("r");
  recovered.set_node_id("node-a");
  recovered.set_epoch(1);
  ASSERT_TRUE(client->ReportRecovered(recovered).ok());

  Result jobs = Ctl("jobs");
  EXPECT_THAT(jobs.out, HasSubstr("RECOVERING"));
  EXPECT_THAT(jobs.out, HasSubstr("epoch 1, 1 node(s) recovered"));
  Result show = Ctl("job show r");
  ASSERT_EQ(show.code, 0) << show.err;
  EXPECT_THAT(show.out, HasSubstr("status:       RECOVERING"));
  EXPECT_THAT(show.out, HasSubstr("recovers in place within 120 s"));
  EXPECT_THAT(show.out, HasSubstr("recovery:     epoch 1, reported by node 'node-b'"));
  EXPECT_THAT(show.out, HasSubstr("lost:         rank 1 of job 'r' on node 'node-b' exited"));
  EXPECT_THAT(show.out, HasSubstr("recovered:    node-a (1/2 nodes)"));
  EXPECT_THAT(show.out, HasSubstr("rejoining:    node-b"));
  EXPECT_THAT(show.out, HasSubstr("deadline:     in 1"));  // 119.x s
  Result why = Ctl("job why r");
  ASSERT_EQ(why.code, 0) << why.err;
  EXPECT_THAT(why.out, HasSubstr("job r: RECOVERING"));
  EXPECT_THAT(why.out, HasSubstr("lost:         rank 1 of job 'r' on node 'node-b' exited"));
  EXPECT_THAT(why.out, HasSubstr("rejoining:    node-b"));
  EXPECT_THAT(why.out, HasSubstr("deadline:     in "));

  recovered.set_node_id("node-b");
  ASSERT_EQ(client->ReportRecovered(recovered)->status(), v1::JOB_READY);
  show = Ctl("job show r");
  EXPECT_THAT(show.out, HasSubstr("status:       READY"));
  EXPECT_THAT(show.out, HasSubstr("recoveries:   1 recovery, "));
  EXPECT_THAT(show.out, HasSubstr("the last: epoch 1, from rank 1 of job 'r'"));
  EXPECT_THAT(Ctl("jobs").out, HasSubstr("1 recovery, "));
}

TEST_F(CtlOnlineTest, CreatesARedundantJobAndShowsItsRebuilds) {
  Result bad = Ctl("job create r --shard 2 --recovery-deadline 60 --redundancy raid5");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--redundancy: 'raid5' is not a redundancy: use none, replica, "
                                 "hsdp or parity:K (K in [1, 16])"));
  EXPECT_EQ(Ctl("job create r --shard 2 --recovery-deadline 60 --redundancy parity:17").code, 2);
  Result no_deadline = Ctl("job create r --shard 2 --redundancy replica");
  EXPECT_EQ(no_deadline.code, 2);
  EXPECT_THAT(no_deadline.err, HasSubstr("--redundancy replica needs --recovery-deadline SECONDS"));
  Result few = Ctl("job create r --shard 2 --recovery-deadline 60 --redundancy parity:2");
  EXPECT_EQ(few.code, 2);
  EXPECT_THAT(few.err, HasSubstr("'parity:2' needs at least K + 1 = 3 nodes (K = 2), but the "
                                 "job's world size is 2"));
  Result created = Ctl("job create r --shard 2 --recovery-deadline 60 --redundancy replica");
  ASSERT_EQ(created.code, 0) << created.err;
  PlannerClientOptions o;
  o.address = p_.address;
  o.security.token_file = p_.token_file;
  auto client = std::move(*GrpcPlannerClient::Create(o));
  EXPECT_EQ(client->GetJob("r")->options().redundancy(), "replica");
  auto inv = ParseInventoryJson(R"({"units": [{"name": "layers.0", "tensors": [
      {"name": "w", "shape": [512, 64], "dtype": "bf16"}]}]})");
  for (int r = 0; r < 2; ++r) {
    v1::RegisterRankRequest req;
    req.set_job_id("r");
    req.set_rank(r);
    req.set_node_id(r == 0 ? "node-a" : "node-b");
    *req.mutable_inventory() = *inv;
    ASSERT_TRUE(client->RegisterRank(req).ok());
  }
  ASSERT_TRUE(client->WaitForPlan("r", 10s).ok());
  Result show = Ctl("job show r");
  ASSERT_EQ(show.code, 0) << show.err;
  EXPECT_THAT(show.out, HasSubstr("redundancy:   replica (each node's state copied"));
  EXPECT_THAT(show.out, HasSubstr("rebuilds:     0 (0 bytes)\n"));
  EXPECT_THAT(Ctl("jobs").out, HasSubstr("replica"));

  // node-a's daemon reports its peer lost; node-b's replacement rebuilds it and reports first.
  v1::ReportFailureRequest report;
  report.set_job_id("r");
  report.set_reporter_node_id("node-a");
  report.set_lost_peer("node-b");
  report.set_message("peer node 'node-b' closed the connection");
  report.set_recoverable(true);
  ASSERT_EQ(client->ReportFailure(report)->recovery_epoch(), 1);
  v1::ReportRecoveredRequest recovered;
  recovered.set_job_id("r");
  recovered.set_node_id("node-b");
  recovered.set_epoch(1);
  recovered.set_replacement(true);
  recovered.set_rebuilt_bytes(4096);
  ASSERT_EQ(client->ReportRecovered(recovered)->status(), v1::JOB_RECOVERING);
  EXPECT_THAT(Ctl("jobs").out, HasSubstr("rebuilding node 'node-b' on a replacement daemon"));
  show = Ctl("job show r");
  EXPECT_THAT(show.out, HasSubstr("lost node:    rebuilding node 'node-b' on a replacement daemon "
                                  "(4096 bytes rebuilt)"));
  Result why = Ctl("job why r");
  ASSERT_EQ(why.code, 0) << why.err;
  EXPECT_THAT(why.out, HasSubstr("redundancy:   replica"));
  EXPECT_THAT(why.out, HasSubstr("lost node:    rebuilding node 'node-b' on a replacement daemon"));

  recovered.set_node_id("node-a");
  recovered.set_replacement(false);
  recovered.set_rebuilt_bytes(0);
  ASSERT_EQ(client->ReportRecovered(recovered)->status(), v1::JOB_READY);
  show = Ctl("job show r");
  EXPECT_THAT(show.out, HasSubstr("status:       READY"));
  EXPECT_THAT(show.out, HasSubstr("rebuilds:     1 (4096 bytes)\n"));
  EXPECT_THAT(Ctl("job why r").out, HasSubstr("rebuilds:     1 (4096 bytes)\n"));
  EXPECT_THAT(Ctl("jobs").out, HasSubstr("replica, rebuilds: 1 (4096 bytes); 1 recovery, "));
}

TEST_F(CtlOnlineTest, UnreachablePlannerIsOneLineAndExitCodeOne) {
  const std::string out = dir_.path() + "/o", err = dir_.path() + "/e";
  int status = std::system((std::string(RAGSHARDCTL_PATH) +
                            " jobs --planner 127.0.0.1:1 --retry-s 1 >" + out + " 2>" + err)
                               .c_str());
  EXPECT_EQ(WEXITSTATUS(status), 1);
  std::string e = testing::ReadAll(err);
  EXPECT_THAT(e, HasSubstr("unreachable"));
  EXPECT_THAT(e, HasSubstr("(tried for "));  // --retry-s 1: retried for about a second
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1);
}

}  // namespace
}  // namespace ragshard

// ragshardctl against a running planner: jobs, job show, plan show, plan metrics, nodes, health.
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

// Shrink in place, the planner's side (issue 55): a job with JobOptions.on_node_loss "shrink"
// whose lost node is not back (or rebuilt) by the recovery deadline turns SHRUNK, naming its
// successor, a job of the ranks on its other nodes, which the planner creates; the daemons are
// told to fail the old job's operations but keep its buffers, and its ranks are refused with the
// successor's name. A shrink keeps whole shard groups: a lost node that held part of one ends the
// job DEGRADED, naming why. Without "shrink" a lost node degrades the job as before.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "engine/inventory.h"
#include "protocol/planner_client.h"
#include "server/planner/store.h"
#include "tests/server/planner/planner_fixture.h"

namespace ragshard {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using namespace std::chrono_literals;

// Long enough for a loaded machine to report the survivors recovered after the loss is seen.
constexpr int64_t kDeadlineMs = 2000;

class PlannerShrinkTest : public testing::PlannerFixture {
 protected:
  // A fresh planner (nothing created yet) whose silent nodes are LOST after `timeout`, with its
  // metrics endpoint.
  void RestartLosingNodes(std::chrono::milliseconds timeout = 300ms) {
    node_timeout_ = timeout;
    RestartWithMetrics();
  }

  static v1::CreateJobRequest Request(const std::string& id, int64_t shard, int64_t replicate,
                                      const std::string& on_node_loss, int64_t deadline_ms) {
    v1::CreateJobRequest req;
    req.set_job_id(id);
    req.mutable_mesh()->set_shard_size(shard);
    req.mutable_mesh()->set_replicate_size(replicate);
    req.mutable_options()->set_on_node_loss(on_node_loss);
    req.mutable_options()->set_recovery_deadline_ms(deadline_ms);
    return req;
  }

  // Job `id` of mesh replicate x shard with rank r on nodes[r], planned and READY.
  void CreateReady(const std::string& id, int64_t shard, int64_t replicate,
                   const std::vector<std::string>& nodes, const std::string& on_node_loss,
                   const std::string& redundancy = "") {
    v1::CreateJobRequest req = Request(id, shard, replicate, on_node_loss, kDeadlineMs);
    req.mutable_options()->set_redundancy(redundancy);
    auto job = client_->CreateJob(req);
    ASSERT_TRUE(job.ok()) << job.status();
    for (size_t r = 0; r < nodes.size(); ++r) {
      ASSERT_TRUE(RegisterFull(id, static_cast<int64_t>(r), SmallInventory(), nodes[r]).ok());
    }
    auto plan = client_->WaitForPlan(id, 30s);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(client_->GetJob(id)->status(), v1::JOB_READY);
  }

  void RegisterNode(const std::string& node) {
    v1::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_data_address("127.0.0.1:9");
    ASSERT_TRUE(client_->RegisterNode(req).ok());
  }

  absl::StatusOr<v1::ReportRecoveredResponse> Recovered(const std::string& id,
                                                        const std::string& node, int64_t epoch) {
    v1::ReportRecoveredRequest req;
    req.set_job_id(id);
    req.set_node_id(node);
    req.set_epoch(epoch);
    return client_->ReportRecovered(req);
  }

  // The job once `done` holds for it (GetJob's answer; NOT_FOUND until it exists): the planner's
  // answer to what the test waits for. The bound is for a hang, not a delay.
  v1::Job AwaitJob(const std::string& id, const std::function<bool(const v1::Job&)>& done) {
    const auto give_up = std::chrono::steady_clock::now() + 30s;
    auto job = client_->GetJob(id);
    while ((!job.ok() || !done(*job)) && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(5ms);
      job = client_->GetJob(id);
    }
    EXPECT_TRUE(job.ok()) << job.status();
    EXPECT_TRUE(job.ok() && done(*job)) << "job '" << id << "' never got there";
    return job.ok() ? *job : v1::Job();
  }
  v1::Job AwaitStatus(const std::string& id, v1::JobStatus status) {
    return AwaitJob(id, [status](const v1::Job& j) { return j.status() == status; });
  }

  // Node `lost` stops heartbeating (it registers once); once the job recovers from its loss,
  // the `survivors` report recovered; then the deadline passes. The job at its end.
  v1::Job LoseNode(const std::string& id, const std::string& lost,
                   const std::vector<std::string>& survivors) {
    RegisterNode(lost);
    const v1::Job recovering = AwaitJob(id, [&](const v1::Job& j) {
      return j.status() == v1::JOB_RECOVERING && j.recovery().lost_node_id() == lost;
    });
    EXPECT_THAT(recovering.error(), HasSubstr("else the job shrinks to the ranks on its other "
                                              "nodes (on_node_loss shrink)"));
    for (const std::string& node : survivors) {
      auto r = Recovered(id, node, recovering.recovery_epoch());
      EXPECT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r.ok() ? r->status() : v1::JOB_STATUS_UNSPECIFIED, v1::JOB_RECOVERING);
    }
    return AwaitJob(id, [](const v1::Job& j) { return j.status() != v1::JOB_RECOVERING; });
  }

  static std::vector<int64_t> Survivors(const v1::Job& job) {
    return {job.survivor_ranks().begin(), job.survivor_ranks().end()};
  }

  static constexpr char kShrinks[] = "ragshard_planner_shrinks_total";
  static constexpr char kShrunk[] = "ragshard_planner_recoveries_total{outcome=\"shrunk\"}";
  static constexpr char kDeadline[] = "ragshard_planner_recoveries_total{outcome=\"deadline\"}";
};

TEST_F(PlannerShrinkTest, ALostReplicaGroupShrinksTheJobToTheOtherGroup) {
  RestartLosingNodes();
  EXPECT_EQ(Figure(kShrinks), 0);
  EXPECT_EQ(Figure(kShrunk), 0);
  // Shard groups of 2 ranks, one per node: hsdp by default.
  CreateReady("tiny", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "shrink");
  ASSERT_EQ(client_->GetJob("tiny")->options().redundancy(), "hsdp");

  const v1::Job shrunk = LoseNode("tiny", "node-1", {"node-0"});
  EXPECT_EQ(shrunk.status(), v1::JOB_SHRUNK);
  EXPECT_EQ(shrunk.successor_job_id(), "tiny/shrink-1");
  EXPECT_THAT(Survivors(shrunk), ElementsAre(0, 1));
  EXPECT_EQ(shrunk.error(),
            "node 'node-1' was lost and no replacement daemon rebuilt it within 2 s: shrunk to "
            "job 'tiny/shrink-1' of 2 ranks (was 4); ranks 0, 1 go on there as ranks 0, 1");
  EXPECT_EQ(Figure(kShrinks), 1);
  EXPECT_EQ(Figure(kShrunk), 1);
  EXPECT_EQ(Figure(kDeadline), 0);

  // The successor: the survivors' mesh, the job's options but hsdp, its predecessor named.
  const v1::Job next = AwaitJob("tiny/shrink-1", [](const v1::Job&) { return true; });
  EXPECT_EQ(next.status(), v1::JOB_REGISTERING);
  EXPECT_EQ(next.world_size(), 2);
  EXPECT_EQ(next.mesh().shard_size(), 2);
  EXPECT_EQ(next.mesh().replicate_size(), 1);
  EXPECT_EQ(next.predecessor_job_id(), "tiny");
  EXPECT_EQ(next.shrinks(), 1);
  EXPECT_EQ(next.options().redundancy(), "");
  EXPECT_EQ(next.options().on_node_loss(), "shrink");
  EXPECT_EQ(next.options().recovery_deadline_ms(), kDeadlineMs);
  EXPECT_EQ(next.options().policy(), shrunk.options().policy());
  EXPECT_EQ(next.options().align_bytes(), shrunk.options().align_bytes());
  EXPECT_EQ(next.options().registration_timeout_ms(), shrunk.options().registration_timeout_ms());
  EXPECT_EQ(next.registered_ranks(), 0);

  // The old job's ranks are refused with the successor's name; failure reports change nothing.
  const std::string refusal =
      "job 'tiny' shrank to 'tiny/shrink-1' (node 'node-1' lost): its ranks 0, 1 go on there as "
      "ranks 0, 1";
  auto again = RegisterFull("tiny", 0, SmallInventory(), "node-0");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(again.status().message(), refusal);
  v1::RegisterNodeRanksRequest node_ranks;
  node_ranks.set_job_id("tiny");
  node_ranks.set_node_id("node-0");
  node_ranks.add_ranks(0);
  node_ranks.add_ranks(1);
  node_ranks.set_inventory_sha256(InventorySha256(SmallInventory()));
  auto both = client_->RegisterNodeRanks(node_ranks);
  EXPECT_EQ(both.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(both.status().message(), refusal);
  auto recovered = Recovered("tiny", "node-0", 1);
  EXPECT_EQ(recovered.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(recovered.status().message(), refusal);
  v1::ReportFailureRequest failure;
  failure.set_job_id("tiny");
  failure.set_reporter_node_id("node-0");
  failure.set_lost_peer("127.0.0.1:9");
  failure.set_message("peer node 'node-1' closed the connection");
  failure.set_recoverable(true);
  failure.set_epoch(1);
  ASSERT_TRUE(client_->ReportFailure(failure).ok());
  EXPECT_EQ(client_->GetJob("tiny")->status(), v1::JOB_SHRUNK);
  EXPECT_EQ(client_->GetJob("tiny")->error(), shrunk.error());

  // Both are stored (this planner loses no node).
  server_.reset();
  node_timeout_ = 60s;
  Start();
  auto stored = client_->GetJob("tiny");
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->status(), v1::JOB_SHRUNK);
  EXPECT_EQ(stored->successor_job_id(), "tiny/shrink-1");
  EXPECT_THAT(Survivors(*stored), ElementsAre(0, 1));
  auto stored_next = client_->GetJob("tiny/shrink-1");
  ASSERT_TRUE(stored_next.ok()) << stored_next.status();
  EXPECT_EQ(stored_next->predecessor_job_id(), "tiny");
  EXPECT_EQ(stored_next->data_secret(), "");  // a summary; the secret is its own

  // node-0's daemon is told the old job failed, with the successor, and keeps its buffers.
  RegisterNode("node-0");
  v1::HeartbeatRequest hb;
  hb.set_node_id("node-0");
  hb.add_jobs("tiny");
  auto beat = client_->Heartbeat(hb);
  ASSERT_TRUE(beat.ok()) << beat.status();
  ASSERT_EQ(beat->failed_jobs_size(), 1);
  EXPECT_EQ(beat->failed_jobs(0).job_id(), "tiny");
  EXPECT_EQ(beat->failed_jobs(0).error(), shrunk.error());
  EXPECT_THAT(beat->release_jobs(), IsEmpty());
  EXPECT_THAT(beat->recovering_jobs(), IsEmpty());

  // The survivors register as the successor's ranks 0 and 1: it plans.
  ASSERT_TRUE(RegisterFull("tiny/shrink-1", 0, SmallInventory(), "node-0").ok());
  ASSERT_TRUE(RegisterFull("tiny/shrink-1", 1, SmallInventory(), "node-0").ok());
  auto plan = client_->WaitForPlan("tiny/shrink-1", 30s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto ready = client_->GetJob("tiny/shrink-1");
  EXPECT_EQ(ready->status(), v1::JOB_READY);
  EXPECT_EQ(ready->options().redundancy(), "");  // one replica group, one node: no hsdp

  // Deleting the old job releases its buffers.
  ASSERT_TRUE(client_->DeleteJob("tiny").ok());
  beat = client_->Heartbeat(hb);
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_THAT(beat->release_jobs(), ElementsAre("tiny"));
  EXPECT_THAT(beat->failed_jobs(), IsEmpty());
  EXPECT_EQ(client_->GetJob("tiny/shrink-1")->status(), v1::JOB_READY);
}

TEST_F(PlannerShrinkTest, LosingTheFirstReplicaGroupKeepsTheSecond) {
  RestartLosingNodes();
  CreateReady("tiny", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "shrink");
  const v1::Job shrunk = LoseNode("tiny", "node-0", {"node-1"});
  EXPECT_EQ(shrunk.status(), v1::JOB_SHRUNK);
  EXPECT_THAT(Survivors(shrunk), ElementsAre(2, 3));
  EXPECT_THAT(shrunk.error(), HasSubstr("node 'node-0' was lost"));
  EXPECT_THAT(shrunk.error(), HasSubstr("shrunk to job 'tiny/shrink-1' of 2 ranks (was 4); ranks "
                                        "2, 3 go on there as ranks 0, 1"));
  auto refused = RegisterFull("tiny", 2, SmallInventory(), "node-1");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "job 'tiny' shrank to 'tiny/shrink-1' (node 'node-0' lost): its ranks 2, 3 go on "
            "there as ranks 0, 1");
  const v1::Job next = AwaitJob("tiny/shrink-1", [](const v1::Job&) { return true; });
  EXPECT_EQ(next.world_size(), 2);
  EXPECT_EQ(next.predecessor_job_id(), "tiny");
}

TEST_F(PlannerShrinkTest, TwoNodesLostTogetherLeaveTheThirdReplicaGroup) {
  RestartLosingNodes();
  CreateReady("three", 2, 3, {"n0", "n0", "n1", "n1", "n2", "n2"}, "shrink");
  // Both stop heartbeating; whichever the planner saw lost first is the one being rebuilt, and
  // the other does not end the recovery: the job shrinks without both.
  RegisterNode("n1");
  RegisterNode("n2");
  const v1::Job both = AwaitJob("three", [](const v1::Job& j) {
    return j.status() == v1::JOB_RECOVERING && absl::StrContains(j.error(), " too (after node '");
  });
  EXPECT_THAT(both.error(), HasSubstr("the job shrinks without both unless they recover by the "
                                      "deadline"));
  ASSERT_EQ(Recovered("three", "n0", 1)->status(), v1::JOB_RECOVERING);
  const v1::Job shrunk =
      AwaitJob("three", [](const v1::Job& j) { return j.status() != v1::JOB_RECOVERING; });
  EXPECT_EQ(shrunk.status(), v1::JOB_SHRUNK);
  EXPECT_THAT(Survivors(shrunk), ElementsAre(0, 1));
  EXPECT_THAT(shrunk.error(), HasSubstr("was lost and no replacement daemon rebuilt it within 2 s; "
                                        "node '"));
  EXPECT_THAT(shrunk.error(), HasSubstr("' was lost too and did not come back: shrunk to job "
                                        "'three/shrink-1' of 2 ranks (was 6); ranks 0, 1 go on "
                                        "there as ranks 0, 1"));
  auto refused = RegisterFull("three", 0, SmallInventory(), "n0");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "job 'three' shrank to 'three/shrink-1' (nodes 'n1', 'n2' lost): its ranks 0, 1 go on "
            "there as ranks 0, 1");
  const v1::Job next = AwaitJob("three/shrink-1", [](const v1::Job&) { return true; });
  EXPECT_EQ(next.world_size(), 2);
  EXPECT_EQ(next.mesh().replicate_size(), 1);
}

TEST_F(PlannerShrinkTest, ASurvivorUpThatCouldNotReattachGoesOn) {
  // node-0 is kept up by the loop's heartbeats, 20 ms apart: a timeout far above that, so
  // that a loaded machine's delays do not lose it too.
  RestartLosingNodes(1500ms);
  CreateReady("up", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "shrink");
  // node-0 heartbeats throughout but never says recovered (its ranks cannot re-attach: the
  // epoch's data plane needs the lost node): it is a survivor, not a lost node.
  RegisterNode("node-0");
  RegisterNode("node-1");
  v1::HeartbeatRequest beat;
  beat.set_node_id("node-0");
  const auto give_up = std::chrono::steady_clock::now() + 30s;
  absl::StatusOr<v1::Job> job = client_->GetJob("up");
  bool recovering = false;
  while (job.ok() && std::chrono::steady_clock::now() < give_up) {
    ASSERT_TRUE(client_->Heartbeat(beat).ok());
    recovering = recovering || job->status() == v1::JOB_RECOVERING;
    if (recovering && job->status() != v1::JOB_RECOVERING) break;
    std::this_thread::sleep_for(20ms);
    job = client_->GetJob("up");
  }
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_SHRUNK) << job->error();
  EXPECT_THAT(Survivors(*job), ElementsAre(0, 1));
  EXPECT_EQ(job->error(),
            "node 'node-1' was lost and no replacement daemon rebuilt it within 2 s: shrunk to "
            "job 'up/shrink-1' of 2 ranks (was 4); ranks 0, 1 go on there as ranks 0, 1");
}

TEST_F(PlannerShrinkTest, ASurvivorGivingUpOnTheLostNodeDoesNotEndTheRecovery) {
  RestartLosingNodes();
  CreateReady("skew", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "shrink");
  RegisterNode("node-1");
  const v1::Job recovering = AwaitJob("skew", [](const v1::Job& j) {
    return j.status() == v1::JOB_RECOVERING && j.recovery().lost_node_id() == "node-1";
  });
  // node-0's data plane cannot connect without node-1 and gives up (its clock a little ahead
  // of the planner's): not a second failure of a job that shrinks at the deadline.
  v1::ReportFailureRequest report;
  report.set_job_id("skew");
  report.set_reporter_node_id("node-0");
  report.set_lost_peer("node-1");
  report.set_message("connecting the other nodes: key 'data/epoch-1/node-1' was not put");
  report.set_epoch(recovering.recovery_epoch());
  ASSERT_TRUE(client_->ReportFailure(report).ok());
  EXPECT_EQ(client_->GetJob("skew")->status(), v1::JOB_RECOVERING);
  ASSERT_TRUE(Recovered("skew", "node-0", recovering.recovery_epoch()).ok());
  const v1::Job shrunk =
      AwaitJob("skew", [](const v1::Job& j) { return j.status() != v1::JOB_RECOVERING; });
  EXPECT_EQ(shrunk.status(), v1::JOB_SHRUNK) << shrunk.error();
  EXPECT_THAT(Survivors(shrunk), ElementsAre(0, 1));
}

TEST_F(PlannerShrinkTest, AnExplicitRedundancyTheNodesLeftCannotHoldDegradesNamingIt) {
  RestartLosingNodes();
  // replica needs 2 nodes; 1 is left: the successor could not plan, so the job does not shrink.
  CreateReady("rep", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "shrink", "replica");
  const v1::Job job = LoseNode("rep", "node-1", {"node-0"});
  EXPECT_EQ(job.status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job.error(), HasSubstr("it cannot shrink: its redundancy 'replica' would not hold "
                                     "on the nodes left ("));
  EXPECT_THAT(job.error(), HasSubstr("under HSDP leave the redundancy to its default, hsdp"));
  EXPECT_EQ(client_->GetJob("rep/shrink-1").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PlannerShrinkTest, ALostPartOfAShardGroupCannotShrinkAndDegradesNamingWhy) {
  RestartLosingNodes();
  // One shard group of 4 ranks over two nodes, no redundancy: the job recovers from the loss
  // because it shrinks, but cannot.
  CreateReady("split", 4, 1, {"n0", "n0", "n1", "n1"}, "shrink");
  const v1::Job job = LoseNode("split", "n1", {"n0"});
  EXPECT_EQ(job.status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job.error(),
              HasSubstr("the recovery of epoch 1 (from node 'n1' lost (no heartbeat for 300 ms)) "
                        "missed its deadline: node 'n1' was lost and did not come back within 2 s; "
                        "it cannot shrink: node 'n1' held ranks 2, 3 of shard group 0 (ranks 0-3), "
                        "and a shrink keeps whole shard groups (HSDP replica groups: --replicate 2 "
                        "or more, with each group on nodes of its own) unless one shard group "
                        "re-cuts from whole copies (redundancy replica or parity:1)"));
  EXPECT_EQ(job.successor_job_id(), "");
  EXPECT_THAT(Survivors(job), IsEmpty());
  EXPECT_EQ(client_->GetJob("split/shrink-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Figure(kDeadline), 1);
  EXPECT_EQ(Figure(kShrinks), 0);
}

TEST_F(PlannerShrinkTest, OneShardGroupWithWholeCopiesShrinksToOneGroupOfTheSurvivors) {
  RestartLosingNodes();
  // One shard group of 6 ranks over three nodes, replica: node 'r1' lost, the 4 ranks of the
  // other two go on as one shard group of 4 (they re-cut the shards), still with replica.
  CreateReady("cut", 6, 1, {"r0", "r0", "r1", "r1", "r2", "r2"}, "shrink", "replica");
  const v1::Job job = LoseNode("cut", "r1", {"r0", "r2"});
  ASSERT_EQ(job.status(), v1::JOB_SHRUNK) << job.error();
  EXPECT_THAT(Survivors(job), ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(job.error(), HasSubstr("shrunk to job 'cut/shrink-1' of 4 ranks (was 6); ranks 0, "
                                     "1, 4, 5 go on there as ranks 0-3, re-cutting the shards"));
  EXPECT_THAT(job.error(), Not(HasSubstr("keeps no redundancy")));
  const v1::Job next = AwaitJob("cut/shrink-1", [](const v1::Job&) { return true; });
  EXPECT_EQ(next.mesh().shard_size(), 4);
  EXPECT_EQ(next.mesh().replicate_size(), 1);
  EXPECT_EQ(next.options().redundancy(), "replica");
  EXPECT_EQ(Figure(kShrinks), 1);
}

TEST_F(PlannerShrinkTest, AReCutThatLeavesOneNodeGoesOnWithoutRedundancy) {
  RestartLosingNodes();
  // parity:1 over two nodes (each holds the other's state whole): one left, which cannot hold
  // parity:1, so the successor keeps none, and says so.
  CreateReady("pair", 4, 1, {"p0", "p0", "p1", "p1"}, "shrink", "parity:1");
  const v1::Job job = LoseNode("pair", "p0", {"p1"});
  ASSERT_EQ(job.status(), v1::JOB_SHRUNK) << job.error();
  EXPECT_THAT(Survivors(job), ElementsAre(2, 3));
  EXPECT_THAT(job.error(), HasSubstr("re-cutting the shards; the successor keeps no redundancy ("));
  const v1::Job next = AwaitJob("pair/shrink-1", [](const v1::Job&) { return true; });
  EXPECT_EQ(next.mesh().shard_size(), 2);
  EXPECT_EQ(next.mesh().replicate_size(), 1);
  EXPECT_EQ(next.options().redundancy(), "none");
}

TEST_F(PlannerShrinkTest, ReCuttingWithoutALostNodesOnlyCopyDegradesNamingBoth) {
  RestartLosingNodes();
  // replica over three nodes: node r1's copy is on r2 (the next on the ring); both lost.
  CreateReady("gone", 6, 1, {"r0", "r0", "r1", "r1", "r2", "r2"}, "shrink", "replica");
  RegisterNode("r1");
  RegisterNode("r2");
  (void)AwaitJob("gone", [](const v1::Job& j) {
    return j.status() == v1::JOB_RECOVERING && absl::StrContains(j.error(), " too (after node '");
  });
  ASSERT_EQ(Recovered("gone", "r0", 1)->status(), v1::JOB_RECOVERING);
  const v1::Job job =
      AwaitJob("gone", [](const v1::Job& j) { return j.status() != v1::JOB_RECOVERING; });
  EXPECT_EQ(job.status(), v1::JOB_DEGRADED);
  EXPECT_THAT(job.error(), HasSubstr("it cannot shrink: node 'r1''s state was copied only on "
                                     "node 'r2' (redundancy replica), lost too: the survivors "
                                     "cannot re-cut"));
  EXPECT_EQ(client_->GetJob("gone/shrink-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Figure(kShrinks), 0);
}

TEST_F(PlannerShrinkTest, CreateJobRefusesAnUnknownOnNodeLossAndShrinkWithoutADeadline) {
  for (const char* bad : {"Shrink", "grow", "degrade", "shrink "}) {
    auto job = client_->CreateJob(Request("j", 2, 2, bad, kDeadlineMs));
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(job.status().message(),
              std::string("options.on_node_loss: '") + bad +
                  "' is not one of '' or 'fail' (the job turns DEGRADED) and 'shrink'");
  }
  auto no_deadline = client_->CreateJob(Request("j", 2, 2, "shrink", 0));
  EXPECT_EQ(no_deadline.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_deadline.status().message(),
              HasSubstr("options.on_node_loss: 'shrink' needs options.recovery_deadline_ms > 0"));
  EXPECT_TRUE(client_->CreateJob(Request("empty", 2, 2, "", 0)).ok());
  EXPECT_TRUE(client_->CreateJob(Request("fail", 2, 2, "fail", 0)).ok());
  auto shrink = client_->CreateJob(Request("shrink", 2, 2, "shrink", kDeadlineMs));
  ASSERT_TRUE(shrink.ok()) << shrink.status();
  EXPECT_EQ(shrink->options().on_node_loss(), "shrink");
}

TEST_F(PlannerShrinkTest, WithoutShrinkALostNodeDegradesTheJobAsBefore) {
  RestartLosingNodes();
  CreateReady("plain", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "");
  CreateReady("fail", 2, 2, {"node-0", "node-0", "node-1", "node-1"}, "fail");
  RegisterNode("node-1");
  for (const std::string& id : std::vector<std::string>{"plain", "fail"}) {
    const v1::Job recovering = AwaitJob(id, [](const v1::Job& j) {
      return j.status() == v1::JOB_RECOVERING && j.recovery().lost_node_id() == "node-1";
    });
    EXPECT_THAT(recovering.error(), Not(HasSubstr("shrink")));
    ASSERT_TRUE(Recovered(id, "node-0", 1).ok());
  }
  for (const std::string& id : std::vector<std::string>{"plain", "fail"}) {
    const v1::Job job = AwaitStatus(id, v1::JOB_DEGRADED);
    EXPECT_THAT(
        job.error(),
        HasSubstr("node 'node-1' was lost and no replacement daemon rebuilt it within 2 s"));
    EXPECT_THAT(job.error(), Not(HasSubstr("shrink")));
    EXPECT_EQ(job.successor_job_id(), "");
    EXPECT_EQ(client_->GetJob(id + "/shrink-1").status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(Figure(kShrinks), 0);
}

TEST_F(PlannerShrinkTest, APlannerStoppedBeforeTheSuccessorWasStoredCreatesItWhenItStarts) {
  // What a planner killed between the shrunk job's row and its successor's leaves.
  server_.reset();
  {
    auto store = planner::Store::Open(dir_.path());
    ASSERT_TRUE(store.ok()) << store.status();
    v1::Job job;
    job.set_job_id("cut");
    job.mutable_mesh()->set_shard_size(2);
    job.mutable_mesh()->set_replicate_size(3);
    job.set_world_size(6);
    job.mutable_options()->set_policy("ragged");
    job.mutable_options()->set_align_bytes(16);
    job.mutable_options()->set_registration_timeout_ms(30'000);
    job.mutable_options()->set_recovery_deadline_ms(kDeadlineMs);
    job.mutable_options()->set_on_node_loss("shrink");
    job.mutable_options()->set_redundancy("hsdp");
    job.set_data_secret("0123456789abcdef0123456789abcdef");
    job.set_status(v1::JOB_SHRUNK);
    job.set_recovery_epoch(1);
    job.set_successor_job_id("cut/shrink-1");
    for (int64_t r : {2, 3, 4, 5}) job.add_survivor_ranks(r);
    job.set_shrinks(2);
    ASSERT_TRUE((*store)->PutJob(job).ok());
  }
  Start();
  auto next = client_->GetJob("cut/shrink-1");
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->status(), v1::JOB_REGISTERING);
  EXPECT_EQ(next->world_size(), 4);
  EXPECT_EQ(next->mesh().shard_size(), 2);
  EXPECT_EQ(next->mesh().replicate_size(), 2);
  EXPECT_EQ(next->predecessor_job_id(), "cut");
  EXPECT_EQ(next->shrinks(), 3);
  EXPECT_EQ(next->options().redundancy(), "");
  EXPECT_EQ(next->options().on_node_loss(), "shrink");
  // Created once: the next start finds it.
  server_.reset();
  Start();
  EXPECT_EQ(client_->GetJob("cut/shrink-1")->created_unix_ms(), next->created_unix_ms());
}

}  // namespace
}  // namespace ragshard

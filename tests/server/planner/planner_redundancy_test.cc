// Node-loss redundancy, the planner's side (issue 55): JobOptions.redundancy is checked at
// CreateJob and against the nodes the ranks register from; a lost node of a job with redundancy
// starts (or is named in) a recovery instead of degrading the job, a replacement daemon with the
// node's id re-registers and reports it rebuilt, and the job counts the rebuild; a second node
// lost during the rebuild, or the deadline, end it DEGRADED, named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
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

class PlannerRedundancyTest : public testing::PlannerFixture {
 protected:
  // A fresh planner (nothing created yet) whose silent nodes are LOST after 300 ms, with its
  // metrics endpoint.
  void RestartLosingNodes() {
    node_timeout_ = 300ms;
    RestartWithMetrics();
  }

  static v1::CreateJobRequest Request(const std::string& id, int64_t world,
                                      const std::string& redundancy, int64_t deadline_ms) {
    v1::CreateJobRequest req;
    req.set_job_id(id);
    req.mutable_mesh()->set_shard_size(world);
    req.mutable_mesh()->set_replicate_size(1);
    req.mutable_options()->set_redundancy(redundancy);
    req.mutable_options()->set_recovery_deadline_ms(deadline_ms);
    return req;
  }

  // Job `id` with rank r on nodes[r], planned and READY.
  void CreateReady(const std::string& id, const std::vector<std::string>& nodes,
                   const std::string& redundancy, int64_t deadline_ms = 60'000) {
    auto job = client_->CreateJob(
        Request(id, static_cast<int64_t>(nodes.size()), redundancy, deadline_ms));
    ASSERT_TRUE(job.ok()) << job.status();
    for (size_t r = 0; r < nodes.size(); ++r) {
      ASSERT_TRUE(RegisterFull(id, static_cast<int64_t>(r), SmallInventory(), nodes[r]).ok());
    }
    auto plan = client_->WaitForPlan(id, 30s);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(client_->GetJob(id)->status(), v1::JOB_READY);
  }

  void RegisterNode(const std::string& node, const std::string& address = "127.0.0.1:9") {
    v1::RegisterNodeRequest req;
    req.set_node_id(node);
    req.set_data_address(address);
    ASSERT_TRUE(client_->RegisterNode(req).ok());
  }

  absl::StatusOr<v1::ReportRecoveredResponse> Recovered(const std::string& id,
                                                        const std::string& node, int64_t epoch,
                                                        bool replacement = false,
                                                        int64_t rebuilt_bytes = 0) {
    v1::ReportRecoveredRequest req;
    req.set_job_id(id);
    req.set_node_id(node);
    req.set_epoch(epoch);
    req.set_replacement(replacement);
    req.set_rebuilt_bytes(rebuilt_bytes);
    return client_->ReportRecovered(req);
  }

  absl::StatusOr<v1::ReportFailureResponse> Report(const std::string& id,
                                                   const std::string& reporter,
                                                   const std::string& message, int64_t epoch = 0) {
    v1::ReportFailureRequest req;
    req.set_job_id(id);
    req.set_reporter_node_id(reporter);
    req.set_lost_peer("127.0.0.1:9");
    req.set_message(message);
    req.set_recoverable(true);
    req.set_epoch(epoch);
    return client_->ReportFailure(req);
  }

  // The job once `done` holds for it: the planner's answer to what the test waits for. The
  // bound is for a hang, not a delay.
  v1::Job AwaitJob(const std::string& id, const std::function<bool(const v1::Job&)>& done) {
    const auto give_up = std::chrono::steady_clock::now() + 30s;
    auto job = client_->GetJob(id);
    while (job.ok() && !done(*job) && std::chrono::steady_clock::now() < give_up) {
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

  static std::vector<std::string> Ids(const v1::JobRecovery& r) {
    return {r.recovered_node_ids().begin(), r.recovered_node_ids().end()};
  }
};

TEST_F(PlannerRedundancyTest, CreateJobRefusesARedundancyItCannotKeep) {
  for (const char* bad : {"raid5", "parity", "parity:", "parity:0", "parity:17", "parity:-1",
                          "parity:+2", "parity: 2", "parity:2x", "Replica", "none "}) {
    auto job = client_->CreateJob(Request("j", 8, bad, 60'000));
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(job.status().message(),
                HasSubstr(std::string("options.redundancy: '") + bad + "' is not a redundancy"));
    EXPECT_THAT(job.status().message(),
                HasSubstr("none, replica, hsdp or parity:K (K in [1, 16])"));
  }
  auto no_deadline = client_->CreateJob(Request("j", 8, "parity:2", 0));
  EXPECT_EQ(no_deadline.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_deadline.status().message(),
              HasSubstr("'parity:2' needs options.recovery_deadline_ms > 0"));
  auto few = client_->CreateJob(Request("j", 2, "parity:2", 60'000));
  EXPECT_EQ(few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(few.status().message(),
              HasSubstr("'parity:2' needs at least K + 1 = 3 nodes (K = 2), but the job's world "
                        "size is 2"));
  auto alone = client_->CreateJob(Request("j", 1, "replica", 60'000));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(alone.status().message(),
              HasSubstr("'replica' needs at least 2 nodes, but the job's world size is 1"));

  EXPECT_TRUE(client_->CreateJob(Request("none", 1, "none", 0)).ok());
  EXPECT_TRUE(client_->CreateJob(Request("empty", 1, "", 0)).ok());
  auto parity = client_->CreateJob(Request("parity", 3, "parity:2", 60'000));
  ASSERT_TRUE(parity.ok()) << parity.status();
  EXPECT_EQ(parity->options().redundancy(), "parity:2");
  EXPECT_TRUE(client_->CreateJob(Request("replica", 2, "replica", 60'000)).ok());
  EXPECT_TRUE(client_->CreateJob(Request("wide", 17, "parity:16", 60'000)).ok());
}

TEST_F(PlannerRedundancyTest, TheRegisteredNodesMustFitTheRedundancy) {
  // parity:1 on 3 nodes: not a multiple of 2. The registration that completes the job fails it.
  ASSERT_TRUE(client_->CreateJob(Request("odd", 3, "parity:1", 60'000)).ok());
  ASSERT_TRUE(RegisterFull("odd", 0, SmallInventory(), "n0").ok());
  ASSERT_TRUE(RegisterFull("odd", 1, SmallInventory(), "n1").ok());
  auto last = RegisterFull("odd", 2, SmallInventory(), "n2");
  EXPECT_EQ(last.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string why =
      "job 'odd': redundancy parity:1 needs a multiple of K + 1 = 2 nodes (groups of 2), but "
      "the job's ranks are on 3 nodes";
  EXPECT_EQ(last.status().message(), why);
  auto odd = client_->GetJob("odd");
  EXPECT_EQ(odd->status(), v1::JOB_FAILED);
  EXPECT_EQ(odd->error(), why);
  EXPECT_EQ(odd->plan_version(), 0);

  // replica with both ranks on one node.
  ASSERT_TRUE(client_->CreateJob(Request("one", 2, "replica", 60'000)).ok());
  ASSERT_TRUE(RegisterFull("one", 0, SmallInventory(), "n0").ok());
  auto one = RegisterFull("one", 1, SmallInventory(), "n0");
  EXPECT_EQ(one.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(one.status().message(),
              HasSubstr("redundancy replica needs at least 2 nodes (each node's state copied on "
                        "another), but the job's ranks are on 1 node"));
  EXPECT_EQ(client_->GetJob("one")->status(), v1::JOB_FAILED);

  // parity:1 on 2 nodes of 2 ranks each plans.
  CreateReady("fits", {"n0", "n0", "n1", "n1"}, "parity:1");
}

TEST_F(PlannerRedundancyTest, HsdpIsTheDefaultWhereItsReplicasAreOnOtherNodes) {
  // hsdp needs replicas; given without them, CreateJob refuses it.
  auto flat = client_->CreateJob(Request("flat", 4, "hsdp", 60'000));
  EXPECT_EQ(flat.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(flat.status().message(), HasSubstr("job has mesh.replicate_size 1"));
  auto hsdp = [&](const std::string& id, const std::string& redundancy,
                  const std::vector<std::string>& nodes) {
    v1::CreateJobRequest req = Request(id, 2, redundancy, 60'000);
    req.mutable_mesh()->set_replicate_size(2);
    EXPECT_TRUE(client_->CreateJob(req).ok()) << id;
    absl::Status last;
    for (size_t r = 0; r < nodes.size(); ++r) {
      last = RegisterFull(id, static_cast<int64_t>(r), SmallInventory(), nodes[r]).status();
    }
    return last;
  };
  // Shard groups of 2 ranks, one per node: the default is hsdp, kept with the job.
  ASSERT_TRUE(hsdp("two", "", {"n0", "n0", "n1", "n1"}).ok());
  ASSERT_TRUE(client_->WaitForPlan("two", 30s).ok());
  EXPECT_EQ(client_->GetJob("two")->options().redundancy(), "hsdp");
  // Both replica groups on one node: no default (it would not cover a lost node) ...
  ASSERT_TRUE(hsdp("together", "", {"n0", "n0", "n0", "n0"}).ok());
  ASSERT_TRUE(client_->WaitForPlan("together", 30s).ok());
  EXPECT_EQ(client_->GetJob("together")->options().redundancy(), "");
  // ... and, asked for, it fails the job naming a rank without a replica elsewhere.
  auto asked = hsdp("asked", "hsdp", {"n0", "n0", "n1", "n0"});
  EXPECT_EQ(asked.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(asked.message(), HasSubstr("has no HSDP replica on another node"));
  EXPECT_EQ(client_->GetJob("asked")->status(), v1::JOB_FAILED);
  // "none" keeps it off.
  ASSERT_TRUE(hsdp("off", "none", {"n0", "n0", "n1", "n1"}).ok());
  ASSERT_TRUE(client_->WaitForPlan("off", 30s).ok());
  EXPECT_EQ(client_->GetJob("off")->options().redundancy(), "none");
}

TEST_F(PlannerRedundancyTest, ALostNodeIsRebuiltOnAReplacementAndCounted) {
  RestartLosingNodes();
  const std::string rebuilds = "ragshard_planner_rebuilds_total";
  const std::string rebuilt_bytes = "ragshard_planner_rebuilt_bytes_total";
  const std::string recovered = "ragshard_planner_recoveries_total{outcome=\"recovered\"}";
  EXPECT_EQ(Figure(rebuilds), 0);
  EXPECT_EQ(Figure(rebuilt_bytes), 0);
  CreateReady("j", {"n0", "n1"}, "parity:1");
  // Beside it, a job that recovers lost ranks but has no redundancy: a lost node degrades it.
  CreateReady("plain", {"n0", "n1"}, "");
  // Only n1 heartbeats (and then stops); n0 never registered as a node, so it is never lost.
  RegisterNode("n1");
  const v1::Job lost = AwaitJob("j", [](const v1::Job& j) { return j.status() != v1::JOB_READY; });
  EXPECT_EQ(lost.status(), v1::JOB_RECOVERING);
  EXPECT_EQ(lost.recovery_epoch(), 1);
  EXPECT_EQ(lost.recovery().lost_node_id(), "n1");
  EXPECT_EQ(lost.recovery().lost(), "node 'n1' lost (no heartbeat for 300 ms)");
  EXPECT_EQ(lost.recovery().reporter_node_id(), "");
  EXPECT_EQ(lost.recovery().deadline_unix_ms(), lost.recovery().started_unix_ms() + 60'000);
  EXPECT_THAT(lost.error(), HasSubstr("recovering in place (epoch 1) from node 'n1' lost"));
  EXPECT_THAT(lost.error(),
              HasSubstr("a replacement daemon with node id 'n1' rebuilds it within 60 s"));
  const v1::Job plain = AwaitStatus("plain", v1::JOB_DEGRADED);
  EXPECT_EQ(plain.error(), "node 'n1' lost (no heartbeat for 300 ms)");
  EXPECT_EQ(plain.recovery_epoch(), 0);

  // The recovery, and the node it rebuilds, survive a planner restart (this one loses no node).
  server_.reset();
  node_timeout_ = 60s;
  Start();
  auto stored = client_->GetJob("j");
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->status(), v1::JOB_RECOVERING);
  EXPECT_EQ(stored->recovery().lost_node_id(), "n1");

  // The replacement daemon: the same node id, another address. Its registration replaces the
  // lost one, its heartbeats work and name the node being rebuilt.
  RegisterNode("n1", "127.0.0.2:9");
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->size(), 1u);
  EXPECT_EQ((*nodes)[0].status(), v1::NODE_UP);
  EXPECT_EQ((*nodes)[0].data_address(), "127.0.0.2:9");
  v1::HeartbeatRequest hb;
  hb.set_node_id("n1");
  hb.add_jobs("j");
  auto beat = client_->Heartbeat(hb);
  ASSERT_TRUE(beat.ok()) << beat.status();
  ASSERT_EQ(beat->recovering_jobs_size(), 1);
  EXPECT_EQ(beat->recovering_jobs(0).lost_node_id(), "n1");
  // Its rank registers the same model again from the same node.
  auto again = RegisterHash("j", 1, InventorySha256(SmallInventory()), "n1");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->status(), v1::JOB_RECOVERING);

  ASSERT_EQ(Recovered("j", "n0", 1)->status(), v1::JOB_RECOVERING);
  auto rebuilt = Recovered("j", "n1", 1, /*replacement=*/true, 4096);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  EXPECT_EQ(rebuilt->status(), v1::JOB_READY);
  auto job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->error(), "");
  EXPECT_EQ(job->recoveries(), 1);
  EXPECT_EQ(job->rebuilds(), 1);
  EXPECT_EQ(job->rebuilt_bytes(), 4096);
  EXPECT_EQ(job->recovery().rebuilt_bytes(), 4096);
  EXPECT_EQ(job->recovery().lost_node_id(), "n1");
  EXPECT_THAT(Ids(job->recovery()), ElementsAre("n0", "n1"));
  EXPECT_EQ(Figure(rebuilds), 1);
  EXPECT_EQ(Figure(rebuilt_bytes), 4096);
  EXPECT_EQ(Figure(recovered), 1);
  EXPECT_EQ(Figure("ragshard_planner_recovery_seconds_count"), 1);
  // A repeat of the replacement's report answers READY and counts nothing again.
  EXPECT_EQ(Recovered("j", "n1", 1, true, 4096)->status(), v1::JOB_READY);
  EXPECT_EQ(client_->GetJob("j")->rebuilds(), 1);

  // The totals are kept across a restart.
  server_.reset();
  Start();
  job = client_->GetJob("j");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->rebuilds(), 1);
  EXPECT_EQ(job->rebuilt_bytes(), 4096);
  EXPECT_EQ(job->options().redundancy(), "parity:1");
}

TEST_F(PlannerRedundancyTest, ANodeLostDuringARecoveryIsNamedAndASecondOneDegrades) {
  RestartLosingNodes();
  const std::string node_lost = "ragshard_planner_recoveries_total{outcome=\"node_lost\"}";
  CreateReady("j", {"a", "b", "c", "d"}, "parity:1");
  // A survivor's report of its lost peer starts the recovery; which node is lost is known once
  // its heartbeats stop.
  constexpr char kPeer[] = "peer node 'c' (127.0.0.1:9) closed the connection";
  ASSERT_EQ(Report("j", "a", kPeer)->recovery_epoch(), 1);
  ASSERT_TRUE(Recovered("j", "c", 1).ok());  // c recovered, before it was lost
  EXPECT_EQ(client_->GetJob("j")->recovery().lost_node_id(), "");
  RegisterNode("c");
  const v1::Job named =
      AwaitJob("j", [](const v1::Job& j) { return !j.recovery().lost_node_id().empty(); });
  EXPECT_EQ(named.status(), v1::JOB_RECOVERING);
  EXPECT_EQ(named.recovery_epoch(), 1);
  EXPECT_EQ(named.recovery().lost_node_id(), "c");
  EXPECT_THAT(named.recovery().lost(), HasSubstr(kPeer));
  // c counts again only once its replacement reports.
  EXPECT_THAT(Ids(named.recovery()), ElementsAre());
  EXPECT_THAT(named.error(), HasSubstr("node 'c' lost (no heartbeat for 300 ms)"));
  EXPECT_THAT(named.error(), HasSubstr("a replacement daemon with node id 'c' rebuilds it"));

  RegisterNode("d");
  const v1::Job job = AwaitStatus("j", v1::JOB_DEGRADED);
  EXPECT_THAT(job.error(), HasSubstr("a second node 'd' lost during the rebuild of node 'c' "
                                     "(recovery epoch 1, from "));
  EXPECT_THAT(job.error(), HasSubstr("node 'd' lost (no heartbeat for 300 ms)"));
  EXPECT_THAT(job.error(), HasSubstr("rebuilds one lost node at a time"));
  EXPECT_EQ(Figure(node_lost), 1);
  auto late = Recovered("j", "c", 1, true, 10);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(late.status().message(), HasSubstr("JOB_DEGRADED"));
}

TEST_F(PlannerRedundancyTest, TheDeadlineNamesTheNodeNoReplacementRebuilt) {
  RestartLosingNodes();
  CreateReady("j", {"n0", "n1"}, "replica", /*deadline_ms=*/200);
  RegisterNode("n1");
  const v1::Job job = AwaitStatus("j", v1::JOB_DEGRADED);
  EXPECT_EQ(job.recovery_epoch(), 1);  // it recovered first, then missed the deadline
  EXPECT_EQ(job.recovery().lost_node_id(), "n1");
  EXPECT_THAT(job.error(), HasSubstr("the recovery of epoch 1 (from node 'n1' lost (no heartbeat "
                                     "for 300 ms)) missed its deadline: "));
  EXPECT_THAT(job.error(),
              HasSubstr("node 'n1' was lost and no replacement daemon rebuilt it within 0.2 s"));
  // n0 may or may not have been named too; never as the lost one.
  EXPECT_THAT(job.error(), Not(HasSubstr("node 'n0' was lost")));
  EXPECT_EQ(Figure("ragshard_planner_recoveries_total{outcome=\"deadline\"}"), 1);
}

TEST_F(PlannerRedundancyTest, AReplacementNamesTheNodeItRebuiltOrIsRefused) {
  // A replacement that came up before the node's heartbeats were missed: its report names it.
  CreateReady("j", {"n0", "n1"}, "replica");
  ASSERT_EQ(Report("j", "n0", "peer node 'n1' closed the connection")->recovery_epoch(), 1);
  ASSERT_EQ(Recovered("j", "n1", 1, true, 100)->status(), v1::JOB_RECOVERING);
  EXPECT_EQ(client_->GetJob("j")->recovery().lost_node_id(), "n1");
  EXPECT_EQ(client_->GetJob("j")->recovery().rebuilt_bytes(), 100);
  ASSERT_EQ(Recovered("j", "n0", 1)->status(), v1::JOB_READY);
  EXPECT_EQ(client_->GetJob("j")->rebuilds(), 1);
  EXPECT_EQ(client_->GetJob("j")->rebuilt_bytes(), 100);

  // A replacement for a second node during a rebuild.
  ASSERT_EQ(Report("j", "n1", "peer node 'n0' closed the connection", 1)->recovery_epoch(), 2);
  ASSERT_TRUE(Recovered("j", "n0", 2, true, 100).ok());
  auto second = Recovered("j", "n1", 2, true, 100);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(),
              HasSubstr("a second node 'n1' lost during the rebuild of node 'n0'"));
  EXPECT_EQ(client_->GetJob("j")->status(), v1::JOB_DEGRADED);
  EXPECT_EQ(client_->GetJob("j")->rebuilds(), 1);

  // A replacement in a job without redundancy cannot rebuild anything.
  CreateReady("plain", {"n0", "n1"}, "");
  ASSERT_EQ(Report("plain", "n0", "peer node 'n1' closed the connection")->recovery_epoch(), 1);
  auto plain = Recovered("plain", "n1", 1, true, 0);
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(plain.status().message(),
              HasSubstr("but job 'plain' has no redundancy to rebuild its state from"));
  EXPECT_EQ(client_->GetJob("plain")->status(), v1::JOB_DEGRADED);

  // The bytes: never negative, and only from a replacement.
  CreateReady("k", {"n0", "n1"}, "replica");
  ASSERT_EQ(Report("k", "n0", "peer node 'n1' closed the connection")->recovery_epoch(), 1);
  auto negative = Recovered("k", "n1", 1, true, -1);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("rebuilt_bytes: must not be negative"));
  auto kept = Recovered("k", "n1", 1, false, 5);
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(kept.status().message(), HasSubstr("must be 0 from a node that kept its state"));
  EXPECT_EQ(client_->GetJob("k")->status(), v1::JOB_RECOVERING);
  // Nodes that kept their state: a recovery of lost ranks, no rebuild.
  ASSERT_TRUE(Recovered("k", "n1", 1).ok());
  ASSERT_EQ(Recovered("k", "n0", 1)->status(), v1::JOB_READY);
  EXPECT_EQ(client_->GetJob("k")->rebuilds(), 0);
  EXPECT_EQ(client_->GetJob("k")->recoveries(), 1);
}

TEST_F(PlannerRedundancyTest, ANodeRegisteredAgainWhileAliveIsReplacedWhole) {
  RegisterNode("n1", "127.0.0.1:9");
  v1::HeartbeatRequest hb;
  hb.set_node_id("n1");
  hb.mutable_figures()->set_buffers(7);
  ASSERT_TRUE(client_->Heartbeat(hb).ok());
  RegisterNode("n1", "127.0.0.3:9");
  auto nodes = client_->ListNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->size(), 1u);
  EXPECT_EQ((*nodes)[0].data_address(), "127.0.0.3:9");
  EXPECT_EQ((*nodes)[0].status(), v1::NODE_UP);
  EXPECT_EQ((*nodes)[0].figures().buffers(), 0);  // the old daemon's figures are gone
  hb.mutable_figures()->set_buffers(2);
  ASSERT_TRUE(client_->Heartbeat(hb).ok());
  EXPECT_EQ((*client_->ListNodes())[0].figures().buffers(), 2);
}

}  // namespace
}  // namespace ragshard

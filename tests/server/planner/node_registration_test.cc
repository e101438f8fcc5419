// A node's ranks registered in one call (RegisterNodeRanks), and plans sent and stored compact
// (zstd), through the planner's real gRPC server.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <future>

#include "absl/strings/str_cat.h"
#include "engine/plan_codec.h"
#include "infra/proto_text.h"
#include "ragshard/v1/planner.grpc.pb.h"
#include "server/planner/store.h"
#include "tests/server/planner/planner_fixture.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;
using NodeRegistrationTest = testing::PlannerFixture;
using namespace std::chrono_literals;

v1::RegisterNodeRanksRequest NodeRanks(const std::string& job, const std::string& node,
                                       const std::vector<int64_t>& ranks) {
  v1::RegisterNodeRanksRequest req;
  req.set_job_id(job);
  req.set_node_id(node);
  for (int64_t r : ranks) req.add_ranks(r);
  return req;
}

// The plans table's blob of a job, read with SQLite itself.
std::string StoredPlan(const std::string& dir, const std::string& job) {
  sqlite3* db = nullptr;
  std::string out;
  if (sqlite3_open_v2((dir + "/planner.db").c_str(), &db, SQLITE_OPEN_READONLY, nullptr) ==
      SQLITE_OK) {
    sqlite3_stmt* st = nullptr;
    sqlite3_prepare_v2(db, "SELECT plan FROM plans WHERE job_id = ? ORDER BY version DESC", -1, &st,
                       nullptr);
    sqlite3_bind_text(st, 1, job.c_str(), -1, SQLITE_TRANSIENT);
    if (sqlite3_step(st) == SQLITE_ROW) {
      out.assign(static_cast<const char*>(sqlite3_column_blob(st, 0)),
                 static_cast<size_t>(sqlite3_column_bytes(st, 0)));
    }
    sqlite3_finalize(st);
  }
  sqlite3_close(db);
  return out;
}

TEST_F(NodeRegistrationTest, ANodeRegistersItsRanksInOneCallAndTheJobPlans) {
  Create("j", 8);
  const Inventory inv = SmallInventory();
  const std::string sha = InventorySha256(inv);
  // A node of hashes waits for the reference inventory, which another node brings.
  auto parked = std::async(std::launch::async, [&] {
    auto req = NodeRanks("j", "n1", {7, 5, 6, 4});
    req.set_inventory_sha256(sha);
    return client_->RegisterNodeRanks(req);
  });
  auto req = NodeRanks("j", "n0", {0, 1, 2, 3});
  *req.mutable_inventory() = inv;
  auto first = client_->RegisterNodeRanks(req);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = parked.get();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->registered_ranks(), 8);
  auto plan = client_->WaitForPlan("j", 30s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->world_size(), 8);
  auto ranks = client_->ListRanks("j");
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  for (int64_t r = 0; r < 8; ++r) {
    EXPECT_TRUE((*ranks)[r].registered());
    EXPECT_EQ((*ranks)[r].node_id(), r < 4 ? "n0" : "n1");
  }
  // The same registration again (a restarted daemon) is accepted; another inventory is not.
  auto again = NodeRanks("j", "n1", {4, 5, 6, 7});
  again.set_inventory_sha256(sha);
  EXPECT_TRUE(client_->RegisterNodeRanks(again).ok());
  again.set_inventory_sha256(std::string(32, 'x'));
  EXPECT_THAT(client_->RegisterNodeRanks(again).status().message(),
              HasSubstr("registration is closed"));

  // Durable: the ranks' rows came back from the store.
  server_.reset();
  Start();
  auto job = client_->GetJob("j");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->registered_ranks(), 8);
}

TEST_F(NodeRegistrationTest, BadNodeRegistrationsNameWhatIsWrong) {
  Create("j", 4);
  const std::string sha = InventorySha256(SmallInventory());
  auto expect_error = [&](const v1::RegisterNodeRanksRequest& req, const std::string& what) {
    auto got = client_->RegisterNodeRanks(req);
    EXPECT_FALSE(got.ok()) << what;
    EXPECT_THAT(got.status().message(), HasSubstr(what));
  };
  auto req = NodeRanks("j", "n0", {});
  req.set_inventory_sha256(sha);
  expect_error(req, "ranks");
  req = NodeRanks("j", "n0", {1, 2, 1});
  req.set_inventory_sha256(sha);
  expect_error(req, "rank 1 is named twice");
  req = NodeRanks("j", "n0", {-1});
  req.set_inventory_sha256(sha);
  expect_error(req, "ranks");
  req = NodeRanks("j", "n0", {0, 4});
  req.set_inventory_sha256(sha);
  expect_error(req, "outside [0, 4)");
  req = NodeRanks("j", "", {0});
  req.set_inventory_sha256(sha);
  expect_error(req, "node_id");
  req = NodeRanks("j", "n0", {0});
  expect_error(req, "inventory_or_hash");
  req.set_inventory_sha256("short");
  expect_error(req, "inventory_sha256");
  req = NodeRanks("nope", "n0", {0});
  req.set_inventory_sha256(sha);
  expect_error(req, "nope");
  // Nothing was registered by the refused calls.
  EXPECT_EQ(client_->GetJob("j")->registered_ranks(), 0);
}

TEST_F(NodeRegistrationTest, ADaemonLearnsTheJobsNodesAndAllAddressesInOneCallEach) {
  RestartWithMetrics();
  Create("j", 6);
  const Inventory inv = SmallInventory();
  auto req = NodeRanks("j", "n0", {0, 1, 4});
  *req.mutable_inventory() = inv;
  ASSERT_TRUE(client_->RegisterNodeRanks(req).ok());
  req = NodeRanks("j", "n1", {2, 3, 5});
  req.set_inventory_sha256(InventorySha256(inv));
  ASSERT_TRUE(client_->RegisterNodeRanks(req).ok());
  auto nodes = client_->ListJobNodes("j");
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  EXPECT_THAT(nodes->node_ids(), ::testing::ElementsAre("n0", "n1"));
  EXPECT_THAT(nodes->run_node(), ::testing::ElementsAre(0, 1, 0, 1));
  EXPECT_THAT(nodes->run_first(), ::testing::ElementsAre(0, 2, 4, 5));
  EXPECT_THAT(nodes->run_count(), ::testing::ElementsAre(2, 2, 1, 1));

  // Every address in one call, which waits until all are published.
  auto both = std::async(std::launch::async, [&] {
    return client_->GetKeys("j", {"data/n1", "data/n0"}, 30s);
  });
  ASSERT_TRUE(AwaitFigure(kParkedGets, 1));  // the planner holds the call before any Put
  ASSERT_TRUE(client_->Put("j", "data/n0", "10.0.0.1:7000").ok());
  // n1 has not published: the call is still parked (a Put takes the gets it answers off the
  // planner's list before it returns).
  EXPECT_EQ(Figure(kParkedGets), 1);
  EXPECT_EQ(both.wait_for(0ms), std::future_status::timeout);
  ASSERT_TRUE(client_->Put("j", "data/n1", "10.0.0.2:7000").ok());
  auto got = both.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(*got, ::testing::ElementsAre("10.0.0.2:7000", "10.0.0.1:7000"));

  // What is missing is named: at once without a wait, after it with one.
  auto none = client_->GetKeys("j", {"data/n0", "data/n2", "data/n3"}, 0ms);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("'data/n2'"));
  EXPECT_THAT(none.status().message(), HasSubstr("nor 1 more"));
  auto late = client_->GetKeys("j", {"data/n2"}, 50ms);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(late.status().message(), HasSubstr("'data/n2'"));
  EXPECT_THAT(client_->GetKeys("j", {}, 0ms).status().message(), HasSubstr("keys"));
  EXPECT_THAT(client_->GetKeys("j", {"data/n0"}, -5ms).status().message(), HasSubstr("wait_ms"));
}

// Many calls parked on overlapping keys: each Put answers exactly the calls it completes, a call
// that expires leaves the others waiting on its keys, and each answer holds its keys' values in
// its order.
TEST_F(NodeRegistrationTest, ParkedGetKeysAreAnsweredByThePutsThatCompleteThem) {
  RestartWithMetrics();
  Create("j", 6);
  constexpr int kCalls = 6;
  std::vector<std::future<absl::StatusOr<std::vector<std::string>>>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::async(std::launch::async, [this, i] {
      return client_->GetKeys(
          "j", {absl::StrCat("k", i), "shared", absl::StrCat("k", (i + 1) % kCalls)}, 60s);
    }));
  }
  auto short_wait = std::async(std::launch::async, [this] {
    return client_->GetKeys("j", {"shared", "k0"}, 200ms);
  });
  ASSERT_TRUE(AwaitFigure(kParkedGets, kCalls + 1));
  EXPECT_EQ(short_wait.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  for (int i = kCalls - 1; i >= 0; --i) {
    ASSERT_TRUE(client_->Put("j", absl::StrCat("k", i), absl::StrCat("v", i)).ok());
  }
  // Every call still misses "shared".
  EXPECT_EQ(Figure(kParkedGets), kCalls);
  for (auto& c : calls) EXPECT_EQ(c.wait_for(0ms), std::future_status::timeout);
  ASSERT_TRUE(client_->Put("j", "shared", "s").ok());
  for (int i = 0; i < kCalls; ++i) {
    auto got = calls[static_cast<size_t>(i)].get();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_THAT(*got, ::testing::ElementsAre(absl::StrCat("v", i), "s",
                                             absl::StrCat("v", (i + 1) % kCalls)));
  }
  EXPECT_EQ(Figure(kParkedGets), 0);
}

// Job "j": one node of 2 ranks registered in one call, planned; its plan as the client library
// gets it (asking for zstd and decoding it).
absl::StatusOr<v1::Plan> PlanOneNode(testing::PlannerFixture& f) {
  f.Create("j", 2);
  auto req = NodeRanks("j", "n0", {0, 1});
  *req.mutable_inventory() = testing::PlannerFixture::SmallInventory();
  auto job = f.client_->RegisterNodeRanks(req);
  if (!job.ok()) return job.status();
  return f.client_->WaitForPlan("j", 30s);
}

TEST_F(NodeRegistrationTest, PlansTravelAndRestCompactAndDecodeToTheSamePlan) {
  auto plan = PlanOneNode(*this);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto stored = client_->GetPlan("j");
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(DeterministicBytes(*plan), DeterministicBytes(*stored));

  // On the wire: plan_zstd when asked for, the plain plan otherwise.
  auto channel = grpc::CreateChannel(server_->bound_address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Planner::NewStub(channel);
  for (bool zstd : {true, false}) {
    grpc::ClientContext ctx;
    v1::WatchPlanRequest w;
    w.set_job_id("j");
    w.set_accept_zstd(zstd);
    auto reader = stub->WatchPlan(&ctx, w);
    v1::WatchPlanEvent ev;
    ASSERT_TRUE(reader->Read(&ev));
    ctx.TryCancel();
    (void)reader->Finish();
    EXPECT_EQ(ev.status(), v1::JOB_READY);
    EXPECT_EQ(ev.has_plan(), !zstd);
    EXPECT_EQ(ev.plan_zstd().empty(), !zstd);
    if (zstd) {
      EXPECT_TRUE(IsZstdFrame(ev.plan_zstd()));
      auto decoded = DecodePlan(ev.plan_zstd(), "event");
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_EQ(DeterministicBytes(*decoded), DeterministicBytes(*stored));
    } else {
      EXPECT_EQ(DeterministicBytes(ev.plan()), DeterministicBytes(*stored));
    }
  }

  // In the store: one zstd frame of the plan.
  server_.reset();
  const std::string blob = StoredPlan(dir_.path(), "j");
  ASSERT_TRUE(IsZstdFrame(blob));
  EXPECT_EQ(DeterministicBytes(*DecodePlan(blob, "blob")), DeterministicBytes(*stored));
  Start();
  auto reloaded = client_->GetPlan("j");
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(DeterministicBytes(*reloaded), DeterministicBytes(*stored));
}

TEST_F(NodeRegistrationTest, APlainPlanFromAnOlderStoreStillLoads) {
  auto plan = PlanOneNode(*this);
  ASSERT_TRUE(plan.ok()) << plan.status();
  server_.reset();
  {
    // What a planner before compact plans stored: the plain serialization.
    auto store = planner::Store::Open(dir_.path());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->PutPlan("j", plan->version(), DeterministicBytes(*plan)).ok());
  }
  ASSERT_FALSE(IsZstdFrame(StoredPlan(dir_.path(), "j")));
  Start();
  auto reloaded = client_->WaitForPlan("j", 30s);
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(DeterministicBytes(*reloaded), DeterministicBytes(*plan));
}

}  // namespace
}  // namespace ragshard

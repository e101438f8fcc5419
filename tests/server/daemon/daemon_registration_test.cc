// NodeRegistrations: a node's ranks held until the node's call, one call per node (per distinct
// inventory), rank 0's inventory in full and the others' hash, deadlines, restarted ranks, and
// the requests it refuses.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/inventory.h"
#include "server/daemon/node_registration.h"

namespace ragshard::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::Inventory Model(int64_t rows) {
  v1::Inventory inv;
  auto* u = inv.add_units();
  u->set_name("layer");
  auto* t = u->add_tensors();
  t->set_name("layer.w");
  t->add_shape(rows);
  t->add_shape(64);
  t->set_dtype(v1::DTYPE_FP32);
  return inv;
}

v1::RegisterRequest Rank(int64_t rank, int64_t local_ranks, const v1::Inventory& inv,
                         bool full = true, const std::string& job = "j") {
  v1::RegisterRequest r;
  r.set_job_id(job);
  r.set_rank(rank);
  r.set_node_id("node-1");
  r.set_local_ranks(local_ranks);
  if (full) {
    *r.mutable_inventory() = inv;
  } else {
    r.set_inventory_sha256(InventorySha256(inv));
  }
  return r;
}

// Counts the answers a batch's waiters get.
struct Answers {
  int ok = 0;
  std::vector<std::string> errors;
  RegistrationDone Done() {
    return [this](const absl::StatusOr<v1::Job>& job) {
      if (job.ok()) {
        ++ok;
      } else {
        errors.emplace_back(job.status().message());
      }
    };
  }
};

std::vector<int64_t> Ranks(const NodeRegistrationBatch& b) {
  return {b.request.ranks().begin(), b.request.ranks().end()};
}

TEST(NodeRegistrations, HoldsTheNodesRanksAndSendsOneCall) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  const absl::Time later = absl::Now() + absl::Hours(1);
  for (int64_t rank : {3, 2, 1}) {
    auto batches = node.Add(Rank(rank, 4, inv), later, a.Done());
    ASSERT_TRUE(batches.ok()) << batches.status();
    EXPECT_TRUE(batches->empty()) << "rank " << rank << " sent before the node's 4 ranks asked";
  }
  EXPECT_EQ(node.held(), 3);
  auto batches = node.Add(Rank(0, 4, inv), later, a.Done());
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 1u);
  const auto& b = (*batches)[0];
  EXPECT_EQ(b.request.job_id(), "j");
  EXPECT_EQ(b.request.node_id(), "node-1");
  EXPECT_THAT(Ranks(b), ElementsAre(0, 1, 2, 3));
  // Rank 0's inventory goes in full: the planner's reference.
  ASSERT_TRUE(b.request.has_inventory());
  EXPECT_EQ(InventorySha256(b.request.inventory()), InventorySha256(inv));
  EXPECT_EQ(b.waiters.size(), 4u);
  EXPECT_EQ(node.held(), 0);
  v1::Job job;
  job.set_job_id("j");
  for (const auto& w : b.waiters) w(job);
  EXPECT_EQ(a.ok, 4);
}

TEST(NodeRegistrations, ANodeWithoutRankZeroSendsTheHashOnly) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  ASSERT_TRUE(node.Add(Rank(4, 2, inv), absl::InfiniteFuture(), a.Done())->empty());
  auto batches = node.Add(Rank(5, 2, inv, /*full=*/false), absl::InfiniteFuture(), a.Done());
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_FALSE((*batches)[0].request.has_inventory());
  EXPECT_EQ((*batches)[0].request.inventory_sha256(), InventorySha256(inv));
  EXPECT_THAT(Ranks((*batches)[0]), ElementsAre(4, 5));
}

TEST(NodeRegistrations, RanksThatDisagreeGoInSeparateCalls) {
  NodeRegistrations node("node-1");
  Answers a;
  ASSERT_TRUE(node.Add(Rank(0, 3, Model(128)), absl::InfiniteFuture(), a.Done())->empty());
  ASSERT_TRUE(node.Add(Rank(1, 3, Model(256)), absl::InfiniteFuture(), a.Done())->empty());
  auto batches = node.Add(Rank(2, 3, Model(128)), absl::InfiniteFuture(), a.Done());
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 2u);  // one per inventory: the planner names the ranks that differ
  std::vector<std::vector<int64_t>> calls;
  for (const auto& b : *batches) calls.push_back(Ranks(b));
  EXPECT_THAT(calls, ::testing::UnorderedElementsAre(ElementsAre(0, 2), ElementsAre(1)));
}

TEST(NodeRegistrations, UnknownLocalRanksAreSentAlone) {
  NodeRegistrations node("node-1");
  Answers a;
  auto batches = node.Add(Rank(7, 0, Model(128), false), absl::InfiniteFuture(), a.Done());
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_THAT(Ranks((*batches)[0]), ElementsAre(7));
}

TEST(NodeRegistrations, TheDeadlineSendsTheRanksThatCameAndALateRankGoesAtOnce) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(node.Add(Rank(2, 3, inv, false), t0 + absl::Seconds(10), a.Done())->empty());
  ASSERT_TRUE(node.Add(Rank(1, 3, inv, false), t0 + absl::Seconds(5), a.Done())->empty());
  EXPECT_TRUE(node.Expire(t0 + absl::Seconds(4)).empty());
  auto expired = node.Expire(t0 + absl::Seconds(5));  // the first held rank's deadline
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_THAT(Ranks(expired[0]), ElementsAre(1, 2));
  EXPECT_TRUE(node.Expire(t0 + absl::Seconds(60)).empty());
  // The node's third rank, late: the other two were sent, so it goes at once.
  auto late = node.Add(Rank(0, 3, inv), absl::InfiniteFuture(), a.Done());
  ASSERT_TRUE(late.ok());
  ASSERT_EQ(late->size(), 1u);
  EXPECT_THAT(Ranks((*late)[0]), ElementsAre(0));
  EXPECT_TRUE((*late)[0].request.has_inventory());
}

TEST(NodeRegistrations, ARestartedRankIsSentAtOnce) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  ASSERT_TRUE(node.Add(Rank(0, 2, inv), absl::InfiniteFuture(), a.Done())->empty());
  ASSERT_EQ(node.Add(Rank(1, 2, inv), absl::InfiniteFuture(), a.Done())->size(), 1u);
  auto again = node.Add(Rank(1, 2, inv), absl::InfiniteFuture(), a.Done());
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->size(), 1u);
  EXPECT_THAT(Ranks((*again)[0]), ElementsAre(1));
}

TEST(NodeRegistrations, ANewLayoutOfTheJobStartsAfresh) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  ASSERT_EQ(node.Add(Rank(0, 1, inv), absl::InfiniteFuture(), a.Done())->size(), 1u);
  // The job again (deleted and created anew) with two ranks on this node: rank 0 waits for 1.
  ASSERT_TRUE(node.Add(Rank(0, 2, inv), absl::InfiniteFuture(), a.Done())->empty());
  ASSERT_EQ(node.Add(Rank(1, 2, inv), absl::InfiniteFuture(), a.Done())->size(), 1u);
}

TEST(NodeRegistrations, JobsAreHeldApart) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  ASSERT_TRUE(node.Add(Rank(0, 2, inv, true, "a"), absl::InfiniteFuture(), a.Done())->empty());
  ASSERT_TRUE(node.Add(Rank(1, 2, inv, true, "b"), absl::InfiniteFuture(), a.Done())->empty());
  auto done = node.Add(Rank(1, 2, inv, true, "a"), absl::InfiniteFuture(), a.Done());
  ASSERT_EQ(done->size(), 1u);
  EXPECT_EQ((*done)[0].request.job_id(), "a");
  EXPECT_EQ(node.held(), 1);
}

TEST(NodeRegistrations, RefusesNamingWhatIsWrong) {
  NodeRegistrations node("node-1");
  Answers a;
  const auto inv = Model(128);
  auto refused = [&](v1::RegisterRequest r) {
    auto got = node.Add(r, absl::InfiniteFuture(), a.Done());
    EXPECT_FALSE(got.ok());
    return std::string(got.status().message());
  };
  auto r = Rank(0, 2, inv);
  r.set_node_id("node-9");
  EXPECT_THAT(refused(r), HasSubstr("its daemon is node 'node-1'"));
  r = Rank(0, 2, inv);
  r.set_job_id("bad job!");
  EXPECT_THAT(refused(r), HasSubstr("job_id"));
  EXPECT_THAT(refused(Rank(-1, 2, inv)), HasSubstr("rank: must not be negative"));
  EXPECT_THAT(refused(Rank(0, -1, inv)), HasSubstr("local_ranks"));
  EXPECT_THAT(refused(Rank(0, NodeRegistrations::kMaxLocalRanks + 1, inv)),
              HasSubstr("local_ranks"));
  r = Rank(0, 2, inv, false);
  r.set_inventory_sha256("short");
  EXPECT_THAT(refused(r), HasSubstr("inventory_sha256: must be 32 bytes"));
  r = Rank(0, 2, inv);
  r.clear_inventory();
  EXPECT_THAT(refused(r), HasSubstr("inventory_or_hash"));
  // A rank already waiting, and a rank that counts the node's ranks differently.
  ASSERT_TRUE(node.Add(Rank(0, 3, inv), absl::InfiniteFuture(), a.Done())->empty());
  EXPECT_THAT(refused(Rank(0, 3, inv)), HasSubstr("rank 0 of job 'j' is already registering"));
  EXPECT_THAT(refused(Rank(1, 2, inv)), HasSubstr("said 3"));
  EXPECT_EQ(node.held(), 1);  // the refused ones held nothing
  EXPECT_EQ(node.TakeAll().size(), 1u);
  EXPECT_EQ(node.held(), 0);
}

}  // namespace
}  // namespace ragshard::daemon

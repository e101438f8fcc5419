// The node data plane's failures: a node killed with -9 during an operation, nodes running
// different units, unsupported placements and pools too small, each a clear error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include "engine/planner.h"
#include "server/daemon/job_data_plane.h"
#include "tests/server/daemon/ucx_group.h"

namespace ragshard::daemon {
namespace {

using testing::Fail;
using testing::UcxGroup;

TEST(JobDataPlaneFailureTest, AKilledNodeIsAnErrorWithinTheDeadline) {
  Inventory inv;
  UnitSpec* unit = inv.add_units();
  unit->set_name("big");
  TensorSpec* t = unit->add_tensors();
  t->set_name("w");
  t->add_shape(2048);
  t->add_shape(2048);
  t->set_dtype(v1::DTYPE_FP32);
  PlanOptions o;
  o.world = 2;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok());
  // Node 1 is killed once node 0 has finished one all-gather with it and started the next.
  testing::Marks started;
  UcxGroup g = UcxGroup::Spawn(2, [&](int node, Comm& comm) {
    auto pool = Pool::Create(128 << 20);
    auto dp = JobDataPlane::Create(*plan, {node}, pool->get(), &comm);
    if (!dp.ok()) return Fail("create: " + dp.status().ToString());
    for (int i = 0; i < 1000000; ++i) {
      if (i == 1 && node == 0) started.Mark();
      absl::Status s = (*dp)->Unshard(0, absl::Now() + absl::Seconds(10));
      if (!s.ok()) return std::string(s.message()).find("peer 1") != std::string::npos ? 0 : 51;
    }
    return Fail("a million all-gathers ran, none of them failing on the peer's loss");
  });
  started.Spawned();
  EXPECT_TRUE(started.Await(1)) << "node 0 ended before its second all-gather";
  kill(g.pids[1], SIGKILL);
  EXPECT_EQ(UcxGroup::ExitCode(g.pids[1]), 128 + SIGKILL);
  EXPECT_EQ(UcxGroup::ExitCode(g.pids[0]), 0);
}

// Nodes running different units of equal size (a layer skipped by one node's ranks): the
// all-gather fails on both nodes, long before the deadline, naming both operations by unit name;
// so does a reduce-scatter that meets another unit's.
TEST(JobDataPlaneMismatchTest, NodesRunningDifferentUnitsOfEqualSizeFailNamingBoth) {
  Inventory inv;
  for (int u = 0; u < 2; ++u) {
    UnitSpec* unit = inv.add_units();
    unit->set_name("layers." + std::to_string(u));
    TensorSpec* t = unit->add_tensors();
    t->set_name(unit->name() + ".weight");
    t->add_shape(256);
    t->add_shape(64);
    t->set_dtype(v1::DTYPE_FP32);
  }
  PlanOptions o;
  o.world = 4;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->units(0).shard_elems(), plan->units(1).shard_elems());
  const absl::Time start = absl::Now();
  UcxGroup g = UcxGroup::Spawn(2, [&](int node, Comm& comm) {
    auto pool = Pool::Create(64 << 20);
    if (!pool.ok()) return Fail("pool: " + pool.status().ToString());
    auto dp = JobDataPlane::Create(*plan, {node * 2, node * 2 + 1}, pool->get(), &comm);
    if (!dp.ok()) return Fail("create: " + dp.status().ToString());
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    // Both nodes agree on unit 0, then node 1 skips to unit 1.
    if (auto st = (*dp)->Unshard(0, deadline); !st.ok()) return Fail("unshard: " + st.ToString());
    absl::Status s = (*dp)->Unshard(node == 0 ? 0 : 1, deadline);
    const std::string m(s.message());
    if (s.code() != absl::StatusCode::kAborted ||
        m.find("OP_UNSHARD of unit 0 'layers.0'") == std::string::npos ||
        m.find("OP_UNSHARD of unit 1 'layers.1'") == std::string::npos) {
      return Fail("the mismatched unshard should be ABORTED naming both units, not " +
                  s.ToString());
    }
    if ((*dp)->unsharded(1, 0) != nullptr) {
      return Fail("the failed unshard left its buffer allocated");
    }
    return 0;
  });
  g.ExpectSucceeded();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST(JobDataPlaneErrorsTest, UnsupportedPlacementsAndSmallPoolsAreClearErrors) {
  Inventory inv;
  UnitSpec* unit = inv.add_units();
  unit->set_name("u");
  TensorSpec* t = unit->add_tensors();
  t->set_name("w");
  t->add_shape(1 << 20);
  t->set_dtype(v1::DTYPE_FP32);
  PlanOptions o;
  o.world = 2;
  auto plan = BuildPlan(inv, o);
  auto pool = Pool::Create(1 << 20);
  auto dp = JobDataPlane::Create(*plan, {0, 1}, pool->get(), nullptr);
  EXPECT_EQ(dp.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(dp.status().message()), ::testing::HasSubstr("unit 'u'"));
  auto big = Pool::Create(64 << 20);
  auto odd = JobDataPlane::Create(*plan, {1}, big->get(), nullptr);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kUnimplemented);
  auto ok = JobDataPlane::Create(*plan, {0, 1}, big->get(), nullptr);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)->Unshard(5, absl::Now()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*ok)->GatherToOwner(-1, absl::Now()).code(), absl::StatusCode::kInvalidArgument);
  // Transient buffers must exist before the operations that use them.
  EXPECT_EQ((*ok)->ReduceScatter(0, ReduceOp::kSum, false, absl::Now()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*ok)->ScatterFromOwner(0, absl::Now()).code(), absl::StatusCode::kFailedPrecondition);
  // A shard group of 3 ranks neither is whole nodes of 2 nor divides a node's ranks.
  PlanOptions o3;
  o3.world = 3;
  auto plan3 = BuildPlan(inv, o3);
  ASSERT_TRUE(plan3.ok());
  auto split = NodeMesh::Of(*plan3, {0, 1}, 0, 3, /*replicas=*/2);
  EXPECT_EQ(split.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(split.status().message()), ::testing::HasSubstr("whole nodes"));
  // A shard group of 2 inside a node of 4 (2 replicas on the node) is a mesh.
  auto inside = NodeMesh::Of(*plan, {0, 1, 2, 3}, 0, 1, /*replicas=*/2);
  ASSERT_TRUE(inside.ok()) << inside.status();
  EXPECT_EQ(inside->slots(Factor::kP), 2);
  EXPECT_EQ(inside->replicas, 2);
}

TEST(JobDataPlaneErrorsTest, APoolTooSmallForTwoUnitsFailsTheSecondUnshardNamingItsBytes) {
  Inventory inv;
  for (const char* name : {"layers.0", "layers.1"}) {
    UnitSpec* unit = inv.add_units();
    unit->set_name(name);
    TensorSpec* t = unit->add_tensors();
    t->set_name(std::string(name) + ".w");
    t->add_shape(1 << 20);  // 4 MiB unsharded, 2 MiB per shard
    t->set_dtype(v1::DTYPE_FP32);
  }
  PlanOptions o;
  o.world = 2;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok());
  // Both ranks' shards (4 MiB) and gradient shards (4 MiB) of both units, and one unit's
  // unsharded buffer (4 MiB).
  auto pool = Pool::Create((20 << 20) + (1 << 16));
  auto dp = JobDataPlane::Create(*plan, {0, 1}, pool->get(), nullptr);
  ASSERT_TRUE(dp.ok()) << dp.status();
  ASSERT_TRUE((*dp)->Unshard(0, absl::Now() + absl::Seconds(5)).ok());
  absl::Status s = (*dp)->Unshard(1, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("unit 'layers.1'"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("4194304 bytes"));
  // Released memory is reused: after the first unit's reshard the second fits.
  ASSERT_TRUE((*dp)->Reshard(0, 0).ok());
  EXPECT_TRUE((*dp)->Unshard(1, absl::Now() + absl::Seconds(5)).ok());
}

}  // namespace
}  // namespace ragshard::daemon

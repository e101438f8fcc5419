// The AMSP factors' positions and groups (engine/sharding.h) on every strategy of several
// clusters, checked against their definitions by enumeration; the nested plans
// (engine/plan_nesting.h) against the plan invariants.
#include "engine/sharding.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "engine/plan_nesting.h"
#include "engine/planner.h"
#include "engine/validator.h"

namespace ragshard {
namespace {

// The group of factor f holding rank (n, l): its node block and local block.
std::pair<int64_t, int64_t> GroupOf(const Sharding& s, Factor f, int64_t n, int64_t l) {
  return {n / s.shape(f).inter, l / s.shape(f).intra};
}

class ShardingTest : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(ShardingTest, PositionsAreBijectionsOnEveryGroupAndNest) {
  const auto [nodes, devices] = GetParam();
  const std::vector<Sharding> all = AllowedShardings(nodes, devices);
  ASSERT_FALSE(all.empty());
  for (const Sharding& s : all) {
    SCOPED_TRACE(s.Describe());
    for (Factor f : {Factor::kP, Factor::kG, Factor::kOs}) {
      std::map<std::pair<int64_t, int64_t>, std::set<int64_t>> seen;
      for (int64_t n = 0; n < nodes; ++n) {
        for (int64_t l = 0; l < devices; ++l) {
          const int64_t pos = s.Position(f, n, l);
          ASSERT_GE(pos, 0);
          ASSERT_LT(pos, s.size(f));
          // Each position once in its group.
          ASSERT_TRUE(seen[GroupOf(s, f, n, l)].insert(pos).second);
          // Replicas inside a node: the position depends on l modulo A only.
          ASSERT_EQ(pos, s.Position(f, n, l % s.shape(f).intra));
        }
      }
      for (const auto& [group, positions] : seen) {
        ASSERT_EQ(static_cast<int64_t>(positions.size()), s.size(f));
      }
    }
    // The os groups are numbered 0 to W / |os| - 1, and group 0 holds every os position once.
    std::multiset<int64_t> first;
    for (int64_t n = 0; n < nodes; ++n) {
      for (int64_t l = 0; l < devices; ++l) {
        const int64_t group = s.OsGroup(n, l);
        ASSERT_GE(group, 0);
        ASSERT_LT(group, s.world() / s.os.size());
        if (group == 0) first.insert(s.Position(Factor::kOs, n, l));
      }
    }
    ASSERT_EQ(static_cast<int64_t>(first.size()), s.os.size());
    ASSERT_EQ(static_cast<int64_t>(std::set<int64_t>(first.begin(), first.end()).size()),
              s.os.size());
    for (int64_t n = 0; n < nodes; ++n) {
      for (int64_t l = 0; l < devices; ++l) {
        // os range inside the g range, inside the p range (S_x = L / |x|).
        const int64_t po = s.Position(Factor::kOs, n, l), pg = s.Position(Factor::kG, n, l),
                      pp = s.Position(Factor::kP, n, l);
        ASSERT_EQ(po / (s.os.size() / s.g.size()), pg);
        ASSERT_EQ(pg / (s.g.size() / s.p.size()), pp);
        // The p group lies inside the g group, inside the os group.
        for (int64_t n2 = 0; n2 < nodes; ++n2) {
          for (int64_t l2 = 0; l2 < devices; ++l2) {
            if (GroupOf(s, Factor::kP, n, l) == GroupOf(s, Factor::kP, n2, l2)) {
              ASSERT_EQ(GroupOf(s, Factor::kG, n, l), GroupOf(s, Factor::kG, n2, l2));
            }
            if (GroupOf(s, Factor::kG, n, l) == GroupOf(s, Factor::kG, n2, l2)) {
              ASSERT_EQ(GroupOf(s, Factor::kOs, n, l), GroupOf(s, Factor::kOs, n2, l2));
            }
          }
        }
      }
    }
  }
}

std::set<int64_t> NodePositions(const Sharding& s, Factor f, int64_t n) {
  std::set<int64_t> out;
  for (int64_t l = 0; l < s.devices; ++l) out.insert(s.Position(f, n, l));
  return out;
}

TEST_P(ShardingTest, TheNodeGroupsOfTheCollectivesHoldWhatTheyExchange) {
  const auto [nodes, devices] = GetParam();
  for (const Sharding& s : AllowedShardings(nodes, devices)) {
    SCOPED_TRACE(s.Describe());
    for (int64_t n = 0; n < nodes; ++n) {
      // The all-gather over p and the reduce-scatter over g: the group's nodes hold every
      // position once (A_x per node).
      for (Factor f : {Factor::kP, Factor::kG}) {
        std::set<int64_t> all;
        for (int m : s.GroupNodes(f, n)) {
          const std::set<int64_t> mine = NodePositions(s, f, m);
          ASSERT_EQ(static_cast<int64_t>(mine.size()), s.shape(f).intra);
          all.insert(mine.begin(), mine.end());
        }
        ASSERT_EQ(static_cast<int64_t>(all.size()), s.size(f));
      }
      // The gradient replicas hold the same g positions, and every node is in one such set.
      const std::vector<int> reps = s.GradReplicaNodes(n);
      ASSERT_EQ(static_cast<int64_t>(reps.size()), nodes / s.g.inter);
      ASSERT_THAT(reps, ::testing::Contains(static_cast<int>(n)));
      for (int m : reps)
        ASSERT_EQ(NodePositions(s, Factor::kG, m), NodePositions(s, Factor::kG, n));
      // The update gather: nodes of the same p positions whose os positions are exactly the os
      // positions inside those p positions, each once.
      std::multiset<int64_t> os_positions;
      for (int m : s.UpdateNodes(n)) {
        ASSERT_EQ(NodePositions(s, Factor::kP, m), NodePositions(s, Factor::kP, n));
        ASSERT_EQ(GroupOf(s, Factor::kOs, m, 0).first, GroupOf(s, Factor::kOs, n, 0).first);
        for (int64_t q : NodePositions(s, Factor::kOs, m)) os_positions.insert(q);
      }
      std::multiset<int64_t> inside;
      const std::set<int64_t> p = NodePositions(s, Factor::kP, n);
      for (int64_t q = 0; q < s.os.size(); ++q) {
        if (p.count(q / (s.os.size() / s.p.size()))) inside.insert(q);
      }
      ASSERT_EQ(os_positions, inside);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Clusters, ShardingTest,
    ::testing::Values(std::pair<int64_t, int64_t>{2, 2}, std::pair<int64_t, int64_t>{4, 2},
                      std::pair<int64_t, int64_t>{2, 4}, std::pair<int64_t, int64_t>{1, 4},
                      std::pair<int64_t, int64_t>{8, 1}, std::pair<int64_t, int64_t>{4, 4}));

Inventory Model() {
  Inventory inv;
  for (int u = 0; u < 3; ++u) {
    UnitSpec* unit = inv.add_units();
    unit->set_name("layers." + std::to_string(u));
    const int64_t shapes[][2] = {{96, 64}, {64, 96}, {128, 1}, {40, 64}};
    for (int t = 0; t < 4; ++t) {
      TensorSpec* spec = unit->add_tensors();
      spec->set_name(unit->name() + ".t" + std::to_string(t));
      spec->add_shape(shapes[t][0]);
      if (shapes[t][1] > 1) {
        spec->add_shape(shapes[t][1]);
        spec->set_granule_kind(v1::GRANULE_ROWS);
        spec->set_granule_rows(8);
        spec->set_optimizer(t == 0 ? v1::OPTIMIZER_MATRIX : v1::OPTIMIZER_ELEMENTWISE);
      }
      spec->set_dtype(u == 1 ? v1::DTYPE_BF16 : v1::DTYPE_FP32);
    }
  }
  return inv;
}

TEST(NestPlanTest, EveryFactorPlanHoldsTheInvariantsAndNests) {
  const Inventory inv = Model();
  for (const Sharding& s : AllowedShardings(2, 4)) {
    SCOPED_TRACE(s.Describe());
    PlanOptions o;
    o.world = s.os.size();
    auto finest = BuildPlan(inv, o);
    ASSERT_TRUE(finest.ok()) << finest.status();
    auto plan = NestPlan(*finest, s);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(ValidatePlan(*plan, &inv).ok()) << ValidatePlan(*plan, &inv);
    if (s.uniform() && s.p.intra == s.devices) {
      EXPECT_FALSE(plan->has_sharding());
      continue;
    }
    ASSERT_TRUE(plan->has_sharding());
    EXPECT_EQ(plan->world_size(), s.p.size());
    // The job's sharding comes back from the plan.
    auto back = ShardingOf(*plan, s.world(), s.devices);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->p, s.p);
    EXPECT_EQ(back->g, s.g);
    EXPECT_EQ(back->os, s.os);
    // Owners live in the os plan, over its positions.
    for (const v1::UnitPlan& up : FactorUnits(*plan, Factor::kOs)) {
      for (const v1::TensorPlacement& t : up.tensors()) {
        if (t.optimizer() == v1::OPTIMIZER_MATRIX) {
          EXPECT_GE(t.owner_rank(), 0);
          EXPECT_LT(t.owner_rank(), s.os.size());
        }
      }
    }
    for (const v1::UnitPlan& up : plan->units()) {
      for (const v1::TensorPlacement& t : up.tensors()) EXPECT_EQ(t.owner_rank(), -1);
    }
  }
}

TEST(ShardingOfTest, PlansWithoutFactorsAndErrorsThatNameTheRule) {
  v1::Plan plan;
  plan.set_world_size(4);
  auto whole = ShardingOf(plan, 8, 2);  // 2 nodes per shard group, 2 replicas
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->p, (GroupShape{2, 2}));
  EXPECT_TRUE(whole->uniform());
  plan.set_world_size(2);
  auto inside = ShardingOf(plan, 8, 4);  // a group of 2 inside each node of 4
  ASSERT_TRUE(inside.ok());
  EXPECT_EQ(inside->p, (GroupShape{2, 1}));
  plan.set_world_size(3);
  auto bad = ShardingOf(plan, 6, 2);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("whole nodes"));
  EXPECT_EQ(ShardingOf(plan, 7, 2).status().code(), absl::StatusCode::kInvalidArgument);
  // A spec for another cluster, and one that breaks the nesting.
  v1::Plan spec;
  spec.set_world_size(2);
  *spec.mutable_sharding() = ToSpec(Sharding{2, 2, {1, 2}, {1, 2}, {2, 2}});
  EXPECT_THAT(std::string(ShardingOf(spec, 8, 2).status().message()),
              ::testing::HasSubstr("the plan is for 2 nodes x 2 ranks"));
  *spec.mutable_sharding() = ToSpec(Sharding{2, 2, {2, 1}, {1, 2}, {2, 2}});
  EXPECT_THAT(std::string(ShardingOf(spec, 4, 2).status().message()),
              ::testing::HasSubstr("p=2x1 must divide g=1x2"));
  // A spec without its factor plans.
  *spec.mutable_sharding() = ToSpec(Sharding{2, 2, {1, 2}, {1, 2}, {2, 2}});
  EXPECT_THAT(std::string(ShardingOf(spec, 4, 2).status().message()),
              ::testing::HasSubstr("no 'g' factor plan"));
}

}  // namespace
}  // namespace ragshard

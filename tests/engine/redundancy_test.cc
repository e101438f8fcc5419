// A job's redundancy spec (engine/redundancy.h): what parses, what each needs of the nodes.
#include "engine/redundancy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ragshard {
namespace {

using ::testing::HasSubstr;

TEST(RedundancyTest, ParsesNoneReplicaAndParityK) {
  for (const char* none : {"", "none"}) {
    auto r = ParseRedundancy("f", none);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->enabled());
    EXPECT_EQ(r->name(), "none");
    EXPECT_EQ(r->min_nodes(), 1);
  }
  auto replica = ParseRedundancy("f", "replica");
  ASSERT_TRUE(replica.ok());
  EXPECT_EQ(replica->kind, Redundancy::Kind::kReplica);
  EXPECT_EQ(replica->min_nodes(), 2);
  for (int k = 1; k <= kMaxParityK; ++k) {
    auto r = ParseRedundancy("f", "parity:" + std::to_string(k));
    ASSERT_TRUE(r.ok()) << k;
    EXPECT_EQ(r->kind, Redundancy::Kind::kParity);
    EXPECT_EQ(r->k, k);
    EXPECT_EQ(r->min_nodes(), k + 1);
    EXPECT_EQ(r->name(), "parity:" + std::to_string(k));
  }
  for (const char* bad : {"parity", "parity:", "parity:0", "parity:17", "parity:01x", "parity:-1",
                          "parity:+1", "parity: 1", "parity:100", "raid", "REPLICA", " none"}) {
    auto r = ParseRedundancy("--redundancy", bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(),
                HasSubstr(std::string("--redundancy: '") + bad + "' is not a redundancy"));
  }
}

TEST(RedundancyTest, NamesTheNodesEachNeeds) {
  const Redundancy parity2 = *ParseRedundancy("f", "parity:2");
  EXPECT_TRUE(CheckRedundancyNodes(parity2, 3).ok());
  EXPECT_TRUE(CheckRedundancyNodes(parity2, 6).ok());
  for (int64_t nodes : {1, 2, 4, 5, 7}) {
    absl::Status s = CheckRedundancyNodes(parity2, nodes);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << nodes;
    EXPECT_THAT(s.message(), HasSubstr("redundancy parity:2 needs a multiple of K + 1 = 3 nodes"));
    EXPECT_THAT(s.message(), HasSubstr("on " + std::to_string(nodes) + " node"));
  }
  const Redundancy replica = *ParseRedundancy("f", "replica");
  EXPECT_TRUE(CheckRedundancyNodes(replica, 2).ok());
  EXPECT_TRUE(CheckRedundancyNodes(replica, 3).ok());
  EXPECT_THAT(CheckRedundancyNodes(replica, 1).message(),
              HasSubstr("redundancy replica needs at least 2 nodes"));
  EXPECT_TRUE(CheckRedundancyNodes(Redundancy(), 1).ok());
  const Redundancy hsdp = *ParseRedundancy("f", "hsdp");
  EXPECT_EQ(hsdp.name(), "hsdp");
  EXPECT_TRUE(CheckRedundancyNodes(hsdp, 2).ok());
  EXPECT_THAT(CheckRedundancyNodes(hsdp, 1).message(),
              HasSubstr("redundancy hsdp needs the HSDP replicas on at least 2 nodes"));
}

TEST(RedundancyTest, HsdpNeedsEachRanksReplicaOnAnotherNode) {
  // Shard groups of 2, a node per group: covered.
  EXPECT_TRUE(CheckHsdpLayout(2, {"a", "a", "b", "b"}).ok());
  // Ranks 0 and 2 (one position) on different nodes, and ranks 1 and 3: covered too.
  EXPECT_TRUE(CheckHsdpLayout(2, {"a", "b", "b", "a"}).ok());
  // Both replicas of rank 0's position on node a: named.
  const absl::Status s = CheckHsdpLayout(2, {"a", "b", "a", "b"});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("rank 0 on node 'a' has no HSDP replica on another node"));
  EXPECT_THAT(CheckHsdpLayout(3, {"a", "a", "b", "b"}).message(),
              HasSubstr("a shard group of 3 ranks does not divide the 4 ranks"));
}

}  // namespace
}  // namespace ragshard

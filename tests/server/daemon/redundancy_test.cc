// Redundancy of the ranks' state across nodes (server/daemon/redundancy.h): the schemes' layout,
// and Protect then Rebuild over an in-memory communicator, one thread per node.
#include "server/daemon/redundancy.h"

#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/daemon/mem_comm.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;

TEST(RedundancySchemeTest, EveryChunkHasOneHolderOnAnotherNode) {
  for (auto [text, nodes] : std::vector<std::pair<std::string, int>>{
           {"parity:1", 2}, {"parity:2", 3}, {"parity:2", 6}, {"parity:3", 8}, {"replica", 3}}) {
    const RedundancyScheme s = SchemeOf(*ParseRedundancy("redundancy", text));
    std::map<std::pair<int, int>, int> held;  // (node, chunk) -> holders
    for (int h = 0; h < nodes; ++h) {
      const std::vector<ChunkRef> sources = ParitySources(s, nodes, h);
      EXPECT_EQ(static_cast<int>(sources.size()), s.replica ? 1 : s.k);
      for (const ChunkRef& c : sources) {
        EXPECT_NE(c.node, h) << text;
        EXPECT_EQ(ParityHolder(s, nodes, c.node, c.chunk), h) << text;
        ++held[{c.node, c.chunk}];
      }
    }
    EXPECT_EQ(static_cast<int>(held.size()), nodes * s.k) << text;
    for (const auto& [chunk, holders] : held) EXPECT_EQ(holders, 1) << text;
  }
}

// One node's ranks' state: segments of its own sizes, with values from a seed.
struct NodeState {
  std::vector<std::map<std::string, std::string>> ranks;  // by local rank: name -> bytes
  std::vector<std::vector<StateSegment>> Segments() {
    std::vector<std::vector<StateSegment>> out(ranks.size());
    for (size_t l = 0; l < ranks.size(); ++l) {
      for (auto& [name, bytes] : ranks[l]) {
        out[l].push_back({name, bytes.data(), static_cast<int64_t>(bytes.size())});
      }
    }
    return out;
  }
};

NodeState MakeState(int node, int locals, uint32_t seed) {
  std::mt19937 rng(seed * 131 + static_cast<uint32_t>(node));
  NodeState st;
  st.ranks.resize(static_cast<size_t>(locals));
  for (int l = 0; l < locals; ++l) {
    // Sizes differ by node and rank (a Muon owner keeps more state than the others).
    for (auto [name, size] : std::vector<std::pair<std::string, int>>{
             {"shard/0", 1000 + 8 * node},
             {"shard/1", 333},
             {"opt/0/exp_avg/0", 1000 + 8 * node},
             {absl::StrCat("opt/0/momentum/", node), 77 * (node + 1) + l}}) {
      std::string bytes(static_cast<size_t>(size), '\0');
      for (char& c : bytes) c = static_cast<char>(rng());
      st.ranks[static_cast<size_t>(l)][name] = bytes;
    }
  }
  return st;
}

// Runs `body(node)` on one thread per node, each with its communicator.
template <typename Body>
void OnEveryNode(testing::MemFabric* fabric, int nodes, Body body) {
  std::vector<std::thread> threads;
  for (int n = 0; n < nodes; ++n) {
    threads.emplace_back([&, n] {
      testing::MemComm comm(fabric, n);
      body(n, comm);
    });
  }
  for (std::thread& t : threads) t.join();
}

class RedundancyTest : public ::testing::TestWithParam<std::pair<std::string, int>> {
 protected:
  void SetUp() override {
    auto pool = Pool::Create(int64_t{64} << 20);
    ASSERT_TRUE(pool.ok());
    pool_ = std::move(*pool);
    scheme_ = SchemeOf(*ParseRedundancy("redundancy", GetParam().first));
    nodes_ = GetParam().second;
    for (int n = 0; n < nodes_; ++n) names_.push_back(absl::StrCat("n", n));
    for (int n = 0; n < nodes_; ++n) {
      node_.push_back(std::make_unique<NodeRedundancy>(scheme_, n, names_, kLocals, pool_.get()));
    }
  }

  void ProtectAll(std::vector<NodeState>& states, int64_t step, uint64_t seq) {
    testing::MemFabric fabric(nodes_);
    OnEveryNode(&fabric, nodes_, [&](int n, Comm& comm) {
      const absl::Status s =
          node_[n]->Protect(comm, states[n].Segments(), step, absl::Now() + absl::Seconds(30), seq);
      EXPECT_TRUE(s.ok()) << "node " << n << ": " << s;
    });
  }

  // Rebuilds the nodes in `lost` (fresh NodeRedundancy, no state) at `step`: their placed
  // segments, and each node's result.
  std::vector<absl::StatusOr<int64_t>> RebuildAll(std::vector<NodeState>& states,
                                                  const std::vector<int>& lost, int64_t step,
                                                  std::vector<NodeState>* placed,
                                                  Pool* replacement_pool = nullptr) {
    for (int x : lost) {
      node_[x] = std::make_unique<NodeRedundancy>(
          scheme_, x, names_, kLocals, replacement_pool ? replacement_pool : pool_.get());
    }
    placed->assign(static_cast<size_t>(nodes_), NodeState());
    for (NodeState& p : *placed) p.ranks.resize(kLocals);
    std::vector<absl::StatusOr<int64_t>> results(static_cast<size_t>(nodes_), int64_t{0});
    testing::MemFabric fabric(nodes_);
    OnEveryNode(&fabric, nodes_, [&](int n, Comm& comm) {
      const bool replaced = std::find(lost.begin(), lost.end(), n) != lost.end();
      NodeState& mine = (*placed)[n];
      const PlaceSegment place = [&](int l, const std::string& name,
                                     int64_t bytes) -> absl::StatusOr<char*> {
        std::string& b = mine.ranks[static_cast<size_t>(l)][name];
        b.assign(static_cast<size_t>(bytes), '\0');
        return b.data();
      };
      results[n] = node_[n]->Rebuild(
          comm, replaced,
          replaced ? std::vector<std::vector<StateSegment>>(kLocals) : states[n].Segments(), step,
          place, absl::Now() + absl::Seconds(30), 9);
    });
    return results;
  }

  static constexpr int kLocals = 2;
  std::unique_ptr<Pool> pool_;
  RedundancyScheme scheme_;
  int nodes_ = 0;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<NodeRedundancy>> node_;
};

TEST_P(RedundancyTest, ALostNodeIsRebuiltBitForBitAtTheAgreedStep) {
  std::vector<NodeState> at1, at2;
  for (int n = 0; n < nodes_; ++n) at1.push_back(MakeState(n, kLocals, 1));
  for (int n = 0; n < nodes_; ++n) at2.push_back(MakeState(n, kLocals, 2));
  ProtectAll(at1, 1, 1);
  ProtectAll(at2, 2, 2);
  // Each holder keeps the parity of the last two steps: 1/K of a blob each (and a bit).
  int64_t largest_blob = 0;
  for (auto& [name, bytes] : at1.back().ranks[1])
    largest_blob += static_cast<int64_t>(bytes.size());
  EXPECT_LE(node_[0]->parity_bytes(),
            2 * kLocals * (ChunkBytes(largest_blob + 256, scheme_.k) + 256));

  // Node 1 is lost while the others are back at step 1 (they roll back): its state at step 1.
  std::vector<NodeState> placed;
  auto results = RebuildAll(at1, {1}, 1, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(results[n].ok()) << n << results[n].status();
  EXPECT_GT(*results[1], 0);
  EXPECT_EQ(*results[0], 0);
  EXPECT_EQ(placed[1].ranks, at1[1].ranks);

  // The replacement's own parity was rebuilt too: protect step 2 and lose another node.
  at1[1] = placed[1];
  ProtectAll(at2, 2, 3);
  const int other = nodes_ - 1 == 1 ? 0 : nodes_ - 1;
  auto again = RebuildAll(at2, {other}, 2, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(again[n].ok()) << n << again[n].status();
  EXPECT_EQ(placed[other].ranks, at2[other].ranks);
}

TEST_P(RedundancyTest, AChunkRebuiltFromChangedDataFailsItsChecksumNamingIt) {
  std::vector<NodeState> st;
  for (int n = 0; n < nodes_; ++n) st.push_back(MakeState(n, kLocals, 3));
  ProtectAll(st, 4, 1);
  // The parity covering node 1's chunk 0 changed after it was taken (a bit flipped in memory).
  node_[ParityHolder(scheme_, nodes_, 1, 0)]->FlipParityByteForTest(0, 4, 100);
  std::vector<NodeState> placed;
  auto results = RebuildAll(st, {1}, 4, &placed);
  ASSERT_FALSE(results[1].ok());
  EXPECT_EQ(results[1].status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(results[1].status().message(), HasSubstr("does not match its checksum"));
  EXPECT_THAT(results[1].status().message(), HasSubstr("rebuilt chunk"));
}

TEST_P(RedundancyTest, TwoLostNodesOfOneGroupFailOnEveryNodeNamingBoth) {
  std::vector<NodeState> st;
  for (int n = 0; n < nodes_; ++n) st.push_back(MakeState(n, kLocals, 5));
  ProtectAll(st, 1, 1);
  std::vector<NodeState> placed;
  auto results = RebuildAll(st, {0, 1}, 1, &placed);
  for (int n = 0; n < nodes_; ++n) {
    ASSERT_FALSE(results[n].ok()) << n;
    EXPECT_EQ(results[n].status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(results[n].status().message(), HasSubstr("were both lost"));
  }
}

TEST_P(RedundancyTest, AReplacementWithASmallerPoolIsRefusedOnEveryNodeNamingTheBytes) {
  std::vector<NodeState> st;
  for (int n = 0; n < nodes_; ++n) st.push_back(MakeState(n, kLocals, 8));
  ProtectAll(st, 1, 1);
  auto small = Pool::Create(4096);
  ASSERT_TRUE(small.ok());
  std::vector<NodeState> placed;
  auto results = RebuildAll(st, {1}, 1, &placed, small->get());
  for (int n = 0; n < nodes_; ++n) {
    ASSERT_FALSE(results[n].ok()) << n;
    EXPECT_EQ(results[n].status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(results[n].status().message(), HasSubstr("4096 bytes free in its pool"));
    EXPECT_THAT(results[n].status().message(), HasSubstr("larger --pool-bytes"));
  }
}

TEST_P(RedundancyTest, ARebuildAtAStepNobodyProtectedIsRefused) {
  std::vector<NodeState> st;
  for (int n = 0; n < nodes_; ++n) st.push_back(MakeState(n, kLocals, 6));
  ProtectAll(st, 1, 1);
  std::vector<NodeState> placed;
  auto results = RebuildAll(st, {1}, 7, &placed);
  for (int n = 0; n < nodes_; ++n) {
    ASSERT_FALSE(results[n].ok()) << n;
    EXPECT_THAT(results[n].status().message(), HasSubstr("step 7"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, RedundancyTest,
    ::testing::Values(std::make_pair("parity:2", 3), std::make_pair("parity:2", 6),
                      std::make_pair("replica", 3), std::make_pair("replica", 2),
                      std::make_pair("parity:1", 2)),
    [](const auto& info) {
      std::string name = info.param.first + "_" + std::to_string(info.param.second);
      for (char& c : name) {
        if (c == ':') c = '_';
      }
      return name;
    });

}  // namespace
}  // namespace ragshard::daemon

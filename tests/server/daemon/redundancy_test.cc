// Redundancy of the ranks' state across nodes (server/daemon/redundancy.h): Protect then Rebuild
// over an in-memory communicator, one thread per node. (The schemes' layout and the state blob's
// checksum: parity_layout_test.cc.)
#include "server/daemon/redundancy.h"

#include <atomic>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon/collectives.h"
#include "tests/server/daemon/mem_comm.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;

// One node's ranks' state: segments of its own sizes, with values from a seed.
struct NodeState {
  std::vector<std::map<std::string, std::string>> ranks;  // by local rank: name -> bytes
  // The segments over `ranks`, in `memory` (nullptr: host memory, read directly).
  std::vector<std::vector<StateSegment>> Segments(const SegmentMemory* memory = nullptr) {
    std::vector<std::vector<StateSegment>> out(ranks.size());
    for (size_t l = 0; l < ranks.size(); ++l) {
      for (auto& [name, bytes] : ranks[l]) {
        out[l].push_back({name, bytes.data(), static_cast<int64_t>(bytes.size()), memory});
      }
    }
    return out;
  }
};

// Memory that, as a GPU's, the daemon may reach only through its copies, which here transform
// the bytes: a protect or rebuild that read or wrote a segment in it directly would see or
// leave the scrambled form.
class ScrambledMemory final : public SegmentMemory {
 public:
  static constexpr char kKey = 0x5a;
  absl::Status ToHost(char* out, const char* from, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<char>(from[i] ^ kKey);
    copies_.fetch_add(1);
    return absl::OkStatus();
  }
  absl::Status FromHost(char* to, const char* in, int64_t n) const override {
    for (int64_t i = 0; i < n; ++i) to[i] = static_cast<char>(in[i] ^ kKey);
    copies_.fetch_add(1);
    return absl::OkStatus();
  }
  // What this memory holds for `state`.
  static NodeState Of(NodeState state) {
    for (auto& rank : state.ranks) {
      for (auto& [name, bytes] : rank) {
        for (char& c : bytes) c = static_cast<char>(c ^ kKey);
      }
    }
    return state;
  }
  int64_t copies() const { return copies_.load(); }

 private:
  mutable std::atomic<int64_t> copies_{0};
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

// Each rank's state several protect windows long (odd sizes: each chunk's last window is
// partial), with values from `seed`.
std::vector<NodeState> ManyWindows(int nodes, int locals, uint32_t seed) {
  constexpr int64_t kWindow = NodeRedundancy::kProtectWindowBytes;
  std::vector<NodeState> states;
  std::mt19937 rng(seed);
  for (int n = 0; n < nodes; ++n) {
    NodeState st = MakeState(n, locals, seed);
    for (int l = 0; l < locals; ++l) {
      std::string big(static_cast<size_t>(2 * kWindow + 12345 + 999 * n + l), '\0');
      for (char& c : big) c = static_cast<char>(rng());
      st.ranks[static_cast<size_t>(l)]["opt/0/exp_avg_sq/0"] = big;
    }
    states.push_back(st);
  }
  return states;
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
    auto pool = Pool::Create(int64_t{1} << 30);  // (the many-window tests: parities, staging)
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
      const absl::Status s = node_[n]->Protect(comm, states[n].Segments(state_memory_), step,
                                               absl::Now() + absl::Seconds(30), seq);
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
                                     int64_t bytes) -> absl::StatusOr<StateSegment> {
        std::string& b = mine.ranks[static_cast<size_t>(l)][name];
        b.assign(static_cast<size_t>(bytes), '\0');
        return StateSegment{name, b.data(), bytes, place_memory_};
      };
      results[n] = node_[n]->Rebuild(comm, replaced,
                                     replaced ? std::vector<std::vector<StateSegment>>(kLocals)
                                              : states[n].Segments(state_memory_),
                                     step, place, absl::Now() + absl::Seconds(30), 9);
    });
    return results;
  }

  // Rebuilds node `lost` at `step` from the others, and checks that it gets `states[lost]`.
  void ExpectRebuilt(std::vector<NodeState>& states, int lost, int64_t step) {
    std::vector<NodeState> placed;
    auto results = RebuildAll(states, {lost}, step, &placed);
    for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(results[n].ok()) << n << results[n].status();
    EXPECT_EQ(placed[lost].ranks, states[lost].ranks);
  }

  static constexpr int kLocals = 2;
  // Where the ranks' state and the rebuilt segments are (nullptr: host memory).
  const SegmentMemory* state_memory_ = nullptr;
  const SegmentMemory* place_memory_ = nullptr;
  std::unique_ptr<Pool> pool_;
  RedundancyScheme scheme_;
  int nodes_ = 0;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<NodeRedundancy>> node_;
};

TEST_P(RedundancyTest, ALostNodeIsRebuiltBitForBitFromOneStepsParity) {
  std::vector<NodeState> at1, at2, at3;
  for (int n = 0; n < nodes_; ++n) at1.push_back(MakeState(n, kLocals, 1));
  for (int n = 0; n < nodes_; ++n) at2.push_back(MakeState(n, kLocals, 2));
  for (int n = 0; n < nodes_; ++n) at3.push_back(MakeState(n, kLocals, 3));
  ProtectAll(at1, 1, 1);
  ProtectAll(at2, 2, 2);
  // One step's parity is kept: 1/K of the state (replica: 1x), up to the pool's rounding of each
  // lease (to 256 bytes).
  int64_t state = 0;
  int64_t parity = 0;
  for (int n = 0; n < nodes_; ++n) {
    state += node_[n]->protected_bytes();
    parity += node_[n]->parity_bytes();
    EXPECT_EQ(node_[n]->parity_steps(), std::vector<int64_t>{2}) << n;
  }
  EXPECT_GE(parity, state / scheme_.k);
  EXPECT_LE(parity, state / scheme_.k + nodes_ * kLocals * 256);

  // Step 1's parity is gone: a rebuild there is refused, on every node alike.
  std::vector<NodeState> placed;
  auto refused = RebuildAll(at1, {1}, 1, &placed);
  for (int n = 0; n < nodes_; ++n) {
    ASSERT_FALSE(refused[n].ok()) << n;
    EXPECT_THAT(refused[n].status().message(), HasSubstr("no parity of step 1")) << n;
  }
  auto results = RebuildAll(at2, {1}, 2, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(results[n].ok()) << n << results[n].status();
  EXPECT_GT(*results[1], 0);
  EXPECT_EQ(*results[0], 0);
  EXPECT_EQ(placed[1].ranks, at2[1].ranks);

  // The replacement's own parity was rebuilt too: protect step 3 and lose another node.
  ProtectAll(at3, 3, 3);
  const int other = nodes_ - 1 == 1 ? 0 : nodes_ - 1;
  auto again = RebuildAll(at3, {other}, 3, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(again[n].ok()) << n << again[n].status();
  EXPECT_EQ(placed[other].ranks, at3[other].ranks);
}

TEST_P(RedundancyTest, StateInADevicesMemoryIsReadAndWrittenThroughItsCopiesOnly) {
  // The CUDA backend's state is in its GPUs' slabs (the device-shaped backend's, in host memory
  // it reaches the same way): protect reads it and rebuild writes it through copies only. Here
  // those copies scramble, so what reaches host memory is right only if every read and write
  // took them: state in the device rebuilt into host memory is the plain state, and host state
  // rebuilt into the device is stored scrambled. Many windows: the sends stage every window.
  ScrambledMemory device;
  const std::vector<NodeState> plain = ManyWindows(nodes_, kLocals, 6);
  std::vector<NodeState> stored;
  for (const NodeState& st : plain) stored.push_back(ScrambledMemory::Of(st));
  state_memory_ = &device;
  ProtectAll(stored, 1, 1);
  std::vector<NodeState> placed;
  auto results = RebuildAll(stored, {1}, 1, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(results[n].ok()) << n << results[n].status();
  EXPECT_EQ(placed[1].ranks, plain[1].ranks);
  const int64_t copies = device.copies();
  EXPECT_GT(copies, 0);

  std::vector<NodeState> host = plain;
  state_memory_ = nullptr;
  place_memory_ = &device;
  ProtectAll(host, 2, 2);
  results = RebuildAll(host, {0}, 2, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(results[n].ok()) << n << results[n].status();
  EXPECT_EQ(placed[0].ranks, stored[0].ranks);
  EXPECT_GT(device.copies(), copies);
}

TEST_P(RedundancyTest, AStateOfManyWindowsIsProtectedThroughBoundedStaging) {
  // Each rank's state is several protect windows long, with odd sizes (the last window of each
  // chunk is partial): the parities are made window by window, and the pool's peak beyond the
  // parities is at most kWindowsPerOperation windows per chunk sent or received on every node.
  constexpr int64_t kWindow = NodeRedundancy::kProtectWindowBytes;
  std::vector<NodeState> states = ManyWindows(nodes_, kLocals, 4);
  const int64_t before = pool_->Stats().used;
  ProtectAll(states, 1, 1);
  int64_t parity = 0;
  for (int n = 0; n < nodes_; ++n) {
    parity += node_[n]->parity_bytes();
    EXPECT_GT(node_[n]->protected_bytes(), 4 * kWindow) << n;
  }
  EXPECT_EQ(pool_->Stats().used, before + parity);  // the staging went back to the pool
  int64_t staging = 0;                              // every node's windows at once
  for (int n = 0; n < nodes_; ++n) {
    const int64_t flows =
        kLocals * (scheme_.k + static_cast<int64_t>(ParitySources(scheme_, nodes_, n).size()));
    staging += flows * kWindow * NodeRedundancy::kWindowsPerOperation + 256;
  }
  EXPECT_LE(pool_->Stats().peak, before + parity + staging);
  ExpectRebuilt(states, 1, 1);
}

TEST_P(RedundancyTest, ABackgroundProtectBetweenOtherOperationsIsTheWholeOne) {
  // Step 2's protect starts, moves on by one window around each of two other operations on the
  // same communicator (all-gathers whose messages use the index the windows' first one does):
  // the even nodes before each, the odd ones after, so that their windows' messages and the
  // gathers' cross (the background lane keeps them apart); and finishes: the other operations
  // get their own data, step 1's parity is held until the barrier, and step 2's rebuilds a lost
  // node as a protect run whole does.
  std::vector<NodeState> at1 = ManyWindows(nodes_, kLocals, 4);
  std::vector<NodeState> at2 = ManyWindows(nodes_, kLocals, 5);
  ProtectAll(at1, 1, 1);
  std::vector<std::vector<int64_t>> during(static_cast<size_t>(nodes_)), gathered = during;
  std::vector<bool> windows_left(static_cast<size_t>(nodes_));
  {
    testing::MemFabric fabric(nodes_);
    OnEveryNode(&fabric, nodes_, [&](int n, Comm& comm) {
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      ASSERT_TRUE(node_[n]->StartProtect(comm, at2[n].Segments(), 2, deadline, 2).ok());
      const bool before = n % 2 == 0;
      for (uint64_t op = 0; op < 2; ++op) {
        if (before) {
          ASSERT_TRUE(node_[n]->AdvanceProtect(comm, 1, absl::Seconds(30)).ok());
        }
        std::vector<int64_t> values(static_cast<size_t>(nodes_), 0);
        values[static_cast<size_t>(n)] = 100 * n + static_cast<int64_t>(op);
        const absl::Status gather =
            AllGather(comm, reinterpret_cast<char*>(values.data()), sizeof(int64_t), deadline,
                      RedundancyStamp(3 + op, 2, 0));
        ASSERT_TRUE(gather.ok()) << "node " << n << ": " << gather;
        gathered[n].insert(gathered[n].end(), values.begin(), values.end());
        if (!before) {
          ASSERT_TRUE(node_[n]->AdvanceProtect(comm, 1, absl::Seconds(30)).ok());
        }
      }
      during[n] = node_[n]->parity_steps();
      windows_left[n] = node_[n]->protecting();
      const absl::Status s = node_[n]->FinishProtect(comm, deadline);
      EXPECT_TRUE(s.ok()) << "node " << n << ": " << s;
      EXPECT_FALSE(node_[n]->protecting());
    });
  }
  for (int n = 0; n < nodes_; ++n) {
    EXPECT_EQ(during[n], std::vector<int64_t>{1}) << n;
    EXPECT_TRUE(windows_left[n]) << n;
    EXPECT_EQ(node_[n]->parity_steps(), std::vector<int64_t>{2}) << n;
    for (int op = 0; op < 2; ++op) {
      for (int m = 0; m < nodes_; ++m) EXPECT_EQ(gathered[n][op * nodes_ + m], 100 * m + op);
    }
  }
  ExpectRebuilt(at2, 1, 2);
}

TEST_P(RedundancyTest, AnAbandonedProtectLeavesTheStepBeforeRebuildable) {
  // A recovery gives up step 2's protect during a window: every node still holds step 1's parity
  // (and counts no other), from which a lost node is rebuilt.
  std::vector<NodeState> at1 = ManyWindows(nodes_, kLocals, 6);
  std::vector<NodeState> at2 = ManyWindows(nodes_, kLocals, 7);
  ProtectAll(at1, 1, 1);
  {
    testing::MemFabric fabric(nodes_);
    OnEveryNode(&fabric, nodes_, [&](int n, Comm& comm) {
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      ASSERT_TRUE(node_[n]->StartProtect(comm, at2[n].Segments(), 2, deadline, 2).ok());
      ASSERT_TRUE(node_[n]->AdvanceProtect(comm, 1, absl::Seconds(30)).ok());
      // (with its window in flight, as a recovery finds it: nothing takes the window's messages
      // once the fabric, the connection, is gone)
      EXPECT_TRUE(node_[n]->protect_in_flight());
      node_[n]->AbandonProtect();
    });
  }
  for (int n = 0; n < nodes_; ++n) {
    EXPECT_FALSE(node_[n]->protecting()) << n;
    EXPECT_EQ(node_[n]->parity_steps(), std::vector<int64_t>{1}) << n;
  }
  ExpectRebuilt(at1, 2 % nodes_, 1);
}

TEST_P(RedundancyTest, ANodeLostBeforeTheBarrierLeavesBothStepsRebuildable) {
  std::vector<NodeState> at1, at2;
  for (int n = 0; n < nodes_; ++n) at1.push_back(MakeState(n, kLocals, 1));
  for (int n = 0; n < nodes_; ++n) at2.push_back(MakeState(n, kLocals, 2));
  // The ranks roll forward to step 2 (rebuilt there), or back to step 1; either way every node
  // then keeps only that step's parity.
  for (int64_t target : {2, 1}) {
    for (int n = 0; n < nodes_; ++n) {
      node_[n] = std::make_unique<NodeRedundancy>(scheme_, n, names_, kLocals, pool_.get());
    }
    ProtectAll(at1, 1, 1);
    // Node 1 is lost once every node has step 2's parity, before the barrier: the others keep
    // step 1's too (none could know that every other has step 2's).
    {
      testing::MemFabric fabric(nodes_);
      node_[1]->SetBeforeBarrierForTest([&fabric] {
        fabric.Lose(1);
        return absl::UnavailableError("node 1 lost");
      });
      OnEveryNode(&fabric, nodes_, [&](int n, Comm& comm) {
        const absl::Status s =
            node_[n]->Protect(comm, at2[n].Segments(), 2, absl::Now() + absl::Seconds(30), 2);
        EXPECT_FALSE(s.ok()) << n;
      });
    }
    for (int n = 0; n < nodes_; ++n) {
      if (n != 1) {
        EXPECT_EQ(node_[n]->parity_steps(), (std::vector<int64_t>{1, 2})) << n;
      }
    }
    std::vector<NodeState>& state = target == 2 ? at2 : at1;
    std::vector<NodeState> placed;
    auto results = RebuildAll(state, {1}, target, &placed);
    for (int n = 0; n < nodes_; ++n) {
      ASSERT_TRUE(results[n].ok()) << n << results[n].status();
      EXPECT_EQ(node_[n]->parity_steps(), std::vector<int64_t>{target}) << n;
    }
    EXPECT_EQ(placed[1].ranks, state[1].ranks) << target;
  }
}

TEST_P(RedundancyTest, AStepProtectedTwiceKeepsItsNewestParityOnly) {
  std::vector<NodeState> first, second;
  for (int n = 0; n < nodes_; ++n) first.push_back(MakeState(n, kLocals, 4));
  for (int n = 0; n < nodes_; ++n) second.push_back(MakeState(n, kLocals, 5));
  ProtectAll(first, 0, 1);
  const int64_t once = node_[0]->parity_bytes();
  // Step 0 again (a recovery back to it), with the state as it is now: one parity of it stays,
  // the newest, and a rebuild uses it.
  ProtectAll(second, 0, 2);
  for (int n = 0; n < nodes_; ++n) {
    EXPECT_EQ(node_[n]->parity_steps(), std::vector<int64_t>{0}) << n;
  }
  EXPECT_EQ(node_[0]->parity_bytes(), once);
  std::vector<NodeState> placed;
  auto results = RebuildAll(second, {1}, 0, &placed);
  for (int n = 0; n < nodes_; ++n) ASSERT_TRUE(results[n].ok()) << n << results[n].status();
  EXPECT_EQ(placed[1].ranks, second[1].ranks);
}

TEST_P(RedundancyTest, ANodesWholeCopyIsReadWhereOneParityHoldsItElseRefused) {
  std::vector<NodeState> at4;
  for (int n = 0; n < nodes_; ++n) at4.push_back(MakeState(n, kLocals, 4));
  ProtectAll(at4, 4, 4);
  const int holder = ParityHolder(scheme_, nodes_, 1, 0);
  for (int l = 0; l < kLocals; ++l) {
    auto copy = node_[holder]->CopyHeld(l, 4);
    if (scheme_.k != 1) {  // XORs of several nodes' chunks: no whole copy anywhere
      ASSERT_FALSE(copy.ok());
      EXPECT_EQ(copy.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(copy.status().message(), HasSubstr("only replica (or parity:1)"));
      continue;
    }
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ(copy->node, 1);
    EXPECT_EQ(copy->node_name, "n1");
    std::map<std::string, std::string> got;
    for (const StateSegment& seg : copy->segments) {
      got[seg.name] = std::string(seg.data, static_cast<size_t>(seg.bytes));
    }
    EXPECT_EQ(got, at4[1].ranks[static_cast<size_t>(l)]) << "local rank " << l;
  }
  if (scheme_.k != 1) return;
  // A step this node holds no parity of, and a flipped byte (the CRC names the chunk).
  EXPECT_EQ(node_[holder]->CopyHeld(0, 3).status().code(), absl::StatusCode::kNotFound);
  node_[holder]->FlipParityByteForTest(1, 4, 200);
  auto bad = node_[holder]->CopyHeld(1, 4);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(),
              HasSubstr(absl::StrCat("chunk 0 of local rank 1's state of node n1, as node n",
                                     holder, " holds it at step 4")));
  EXPECT_THAT(bad.status().message(), HasSubstr("does not match its checksum"));
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

// "hsdp": rank q's state is the same as rank q + shard's; a lost node's ranks are copied from
// replicas on other nodes, as they are.
TEST(HsdpRedundancyTest, ALostNodeIsCopiedFromReplicasElsewhereAndLosingEveryCopyIsNamed) {
  auto pool = Pool::Create(int64_t{64} << 20);
  ASSERT_TRUE(pool.ok());
  for (auto [nodes, locals] : std::vector<std::pair<int, int>>{{2, 2}, {4, 1}}) {
    RedundancyScheme scheme = SchemeOf(*ParseRedundancy("redundancy", "hsdp"));
    scheme.shard_ranks = 2;
    std::vector<std::string> names;
    for (int n = 0; n < nodes; ++n) names.push_back(absl::StrCat("n", n));
    // Rank q holds its shard position's state (q mod 2).
    std::vector<NodeState> states(static_cast<size_t>(nodes));
    for (int n = 0; n < nodes; ++n) {
      for (int l = 0; l < locals; ++l) {
        states[n].ranks.push_back(MakeState((n * locals + l) % 2, 1, 11).ranks[0]);
      }
    }
    auto rebuild = [&](const std::vector<int>& lost, std::vector<NodeState>* placed) {
      placed->assign(static_cast<size_t>(nodes), NodeState());
      std::vector<absl::StatusOr<int64_t>> results(static_cast<size_t>(nodes), int64_t{0});
      testing::MemFabric fabric(nodes);
      OnEveryNode(&fabric, nodes, [&](int n, Comm& comm) {
        NodeRedundancy node(scheme, n, names, locals, pool->get());
        const bool replaced = std::find(lost.begin(), lost.end(), n) != lost.end();
        NodeState& mine = (*placed)[n];
        mine.ranks.resize(static_cast<size_t>(locals));
        EXPECT_TRUE(node.Protect(comm, states[n].Segments(), 1, absl::Now(), 1).ok());
        EXPECT_EQ(node.parity_bytes(), 0);
        const PlaceSegment place = [&](int l, const std::string& name,
                                       int64_t bytes) -> absl::StatusOr<StateSegment> {
          std::string& b = mine.ranks[static_cast<size_t>(l)][name];
          b.assign(static_cast<size_t>(bytes), '\0');
          return StateSegment{name, b.data(), bytes};
        };
        results[n] = node.Rebuild(
            comm, replaced,
            replaced ? std::vector<std::vector<StateSegment>>(static_cast<size_t>(locals))
                     : states[n].Segments(),
            1, place, absl::Now() + absl::Seconds(30), 2);
      });
      return results;
    };
    std::vector<NodeState> placed;
    auto one = rebuild({1}, &placed);
    for (int n = 0; n < nodes; ++n) ASSERT_TRUE(one[n].ok()) << nodes << " " << one[n].status();
    EXPECT_GT(*one[1], 0);
    EXPECT_EQ(placed[1].ranks, states[1].ranks) << nodes;
    if (nodes == 4) {
      // Nodes 1 and 3 hold the only copies of position 1.
      auto both = rebuild({1, 3}, &placed);
      for (int n = 0; n < nodes; ++n) {
        ASSERT_FALSE(both[n].ok()) << n;
        EXPECT_THAT(both[n].status().message(),
                    HasSubstr("every HSDP replica of rank 1's shards was lost"));
      }
      // Nodes 1 and 2: each has its copy on a node that kept it.
      auto two = rebuild({1, 2}, &placed);
      for (int n = 0; n < nodes; ++n) ASSERT_TRUE(two[n].ok()) << n << two[n].status();
      EXPECT_EQ(placed[2].ranks, states[2].ranks);
    }
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

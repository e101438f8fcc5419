// Baseline layouts on hand-computed cases, and the shared metric code against element-by-element
// brute force.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "engine/layout.h"
#include "engine/models.h"
#include "engine/planner.h"

namespace ragshard {
namespace {

Inventory Parse(const std::string& json) {
  auto inv = ParseInventoryJson(json);
  EXPECT_TRUE(inv.ok()) << inv.status();
  return *inv;
}

PolicyResult RunP(const Inventory& inv, Policy p, int64_t w) {
  PlanOptions o;
  o.policy = p;
  o.world = w;
  auto r = RunPolicy(inv, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

TEST(BaselinesTest, Fsdp2ChunksDim0AndPadsToCeilRows) {
  Inventory inv = Parse(R"({"units": [{"name": "u", "tensors": [
      {"name": "w", "shape": [10, 4], "dtype": "bf16"}]}]})");
  PolicyResult r = RunP(inv, Policy::kFsdp2, 4);
  ASSERT_EQ(r.layout.groups.size(), 1u);
  EXPECT_EQ(r.layout.groups[0].per_rank_elems, 12);  // ceil(10/4) = 3 rows of 4
  EXPECT_EQ(r.metrics.padding_elems(), 8);
  EXPECT_DOUBLE_EQ(r.metrics.imbalance(), 12.0 / 10.0);
  std::vector<Segment> segs = TensorSegments(r.layout.groups[0].tensors[0]);
  ASSERT_EQ(segs.size(), 4u);
  EXPECT_EQ(segs[3].rank, 3);
  EXPECT_EQ(segs[3].tensor_begin, 36);
  EXPECT_EQ(segs[3].count, 4);
  // Copy-in + copy-out of the all-gather twice, and the reduce-scatter copy-in:
  // 2 * (24 + 96) + 96 bytes.
  EXPECT_EQ(r.metrics.copy_bytes_per_step(), 2 * (24 + 96) + 96);
}

TEST(BaselinesTest, Zero3PartitionsEachParameterInCeilNumelOverW) {
  Inventory inv = Parse(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [10], "dtype": "fp32"}, {"name": "b", "shape": [3], "dtype": "fp32"}]}]})");
  PolicyResult r = RunP(inv, Policy::kZero3, 4);
  EXPECT_EQ(r.layout.groups[0].per_rank_elems, 3 + 1);
  EXPECT_EQ(r.metrics.padding_elems(), 16 - 13);
  EXPECT_GT(r.metrics.copy_bytes_per_step(), 0);
}

TEST(BaselinesTest, Fsdp1AlignsStartsTo16BytesAndPadsToW) {
  Inventory inv = Parse(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [3], "dtype": "bf16"}, {"name": "b", "shape": [5], "dtype": "bf16"}]}]})");
  PolicyResult r = RunP(inv, Policy::kFsdp1, 4);
  const auto& g = r.layout.groups[0];
  EXPECT_EQ(g.tensors[1].start, 8);         // 16 bytes = 8 bf16
  EXPECT_EQ(g.per_rank_elems, 4);           // ceil(13 / 4)
  EXPECT_EQ(r.metrics.padding_elems(), 8);  // 16 - 8 real elements
  EXPECT_EQ(r.metrics.copy_bytes_per_step(), 0);
}

TEST(BaselinesTest, MegatronDOReversesPads64AndPadsBucketEnds) {
  Inventory inv = Parse(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [100], "dtype": "fp32"}, {"name": "b", "shape": [30], "dtype": "fp32"}]}]})");
  PolicyResult r = RunP(inv, Policy::kMegatronDO, 4);
  ASSERT_EQ(r.layout.groups.size(), 1u);
  const auto& g = r.layout.groups[0];
  EXPECT_EQ(*g.tensors[0].name, "b");  // reverse order
  EXPECT_EQ(g.tensors[0].start, 0);
  EXPECT_EQ(g.tensors[1].start, 64);
  EXPECT_EQ(g.per_rank_elems, 256 / 4);  // 164 padded to lcm(4, 128) = 128
  EXPECT_EQ(r.metrics.padding_elems(), 256 - 130);
}

TEST(BaselinesTest, MegatronDOClosesBucketsAtTheBucketSize) {
  Inventory inv = Parse(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [30000000], "dtype": "fp32"},
      {"name": "b", "shape": [30000000], "dtype": "fp32"},
      {"name": "c", "shape": [20000000], "dtype": "fp32"}]}]})");
  PolicyResult r = RunP(inv, Policy::kMegatronDO, 8);
  ASSERT_EQ(r.layout.groups.size(), 2u);  // [c, b] reaches 40M and closes, then [a]
  EXPECT_EQ(r.layout.groups[0].tensors.size(), 2u);
}

TEST(BaselinesTest, MegatronFsdpUsesTheLcmOfRowSizes) {
  Inventory inv = Parse(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [4, 6], "dtype": "bf16"}, {"name": "b", "shape": [5, 4], "dtype": "bf16"},
      {"name": "c", "shape": [3], "dtype": "bf16"}]}]})");
  PolicyResult r = RunP(inv, Policy::kMegatronFsdp, 2);
  const auto& g = r.layout.groups[0];
  EXPECT_EQ(g.tensors[0].start, 0);
  EXPECT_EQ(g.tensors[1].start, 24);
  EXPECT_EQ(g.tensors[2].start, 44);  // the fragment fills b's gap
  EXPECT_EQ(g.per_rank_elems, 24);    // 48 = 2 * lcm(6, 4, 1)
  EXPECT_EQ(r.metrics.padding_elems(), 1);
}

TEST(BaselinesTest, RaggedNeverSplitsBlocksThatBaselinesSplit) {
  auto inv = GenerateModel("llama3-8b");
  ASSERT_TRUE(inv.ok());
  ApplyGranule(&*inv, *ParseGranule("rows:128"));
  PolicyResult ragged = RunP(*inv, Policy::kRagged, 1024);
  PolicyResult fsdp2 = RunP(*inv, Policy::kFsdp2, 1024);
  EXPECT_EQ(ragged.metrics.blocks128_split(), 0);
  EXPECT_GT(fsdp2.metrics.blocks128_split(), 0);
  EXPECT_EQ(ragged.metrics.blocks128_total(), fsdp2.metrics.blocks128_total());
  for (Policy p : AllPolicies()) {
    PolicyResult r = RunP(*inv, p, 1024);
    EXPECT_EQ(r.metrics.total_elems(), 8'030'261'248) << PolicyName(p);
    EXPECT_GE(r.metrics.padding_elems(), 0) << PolicyName(p);
    EXPECT_GE(r.metrics.imbalance(), 1.0) << PolicyName(p);
  }
}

// The metric code against a direct computation: the rank of every element, then each block's
// set of ranks.
TEST(LayoutMetricsTest, SplitBlocksMatchElementByElementCount) {
  std::mt19937 rng(11);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int k = 0; k < 3000; ++k) {
    google::protobuf::RepeatedField<int64_t> shape;
    const int dims = uni(2, 3);
    if (dims == 3) shape.Add(uni(1, 3));
    shape.Add(uni(1, 20));
    shape.Add(uni(1, 20));
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    std::string name = "t";
    TensorLayout t{&name, &shape, numel, uni(0, 60), uni(1, 50), 0};
    const int64_t block = uni(2, 5);
    const int64_t rows = shape.Get(shape.size() - 2), cols = shape.Get(shape.size() - 1);
    const int64_t mats = numel / (rows * cols);
    int64_t split = 0, total = 0;
    for (int64_t m = 0; m < mats; ++m) {
      for (int64_t br = 0; br < rows; br += block) {
        for (int64_t bc = 0; bc < cols; bc += block) {
          ++total;
          std::set<int64_t> ranks;
          for (int64_t r = br; r < std::min(rows, br + block); ++r) {
            for (int64_t c = bc; c < std::min(cols, bc + block); ++c) {
              ranks.insert((t.start + m * rows * cols + r * cols + c) / t.period);
            }
          }
          if (ranks.size() > 1) ++split;
        }
      }
    }
    BlockCount got = CountSplitBlocks(t, block);
    ASSERT_EQ(got.total, total);
    ASSERT_EQ(got.split, split) << "shape " << shape.Get(0) << "x" << shape.Get(1) << " start "
                                << t.start << " period " << t.period << " block " << block;
    int64_t covered = 0;
    for (const Segment& s : TensorSegments(t)) {
      ASSERT_EQ(s.tensor_begin, covered);
      ASSERT_EQ(s.rank, (t.start + s.tensor_begin) / t.period);
      covered += s.count;
    }
    ASSERT_EQ(covered, numel);
  }
}

}  // namespace
}  // namespace ragshard

#include "engine/planner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/models.h"
#include "engine/unit_solver.h"
#include "engine/validator.h"

namespace ragshard {
namespace {

Inventory Model(const std::string& name, const std::string& granule) {
  auto inv = GenerateModel(name);
  EXPECT_TRUE(inv.ok()) << inv.status();
  ApplyGranule(&*inv, *ParseGranule(granule));
  return *inv;
}

v1::Plan MustPlan(const Inventory& inv, Policy policy, int64_t world, int32_t align = 16) {
  PlanOptions o;
  o.policy = policy;
  o.world = world;
  o.align_bytes = align;
  auto plan = BuildPlan(inv, o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::Plan();
}

struct ZooCase {
  std::string model;
  int64_t world;
  std::string granule;
};

void PrintTo(const ZooCase& c, std::ostream* os) {
  *os << c.model << " W=" << c.world << " " << c.granule;
}

class ZooPlanTest : public ::testing::TestWithParam<ZooCase> {};

// Every plan from ragged and ragged-paper passes the validator; ragged is never worse than
// ragged-paper on any unit; block splits are zero when the granule holds the blocks.
TEST_P(ZooPlanTest, PlansAreValidAndRaggedBeatsPaper) {
  const ZooCase& c = GetParam();
  Inventory inv = Model(c.model, c.granule);
  v1::Plan ragged = MustPlan(inv, Policy::kRagged, c.world);
  v1::Plan paper = MustPlan(inv, Policy::kRaggedPaper, c.world);
  ASSERT_TRUE(ValidatePlan(ragged, &inv).ok()) << ValidatePlan(ragged, &inv);
  ASSERT_TRUE(ValidatePlan(paper, &inv).ok()) << ValidatePlan(paper, &inv);
  ASSERT_EQ(ragged.units_size(), paper.units_size());
  for (int u = 0; u < ragged.units_size(); ++u) {
    EXPECT_LE(ragged.units(u).shard_elems(), paper.units(u).shard_elems())
        << ragged.units(u).unit();
    EXPECT_GE(ragged.units(u).shard_elems() * c.world, ragged.units(u).metrics().lb2_elems());
  }
  EXPECT_LE(ragged.metrics().padding_elems(), paper.metrics().padding_elems());
  EXPECT_GE(ragged.metrics().lb2_gap_pct(), 0.0);
  EXPECT_GE(ragged.metrics().lb1_gap_pct(), ragged.metrics().lb2_gap_pct());
  if (c.granule == "rows:128") {
    EXPECT_EQ(ragged.metrics().blocks128_split(), 0);
  }
  if (c.granule == "rows:128" || c.granule == "rows:32") {
    EXPECT_EQ(ragged.metrics().blocks32_split(), 0);
  }
  EXPECT_EQ(ragged.metrics().copy_bytes_per_step(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Zoo, ZooPlanTest,
    ::testing::Values(ZooCase{"llama3-8b", 8, "rows:128"}, ZooCase{"llama3-8b", 64, "element"},
                      ZooCase{"llama3-8b", 1024, "rows:32"}, ZooCase{"llama3-70b", 256, "rows:128"},
                      ZooCase{"gpt3-175b", 64, "rows:1"}, ZooCase{"mixtral-8x7b", 8192, "rows:128"},
                      ZooCase{"qwen3-235b-a22b", 64, "rows:128"},
                      ZooCase{"mixtral-8x7b:grouped", 64, "rows:128"},
                      ZooCase{"llama-30b", 8, "rows:32"}, ZooCase{"deepseek-v3", 1024, "rows:128"}),
    [](const auto& info) {
      std::string n =
          info.param.model + "_W" + std::to_string(info.param.world) + "_" + info.param.granule;
      for (char& ch : n) {
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return n;
    });

TEST(PlannerTest, PlansAreDeterministicByteForByte) {
  Inventory inv = Model("qwen3-235b-a22b", "rows:128");
  for (Policy p : {Policy::kRagged, Policy::kRaggedPaper}) {
    std::string a, b;
    ASSERT_TRUE(MustPlan(inv, p, 512).SerializeToString(&a));
    ASSERT_TRUE(MustPlan(inv, p, 512).SerializeToString(&b));
    EXPECT_EQ(a, b);
  }
}

TEST(PlannerTest, SplitIsStoredSparsely) {
  // W = 65536 with 45k tensors: each tensor stores only the ranks it touches.
  Inventory inv = Model("deepseek-v3", "rows:128");
  v1::Plan plan = MustPlan(inv, Policy::kRagged, 65536);
  int64_t counts = 0, tensors = 0;
  for (const auto& u : plan.units()) {
    for (const auto& t : u.tensors()) {
      counts += t.rank_elems_size();
      ++tensors;
    }
  }
  EXPECT_LT(counts, 3 * tensors);
  EXPECT_TRUE(ValidatePlan(plan, &inv).ok());
}

TEST(PlannerTest, MixedDtypeUnitsBecomeOneUnitPlanPerDtype) {
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "w", "shape": [64, 16], "dtype": "bf16", "granule": "rows:8"},
      {"name": "scale", "shape": [8, 2], "dtype": "fp32"},
      {"name": "b", "shape": [16], "dtype": "bf16"}]}]})");
  ASSERT_TRUE(inv.ok());
  v1::Plan plan = MustPlan(*inv, Policy::kRagged, 4);
  ASSERT_EQ(plan.units_size(), 2);
  EXPECT_EQ(plan.units(0).dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(plan.units(0).tensors_size(), 2);
  EXPECT_EQ(plan.units(1).dtype(), v1::DTYPE_FP32);
  EXPECT_TRUE(ValidatePlan(plan, &*inv).ok());
}

TEST(PlannerTest, AlignmentIsInBytesOfTheDtype) {
  // 16 bytes = 8 bf16 elements: tensors of 3 elements start at multiples of 8.
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [3], "dtype": "bf16"}, {"name": "b", "shape": [3], "dtype": "bf16"},
      {"name": "c", "shape": [3], "dtype": "bf16"}]}]})");
  ASSERT_TRUE(inv.ok());
  v1::Plan aligned = MustPlan(*inv, Policy::kRagged, 2, 16);
  for (const auto& t : aligned.units(0).tensors()) EXPECT_EQ(t.offset() % 8, 0);
  EXPECT_EQ(aligned.units(0).shard_elems() % 8, 0);
  v1::Plan packed = MustPlan(*inv, Policy::kRagged, 2, 1);
  EXPECT_EQ(packed.units(0).shard_elems(), 5);  // ceil(9 / 2)
  EXPECT_TRUE(ValidatePlan(aligned, &*inv).ok());
  EXPECT_TRUE(ValidatePlan(packed, &*inv).ok());
}

TEST(PlannerTest, OwnersAreBalancedAndPreferHolders) {
  Inventory inv = Model("llama3-8b", "rows:128");
  v1::Plan plan = MustPlan(inv, Policy::kRagged, 8);
  int64_t matrices = 0;
  for (const auto& u : plan.units()) {
    for (const auto& t : u.tensors()) {
      if (t.optimizer() == v1::OPTIMIZER_MATRIX) {
        ++matrices;
        EXPECT_GE(t.owner_rank(), 0);
        EXPECT_LT(t.owner_rank(), 8);
      } else {
        EXPECT_EQ(t.owner_rank(), -1);
      }
    }
  }
  EXPECT_EQ(matrices, 32 * 7);
  EXPECT_LT(plan.metrics().owner_load_max_over_mean(), 1.1);
  EXPECT_GT(plan.metrics().owner_locality(), 0.5);
}

// Owners are balanced by each optimizer's own cost. A tall 4096 x 64 matrix is cheap for
// Newton-Schulz (m^2 n with m = 64) and dear for Shampoo (its 4096 x 4096 left factor), next to
// four 1024 x 1024 matrices; Shampoo's blocked variant makes every 64 x 64 block cost the same.
TEST(PlannerTest, OwnersAreBalancedByTheOptimizersCost) {
  auto plan_for = [](const std::string& opt) {
    std::string tensors = R"({"name": "tall", "shape": [4096, 64], "dtype": "fp32",
                              "optimizer": ")" +
                          opt + R"("})";
    for (int i = 0; i < 4; ++i) {
      tensors += absl::StrCat(R"(, {"name": "sq)", i,
                              R"(", "shape": [1024, 1024], "dtype": "fp32", "optimizer": ")", opt,
                              R"("})");
    }
    auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [)" + tensors + "]}]}");
    EXPECT_TRUE(inv.ok()) << inv.status();
    v1::Plan plan = MustPlan(*inv, Policy::kRagged, 2);
    EXPECT_TRUE(ValidatePlan(plan, &*inv).ok());
    return plan;
  };
  // The squares the tall matrix's owner also owns.
  auto with_tall = [](const v1::Plan& plan) {
    const auto& t = plan.units(0).tensors();
    int64_t tall = -1, n = 0;
    for (const auto& tp : t) {
      if (tp.name() == "tall") tall = tp.owner_rank();
    }
    for (const auto& tp : t) n += tp.name() != "tall" && tp.owner_rank() == tall;
    return n;
  };
  v1::Plan muon = plan_for("matrix");
  EXPECT_EQ(with_tall(muon), 2);  // the squares split 2 + 2; the tall one hardly counts
  v1::Plan shampoo = plan_for("shampoo");
  // 4096^3 for the tall one's root outweighs the four squares together (7.3e10 vs 4.3e10).
  EXPECT_EQ(with_tall(shampoo), 0);
  EXPECT_GT(shampoo.metrics().owner_load_max_over_mean(), 1.2);
  for (const auto& tp : shampoo.units(0).tensors()) {
    EXPECT_EQ(tp.optimizer(), v1::OPTIMIZER_SHAMPOO);
    EXPECT_EQ(tp.shampoo_block(), 0);
  }
  v1::Plan blocked = plan_for("shampoo:64");
  EXPECT_EQ(blocked.units(0).tensors(0).shampoo_block(), 64);
  // 64 x 64 blocks: 64 of the tall one, 256 of each square; 2 squares per owner, and the tall
  // one on top of one of them: 576 / 544 blocks.
  EXPECT_EQ(with_tall(blocked), 2);
  EXPECT_NEAR(blocked.metrics().owner_load_max_over_mean(), 576.0 / 544.0, 1e-9);
}

TEST(PlannerTest, PaddingMatchesTheLowerBoundFiguresOfTheDesign) {
  // docs/design.md: DeepSeek-V3 with rows:128 and one layer per unit pads about 1.6 % at W=64,
  // 9.9 % at W=256 and 42 % at W=1024, and that padding is LB2 itself. (The zoo's model has a
  // dense layer's attention as a unit of its own, "attn.<i>"; one layer per unit joins it back.)
  Inventory split = Model("deepseek-v3", "rows:128");
  Inventory inv;
  for (const auto& u : split.units()) {
    if (absl::StartsWith(u.name(), "attn.") || inv.units_size() == 0 ||
        !absl::StartsWith(inv.units(inv.units_size() - 1).name(), "attn.")) {
      *inv.add_units() = u;
      continue;
    }
    auto* layer = inv.mutable_units(inv.units_size() - 1);  // its attention, then its MLP
    layer->set_name(u.name());
    for (const auto& t : u.tensors()) *layer->add_tensors() = t;
  }
  ASSERT_EQ(inv.units_size(), 63);
  ASSERT_EQ(split.units_size(), 66);
  const std::vector<std::pair<int64_t, double>> cases = {{64, 1.6}, {256, 9.9}, {1024, 42.0}};
  for (const auto& [w, pct] : cases) {
    v1::Plan plan = MustPlan(inv, Policy::kRagged, w);
    EXPECT_NEAR(plan.metrics().padding_pct(), pct, 0.1 * pct) << "W=" << w;
    EXPECT_LT(plan.metrics().lb2_gap_pct(), 0.1) << "W=" << w;
  }
}

TEST(PlannerTest, BadOptionsAreRejected) {
  Inventory inv = Model("llama3-8b", "element");
  PlanOptions o;
  o.world = 0;
  EXPECT_EQ(BuildPlan(inv, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.world = kMaxWorld + 1;
  EXPECT_EQ(BuildPlan(inv, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.world = 8;
  o.align_bytes = 0;
  EXPECT_EQ(BuildPlan(inv, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.align_bytes = 16;
  o.policy = Policy::kFsdp2;
  EXPECT_EQ(BuildPlan(inv, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlannerTest, HugeUnitsAtHugeWorldDoNotOverflow) {
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [1048576, 1048576, 1024], "dtype": "bf16", "granule": "whole"}]}]})");
  ASSERT_TRUE(inv.ok()) << inv.status();
  PlanOptions o;
  o.world = kMaxWorld;
  auto plan = BuildPlan(*inv, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(plan.status().message()), ::testing::HasSubstr("unit 'u'"));
}

TEST(PlannerTest, PolicyNamesRoundTrip) {
  for (Policy p : AllPolicies()) EXPECT_EQ(*ParsePolicy(PolicyName(p)), p);
  EXPECT_FALSE(ParsePolicy("fsdp3").ok());
}

}  // namespace
}  // namespace ragshard

// Padding in the strategy search: on the model zoo at W = 1024 on 8 x H100 nodes with 128-row
// granules and 80 GiB, every recommendation fits and pads under 1 %, or the search proves that
// no strategy can (its lower bounds, over its candidates and over any grouping of the units),
// and the bounds hold for every candidate and are reached.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/models.h"
#include "engine/strategy_search.h"
#include "engine/unit_grouping.h"
#include "tests/engine/tiny_profile.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;

constexpr double kBudget = 80.0 * (int64_t{1} << 30);

struct Searched {
  absl::StatusOr<Advice> advice;
  double wall_seconds = 0;
};

Searched AdviseZoo(const std::string& name, int64_t world, int64_t budget) {
  auto inv = GenerateModel(name);
  EXPECT_TRUE(inv.ok()) << inv.status();
  ApplyGranule(&*inv, {v1::GRANULE_ROWS, 128});
  auto profile =
      LoadClusterProfile(absl::StrCat(RAGSHARD_SOURCE_DIR, "/profiles/h100-8x-nvlink-ib400.json"));
  EXPECT_TRUE(profile.ok()) << profile.status();
  auto sized = WithWorld(*profile, world);
  EXPECT_TRUE(sized.ok()) << sized.status();
  CostOptions o;
  o.memory_budget_bytes = budget;
  o.tokens_per_step = world * 4096;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = StrategyModel::Create(*inv, DeriveModelShape(*inv, name), *sized, o);
  EXPECT_TRUE(model.ok()) << model.status();
  Searched s{Advise(model->get())};
  s.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

// The three models whose executable recommendations padded 7.59 %, 9.40 % and 1.93 % when
// padding was only a filter: each now meets the target or carries a bound above it that its
// recommendation reaches.
TEST(StrategyPaddingTest, EveryZooModelAtW1024PadsUnderOnePercentOrProvesItCannot) {
  const std::set<std::string> bounded = {"deepseek-v3", "llama3.1-405b", "gpt3-175b"};
  for (const ModelInfo& info : ModelZoo()) {
    SCOPED_TRACE(info.name);
    const Searched s = AdviseZoo(info.name, 1024, static_cast<int64_t>(kBudget));
    ASSERT_TRUE(s.advice.ok()) << s.advice.status();
    const Advice& a = *s.advice;
    const Evaluation& r = a.recommendation;
    EXPECT_LE(r.memory.total(), kBudget);
    EXPECT_LT(s.wall_seconds, 2.0);
    if (!bounded.count(info.name)) {
      EXPECT_TRUE(a.padding_target_met);
      EXPECT_LT(r.padding_pct, 1.0);
      continue;
    }
    if (a.padding_target_met) {
      EXPECT_LT(r.padding_pct, 1.0);
      continue;
    }
    // Unreachable: both bounds are above the target, the recommendation is the least padding
    // that fits and reaches the bound over any grouping, and the reason names the granules.
    EXPECT_GE(a.padding_bound_pct, 1.0);
    EXPECT_GE(a.any_grouping_bound_pct, 1.0);
    EXPECT_LE(a.any_grouping_bound_pct, a.padding_bound_pct + 1e-9);
    EXPECT_NEAR(a.best_padding_pct, r.padding_pct, 0.01);
    EXPECT_GE(r.padding_pct, a.padding_bound_pct - 1e-9);
    EXPECT_LT(r.padding_pct, a.any_grouping_bound_pct + 0.01);
    EXPECT_THAT(a.padding_bound_why, HasSubstr("LB2"));
    EXPECT_THAT(a.padding_bound_why, HasSubstr("granule"));
    EXPECT_THAT(a.any_grouping_bound_why, HasSubstr("|os| = 1024"));
    // No candidate that fits pads less than the bound over the search's candidates.
    for (const Evaluation& e : a.rejected) {
      if (e.memory_lower_bound || e.memory.total() > kBudget) continue;
      EXPECT_GE(e.padding_pct, a.padding_bound_pct - 1e-9) << StrategyName(e.strategy);
    }
  }
}

TEST(StrategyPaddingTest, TheBoundsNameWhyEachModelPads) {
  // llama3.1-405b: down_proj's 128-row granule (2^19 x 13) and the others' 2^21 force every
  // shard of a layer to a multiple of 2^21 x 13 = 27,262,976 elements.
  Searched s = AdviseZoo("llama3.1-405b", 1024, static_cast<int64_t>(kBudget));
  ASSERT_TRUE(s.advice.ok()) << s.advice.status();
  EXPECT_THAT(s.advice->padding_bound_why, HasSubstr("a multiple of 27262976"));
  EXPECT_THAT(s.advice->padding_bound_why, HasSubstr("down_proj"));
  // gpt3-175b: fc2's granule 2^21 x 3 with the others' 2^19 x 3.
  s = AdviseZoo("gpt3-175b", 1024, static_cast<int64_t>(kBudget));
  ASSERT_TRUE(s.advice.ok()) << s.advice.status();
  EXPECT_THAT(s.advice->padding_bound_why, HasSubstr("a multiple of 6291456"));
  // deepseek-v3: the MoE layers' o_proj (granule 2^21) at 512 positions.
  s = AdviseZoo("deepseek-v3", 1024, static_cast<int64_t>(kBudget));
  ASSERT_TRUE(s.advice.ok()) << s.advice.status();
  EXPECT_THAT(s.advice->padding_bound_why, HasSubstr("o_proj"));
  EXPECT_THAT(s.advice->padding_bound_why, HasSubstr("|os| = 512"));
}

// Four layers of one [704, 64] bf16 matrix with 64-row granules (4,096 elements: 11 per
// matrix), 1,100,000 bytes per device, Adam, no prefetch, one token of activations. By hand:
// optimizer states over 4 devices are needed (18 bytes per element of 180,224 over 2 devices
// is 1,622,016). At 4 positions a layer's even share, 11,264, is under half the matrix, so two
// cuts fall inside it and the shard is a multiple of 4,096: 12,288, padding 4,096 per layer
// (9.09 %). Two layers per unit could pad nothing as far as LB2 knows (an even share of
// 22,528 holds one cut), but their unsharded buffers, 2 x 180,224 bytes, do not fit beside the
// 811,008 bytes of shards.
// So the search reaches 9.09 % (k = 1 over 2 x 2) and both bounds prove nothing pads less.
TEST(StrategyPaddingTest, TheBoundsOnAHandComputedModel) {
  Inventory inv;
  for (int l = 0; l < 4; ++l) {
    UnitSpec* u = inv.add_units();
    u->set_name(absl::StrCat("layers.", l));
    TensorSpec* t = u->add_tensors();
    t->set_name(absl::StrCat("layers.", l, ".w"));
    t->add_shape(704);
    t->add_shape(64);
    t->set_dtype(v1::DTYPE_BF16);
    t->set_granule_kind(v1::GRANULE_ROWS);
    t->set_granule_rows(64);
    t->set_optimizer(v1::OPTIMIZER_ELEMENTWISE);
  }
  auto profile = ParseClusterProfile(kTinyProfile);
  ASSERT_TRUE(profile.ok()) << profile.status();
  CostOptions o;
  o.memory_budget_bytes = 1100000;
  o.prefetch_depths = {0};
  o.micro_batch_tokens = 1;
  auto model = StrategyModel::Create(inv, {/*hidden=*/1, /*layers=*/4, 1}, *profile, o);
  ASSERT_TRUE(model.ok()) << model.status();
  auto advice = Advise(model->get());
  ASSERT_TRUE(advice.ok()) << advice.status();
  const double want = 100.0 * 4 * 4096 / (4 * 45056);
  EXPECT_FALSE(advice->padding_target_met);
  EXPECT_EQ(StrategyName(advice->recommendation.strategy), "k=1,shard=2x2,prefetch=0");
  EXPECT_NEAR(advice->recommendation.padding_pct, want, 1e-9);
  EXPECT_NEAR(advice->best_padding_pct, want, 1e-9);
  EXPECT_NEAR(advice->padding_bound_pct, want, 1e-9);
  EXPECT_NEAR(advice->any_grouping_bound_pct, want, 1e-9);
  EXPECT_THAT(advice->padding_bound_why, HasSubstr("a multiple of 4096"));
  EXPECT_THAT(advice->padding_bound_why, HasSubstr("at least 12288 elements"));
  EXPECT_THAT(advice->any_grouping_bound_why, HasSubstr("|os| = 2: no grouping fits"));
  EXPECT_THAT(advice->any_grouping_bound_why,
              HasSubstr("|os| = 4: at least 9.091% (units of at most 1 layer unit)"));
  // With room for four layers per unit (each matrix one whole shard) the target is met.
  o.memory_budget_bytes = 1600000;
  model = StrategyModel::Create(inv, {1, 4, 1}, *profile, o);
  ASSERT_TRUE(model.ok()) << model.status();
  advice = Advise(model->get());
  ASSERT_TRUE(advice.ok()) << advice.status();
  EXPECT_TRUE(advice->padding_target_met);
  EXPECT_LT(advice->recommendation.padding_pct, 1.0);
}

TEST(StrategyPaddingTest, ABudgetBelowEveryNeedNamesTheSmallest) {
  for (const char* name : {"deepseek-v3", "llama3.1-405b", "gpt3-175b"}) {
    SCOPED_TRACE(name);
    const Searched s = AdviseZoo(name, 1024, int64_t{20} << 30);
    ASSERT_EQ(s.advice.status().code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(s.advice.status().message());
    EXPECT_THAT(msg, HasSubstr("no strategy fits the memory budget of 20.00 GiB"));
    const int64_t need = std::stoll(msg.substr(msg.find('(', msg.find("the smallest needs")) + 1));
    EXPECT_GT(need, int64_t{20} << 30);
    EXPECT_TRUE(AdviseZoo(name, 1024, need).advice.ok());
  }
}

}  // namespace
}  // namespace ragshard

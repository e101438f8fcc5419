#include "ctl/strategy_render.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/models.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

using ::testing::HasSubstr;

class StrategyRenderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto inv = GenerateModel("llama-13b");
    ASSERT_TRUE(inv.ok());
    ApplyGranule(&*inv, {v1::GRANULE_ROWS, 128});
    auto profile = LoadClusterProfile(
        absl::StrCat(RAGSHARD_SOURCE_DIR, "/profiles/h100-8x-nvlink-ib400.json"));
    ASSERT_TRUE(profile.ok()) << profile.status();
    auto m =
        StrategyModel::Create(*inv, DeriveModelShape(*inv, "llama-13b"), *profile, CostOptions{});
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    auto advice = Advise(model_.get());
    ASSERT_TRUE(advice.ok()) << advice.status();
    advice_ = std::move(*advice);
    ASSERT_GT(advice_.rejected.size(), 2u);
  }
  std::unique_ptr<StrategyModel> model_;
  Advice advice_;
};

TEST_F(StrategyRenderTest, AdviceJsonCarriesTheRecommendationAndBoundsTheRejections) {
  auto j = nlohmann::json::parse(AdviceJson(advice_, *model_, 2));
  for (const char* key : {"padding_pct", "predicted_step_seconds", "memory_bytes", "strategy"}) {
    EXPECT_TRUE(j["recommendation"].contains(key)) << key;
  }
  EXPECT_EQ(j["recommendation"]["strategy"]["spec"], StrategyName(advice_.recommendation.strategy));
  ASSERT_TRUE(j["candidates"].is_array());
  EXPECT_EQ(j["candidates"].size(), advice_.top.size());
  EXPECT_EQ(j["rejected"].size(), 2u);
}

TEST_F(StrategyRenderTest, TheTableAndTheSimulationNameTheStrategyAndItsMemory) {
  const std::string name = StrategyName(advice_.recommendation.strategy);
  const std::string table = AdviceTable(advice_, *model_, 1);
  EXPECT_THAT(table, HasSubstr(name));
  EXPECT_THAT(table, HasSubstr(FormatBytes(advice_.recommendation.memory.total())));
  EXPECT_THAT(table, HasSubstr("--max-rejected"));
  auto e = model_->Evaluate(advice_.recommendation.strategy, /*detail=*/true);
  ASSERT_TRUE(e.ok()) << e.status();
  const std::string report = SimulationReport(*e, *model_);
  EXPECT_THAT(report, HasSubstr(name));
  EXPECT_THAT(report, HasSubstr(e->units.front().name));
  auto ej = nlohmann::json::parse(EvaluationJson(*e));
  EXPECT_EQ(ej["spec"], name);
  EXPECT_EQ(ej["units"].size(), e->units.size());
}

}  // namespace
}  // namespace ragshard

#include "engine/models.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ragshard {
namespace {

struct Totals {
  int64_t params = 0;
  int64_t tensors = 0;
  int64_t max_rank = 0;
};

Totals Count(const Inventory& inv) {
  Totals t;
  for (const auto& u : inv.units()) {
    for (const auto& s : u.tensors()) {
      t.params += *TensorNumel(s);
      ++t.tensors;
      t.max_rank = std::max<int64_t>(t.max_rank, s.shape_size());
    }
  }
  return t;
}

TEST(ModelsTest, EveryZooModelMatchesThePublishedTotals) {
  ASSERT_EQ(ModelZoo().size(), 10u);
  for (const ModelInfo& info : ModelZoo()) {
    auto inv = GenerateModel(info.name);
    ASSERT_TRUE(inv.ok()) << info.name << ": " << inv.status();
    ASSERT_TRUE(ValidateInventory(*inv).ok()) << info.name;
    Totals t = Count(*inv);
    EXPECT_EQ(t.params, info.total_params) << info.name;
    if (info.tensors > 0) {
      EXPECT_EQ(t.tensors, info.tensors) << info.name;
    }
  }
}

TEST(ModelsTest, UnitsAreEmbedLayersAndHead) {
  auto inv = GenerateModel("llama3-8b");
  ASSERT_TRUE(inv.ok());
  ASSERT_EQ(inv->units_size(), 34);
  EXPECT_EQ(inv->units(0).name(), "embed");
  EXPECT_EQ(inv->units(1).name(), "layers.0");
  EXPECT_EQ(inv->units(33).name(), "head");
  EXPECT_EQ(inv->units(1).tensors_size(), 9);
}

TEST(ModelsTest, DeepSeekV3HasAbout45kTensors) {
  auto inv = GenerateModel("deepseek-v3");
  ASSERT_TRUE(inv.ok());
  Totals t = Count(*inv);
  EXPECT_EQ(t.tensors, 3 + 3 * 12 + 58 * 782);
  // embed, 3 dense layers as attention and MLP units, 58 MoE layers, head.
  EXPECT_EQ(inv->units_size(), 1 + 3 * 2 + 58 + 1);
  EXPECT_EQ(inv->units(1).name(), "attn.0");
  EXPECT_EQ(inv->units(2).name(), "layers.0");
  EXPECT_EQ(inv->units(7).name(), "layers.3");
}

TEST(ModelsTest, VariantsKeepTheTotals) {
  for (const char* base : {"mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3", "llama3-8b"}) {
    auto plain = GenerateModel(base);
    auto grouped = GenerateModel(std::string(base) + ":grouped:fused");
    ASSERT_TRUE(plain.ok() && grouped.ok()) << base;
    EXPECT_EQ(Count(*plain).params, Count(*grouped).params) << base;
    EXPECT_LT(Count(*grouped).tensors, Count(*plain).tensors) << base;
  }
  EXPECT_EQ(Count(*GenerateModel("deepseek-v3:grouped")).max_rank, 3);
}

TEST(ModelsTest, UnknownNamesAreErrors) {
  auto inv = GenerateModel("gpt5");
  ASSERT_FALSE(inv.ok());
  EXPECT_THAT(std::string(inv.status().message()), ::testing::HasSubstr("unknown model 'gpt5'"));
  EXPECT_FALSE(GenerateModel("llama3-8b:sparse").ok());
}

}  // namespace
}  // namespace ragshard

#include "engine/inventory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ragshard {
namespace {

using ::testing::HasSubstr;

TEST(InventoryTest, ParsesTheDocumentedFormat) {
  auto inv = ParseInventoryJson(R"({"units": [{"name": "layers.0", "tensors": [
      {"name": "layers.0.q.weight", "shape": [4096, 4096], "dtype": "bf16",
       "granule": "rows:128", "optimizer": "matrix"},
      {"name": "layers.0.norm.weight", "shape": [4096], "dtype": "fp32"},
      {"name": "layers.0.experts", "shape": [8, 256, 64], "dtype": "fp8e4m3", "granule": "whole"}
  ]}]})");
  ASSERT_TRUE(inv.ok()) << inv.status();
  ASSERT_EQ(inv->units_size(), 1);
  const auto& t = inv->units(0).tensors();
  EXPECT_EQ(t[0].granule_kind(), v1::GRANULE_ROWS);
  EXPECT_EQ(t[0].granule_rows(), 128);
  EXPECT_EQ(t[0].optimizer(), v1::OPTIMIZER_MATRIX);
  EXPECT_EQ(GranuleElems(t[0]), 128 * 4096);
  EXPECT_EQ(t[1].granule_kind(), v1::GRANULE_ELEMENT);  // default
  EXPECT_EQ(t[1].optimizer(), v1::OPTIMIZER_ELEMENTWISE);
  EXPECT_EQ(GranuleElems(t[1]), 1);
  EXPECT_EQ(GranuleElems(t[2]), 8 * 256 * 64);
}

TEST(InventoryTest, RowsGranuleOfShortTensorIsTheWholeTensor) {
  TensorSpec spec;
  spec.add_shape(576);
  spec.add_shape(7168);
  spec.set_dtype(v1::DTYPE_BF16);
  spec.set_granule_kind(v1::GRANULE_ROWS);
  spec.set_granule_rows(1024);
  EXPECT_EQ(GranuleElems(spec), 576 * 7168);
  spec.set_granule_rows(128);
  EXPECT_EQ(GranuleElems(spec), 128 * 7168);  // the last granule (64 rows) is shorter
}

TEST(InventoryTest, RoundTripsThroughJson) {
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [3, 5], "dtype": "fp16", "granule": "rows:2", "optimizer": "matrix"}
  ]}]})");
  ASSERT_TRUE(inv.ok());
  auto again = ParseInventoryJson(InventoryToJson(*inv));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), inv->SerializeAsString());
}

TEST(InventoryTest, ShampooAndItsBlockSideRoundTrip) {
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [300, 200], "dtype": "fp32", "optimizer": "shampoo"},
      {"name": "b", "shape": [300, 200], "dtype": "fp32", "optimizer": "shampoo:128"}
  ]}]})");
  ASSERT_TRUE(inv.ok()) << inv.status();
  const auto& t = inv->units(0).tensors();
  EXPECT_EQ(t[0].optimizer(), v1::OPTIMIZER_SHAMPOO);
  EXPECT_EQ(t[0].shampoo_block(), 0);
  EXPECT_EQ(t[1].shampoo_block(), 128);
  EXPECT_TRUE(WholeMatrix(t[1].optimizer()));
  EXPECT_EQ(OptimizerName(t[1]), "shampoo:128");
  auto again = ParseInventoryJson(InventoryToJson(*inv));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), inv->SerializeAsString());
  // A block side on another optimizer kind is refused.
  Inventory bad = *inv;
  bad.mutable_units(0)->mutable_tensors(0)->set_optimizer(v1::OPTIMIZER_MATRIX);
  bad.mutable_units(0)->mutable_tensors(0)->set_shampoo_block(64);
  absl::Status st = ValidateInventory(bad);
  EXPECT_THAT(std::string(st.message()), HasSubstr("'a' optimizer: shampoo_block 64"));
}

struct BadCase {
  const char* json;
  const char* expect;  // a substring the error must contain
};

class BadInventoryTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInventoryTest, IsRejectedWithAnErrorNamingTheField) {
  auto inv = ParseInventoryJson(GetParam().json);
  ASSERT_FALSE(inv.ok()) << GetParam().json;
  EXPECT_EQ(inv.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(inv.status().message()), HasSubstr(GetParam().expect));
}

#define T(body) "{\"units\": [{\"name\": \"u\", \"tensors\": [" body "]}]}"
INSTANTIATE_TEST_SUITE_P(
    Cases, BadInventoryTest,
    ::testing::Values(
        BadCase{"{\"units\": [", "malformed JSON"}, BadCase{"[]", "top level"},
        BadCase{"{}", "units: missing"}, BadCase{"{\"units\": []}", "no units"},
        BadCase{"{\"units\": [{\"name\": \"u\", \"tensors\": []}]}", "empty unit"},
        BadCase{T("{\"name\": \"a\", \"shape\": [0, 3], \"dtype\": \"bf16\"}"), "shape[0]"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4, -3], \"dtype\": \"bf16\"}"), "shape[1]"},
        BadCase{T("{\"name\": \"a\", \"shape\": [], \"dtype\": \"bf16\"}"), "rank >= 1"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4294967296, 4294967296], \"dtype\": \"bf16\"}"),
                "overflows int64"},
        BadCase{T("{\"name\": \"a\", \"shape\": [18446744073709551615], \"dtype\": \"bf16\"}"),
                "does not fit int64"},
        BadCase{T("{\"name\": \"a\", \"shape\": [1.5], \"dtype\": \"bf16\"}"), "not an integer"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf17\"}"), "unknown dtype"},
        BadCase{
            T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"granule\": \"rows:0\"}"),
            "at least 1"},
        BadCase{
            T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"granule\": \"rows:-2\"}"),
            "at least 1"},
        BadCase{
            T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"granule\": \"blocks\"}"),
            "expected element, rows:K or whole"},
        BadCase{
            T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"optimizer\": \"lion\"}"),
            "optimizer"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"optimizer\": "
                  "\"shampoo:0\"}"),
                "'shampoo:0': the block side after 'shampoo:' must be an integer in [1, 1048576]"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"optimizer\": "
                  "\"shampoo:x\"}"),
                "'shampoo:x'"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"optimizer\": "
                  "\"shampoo:99999999999999999999\"}"),
                "integer in [1, 1048576]"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"optimizer\": 3}"),
                "optimizer: not a string"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\"},"
                  "{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\"}"),
                "duplicate tensor name"},
        BadCase{T("{\"name\": \"a b\", \"shape\": [4], \"dtype\": \"bf16\"}"), "not allowed"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\", \"granuel\": \"whole\"}"),
                "unknown key 'granuel'"},
        BadCase{T("{\"shape\": [4], \"dtype\": \"bf16\"}"), "name: missing"},
        BadCase{T("{\"name\": \"a\", \"dtype\": \"bf16\"}"), "shape: missing"},
        BadCase{T("{\"name\": \"a\", \"shape\": [4]}"), "dtype: missing"}));
#undef T

TEST(InventoryTest, DuplicateUnitNamesAreRejected) {
  auto inv = ParseInventoryJson(R"({"units": [
      {"name": "u", "tensors": [{"name": "a", "shape": [4], "dtype": "bf16"}]},
      {"name": "u", "tensors": [{"name": "b", "shape": [4], "dtype": "bf16"}]}]})");
  ASSERT_FALSE(inv.ok());
  EXPECT_THAT(std::string(inv.status().message()), HasSubstr("duplicate unit name"));
}

TEST(InventoryTest, LimitsAreEnforced) {
  InventoryLimits limits;
  limits.max_tensors = 1;
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "a", "shape": [4], "dtype": "bf16"},
      {"name": "b", "shape": [4], "dtype": "bf16"}]}]})",
                                limits);
  ASSERT_FALSE(inv.ok());
  EXPECT_THAT(std::string(inv.status().message()), HasSubstr("more than 1 tensors"));
}

TEST(InventoryTest, ApplyGranuleLeavesVectorsElementWise) {
  auto inv = ParseInventoryJson(R"({"units": [{"name": "u", "tensors": [
      {"name": "w", "shape": [256, 64], "dtype": "bf16"},
      {"name": "b", "shape": [64], "dtype": "bf16"}]}]})");
  ASSERT_TRUE(inv.ok());
  ApplyGranule(&*inv, *ParseGranule("rows:32"));
  EXPECT_EQ(GranuleElems(inv->units(0).tensors(0)), 32 * 64);
  EXPECT_EQ(GranuleElems(inv->units(0).tensors(1)), 1);
}

TEST(InventoryTest, MissingFileIsNotFound) {
  auto inv = LoadInventoryFile("/nonexistent/inventory.json");
  EXPECT_EQ(inv.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ragshard

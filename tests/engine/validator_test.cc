#include "engine/validator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ragshard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

v1::TensorPlacement* AddTensor(v1::UnitPlan* up, const std::string& name, int64_t off, int64_t e,
                               int64_t g, int64_t first, std::vector<int64_t> counts) {
  auto* t = up->add_tensors();
  t->set_name(name);
  t->set_offset(off);
  t->set_numel(e);
  t->set_granule_elems(g);
  t->set_first_rank(first);
  for (int64_t c : counts) t->add_rank_elems(c);
  t->set_owner_rank(-1);
  t->add_shape(e);
  return t;
}

// W = 2, S = 8 (bf16, 16-byte alignment): a = [0, 8) on rank 0, b = [8, 14) on rank 1.
v1::Plan ValidPlan() {
  v1::Plan plan;
  plan.set_world_size(2);
  plan.set_align_bytes(16);
  auto* up = plan.add_units();
  up->set_unit("layers.0");
  up->set_dtype(v1::DTYPE_BF16);
  up->set_shard_elems(8);
  up->set_align_bytes(16);
  AddTensor(up, "a", 0, 8, 4, 0, {8});
  AddTensor(up, "b", 8, 6, 2, 1, {6});
  return plan;
}

std::string Error(const v1::Plan& plan) { return std::string(ValidatePlan(plan).message()); }

TEST(ValidatorTest, AcceptsAValidPlan) { EXPECT_TRUE(ValidatePlan(ValidPlan()).ok()); }

TEST(ValidatorTest, Invariant1Overlap) {
  v1::Plan plan = ValidPlan();
  plan.mutable_units(0)->mutable_tensors(1)->set_offset(0);
  EXPECT_THAT(Error(plan),
              AllOf(HasSubstr("invariant 1"), HasSubstr("layers.0"), HasSubstr("'b'")));
}

TEST(ValidatorTest, Invariant1SplitDisagreesWithOffsets) {
  v1::Plan plan = ValidPlan();
  plan.mutable_units(0)->mutable_tensors(0)->set_rank_elems(0, 7);
  EXPECT_THAT(Error(plan),
              AllOf(HasSubstr("invariant 1"), HasSubstr("rank 0 holds 7"), HasSubstr("'a'")));
  plan = ValidPlan();
  plan.mutable_units(0)->mutable_tensors(1)->set_first_rank(0);
  EXPECT_THAT(Error(plan), HasSubstr("invariant 1"));
}

TEST(ValidatorTest, Invariant2CutInsideAGranule) {
  v1::Plan plan;
  plan.set_world_size(2);
  plan.set_align_bytes(2);
  auto* up = plan.add_units();
  up->set_unit("layers.3");
  up->set_dtype(v1::DTYPE_BF16);
  up->set_shard_elems(8);
  up->set_align_bytes(2);
  AddTensor(up, "w", 2, 8, 4, 0, {6, 2});  // the cut at 8 is 6 elements in: 2 into a granule
  EXPECT_THAT(Error(plan), AllOf(HasSubstr("invariant 2"), HasSubstr("layers.3"), HasSubstr("'w'"),
                                 HasSubstr("cut at 8")));
}

TEST(ValidatorTest, Invariant3Alignment) {
  v1::Plan plan = ValidPlan();
  plan.mutable_units(0)->set_shard_elems(4);  // 8 bytes, not a multiple of 16
  EXPECT_THAT(Error(plan), HasSubstr("invariant 3"));
  plan = ValidPlan();
  auto* b = plan.mutable_units(0)->mutable_tensors(1);
  b->set_offset(9);  // byte 18
  b->set_rank_elems(0, 6);
  EXPECT_THAT(Error(plan), AllOf(HasSubstr("invariant 3"), HasSubstr("'b'")));
}

TEST(ValidatorTest, Invariant4Bounds) {
  v1::Plan plan = ValidPlan();
  auto* b = plan.mutable_units(0)->mutable_tensors(1);
  b->set_numel(16);  // ends at 24 > W * S = 16
  b->set_rank_elems(0, 16);
  EXPECT_THAT(Error(plan), AllOf(HasSubstr("invariant 4"), HasSubstr("'b'")));
}

TEST(ValidatorTest, ChecksThePlanAgainstTheInventory) {
  Inventory inv;
  auto* u = inv.add_units();
  u->set_name("layers.0");
  for (auto [name, n] : {std::pair<const char*, int64_t>{"c", 6}, {"a", 8}}) {
    auto* t = u->add_tensors();
    t->set_name(name);
    t->add_shape(n);
    t->set_dtype(v1::DTYPE_BF16);
  }
  absl::Status s = ValidatePlan(ValidPlan(), &inv);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'c' is missing"));
}

TEST(ValidatorTest, OwnerMustMatchTheOptimizerKind) {
  v1::Plan plan = ValidPlan();
  plan.mutable_units(0)->mutable_tensors(0)->set_optimizer(v1::OPTIMIZER_MATRIX);
  EXPECT_THAT(Error(plan), HasSubstr("owner rank"));
  plan.mutable_units(0)->mutable_tensors(0)->set_owner_rank(1);
  EXPECT_TRUE(ValidatePlan(plan).ok());
}

}  // namespace
}  // namespace ragshard

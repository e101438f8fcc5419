// The data plane with separate AMSP factors (engine/sharding.h): every sharding of 2 nodes x 2
// ranks (processes over UCX) and of 1 node x 4 ranks, in the host's node shape and the device
// shape, against what each operation must leave, computed from the flat layout alone:
//   * the all-gather over p: every rank's unsharded buffer is the unit's values;
//   * the reduce-scatter over g, then the all-reduce over the gradients' replicas: every rank's
//     gradient shard is the sum (mean) over all W ranks at its g range;
//   * the update gather: each stepping rank writes new values into its os range of its
//     parameter shard, and afterwards every parameter shard holds them over its whole p range;
//   * the matrix pieces to their os owners and back.
// A rank's ranges come from the daemon's own description (Describe: positions, shard sizes and
// offsets), and must nest: its os range inside its g range, inside its p range.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "engine/dtype.h"
#include "engine/plan_nesting.h"
#include "engine/planner.h"
#include "engine/validator.h"
#include "server/daemon/job_data_plane.h"
#include "tests/server/daemon/ucx_group.h"

namespace ragshard::daemon {
namespace {

using testing::Fail;
using testing::UcxGroup;

Inventory Model() {
  Inventory inv;
  const v1::DType dtypes[] = {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP32};
  for (int u = 0; u < 3; ++u) {
    UnitSpec* unit = inv.add_units();
    unit->set_name("layers." + std::to_string(u));
    const int64_t shapes[][2] = {{48, 40}, {40, 48}, {96, 1}, {24, 40}};
    for (int t = 0; t < 4; ++t) {
      TensorSpec* spec = unit->add_tensors();
      spec->set_name(unit->name() + ".t" + std::to_string(t));
      spec->add_shape(shapes[t][0]);
      if (shapes[t][1] > 1) {
        spec->add_shape(shapes[t][1]);
        spec->set_granule_kind(v1::GRANULE_ROWS);
        spec->set_granule_rows(4);
        if (t != 1) spec->set_optimizer(v1::OPTIMIZER_MATRIX);
      }
      spec->set_dtype(dtypes[u]);
    }
  }
  return inv;
}

// Values exact in bf16 and in sums of a few of them.
float Truth(int64_t u, int64_t x) { return static_cast<float>((u * 13 + x * 7) % 61 - 30) / 8; }
float Grad(int64_t rank, int64_t x) {
  return static_cast<float>((rank * 5 + x * 11) % 37 - 18) / 16;
}
float Update(int64_t u, int64_t x) { return Truth(u, x) + 0.5f; }
float Held(int64_t x) { return static_cast<float>(x % 97) * 0.25f; }

void Store(char* base, v1::DType dt, int64_t i, float v) {
  if (dt == v1::DTYPE_FP32) {
    reinterpret_cast<float*>(base)[i] = v;
  } else {
    reinterpret_cast<uint16_t*>(base)[i] = FloatToBf16(v);
  }
}
float Load(const char* base, v1::DType dt, int64_t i) {
  if (dt == v1::DTYPE_FP32) return reinterpret_cast<const float*>(base)[i];
  return Bf16ToFloat(reinterpret_cast<const uint16_t*>(base)[i]);
}

v1::Plan NestedPlan(const Sharding& s) {
  const Inventory inv = Model();
  PlanOptions o;
  o.world = s.os.size();
  auto finest = BuildPlan(inv, o);
  auto plan = NestPlan(*finest, s);
  return *plan;
}

// The checks of one node; 0 when everything matched, else 1 after Fail named the first
// difference.
int CheckNode(const v1::Plan& plan, const Sharding& s, int node, Comm* comm,
              JobDataPlane::Shape shape) {
  const int64_t k = s.devices, w = s.world();
  auto pool = Pool::Create(32 << 20, 256);
  if (!pool.ok()) return Fail("pool: " + pool.status().ToString());
  std::vector<int64_t> local;
  for (int64_t i = 0; i < k; ++i) local.push_back(node * k + i);
  auto dp = JobDataPlane::Create(plan, local, pool->get(), comm, w / plan.world_size(), shape);
  if (!dp.ok()) return Fail("create: " + dp.status().ToString());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  const int64_t persistent = (*pool)->Stats().used;
  std::vector<v1::AttachResponse> desc(k);
  for (int i = 0; i < k; ++i) (*dp)->Describe(i, plan, &desc[i]);
  const auto& os_units = FactorUnits(plan, Factor::kOs);
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::DType dt = plan.units(u).dtype();
    const int64_t sp = (*dp)->shard_elems(u), sg = (*dp)->grad_elems(u), so = (*dp)->os_elems(u);
    const int64_t total = plan.world_size() * sp;
    if (sg * s.g.size() != total || so * s.os.size() != total) {
      return Fail(absl::StrCat("unit ", u, ": g and os shards of ", sg, " and ", so,
                               " elements do not cover the unit's ", total));
    }
    for (int i = 0; i < k; ++i) {
      // The ranges nest: os inside g inside p.
      const v1::RankPositions& pos = desc[i].positions();
      const v1::UnitBuffers& b = desc[i].units(u);
      const int64_t p0 = pos.p() * sp, g0 = pos.g() * sg, o0 = pos.os() * so;
      if (b.os_elems() != so || b.grad_shard_elems() != sg) {
        return Fail(absl::StrCat("unit ", u, ": local rank ", i, " describes os ", b.os_elems(),
                                 " and g ", b.grad_shard_elems(), " elements, not ", so, " and ",
                                 sg));
      }
      if (o0 < g0 || o0 + so > g0 + sg || g0 < p0 || g0 + sg > p0 + sp) {
        return Fail(absl::StrCat("unit ", u, ": local rank ", i, "'s ranges do not nest: os at ",
                                 o0, ", g at ", g0, ", p at ", p0));
      }
      if (b.os_param_offset() != o0 - p0 || b.os_grad_offset() != o0 - g0) {
        return Fail(absl::StrCat("unit ", u, ": local rank ", i, "'s os offsets ",
                                 b.os_param_offset(), " and ", b.os_grad_offset(), ", not ",
                                 o0 - p0, " and ", o0 - g0));
      }
    }
    // The all-gather over p.
    for (int i = 0; i < k; ++i) {
      const int64_t p0 = desc[i].positions().p() * sp;
      for (int64_t e = 0; e < sp; ++e) Store((*dp)->param_shard(u, i), dt, e, Truth(u, p0 + e));
    }
    if (absl::Status st = (*dp)->Unshard(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": unshard: ", st.ToString()));
    }
    for (int i = 0; i < k; ++i) {
      for (int64_t x = 0; x < total; ++x) {
        if (Load((*dp)->unsharded(u, i), dt, x) != Truth(u, x)) {
          return Fail(absl::StrCat("unit ", u, ": unsharded element ", x, " of local rank ", i,
                                   " is ", Load((*dp)->unsharded(u, i), dt, x), ", not ",
                                   Truth(u, x)));
        }
      }
    }
    if (auto st = (*dp)->Reshard(u, 0); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": reshard: ", st.ToString()));
    }
    // The reduce-scatter over g and the all-reduce over the gradients' replicas.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (auto st = (*dp)->AllocateGrad(u); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": allocate_grad: ", st.ToString()));
      }
      for (int i = 0; i < k; ++i) {
        for (int64_t x = 0; x < total; ++x) Store((*dp)->grad(u, i), dt, x, Grad(local[i], x));
      }
      if (absl::Status st = (*dp)->ReduceScatter(u, op, /*accumulate=*/false, deadline); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": reduce_scatter: ", st.ToString()));
      }
      if (absl::Status st = (*dp)->AllReduce(u, op, deadline); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": all_reduce: ", st.ToString()));
      }
      for (int i = 0; i < k; ++i) {
        const int64_t g0 = desc[i].positions().g() * sg;
        for (int64_t e = 0; e < sg; ++e) {
          double expect = 0;
          for (int64_t q = 0; q < w; ++q) expect += Grad(q, g0 + e);
          if (op == ReduceOp::kAvg) expect /= static_cast<double>(w);
          if (std::abs((*dp)->grad_shard(u, i)[e] - expect) > 1e-5) {
            return Fail(absl::StrCat("unit ", u, ": reduced element ", e, " of local rank ", i,
                                     " is ", (*dp)->grad_shard(u, i)[e], ", not ", expect));
          }
        }
      }
    }
    // The update gather: the stepping ranks write their os ranges.
    for (int i = 0; i < k; ++i) {
      if (!desc[i].positions().steps_optimizer()) continue;
      const v1::UnitBuffers& b = desc[i].units(u);
      const int64_t o0 = desc[i].positions().os() * so;
      for (int64_t e = 0; e < so; ++e) {
        Store((*dp)->param_shard(u, i), dt, b.os_param_offset() + e, Update(u, o0 + e));
      }
    }
    if (absl::Status st = (*dp)->UpdateGather(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": update_gather: ", st.ToString()));
    }
    for (int i = 0; i < k; ++i) {
      const int64_t p0 = desc[i].positions().p() * sp;
      for (int64_t e = 0; e < sp; ++e) {
        if (Load((*dp)->param_shard(u, i), dt, e) != Update(u, p0 + e)) {
          return Fail(absl::StrCat("unit ", u, ": updated shard element ", e, " of local rank ", i,
                                   " is ", Load((*dp)->param_shard(u, i), dt, e), ", not ",
                                   Update(u, p0 + e)));
        }
      }
    }
    // The matrix pieces of the os layout to their owners and back.
    for (int i = 0; i < k; ++i) {
      const int64_t g0 = desc[i].positions().g() * sg;
      for (int64_t e = 0; e < sg; ++e) (*dp)->grad_shard(u, i)[e] = Held(g0 + e);
    }
    if (absl::Status st = (*dp)->GatherToOwner(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": gather_to_owner: ", st.ToString()));
    }
    const v1::UnitPlan& ou = os_units.Get(u);
    std::map<int64_t, int64_t> packed;  // owner -> elements so far
    for (const v1::TensorPlacement& t : ou.tensors()) {
      if (t.optimizer() != v1::OPTIMIZER_MATRIX) continue;
      const int64_t at = packed[t.owner_rank()];
      packed[t.owner_rank()] += t.numel();
      for (int i = 0; i < k; ++i) {
        if (desc[i].positions().os() != t.owner_rank() || (*dp)->owner_elems(u, i) == 0) continue;
        float* whole = (*dp)->owner_buffer(u, i);
        if (whole == nullptr) {
          return Fail(absl::StrCat("unit ", u, ": the owner of ", t.name(), " has no buffer"));
        }
        for (int64_t x = 0; x < t.numel(); ++x) {
          if (whole[at + x] != Held(t.offset() + x)) {
            return Fail(absl::StrCat("unit ", u, ": element ", x, " of ", t.name(),
                                     " at its owner is ", whole[at + x], ", not ",
                                     Held(t.offset() + x)));
          }
          whole[at + x] = -whole[at + x];
        }
      }
    }
    if (auto st = (*dp)->ScatterFromOwner(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": scatter_from_owner: ", st.ToString()));
    }
    for (int i = 0; i < k; ++i) {
      const v1::UnitBuffers& b = desc[i].units(u);
      const int64_t o0 = desc[i].positions().os() * so;
      for (int64_t e = 0; e < so; ++e) {
        const int64_t x = o0 + e;
        bool matrix = false;
        for (const v1::TensorPlacement& t : ou.tensors()) {
          matrix |= t.optimizer() == v1::OPTIMIZER_MATRIX && x >= t.offset() &&
                    x < t.offset() + t.numel();
        }
        if ((*dp)->grad_shard(u, i)[b.os_grad_offset() + e] != (matrix ? -Held(x) : Held(x))) {
          return Fail(absl::StrCat("unit ", u, ": scattered element ", x, " of local rank ", i,
                                   " is ", (*dp)->grad_shard(u, i)[b.os_grad_offset() + e],
                                   ", not ", matrix ? -Held(x) : Held(x)));
        }
      }
    }
    if ((*pool)->Stats().used != persistent) {
      return Fail(absl::StrCat("unit ", u, ": ", (*pool)->Stats().used - persistent,
                               " transient bytes still held"));
    }
  }
  if ((*dp)->staging_bytes() != 0) {
    return Fail(absl::StrCat((*dp)->staging_bytes(), " bytes staged outside the collectives"));
  }
  return 0;
}

class ShardingDataPlaneTest : public ::testing::TestWithParam<JobDataPlane::Shape> {};

TEST_P(ShardingDataPlaneTest, EveryShardingOfTwoNodesOfTwoRanksMatchesTheLayout) {
  for (const Sharding& s : AllowedShardings(2, 2)) {
    SCOPED_TRACE(s.Describe());
    const v1::Plan plan = NestedPlan(s);
    ASSERT_TRUE(ValidatePlan(plan).ok()) << ValidatePlan(plan);
    UcxGroup g = UcxGroup::Spawn(
        2, [&](int node, Comm& comm) { return CheckNode(plan, s, node, &comm, GetParam()); });
    g.ExpectSucceeded();
  }
}

TEST_P(ShardingDataPlaneTest, EveryShardingOfOneNodeOfFourRanksMatchesTheLayout) {
  for (const Sharding& s : AllowedShardings(1, 4)) {
    SCOPED_TRACE(s.Describe());
    EXPECT_EQ(CheckNode(NestedPlan(s), s, 0, nullptr, GetParam()), 0);  // Fail said what differed
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ShardingDataPlaneTest,
                         ::testing::Values(JobDataPlane::Shape::kNode,
                                           JobDataPlane::Shape::kDevice));

}  // namespace
}  // namespace ragshard::daemon

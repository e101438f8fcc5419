// The node data plane: all-gather and reduce-scatter of random ragged plans with mixed granules
// and dtypes, 2 nodes (processes, UCX) x 2 ranks and 1 node x 4 ranks, against references
// computed independently (job_data_plane_errors_test.cc: a node killed, mismatched units and
// clear errors).
#include "server/daemon/job_data_plane.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <cstring>
#include <random>

#include "engine/dtype.h"
#include "engine/planner.h"
#include "engine/validator.h"
#include "protocol/unsharded_view.h"
#include "tests/server/daemon/ucx_group.h"

namespace ragshard::daemon {
namespace {

using testing::Fail;
using testing::UcxGroup;

// A random inventory: 3 units, mixed dtypes and granules.
Inventory RandomInventory(uint32_t seed) {
  std::mt19937 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const v1::DType dtypes[] = {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16};
  Inventory inv;
  for (int u = 0; u < 3; ++u) {
    UnitSpec* unit = inv.add_units();
    unit->set_name("layers." + std::to_string(u));
    for (int t = uni(1, 5); t > 0; --t) {
      TensorSpec* spec = unit->add_tensors();
      spec->set_name(unit->name() + ".t" + std::to_string(t));
      if (uni(0, 2) == 0) {
        spec->add_shape(uni(1, 300));
      } else {
        spec->add_shape(uni(1, 40));
        spec->add_shape(uni(1, 50));
        if (uni(0, 1)) {
          spec->set_granule_kind(v1::GRANULE_ROWS);
          spec->set_granule_rows(uni(1, 8));
        }
        if (uni(0, 1)) spec->set_optimizer(v1::OPTIMIZER_MATRIX);
      }
      spec->set_dtype(dtypes[uni(0, 2)]);
    }
  }
  return inv;
}

// The value rank r holds at element e of its shard, exactly representable in every dtype.
float ParamValue(int64_t r, int64_t e) {
  return static_cast<float>((r * 7 + e * 3) % 61 - 30) / 8.0f;
}
float GradValue(int64_t r, int64_t x) {
  return static_cast<float>((r * 5 + x * 11) % 37 - 18) / 16.0f;
}

void Store(char* base, v1::DType dt, int64_t i, float v) {
  if (dt == v1::DTYPE_FP32) {
    reinterpret_cast<float*>(base)[i] = v;
  } else if (dt == v1::DTYPE_BF16) {
    reinterpret_cast<uint16_t*>(base)[i] = FloatToBf16(v);
  } else {
    // fp16 of a multiple of 1/16 in [-30, 30]: exact.
    uint16_t h = 0;
    const float a = std::fabs(v);
    if (a != 0) {
      int e;
      const float m = std::frexp(a, &e);
      h = static_cast<uint16_t>(((e - 1 + 15) << 10) |
                                static_cast<uint16_t>(std::lround((m * 2 - 1) * 1024)));
    }
    if (v < 0) h |= 0x8000;
    reinterpret_cast<uint16_t*>(base)[i] = h;
  }
}

float Load(const char* base, v1::DType dt, int64_t i) {
  if (dt == v1::DTYPE_FP32) return reinterpret_cast<const float*>(base)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[i];
  return dt == v1::DTYPE_BF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// What rank r's (fp32) gradient shard holds at element e before the owner operations.
float ShardValue(int64_t r, int64_t e) { return static_cast<float>(r * 1000 + e % 997) * 0.5f; }

// Runs the checks of one node of a mesh of `replicas` shard groups of plan.world_size() ranks;
// returns 0 when everything matched, else 1 after Fail named the first difference.
// `pool_alignment` a multiple of the page: the host shape maps the shards into unsharded views
// where the sizes allow (protocol/unsharded_view.h), which is checked too.
int CheckNode(const v1::Plan& plan, int node, int ranks_per_node, Comm* comm, int64_t replicas = 1,
              JobDataPlane::Shape shape = JobDataPlane::Shape::kNode,
              int64_t pool_alignment = 256) {
  auto pool = Pool::Create(64 << 20, pool_alignment);
  if (!pool.ok()) return Fail("pool: " + pool.status().ToString());
  std::vector<int64_t> local;
  for (int i = 0; i < ranks_per_node; ++i) local.push_back(node * ranks_per_node + i);
  auto dp = JobDataPlane::Create(plan, local, pool->get(), comm, replicas, shape);
  if (!dp.ok()) return Fail("create: " + dp.status().ToString());
  const int64_t f = plan.world_size(), w = f * replicas;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  // A canary right after the job's buffers: no operation may write past its own buffers (the
  // pool rounds leases up, so an operation sized by a lease instead of its buffer would).
  auto canary = (*pool)->Allocate(4096);
  if (!canary.ok()) return Fail("canary: " + canary.status().ToString());
  std::memset(canary->data(), 0xA5, 4096);
  // What persists: the shards. Every transient buffer is back in the pool after each unit.
  const int64_t persistent = (*pool)->Stats().used;
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::UnitPlan& up = plan.units(u);
    const int64_t s = up.shard_elems();
    for (int i = 0; i < ranks_per_node; ++i) {
      if ((*dp)->unsharded(u, i) != nullptr || (*dp)->grad(u, i) != nullptr) {
        return Fail(absl::StrCat("unit ", u, ": transient buffers held before its unshard"));
      }
      for (int64_t e = 0; e < s; ++e)
        Store((*dp)->param_shard(u, i), up.dtype(), e, ParamValue(local[i], e));
    }
    if (auto st = (*dp)->Unshard(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": unshard: ", st.ToString()));
    }
    const int64_t item = DTypeSize(up.dtype());
    if (shape == JobDataPlane::Shape::kNode && pool_alignment % kViewPageBytes == 0 &&
        AliasesShards(ranks_per_node, s, item)) {
      // A view: only the other nodes' shards take pool memory, and the buffer is not a lease.
      if ((*pool)->Stats().used - persistent != (f - ranks_per_node) * s * item) {
        return Fail(absl::StrCat("unit ", u, ": a view took ", (*pool)->Stats().used - persistent,
                                 " pool bytes, not the other nodes' ",
                                 (f - ranks_per_node) * s * item));
      }
      const char* at = (*dp)->unsharded(u, 0);
      if (at >= (*pool)->base() && at < (*pool)->base() + (*pool)->Stats().capacity) {
        return Fail(absl::StrCat("unit ", u, ": the unsharded view is a pool lease"));
      }
    } else if ((*pool)->Stats().used - persistent < f * s * item) {
      return Fail(absl::StrCat("unit ", u, ": no buffer of F * S was allocated for the copy"));
    }
    // Every element of each rank's unsharded buffer, hence every tensor view [offset, offset +
    // numel), holds the value of the rank of this replica that holds it.
    const int64_t first = local[0] / f * f;  // first rank of this node's replica
    for (int i = 0; i < ranks_per_node; ++i) {
      for (int64_t x = 0; x < f * s; ++x) {
        if (Load((*dp)->unsharded(u, i), up.dtype(), x) != ParamValue(first + x / s, x % s)) {
          return Fail(absl::StrCat("unit ", u, ": unsharded element ", x, " of local rank ", i,
                                   " is ", Load((*dp)->unsharded(u, i), up.dtype(), x),
                                   ", not rank ", first + x / s, "'s ",
                                   ParamValue(first + x / s, x % s)));
        }
      }
    }
    // One buffer per node, or one per rank in the device shape.
    if (((*dp)->unsharded(u, 0) == (*dp)->unsharded(u, ranks_per_node - 1)) !=
        (shape == JobDataPlane::Shape::kNode || ranks_per_node == 1)) {
      return Fail(absl::StrCat("unit ", u, ": one unsharded buffer per ",
                               shape == JobDataPlane::Shape::kNode ? "node" : "rank", " expected"));
    }
    // Resharded to groups of the node's ranks, the unit is rebuilt within the node.
    if (auto st = (*dp)->Reshard(u, ranks_per_node); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": reshard to the node's ranks: ", st.ToString()));
    }
    if ((*dp)->unsharded(u, 0) != nullptr && shape == JobDataPlane::Shape::kDevice &&
        ranks_per_node > 1) {
      return Fail(absl::StrCat("unit ", u, ": a device-shaped rank kept the whole unit"));
    }
    if (auto st = (*dp)->Unshard(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": unshard after a kept reshard: ", st.ToString()));
    }
    for (int i = 0; i < ranks_per_node; ++i) {
      for (int64_t x = 0; x < f * s; ++x) {
        if (Load((*dp)->unsharded(u, i), up.dtype(), x) != ParamValue(first + x / s, x % s)) {
          return Fail(
              absl::StrCat("unit ", u, ": rebuilt element ", x, " of local rank ", i, " differs"));
        }
      }
    }
    if (!(*dp)->Reshard(u, 0).ok() || (*dp)->unsharded(u, 0) != nullptr) {
      return Fail(absl::StrCat("unit ", u, ": reshard did not release the unsharded buffer"));
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (auto st = (*dp)->AllocateGrad(u); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": allocate_grad: ", st.ToString()));
      }
      for (int i = 0; i < ranks_per_node; ++i) {
        for (int64_t x = 0; x < f * s; ++x) {
          if (Load((*dp)->grad(u, i), up.dtype(), x) != 0.0f) {
            return Fail(absl::StrCat("unit ", u, ": gradient element ", x, " not zero-filled"));
          }
          Store((*dp)->grad(u, i), up.dtype(), x, GradValue(local[i], x));
        }
      }
      if (auto st = (*dp)->ReduceScatter(u, op, /*accumulate=*/false, deadline); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": reduce_scatter: ", st.ToString()));
      }
      if ((*dp)->grad(u, 0) != nullptr) {
        return Fail(absl::StrCat("unit ", u, ": the reduce-scatter did not release the gradients"));
      }
      for (int i = 0; i < ranks_per_node; ++i) {
        const int64_t pos = local[i] % f;
        for (int64_t e = 0; e < s; ++e) {
          double expect = 0;
          for (int64_t q = first; q < first + f; ++q) expect += GradValue(q, pos * s + e);
          if (op == ReduceOp::kAvg) expect /= static_cast<double>(f);
          if (std::abs((*dp)->grad_shard(u, i)[e] - expect) > 1e-5) {
            return Fail(absl::StrCat("unit ", u, ": reduced element ", e, " of local rank ", i,
                                     " is ", (*dp)->grad_shard(u, i)[e], ", not ", expect));
          }
        }
      }
      // Over the replicas: the sum (mean) over all W ranks.
      if (auto st = (*dp)->AllReduce(u, op, deadline); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": all_reduce: ", st.ToString()));
      }
      for (int i = 0; i < ranks_per_node; ++i) {
        const int64_t pos = local[i] % f;
        for (int64_t e = 0; e < s; ++e) {
          double expect = 0;
          for (int64_t q = 0; q < w; ++q) expect += GradValue(q, pos * s + e);
          if (op == ReduceOp::kAvg) expect /= static_cast<double>(w);
          if (std::abs((*dp)->grad_shard(u, i)[e] - expect) > 1e-4) {
            return Fail(absl::StrCat("unit ", u, ": all-reduced element ", e, " of local rank ", i,
                                     " is ", (*dp)->grad_shard(u, i)[e], ", not ", expect));
          }
        }
      }
    }
    // Accumulation (a second backward before the step): each gradient shard keeps the mean it
    // holds and receives the new reduction on top, once per shard also where local ranks share
    // one; the all-reduce over the replicas then averages the sums.
    {
      std::vector<std::vector<float>> held(ranks_per_node);
      for (int i = 0; i < ranks_per_node; ++i) {
        held[i].assign((*dp)->grad_shard(u, i), (*dp)->grad_shard(u, i) + s);
      }
      if (auto st = (*dp)->AllocateGrad(u); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": allocate_grad (accumulate): ", st.ToString()));
      }
      for (int i = 0; i < ranks_per_node; ++i) {
        for (int64_t x = 0; x < f * s; ++x) {
          Store((*dp)->grad(u, i), up.dtype(), x, GradValue(local[i] + 1, x));
        }
      }
      if (auto st = (*dp)->ReduceScatter(u, ReduceOp::kAvg, /*accumulate=*/true, deadline);
          !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": accumulating reduce_scatter: ", st.ToString()));
      }
      if (auto st = (*dp)->AllReduce(u, ReduceOp::kAvg, deadline); !st.ok()) {
        return Fail(absl::StrCat("unit ", u, ": all_reduce after accumulating: ", st.ToString()));
      }
      for (int i = 0; i < ranks_per_node; ++i) {
        const int64_t pos = local[i] % f;
        for (int64_t e = 0; e < s; ++e) {
          double added = 0;
          for (int64_t q = 0; q < w; ++q) added += GradValue(q + 1, pos * s + e);
          const double expect = held[i][e] + added / static_cast<double>(w);
          if (std::abs((*dp)->grad_shard(u, i)[e] - expect) > 1e-4) {
            return Fail(absl::StrCat("unit ", u, ": accumulated element ", e, " of local rank ", i,
                                     " is ", (*dp)->grad_shard(u, i)[e], ", not ", expect));
          }
        }
      }
    }
    // Matrix tensors to their owners and back.
    for (int i = 0; i < ranks_per_node; ++i) {
      for (int64_t e = 0; e < s; ++e) (*dp)->grad_shard(u, i)[e] = ShardValue(local[i], e);
    }
    if (auto st = (*dp)->GatherToOwner(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": gather_to_owner: ", st.ToString()));
    }
    for (const v1::TensorPlacement& t : up.tensors()) {
      if (t.optimizer() != v1::OPTIMIZER_MATRIX) continue;
      const int64_t owner_local = first + t.owner_rank() - local[0];
      if (owner_local < 0 || owner_local >= ranks_per_node) continue;
      float* whole = (*dp)->owner_buffer(u, static_cast<int>(owner_local));
      if (whole == nullptr) {
        return Fail(absl::StrCat("unit ", u, ": the owner of ", t.name(), " has no buffer"));
      }
      // The owner's matrices, packed in plan order.
      int64_t packed = 0;
      for (const v1::TensorPlacement& o : up.tensors()) {
        if (&o == &t) break;
        if (o.optimizer() == v1::OPTIMIZER_MATRIX && o.owner_rank() == t.owner_rank()) {
          packed += o.numel();
        }
      }
      for (int64_t x = t.offset(); x < t.offset() + t.numel(); ++x) {
        float& v = whole[packed + x - t.offset()];
        if (v != ShardValue(first + x / s, x % s)) {
          return Fail(absl::StrCat("unit ", u, ": element ", x, " of ", t.name(),
                                   " at its owner is ", v, ", not ",
                                   ShardValue(first + x / s, x % s)));
        }
        v = -v;  // the owner's "update"
      }
    }
    if (auto st = (*dp)->ScatterFromOwner(u, deadline); !st.ok()) {
      return Fail(absl::StrCat("unit ", u, ": scatter_from_owner: ", st.ToString()));
    }
    for (int i = 0; i < ranks_per_node; ++i) {
      if ((*dp)->owner_buffer(u, i) != nullptr) {
        return Fail(absl::StrCat("unit ", u, ": scatter_from_owner did not release the buffer"));
      }
    }
    for (int i = 0; i < ranks_per_node; ++i) {
      const int64_t pos = local[i] % f;
      for (int64_t e = 0; e < s; ++e) {
        const int64_t x = pos * s + e;
        bool matrix = false;
        for (const v1::TensorPlacement& t : up.tensors()) {
          matrix |= t.optimizer() == v1::OPTIMIZER_MATRIX && x >= t.offset() &&
                    x < t.offset() + t.numel();
        }
        const float expect = matrix ? -ShardValue(local[i], e) : ShardValue(local[i], e);
        if ((*dp)->grad_shard(u, i)[e] != expect) {
          return Fail(absl::StrCat("unit ", u, ": scattered element ", e, " of local rank ", i,
                                   " is ", (*dp)->grad_shard(u, i)[e], ", not ", expect));
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
  for (int64_t i = 0; i < 4096; ++i) {
    if (static_cast<unsigned char>(canary->data()[i]) != 0xA5) {
      return Fail(absl::StrCat("byte ", i, " past the job's buffers was written"));
    }
  }
  return 0;
}

int MatrixTensors(const v1::Plan& plan) {
  int n = 0;
  for (const auto& u : plan.units()) {
    for (const auto& t : u.tensors()) n += t.optimizer() == v1::OPTIMIZER_MATRIX;
  }
  return n;
}

class JobDataPlaneTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(JobDataPlaneTest, TwoNodesOfTwoRanksMatchTheReference) {
  Inventory inv = RandomInventory(GetParam());
  PlanOptions o;
  o.world = 4;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(ValidatePlan(*plan, &inv).ok());
  EXPECT_GT(MatrixTensors(*plan), 0);  // the owner operations have something to move
  UcxGroup g =
      UcxGroup::Spawn(2, [&](int node, Comm& comm) { return CheckNode(*plan, node, 2, &comm); });
  g.ExpectSucceeded();
}

TEST_P(JobDataPlaneTest, DeviceShapedTwoNodesOfTwoRanksMatchTheReference) {
  Inventory inv = RandomInventory(GetParam() + 4000);
  PlanOptions o;
  o.world = 4;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  UcxGroup g = UcxGroup::Spawn(2, [&](int node, Comm& comm) {
    return CheckNode(*plan, node, 2, &comm, 1, JobDataPlane::Shape::kDevice);
  });
  g.ExpectSucceeded();
}

TEST_P(JobDataPlaneTest, DeviceShapedOneNodeOfFourRanksMatchesTheReference) {
  Inventory inv = RandomInventory(GetParam() + 5000);
  PlanOptions o;
  o.world = 4;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(CheckNode(*plan, 0, 4, nullptr, 1, JobDataPlane::Shape::kDevice), 0);
}

TEST_P(JobDataPlaneTest, OneNodeOfFourRanksMatchesTheReference) {
  Inventory inv = RandomInventory(GetParam() + 1000);
  PlanOptions o;
  o.world = 4;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(CheckNode(*plan, 0, 4, nullptr), 0);
}

TEST_P(JobDataPlaneTest, HsdpTwoReplicasOfTwoNodesOfOneRankMatchTheReference) {
  Inventory inv = RandomInventory(GetParam() + 2000);
  PlanOptions o;
  o.world = 2;  // shard group of 2 ranks; 2 replicas; 4 nodes of 1 rank
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  UcxGroup g = UcxGroup::Spawn(
      4, [&](int node, Comm& comm) { return CheckNode(*plan, node, 1, &comm, /*replicas=*/2); });
  g.ExpectSucceeded();
}

TEST_P(JobDataPlaneTest, HsdpOneShardGroupPerNodeMatchesTheReference) {
  Inventory inv = RandomInventory(GetParam() + 3000);
  PlanOptions o;
  o.world = 2;  // each node of 2 ranks is a shard group; 2 replicas across the nodes
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  UcxGroup g = UcxGroup::Spawn(
      2, [&](int node, Comm& comm) { return CheckNode(*plan, node, 2, &comm, /*replicas=*/2); });
  g.ExpectSucceeded();
}

// Shards of whole pages (the planner's alignment) in a pool of page-aligned leases, as ragshardd
// makes it: unsharded buffers are views over the node's shards.
PlanOptions PageAligned(int world) {
  PlanOptions o;
  o.world = world;
  o.align_bytes = static_cast<int32_t>(kViewPageBytes);
  return o;
}

TEST_P(JobDataPlaneTest, ViewsTwoNodesOfTwoRanksMatchTheReference) {
  Inventory inv = RandomInventory(GetParam() + 6000);
  auto plan = BuildPlan(inv, PageAligned(4));
  ASSERT_TRUE(plan.ok()) << plan.status();
  UcxGroup g = UcxGroup::Spawn(2, [&](int node, Comm& comm) {
    return CheckNode(*plan, node, 2, &comm, 1, JobDataPlane::Shape::kNode, kViewPageBytes);
  });
  g.ExpectSucceeded();
}

TEST_P(JobDataPlaneTest, ViewsHsdpTwoReplicasOfTwoNodesOfOneRankMatchTheReference) {
  Inventory inv = RandomInventory(GetParam() + 7000);
  auto plan = BuildPlan(inv, PageAligned(2));
  ASSERT_TRUE(plan.ok()) << plan.status();
  UcxGroup g = UcxGroup::Spawn(4, [&](int node, Comm& comm) {
    return CheckNode(*plan, node, 1, &comm, 2, JobDataPlane::Shape::kNode, kViewPageBytes);
  });
  g.ExpectSucceeded();
}

TEST_P(JobDataPlaneTest, ViewsOneNodeOfFourRanksMatchesTheReference) {
  Inventory inv = RandomInventory(GetParam() + 8000);
  auto plan = BuildPlan(inv, PageAligned(4));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(CheckNode(*plan, 0, 4, nullptr, 1, JobDataPlane::Shape::kNode, kViewPageBytes), 0);
}

INSTANTIATE_TEST_SUITE_P(Seeds, JobDataPlaneTest, ::testing::Values(1u, 2u, 3u));

}  // namespace
}  // namespace ragshard::daemon

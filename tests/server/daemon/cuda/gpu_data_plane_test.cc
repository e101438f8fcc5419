// The GPU data plane on this process's devices: one rank per visible GPU (at most 4), NCCL
// communicators from unique ids passed through an in-memory rendezvous, all-gather and
// reduce-scatter (fp32 and bf16, sum and avg) against a reference computed on the host. Skips,
// with the reason, when no CUDA device is present.
#include "server/daemon/cuda/gpu_data_plane.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/planner.h"
#include "server/daemon/cuda/cuda_device.h"

namespace ragshard::gpu {
namespace {

float PV(int64_t r, int64_t e) { return static_cast<float>((r * 7 + e * 3) % 61 - 30) / 8.0f; }
float GV(int64_t r, int64_t x) { return static_cast<float>((r * 5 + x * 11) % 37 - 18) / 16.0f; }
uint16_t ToBf16(float f) {  // exact for the values above
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class GpuDataPlaneTest : public ::testing::TestWithParam<v1::DType> {
 protected:
  void SetUp() override {
    std::string reason;
    if (!IsViable(&reason)) GTEST_SKIP() << "GPU backend not viable: " << reason;
  }
};

TEST_P(GpuDataPlaneTest, AllGatherAndReduceScatterMatchTheReference) {
  const int w = std::min(DeviceCount(), 4);
  Inventory inv;
  UnitSpec* unit = inv.add_units();
  unit->set_name("u");
  for (int t = 0; t < 3; ++t) {
    TensorSpec* spec = unit->add_tensors();
    spec->set_name("t" + std::to_string(t));
    spec->add_shape(64 + 40 * t);
    spec->add_shape(33);
    spec->set_dtype(GetParam());
  }
  PlanOptions o;
  o.world = w;
  auto plan = BuildPlan(inv, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::map<std::string, std::string> kv;
  daemon::BackendContext c;
  c.plan = &*plan;
  for (int r = 0; r < w; ++r) c.local_ranks.push_back(r);
  c.put = [&](const std::string& k, const std::string& v) {
    kv[k] = v;
    return absl::OkStatus();
  };
  c.get = [&](const std::string& k) -> absl::StatusOr<std::string> {
    if (!kv.count(k)) return absl::NotFoundError(k);
    return kv[k];
  };
  c.gpu_pool_bytes = 64 << 20;
  auto dp = CreateGpuDataPlane(c);
  ASSERT_TRUE(dp.ok()) << dp.status();
  v1::AttachResponse desc[4];
  const bool fp32 = GetParam() == v1::DTYPE_FP32;
  const int64_t s = plan->units(0).shard_elems(), item = fp32 ? 4 : 2;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto encode = [&](float v, char* out) {
    if (fp32) {
      std::memcpy(out, &v, 4);
    } else {
      const uint16_t h = ToBf16(v);
      std::memcpy(out, &h, 2);
    }
  };
  auto placement = [&](int r) {
    v1::UnitBuffers b;
    (*dp)->Placement(0, r, &b);
    return b;
  };
  for (int r = 0; r < w; ++r) {
    (*dp)->Describe(r, *plan, &desc[r]);
    EXPECT_EQ(desc[r].backend(), "cuda");
    // Persistent: the shards; transient: nothing is allocated before it is used.
    EXPECT_GE(desc[r].units(0).param_shard_offset(), 0);
    EXPECT_GE(desc[r].units(0).grad_shard_offset(), 0);
    EXPECT_EQ(desc[r].units(0).unsharded_offset(), -1);
    EXPECT_EQ(desc[r].units(0).grad_offset(), -1);
    std::vector<char> shard(s * item);
    for (int64_t e = 0; e < s; ++e) encode(PV(r, e), shard.data() + e * item);
    ASSERT_EQ(cudaMemcpy(*SlabBase(**dp, r) + desc[r].units(0).param_shard_offset(), shard.data(),
                         shard.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ASSERT_TRUE((*dp)->Unshard(0, deadline).ok());
  for (int r = 0; r < w; ++r) {
    const int64_t at = placement(r).unsharded_offset();
    ASSERT_GE(at, 0);
    std::vector<char> full(w * s * item);
    ASSERT_EQ(cudaMemcpy(full.data(), *SlabBase(**dp, r) + at, full.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t x = 0; x < w * s; ++x) {
      const float v = fp32 ? reinterpret_cast<float*>(full.data())[x]
                           : FromBf16(reinterpret_cast<uint16_t*>(full.data())[x]);
      ASSERT_EQ(v, PV(x / s, x % s)) << "rank " << r << " element " << x;
    }
  }
  ASSERT_TRUE((*dp)->Reshard(0, 1).ok());
  EXPECT_EQ(placement(0).unsharded_offset(), -1);
  // Sum, mean, then a mean added to the mean before (gradient accumulation on the device).
  std::vector<std::vector<float>> held(w, std::vector<float>(s, 0.0f));
  for (auto [op, accumulate] :
       {std::pair{daemon::ReduceOp::kSum, false}, std::pair{daemon::ReduceOp::kAvg, false},
        std::pair{daemon::ReduceOp::kAvg, true}}) {
    ASSERT_TRUE((*dp)->AllocateGrad(0).ok());
    for (int r = 0; r < w; ++r) {
      std::vector<char> grad(w * s * item);
      for (int64_t x = 0; x < w * s; ++x) encode(GV(r, x), grad.data() + x * item);
      ASSERT_GE(placement(r).grad_offset(), 0);
      ASSERT_EQ(cudaMemcpy(*SlabBase(**dp, r) + placement(r).grad_offset(), grad.data(),
                           grad.size(), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    ASSERT_TRUE((*dp)->ReduceScatter(0, op, accumulate, deadline).ok());
    for (int r = 0; r < w; ++r) {
      EXPECT_EQ(placement(r).grad_offset(), -1) << "the gradients are released";
      std::vector<float> out(s);
      ASSERT_EQ(cudaMemcpy(out.data(), *SlabBase(**dp, r) + desc[r].units(0).grad_shard_offset(),
                           s * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (int64_t e = 0; e < s; ++e) {
        double expect = 0;
        for (int q = 0; q < w; ++q) expect += GV(q, r * s + e);
        if (op == daemon::ReduceOp::kAvg) expect /= w;
        if (accumulate) expect += held[r][e];
        ASSERT_NEAR(out[e], expect, 1e-5) << "rank " << r << " element " << e;
      }
      held[r] = out;
    }
  }
  // bf16 gradients are converted to fp32 before NCCL: counted as staging.
  EXPECT_EQ((*dp)->staging_bytes(), fp32 ? 0 : 3 * w * w * s * 4);
}

INSTANTIATE_TEST_SUITE_P(DTypes, GpuDataPlaneTest,
                         ::testing::Values(v1::DTYPE_FP32, v1::DTYPE_BF16));

}  // namespace
}  // namespace ragshard::gpu

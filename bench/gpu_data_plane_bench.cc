// The GPU data plane's intra-device paths against the device's own copy bandwidth, on one GPU:
// a one-rank job on device 0 (CreateGpuDataPlane, the daemon's own backend), timing
//   unshard         Unshard + Reshard of a unit of B bytes (the shard placed into the unsharded
//                   buffer through NCCL's one-rank all-gather, then released), and
//   reduce_scatter  AllocateGrad + ReduceScatter (the gradients reduced into the fp32 shard),
// each against cudaMemcpy device to device of the same B bytes. One JSON line per size:
//   {"bytes": B, "copy_gbps": ..., "unshard_gbps": ..., "reduce_scatter_gbps": ..., ...}
// where every GB/s is the unit's B bytes over the median time of --reps repetitions (after a
// warm-up): the copy's too (it reads B and writes B, as the unshard does). With no usable device it
// prints
// {"skipped": "<reason>"} and exits 0 (scripts/gpu/run.sh reports it as skipped).
//
//   gpu_data_plane_bench [--max-mib 256] [--reps 5]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "engine/planner.h"
#include "server/daemon/cuda/cuda_device.h"
#include "server/daemon/cuda/gpu_data_plane.h"

namespace ragshard::gpu {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double TimeIt(int reps, F&& step) {
  std::vector<double> seconds;
  for (int i = 0; i <= reps; ++i) {  // the first is a warm-up
    const auto t0 = std::chrono::steady_clock::now();
    if (!step()) return -1;
    cudaDeviceSynchronize();
    const std::chrono::duration<double> d = std::chrono::steady_clock::now() - t0;
    if (i > 0) seconds.push_back(d.count());
  }
  return Median(seconds);
}

// `text` as a JSON string's contents (status messages may quote).
std::string Escape(std::string text) {
  for (char& ch : text) {
    if (ch == '"' || ch == '\\' || static_cast<unsigned char>(ch) < 0x20) ch = '\'';
  }
  return text;
}

int Fail(const std::string& what) {
  std::printf("{\"error\": \"%s\"}\n", Escape(what).c_str());
  return 1;
}

int Run(int64_t bytes, int reps, int64_t pool) {
  const int64_t elems = bytes / 4;
  Inventory inv;
  UnitSpec* unit = inv.add_units();
  unit->set_name("u");
  TensorSpec* spec = unit->add_tensors();
  spec->set_name("w");
  spec->add_shape(elems);
  spec->set_dtype(v1::DTYPE_FP32);
  PlanOptions o;
  o.world = 1;
  auto plan = BuildPlan(inv, o);
  if (!plan.ok()) return Fail(plan.status().ToString());
  std::map<std::string, std::string> kv;
  daemon::BackendContext c;
  c.plan = &*plan;
  c.local_ranks = {0};
  c.put = [&](const std::string& k, const std::string& v) {
    kv[k] = v;
    return absl::OkStatus();
  };
  c.get = [&](const std::string& k) -> absl::StatusOr<std::string> {
    auto it = kv.find(k);
    if (it == kv.end()) return absl::NotFoundError(k);
    return it->second;
  };
  c.gpu_pool_bytes = pool;
  auto dp = CreateGpuDataPlane(c);
  if (!dp.ok()) return Fail(dp.status().ToString());
  auto deadline = [] { return absl::Now() + absl::Seconds(60); };
  std::string error;
  auto ok = [&](const absl::Status& s) {
    if (!s.ok()) error = s.ToString();
    return s.ok();
  };
  const double unshard =
      TimeIt(reps, [&] { return ok((*dp)->Unshard(0, deadline())) && ok((*dp)->Reshard(0, 1)); });
  const double reduce = TimeIt(reps, [&] {
    return ok((*dp)->AllocateGrad(0)) &&
           ok((*dp)->ReduceScatter(0, daemon::ReduceOp::kSum, /*accumulate=*/false, deadline()));
  });
  if (!error.empty()) return Fail(error);
  void *a = nullptr, *b = nullptr;
  const bool allocated =
      cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess;
  double copy = -1;
  if (allocated) {
    copy = TimeIt(reps,
                  [&] { return cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice) == cudaSuccess; });
  }
  cudaFree(a);  // cudaFree(nullptr) is a no-op
  cudaFree(b);
  if (!allocated) return Fail("cudaMalloc of the copy's buffers");
  if (copy < 0) return Fail("cudaMemcpy device to device failed");
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf(
      "{\"bytes\": %lld, \"copy_seconds\": %.6g, \"unshard_seconds\": %.6g, "
      "\"reduce_scatter_seconds\": %.6g, \"copy_gbps\": %.4g, \"unshard_gbps\": %.4g, "
      "\"reduce_scatter_gbps\": %.4g}\n",
      static_cast<long long>(bytes), copy, unshard, reduce, gb / copy, gb / unshard, gb / reduce);
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace ragshard::gpu

int main(int argc, char** argv) {
  CLI::App app{
      "The GPU data plane's intra-device unshard and reduce-scatter against "
      "cudaMemcpy, on one GPU (one JSON line per size)"};
  int64_t max_mib = 256;
  int reps = 5;
  app.add_option("--max-mib", max_mib, "largest unit, MiB (from 1 MiB, x4)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions per size (median)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::string reason;
  if (!ragshard::gpu::IsViable(&reason)) {
    std::printf("{\"skipped\": \"no GPU: %s\"}\n", ragshard::gpu::Escape(reason).c_str());
    return 0;
  }
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) {
    const int64_t bytes = mib << 20;
    // The shard, the unsharded buffer, the gradients and the grad shard, with room to spare.
    if (int rc = ragshard::gpu::Run(bytes, reps, 5 * bytes + (64 << 20))) return rc;
  }
  return 0;
}

// A two-layer MLP trained through ragshard from C++, for users who do not use Python. Each rank
// registers the same inventory, attaches to its node's daemon, writes its shard of the initial
// weights, and per step: unshard -> forward and backward on its part of the batch, writing the
// gradients into its gradient buffer -> reduce_scatter (avg) -> SGD on its parameter shard.
//
//   train_mlp --planner ADDR --socket PATH --job JOB --rank R --world W [--node ID]
//             [--steps N] [--create-job]
//
// Data: y = sin(x . a) for random a; the loss is the mean squared error, printed by rank 0.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/client.h"

namespace {

constexpr int kIn = 16, kHidden = 64;

// The batch of step `step` for rank `rank` (the same on every run).
void Batch(int step, int rank, int rows, std::vector<float>& x, std::vector<float>& y) {
  std::mt19937 rng(static_cast<uint32_t>(step * 1009 + rank));
  std::normal_distribution<float> n(0, 1);
  std::mt19937 arng(42);
  std::vector<float> a(kIn);
  for (float& v : a) v = n(arng) / 4;
  x.resize(static_cast<size_t>(rows) * kIn);
  y.resize(rows);
  for (int r = 0; r < rows; ++r) {
    float dot = 0;
    for (int i = 0; i < kIn; ++i) {
      x[r * kIn + i] = n(rng);
      dot += x[r * kIn + i] * a[i];
    }
    y[r] = std::sin(dot);
  }
}

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "train_mlp: %s: %s\n", what, std::string(s.ToString()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A two-layer MLP trained through ragshard"};
  std::string planner, socket, job, node;
  int64_t rank = 0, world = 1;
  int steps = 200, rows = 32;
  float lr = 0.05f;
  bool create = false;
  app.add_option("--planner", planner, "planner address")->required();
  app.add_option("--socket", socket, "this node's daemon socket")->required();
  app.add_option("--job", job, "job id")->required();
  app.add_option("--rank", rank, "this rank")->required()->check(CLI::NonNegativeNumber);
  app.add_option("--world", world, "number of ranks")->required()->check(CLI::PositiveNumber);
  app.add_option("--node", node, "node id");
  app.add_option("--steps", steps, "training steps")->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "rows per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "SGD learning rate");
  app.add_flag("--create-job", create, "create the job first (rank 0)");
  CLI11_PARSE(app, argc, argv);

  ragshard::PlannerClientOptions po;
  po.address = planner;
  po.security = ragshard::ClientSecurityFromEnv();  // RAGSHARD_TOKEN_FILE, RAGSHARD_TLS_*
  auto pc = ragshard::GrpcPlannerClient::Create(po);
  if (!pc.ok()) return Fail(pc.status(), "planner");
  std::shared_ptr<ragshard::PlannerClient> planner_client(std::move(*pc));
  if (create && rank == 0) {
    ragshard::v1::CreateJobRequest req;
    req.set_job_id(job);
    req.mutable_mesh()->set_shard_size(world);
    req.mutable_mesh()->set_replicate_size(1);
    auto j = planner_client->CreateJob(req);
    if (!j.ok()) return Fail(j.status(), "create job");
  }
  auto from_env = ragshard::ClientOptions::FromEnvironment();  // RAGSHARD_PEER_TIMEOUT_S, ...
  if (!from_env.ok()) return Fail(from_env.status(), "environment");
  ragshard::ClientOptions co = *from_env;
  co.planner = planner_client;
  co.daemon_socket = socket;
  co.job_id = job;
  co.rank = rank;
  co.node_id = node;
  auto client = ragshard::Client::Create(co);
  if (!client.ok()) return Fail(client.status(), "client");
  ragshard::Client& c = **client;
  auto inv = ragshard::ParseInventoryJson(R"({"units": [{"name": "mlp", "tensors": [
      {"name": "w1", "shape": [64, 16], "dtype": "fp32", "granule": "rows:8"},
      {"name": "b1", "shape": [64], "dtype": "fp32"},
      {"name": "w2", "shape": [1, 64], "dtype": "fp32"}]}]})");
  if (!inv.ok()) return Fail(inv.status(), "inventory");
  if (absl::Status s = c.Register(*inv, true); !s.ok()) return Fail(s, "register");
  if (absl::Status s = c.Attach(); !s.ok()) return Fail(s, "attach");
  const auto& unit = c.plan().units(0);
  int64_t off[3];
  for (int t = 0; t < 3; ++t) off[t] = unit.tensors(t).offset();
  // The shards persist; the unsharded parameters and gradients are views taken after the
  // operations that allocate them (unshard, allocate_grad), valid until reshard and the end of
  // reduce_scatter.
  auto shard = c.ParamShard<float>(0);
  auto gshard = c.GradShard(0);
  if (!shard.ok() || !gshard.ok()) {
    return Fail(absl::InternalError("views"), "views");
  }
  const int64_t s = unit.shard_elems(), lo = rank * s;
  // Initial weights, the same on every rank: each writes its own shard only.
  {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0, 1);
    std::vector<float> init(static_cast<size_t>(world * s), 0.0f);
    for (int i = 0; i < kHidden * kIn; ++i) init[off[0] + i] = n(rng) / 4;
    for (int i = 0; i < kHidden; ++i) init[off[2] + i] = n(rng) / 8;
    for (int64_t e = 0; e < s; ++e) (*shard)[e] = init[lo + e];
  }
  std::vector<float> x, y, h(kHidden), dh(kHidden);
  for (int step = 0; step < steps; ++step) {
    auto u = c.Unshard(0);
    if (!u.ok()) return Fail(u.status(), "unshard");
    if (absl::Status st = u->Wait(); !st.ok()) return Fail(st, "unshard");
    auto ag = c.AllocateGrad(0);
    if (!ag.ok()) return Fail(ag.status(), "allocate_grad");
    if (absl::Status st = ag->Wait(); !st.ok()) return Fail(st, "allocate_grad");
    auto full = c.Unsharded<float>(0);
    auto grad = c.Grad<float>(0);
    if (!full.ok()) return Fail(full.status(), "unsharded view");
    if (!grad.ok()) return Fail(grad.status(), "gradient view");
    const float* w1 = full->data() + off[0];
    const float* b1 = full->data() + off[1];
    const float* w2 = full->data() + off[2];
    float* gw1 = grad->data() + off[0];
    float* gb1 = grad->data() + off[1];
    float* gw2 = grad->data() + off[2];
    Batch(step, static_cast<int>(rank), rows, x, y);
    double loss = 0;
    for (int r = 0; r < rows; ++r) {
      const float* xr = &x[static_cast<size_t>(r) * kIn];
      float out = 0;
      for (int j = 0; j < kHidden; ++j) {
        float a = b1[j];
        for (int i = 0; i < kIn; ++i) a += w1[j * kIn + i] * xr[i];
        h[j] = std::tanh(a);
        out += w2[j] * h[j];
      }
      const float err = out - y[r];
      loss += err * err / rows;
      const float dout = 2 * err / rows;
      for (int j = 0; j < kHidden; ++j) {
        gw2[j] += dout * h[j];
        dh[j] = dout * w2[j] * (1 - h[j] * h[j]);
        gb1[j] += dh[j];
        for (int i = 0; i < kIn; ++i) gw1[j * kIn + i] += dh[j] * xr[i];
      }
    }
    auto rh = c.Reshard(0);
    if (!rh.ok()) return Fail(rh.status(), "reshard");
    if (absl::Status st = rh->Wait(); !st.ok()) return Fail(st, "reshard");
    auto rs = c.ReduceScatter(0, ragshard::v1::REDUCE_AVG);
    if (!rs.ok()) return Fail(rs.status(), "reduce_scatter");
    if (absl::Status st = rs->Wait(); !st.ok()) return Fail(st, "reduce_scatter");
    for (int64_t e = 0; e < s; ++e) (*shard)[e] -= lr * (*gshard)[e];
    if (rank == 0 && (step % 20 == 0 || step == steps - 1)) {
      std::printf("step %d loss %.5f\n", step + 1, loss);
      std::fflush(stdout);
    }
  }
  return 0;
}

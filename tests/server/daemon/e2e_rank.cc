// A training rank for the daemon end-to-end test, run as its own process (gRPC state must not
// be inherited across fork):
//   e2e_rank PLANNER_ADDR SOCKET_DIR JOB RANK MODE
// MODE "check" runs all-gather and reduce-scatter against the reference; "loop" runs
// all-gathers until one fails and exits 0 when the error names a lost peer or a detached rank;
// "register" only registers; "attach" attaches without registering and checks; "disagree": rank 0
// unshards unit 1 where the others unshard unit 0, and each rank exits 0 when its error says so
// (node 0's ranks: FAILED_PRECONDITION naming the disagreement; node 1's: ABORTED quoting node 0's
// notice, or the planner's word quoting node 0's report), within 10 s.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "client/client.h"
#include "server/daemon/collectives.h"

namespace ragshard {
namespace {

using namespace std::chrono_literals;

std::string g_planner, g_dir;

std::string Socket(int n) { return g_dir + "/d" + std::to_string(n) + ".sock"; }

Inventory TestInventory() {
  auto inv = ParseInventoryJson(R"({"units": [
      {"name": "layers.0", "tensors": [
        {"name": "l0.w", "shape": [96, 40], "dtype": "fp32", "granule": "rows:8", "optimizer": "matrix"},
        {"name": "l0.b", "shape": [40], "dtype": "fp32"},
        {"name": "l0.h", "shape": [64, 24], "dtype": "bf16", "granule": "rows:16"}]},
      {"name": "layers.1", "tensors": [
        {"name": "l1.w", "shape": [130, 33], "dtype": "bf16", "granule": "rows:32"},
        {"name": "l1.n", "shape": [33], "dtype": "bf16"}]}]})");
  return *inv;
}

// A unit's parameter value at flat element x (u: the unit, or another series), exact in bf16.
float PV(int64_t u, int64_t x) { return static_cast<float>((u * 13 + x * 7) % 41 - 20) / 4.0f; }
float GV(int64_t r, int64_t x) { return static_cast<float>((r * 3 + x * 5) % 29 - 14) / 8.0f; }

std::unique_ptr<Client> Connect(const std::string& job, int rank) {
  PlannerClientOptions o;
  o.address = g_planner;
  o.security = ClientSecurityFromEnv();  // the planner's token (testing::PlannerProcess)
  ClientOptions co;
  co.planner = std::shared_ptr<PlannerClient>(std::move(*GrpcPlannerClient::Create(o)));
  co.daemon_socket = Socket(rank / 2);
  co.job_id = job;
  co.rank = rank;
  co.node_id = "node-" + std::to_string(rank / 2);
  co.timeout = 20s;
  return std::move(*Client::Create(co));
}

// Runs in a forked rank process; returns its exit code.
int Check(Client& client, int rank);

// `direct`: as an older client does, the rank registers with the planner itself
// (RegisterRank); else through its daemon, which registers the node's 2 ranks in one call.
int Rank(const std::string& job, int rank, bool direct = false) {
  auto c = Connect(job, rank);
  Inventory inv = TestInventory();
  if (direct) {
    PlannerClientOptions o;
    o.address = g_planner;
    o.security = ClientSecurityFromEnv();
    auto planner = GrpcPlannerClient::Create(o);
    v1::RegisterRankRequest req;
    req.set_job_id(job);
    req.set_rank(rank);
    req.set_node_id("node-" + std::to_string(rank / 2));
    *req.mutable_inventory() = inv;
    if (!planner.ok() || !(*planner)->RegisterRank(req).ok()) return 62;
  } else if (!c->Register(inv, rank == 0, /*local_ranks=*/2).ok()) {
    return 60;
  }
  absl::Status a = c->Attach();
  if (!a.ok()) {
    fprintf(stderr, "attach: %s\n", std::string(a.message()).c_str());
    return 61;
  }
  return Check(*c, rank);
}

int Check(Client& client, int rank) {
  Client* c = &client;
  // The rank's place in the job's AMSP factors (engine/sharding.h; p = g = os with HSDP's or
  // FSDP's plans): its parameter shard is p position pp of the plan's world, its gradient shard
  // g position pg, its optimizer range os position po. Values are defined over the unit's flat
  // layout, so what every operation must leave follows from the layout alone.
  const int64_t w = c->plan().world_size();
  // Every rank's gradient is summed: W = |g| * replicas, and |g| = w * S_p / S_g.
  int64_t world = 0;
  const v1::RankPositions& at = c->positions();
  const int64_t pp = at.p(), pg = at.g(), po = at.os();
  if (pp < 0 || pp >= w) return 75;
  const v1::Plan& plan = c->plan();
  const v1::FactorPlan* os_plan = nullptr;
  for (const auto& f : plan.factors()) {
    if (f.component() == "os") os_plan = &f;
  }
  for (int u = 0; u < c->units(); ++u) {
    const auto& b = c->buffers(u);
    const int64_t s = b.shard_elems(), sg = b.grad_shard_elems(), so = b.os_elems();
    const int64_t total = w * s;
    if (sg <= 0 || so <= 0 || total % sg != 0 || total % so != 0) return 76;
    world = total / sg * c->replicas();
    // The ranges nest: os inside g inside p.
    if (po * so < pg * sg || (po + 1) * so > (pg + 1) * sg || pg * sg < pp * s ||
        (pg + 1) * sg > (pp + 1) * s) {
      return 77;
    }
    const bool fp32 = b.dtype() == v1::DTYPE_FP32;
    // Wrong-dtype views are errors, not reinterpretations.
    if (fp32 ? c->ParamShard<uint16_t>(u).ok() : c->ParamShard<float>(u).ok()) return 62;
    auto store = [&](char* base, int64_t i, float v) {
      if (fp32) {
        reinterpret_cast<float*>(base)[i] = v;
      } else {
        reinterpret_cast<uint16_t*>(base)[i] = daemon::FloatToBf16(v);
      }
    };
    auto load = [&](const char* base, int64_t i) {
      return fp32 ? reinterpret_cast<const float*>(base)[i]
                  : daemon::Bf16ToFloat(reinterpret_cast<const uint16_t*>(base)[i]);
    };
    char* shard =
        c->arena() == nullptr ? nullptr : const_cast<char*>(c->arena()) + b.param_shard_offset();
    // Transient buffers exist only between the operations that allocate and release them.
    if (b.unsharded_offset() >= 0 || c->Unsharded<float>(u).ok() || c->Grad<float>(u).ok()) {
      return 70;
    }
    // Zero copy: the typed views are these very addresses in the daemon's arena.
    void* view = fp32 ? static_cast<void*>(c->ParamShard<float>(u)->data())
                      : static_cast<void*>(c->ParamShard<uint16_t>(u)->data());
    if (view != shard) return 63;
    // Every rank holding p position pp writes the same values (replicas may share memory).
    for (int64_t e = 0; e < s; ++e) store(shard, e, PV(u, pp * s + e));
    auto h = c->Unshard(u);
    if (!h.ok() || !h->Wait(20s).ok()) return 64;
    char* full = const_cast<char*>(c->UnshardedData(u));
    if (c->buffers(u).unsharded_offset() < 0 || full == nullptr) return 71;
    for (int64_t x = 0; x < total; ++x) {
      if (load(full, x) != PV(u, x)) return 65;
    }
    // Every tensor of the unit is a contiguous view of the unsharded buffer.
    for (const auto& t : plan.units(u).tensors()) {
      for (int64_t i = 0; i < t.numel(); i += 17) {
        if (load(full, t.offset() + i) != PV(u, t.offset() + i)) return 66;
      }
    }
    auto rh = c->Reshard(u);
    if (!rh.ok() || !rh->Wait(20s).ok() || c->buffers(u).unsharded_offset() >= 0) return 72;
    for (v1::ReduceKind op : {v1::REDUCE_SUM, v1::REDUCE_AVG}) {
      auto ag = c->AllocateGrad(u);
      if (!ag.ok() || !ag->Wait(20s).ok() || c->buffers(u).grad_offset() < 0) return 73;
      char* grad = const_cast<char*>(c->arena()) + c->buffers(u).grad_offset();
      for (int64_t x = 0; x < total; ++x) store(grad, x, GV(rank, x));
      auto r = c->ReduceScatter(u, op);
      absl::Status rs = r.ok() ? r->Wait(20s) : r.status();
      if (!rs.ok()) {
        fprintf(stderr, "reduce_scatter: %s\n", rs.ToString().c_str());
        return 67;
      }
      if (c->buffers(u).grad_offset() >= 0) return 74;  // released after the reduce-scatter
      auto gs = c->GradShard(u);
      if (!gs.ok() || static_cast<int64_t>(gs->size()) != sg) return 68;
      // Over the gradients' replicas: the sum (mean) over all ranks.
      auto ar = c->AllReduce(u, op);
      absl::Status as = ar.ok() ? ar->Wait(20s) : ar.status();
      if (!as.ok()) {
        fprintf(stderr, "all_reduce: %s\n", as.ToString().c_str());
        return 91;
      }
      for (int64_t e = 0; e < sg; ++e) {
        double expect = 0;
        for (int64_t k = 0; k < world; ++k) expect += GV(k, pg * sg + e);
        if (op == v1::REDUCE_AVG) expect /= static_cast<double>(world);
        if (std::abs((*gs)[e] - expect) > 1e-4) return 92;
      }
    }
    // AMSP's update gather: each stepping rank writes its optimizer range; every parameter
    // shard then holds the new values over its whole range.
    if (at.steps_optimizer()) {
      for (int64_t e = 0; e < so; ++e)
        store(shard, b.os_param_offset() + e, PV(u + 7, po * so + e));
    }
    auto ug = c->UpdateGather(u);
    if (!ug.ok() || !ug->Wait(20s).ok()) return 78;
    for (int64_t e = 0; e < s; ++e) {
      // With p = g = os the rank's range is its whole shard: nothing moves.
      if (load(shard, e) != PV(u + 7, pp * s + e)) return 79;
    }
    // Matrix tensors: optimizer-range pieces to the os plan's owner, an update there, and back.
    auto gs = c->GradShard(u);
    auto held = [](int64_t x) { return static_cast<float>(x % 4093) * 0.5f; };
    for (int64_t e = 0; e < so; ++e) (*gs)[b.os_grad_offset() + e] = held(po * so + e);
    auto g2o = c->GatherToOwner(u);
    if (!g2o.ok() || !g2o->Wait(20s).ok()) return 93;
    auto owner = c->OwnerBuffer(u);
    const v1::UnitPlan& ou = os_plan != nullptr ? os_plan->units(u) : plan.units(u);
    bool owns = false;
    int64_t packed = 0;  // the owned matrices one after another, in plan order
    for (const auto& t : ou.tensors()) {
      if (t.optimizer() != v1::OPTIMIZER_MATRIX || t.owner_rank() != po) continue;
      if (!owner.ok()) {
        if (at.steps_optimizer()) return 94;
        continue;  // its replica in the same memory owns it
      }
      owns = true;
      for (int64_t x = t.offset(); x < t.offset() + t.numel(); ++x) {
        float& v = (*owner)[packed + x - t.offset()];
        if (v != held(x)) return 95;
        v = -v;
      }
      packed += t.numel();
    }
    if (owns && static_cast<int64_t>(owner->size()) != packed) return 99;
    if (!owns && owner.status().code() != absl::StatusCode::kNotFound) return 96;
    auto s2o = c->ScatterFromOwner(u);
    if (!s2o.ok() || !s2o->Wait(20s).ok()) return 97;
    for (int64_t e = 0; e < so; ++e) {
      const int64_t x = po * so + e;
      bool matrix = false;
      for (const auto& t : ou.tensors()) {
        matrix |=
            t.optimizer() == v1::OPTIMIZER_MATRIX && x >= t.offset() && x < t.offset() + t.numel();
      }
      if ((*gs)[b.os_grad_offset() + e] != (matrix ? -held(x) : held(x))) return 98;
    }
  }
  // No parameter or gradient data was copied outside the collectives.
  auto stats = c->DaemonStats();
  if (!stats.ok() || stats->jobs_size() < 1) return 99;
  for (const auto& j : stats->jobs()) {
    if (j.staging_bytes() != 0 || j.operations() == 0) return 100;
  }
  // Bad input: a unit that does not exist.
  if (c->Unshard(99).ok()) return 69;
  return 0;
}

int Loop(const std::string& job, int r) {
  auto c = Connect(job, r);
  if (!c->Register(TestInventory(), r == 0).ok() || !c->Attach().ok()) return 70;
  for (int i = 0; i < 100000; ++i) {
    auto h = c->Unshard(0);
    absl::Status s = h.ok() ? h->Wait(15s) : h.status();
    if (s.ok() && i == 0) {
      // The test kills a peer only once every rank is looping.
      FILE* f = std::fopen((g_dir + "/looping" + std::to_string(r)).c_str(), "w");
      std::fputs("1", f);
      std::fclose(f);
    }
    if (!s.ok()) {
      fprintf(stderr, "rank %d: %s\n", r, std::string(s.message()).c_str());
      const std::string m(s.message());
      return m.find("peer") != std::string::npos || m.find("detached") != std::string::npos ? 0
                                                                                            : 71;
    }
  }
  return 72;
}

int Disagree(const std::string& job, int r) {
  auto c = Connect(job, r);
  if (!c->Register(TestInventory(), r == 0).ok() || !c->Attach().ok()) return 75;
  const auto start = std::chrono::steady_clock::now();
  auto h = c->Unshard(r == 0 ? 1 : 0);
  absl::Status s = h.ok() ? h->Wait(20s) : h.status();
  fprintf(stderr, "rank %d: %s\n", r, s.ToString().c_str());
  const std::string m(s.message());
  if (m.find("local ranks disagree on operation 1: OP_UNSHARD of unit") == std::string::npos) {
    return 76;
  }
  if (std::chrono::steady_clock::now() - start > 10s) return 77;
  if (r < 2) return s.code() == absl::StatusCode::kFailedPrecondition ? 0 : 78;
  // Node 0's notice over the data plane, or (should node 1's heartbeat come first) the planner's
  // word, which quotes node 0's report.
  const bool notice = s.code() == absl::StatusCode::kAborted &&
                      m.find("node 0 stopped the job") != std::string::npos;
  const bool planner = s.code() == absl::StatusCode::kUnavailable &&
                       m.find("stopped by the planner: node 'node-0' reports") != std::string::npos;
  return notice || planner ? 0 : 79;
}

}  // namespace
}  // namespace ragshard

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  ragshard::g_planner = argv[1];
  ragshard::g_dir = argv[2];
  const std::string job = argv[3], mode = argv[5];
  const int rank = std::atoi(argv[4]);
  if (mode == "check") return ragshard::Rank(job, rank);
  if (mode == "check-direct") return ragshard::Rank(job, rank, /*direct=*/true);
  if (mode == "loop") return ragshard::Loop(job, rank);
  if (mode == "disagree") return ragshard::Disagree(job, rank);
  if (mode == "pause") {
    // Attach, then wait (the test stops the planner) before running the checks.
    auto c = ragshard::Connect(job, rank);
    if (!c->Register(ragshard::TestInventory(), rank == 0).ok() || !c->Attach().ok()) return 80;
    FILE* f = std::fopen((ragshard::g_dir + "/ready" + std::to_string(rank)).c_str(), "w");
    std::fputs("1", f);
    std::fclose(f);
    for (int i = 0; i < 3000; ++i) {
      if (FILE* go = std::fopen((ragshard::g_dir + "/go").c_str(), "r")) {
        std::fclose(go);
        return ragshard::Check(*c, rank);
      }
      usleep(10000);
    }
    return 81;
  }
  if (mode == "attach") {
    // Attach and check without registering (a "register" run did): the daemon's job setup is
    // the first call of the run to need the planner.
    auto c = ragshard::Connect(job, rank);
    absl::Status a = c->Attach();
    if (!a.ok()) {
      fprintf(stderr, "attach: %s\n", std::string(a.message()).c_str());
      return 82;
    }
    return ragshard::Check(*c, rank);
  }
  if (mode == "register") {
    auto c = ragshard::Connect(job, rank);
    return c->Register(ragshard::TestInventory(), rank == 0).ok() ? 0 : 1;
  }
  return 2;
}

// Control-plane benchmark: N simulated nodes of K ranks each run one job's control plane against
// a real ragshard-planner process on 127.0.0.1, each over its own connection, with the protocol a
// node's daemon speaks:
//   * RegisterNode, then a heartbeat every interval the planner answers (1 s), each carrying the
//     node's figures and its K ranks' progress, as ragshardd sends them;
//   * one WatchPlan stream per node, taking the plan compact (zstd), as ragshardd does; the
//     node's ranks get the plan from their daemon (Attach), never from the planner;
//   * each node's K ranks register through the daemon's registration code
//     (server/daemon/node_registration.h, as ragshardd runs it): one RegisterNodeRanks call per
//     node, node 0's carrying the model's inventory (rank 0's), the others its SHA-256;
//   * then the daemon's rendezvous: GetJob (the data secret), ListJobNodes, Put of its data
//     address and one GetKeys for every node's address.
// The first node to get the plan decodes and checks it; every other node compares the frame it
// got with that one, byte for byte (a real daemon would parse its own copy; N parses in one
// process would measure this process, not the planner).
//
// Prints the figures (one JSON object with --json). With --heartbeat-s S it then measures S
// seconds of heartbeats alone: the planner's CPU share and its database's size.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/proc_stats.h"
#include "engine/models.h"
#include "engine/plan_codec.h"
#include "infra/open_files.h"
#include "nlohmann/json.hpp"
#include "protocol/planner_client.h"
#include "server/daemon/node_registration.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kJob[] = "bench";

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

std::string NodeId(int64_t n) { return absl::StrCat("node-", n); }

// The bytes of the planner's SQLite files (the database and its write-ahead log).
int64_t StoreBytes(const std::string& dir) {
  int64_t total = 0;
  for (const char* f : {"/planner.db", "/planner.db-wal"}) {
    struct stat st {};
    if (::stat((dir + f).c_str(), &st) == 0) total += st.st_size;
  }
  return total;
}

// Runs fn(i) for i in [0, n) on `threads` threads.
void ParallelFor(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

struct Options {
  int64_t nodes = 64;
  int64_t ranks_per_node = 8;
  std::string model = "deepseek-v3";
  std::string granule = "rows:128";
  std::string planner;
  double heartbeat_s = 0;
  int channels = 0;  // one per node
  bool json = false;
};

// The simulated daemons' heartbeats: every node once per interval, from a few threads, until
// stopped. Counts the beats and the failed ones.
class Heartbeats {
 public:
  Heartbeats(const Options& o, std::vector<std::unique_ptr<GrpcPlannerClient>>* clients,
             std::chrono::milliseconds interval)
      : options_(o), clients_(clients), interval_(interval) {
    for (int t = 0; t < kThreads; ++t) threads_.emplace_back([this, t] { Run(t); });
  }
  ~Heartbeats() { Stop(); }
  void Stop() {
    stop_.store(true);
    for (auto& th : threads_) th.join();
    threads_.clear();
  }
  int64_t beats() const { return beats_.load(); }
  int64_t failures() const { return failures_.load(); }

 private:
  static constexpr int kThreads = 16;

  v1::HeartbeatRequest Beat(int64_t node) const {
    v1::HeartbeatRequest req;
    req.set_node_id(NodeId(node));
    req.add_jobs(kJob);
    v1::NodeFigures* f = req.mutable_figures();
    f->set_pool_capacity_bytes(int64_t{64} << 30);
    f->set_pool_used_bytes(int64_t{12} << 30);
    f->set_pool_peak_bytes(int64_t{20} << 30);
    f->set_buffers(4 * options_.ranks_per_node);
    f->set_attachments(options_.ranks_per_node);
    f->set_jobs(1);
    for (int64_t r = 0; r < options_.ranks_per_node; ++r) {
      v1::RankProgress* p = f->add_ranks();
      p->set_job_id(kJob);
      p->set_rank(node * options_.ranks_per_node + r);
      p->set_done_seq(1000);
      p->set_done("unshard unit 12");
      p->set_pending_seq(1001);
      p->set_pending("reduce-scatter unit 12");
    }
    return req;
  }

  void Run(int t) {
    const auto start = Clock::now();
    for (int64_t round = 1; !stop_.load(); ++round) {
      for (int64_t n = t; n < options_.nodes && !stop_.load(); n += kThreads) {
        auto r = (*clients_)[n % clients_->size()]->Heartbeat(Beat(n));
        (r.ok() ? beats_ : failures_).fetch_add(1);
      }
      const auto next = start + round * interval_;
      while (!stop_.load() && Clock::now() < next) {
        std::this_thread::sleep_for(
            std::min<Clock::duration>(next - Clock::now(), std::chrono::milliseconds(50)));
      }
    }
  }

  const Options& options_;
  std::vector<std::unique_ptr<GrpcPlannerClient>>* clients_;
  const std::chrono::milliseconds interval_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> beats_{0}, failures_{0};
  std::vector<std::thread> threads_;
};

// What the nodes' plan watches saw.
struct Holding {
  absl::Mutex mu;
  std::string reference;  // the first frame, decoded and checked
  Clock::time_point first_at{}, all_at{};
  int64_t holding = 0, mismatched = 0, corrupt = 0;
  std::string error;
};

int Run(const Options& o) {
  const std::string dir = [] {
    char tmpl[] = "/tmp/ragshard_cp_bench.XXXXXX";
    return std::string(mkdtemp(tmpl));
  }();
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  auto planner = testing::PlannerProcess::Start(o.planner, dir);
  if (planner.address.empty()) {
    std::cerr << "error: the planner (" << o.planner << ") did not start; see its log\n";
    return 1;
  }
  const pid_t pid = planner.child.pid();
  const int port = std::stoi(planner.address.substr(planner.address.rfind(':') + 1));
  const int64_t world = o.nodes * o.ranks_per_node;

  auto inv = GenerateModel(o.model);
  if (!inv.ok()) {
    std::cerr << "error: --model: " << inv.status() << "\n";
    return 2;
  }
  auto granule = ParseGranule(o.granule);
  if (!granule.ok()) {
    std::cerr << "error: --granule: " << granule.status() << "\n";
    return 2;
  }
  ApplyGranule(&*inv, *granule);
  const std::string sha = InventorySha256(*inv);

  std::vector<std::unique_ptr<GrpcPlannerClient>> clients;
  for (int i = 0; i < o.channels; ++i) {
    PlannerClientOptions c;
    c.address = planner.address;
    c.security.token_file = planner.token_file;
    c.retry_window = std::chrono::milliseconds(0);  // measure; never retry
    c.rpc_timeout = std::chrono::seconds(300);
    c.decode_plans = false;
    clients.push_back(std::move(*GrpcPlannerClient::Create(c)));
  }
  v1::CreateJobRequest create;
  create.set_job_id(kJob);
  create.mutable_mesh()->set_shard_size(world);
  create.mutable_mesh()->set_replicate_size(1);
  if (auto j = clients[0]->CreateJob(create); !j.ok()) {
    std::cerr << "error: CreateJob: " << j.status() << "\n";
    return 1;
  }

  // The daemons start: they register their nodes and beat.
  std::atomic<int64_t> failures{0};
  std::atomic<int64_t> interval_ms{1000};
  ParallelFor(o.nodes, 16, [&](int64_t n) {
    v1::RegisterNodeRequest req;
    req.set_node_id(NodeId(n));
    req.set_data_address(absl::StrCat("127.0.0.1:", 20000 + n % 40000));
    req.set_capacity_bytes(int64_t{64} << 30);
    auto r = clients[n % o.channels]->RegisterNode(req);
    if (!r.ok()) {
      failures.fetch_add(1);
    } else if (r->heartbeat_interval_ms() > 0) {
      interval_ms.store(r->heartbeat_interval_ms());
    }
  });
  Heartbeats beats(o, &clients, std::chrono::milliseconds(interval_ms.load()));

  // Each daemon watches the job's plan.
  Holding h;
  std::atomic<int64_t> connected{0};
  std::vector<std::unique_ptr<PlanWatch>> watches;
  for (int64_t n = 0; n < o.nodes; ++n) {
    watches.push_back(clients[n % o.channels]->WatchPlan(
        kJob, [&, seen = false](const absl::Status& s, const v1::WatchPlanEvent* ev) mutable {
          if (!s.ok() || ev == nullptr) return;
          if (!seen) connected.fetch_add(1);
          seen = true;
          if (ev->plan_zstd().empty()) return;
          const auto now = Clock::now();
          absl::MutexLock lock(&h.mu);
          if (h.reference.empty()) {
            auto plan = DecodePlan(ev->plan_zstd(), "the plan event");
            if (!plan.ok() || plan->world_size() != world || plan->units_size() == 0) {
              h.error = plan.ok() ? absl::StrCat("the plan is for ", plan->world_size(),
                                                 " ranks with ", plan->units_size(), " units")
                                  : std::string(plan.status().message());
              ++h.corrupt;
              return;
            }
            h.reference = ev->plan_zstd();
            h.first_at = now;
          } else if (ev->plan_zstd() != h.reference) {
            ++h.mismatched;
            return;
          }
          if (++h.holding == o.nodes) h.all_at = now;
        }));
  }
  for (int i = 0; connected.load() < o.nodes; ++i) {
    if (i == 12000) {
      std::cerr << "error: only " << connected.load() << " of " << o.nodes
                << " watches opened in 120 s\n";
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // Registration: node 0 with the inventory, then every other node with its hash.
  const int64_t sent0 = bench::TcpBytesSent(port);
  const double cpu0 = bench::CpuSeconds(pid), self0 = bench::CpuSeconds(getpid());
  const auto t0 = Clock::now();
  // Each node registers its ranks through the daemon's own code (server/daemon/
  // node_registration.h): every rank's request is held until the node's K ranks have asked, then
  // one RegisterNodeRanks goes out. Rank 0 sends the model's inventory, the other ranks its hash
  // (a rank that sends its inventory in full costs its own daemon a hash of it, not the planner).
  auto register_node = [&](int64_t n) {
    daemon::NodeRegistrations node(NodeId(n));
    std::vector<daemon::NodeRegistrationBatch> ready;
    std::atomic<int64_t> answered{0};
    for (int64_t r = 0; r < o.ranks_per_node; ++r) {
      v1::RegisterRequest req;
      req.set_job_id(kJob);
      req.set_rank(n * o.ranks_per_node + r);
      req.set_node_id(NodeId(n));
      req.set_local_ranks(o.ranks_per_node);
      req.set_timeout_ms(600'000);
      if (req.rank() == 0) {
        *req.mutable_inventory() = *inv;
      } else {
        req.set_inventory_sha256(sha);
      }
      auto batches = node.Add(req, absl::InfiniteFuture(), [&](const absl::StatusOr<v1::Job>& job) {
        if (!job.ok()) failures.fetch_add(1);
        answered.fetch_add(1);
      });
      if (!batches.ok()) {
        failures.fetch_add(1);
        return;
      }
      for (auto& b : *batches) ready.push_back(std::move(b));
    }
    if (ready.size() != 1) failures.fetch_add(1);  // one call per node
    for (const auto& b : ready) daemon::SendNodeRegistration(*clients[n % o.channels], b);
    if (answered.load() != o.ranks_per_node) failures.fetch_add(1);
  };
  register_node(0);
  ParallelFor(o.nodes - 1, 32, [&](int64_t i) { register_node(i + 1); });
  const auto registered_at = Clock::now();
  {
    absl::MutexLock lock(&h.mu);
    auto done = [&] { return h.holding + h.mismatched + h.corrupt >= o.nodes || h.corrupt > 0; };
    if (!h.mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(600))) {
      std::cerr << "error: " << h.holding << " of " << o.nodes
                << " nodes hold the plan after 600 s\n";
    }
  }
  const int64_t sent1 = bench::TcpBytesSent(port);
  const double cpu1 = bench::CpuSeconds(pid), self1 = bench::CpuSeconds(getpid());

  nlohmann::json out;
  out["nodes"] = o.nodes;
  out["ranks_per_node"] = o.ranks_per_node;
  out["ranks"] = world;
  out["model"] = o.model;
  out["granule"] = o.granule;
  int64_t tensors = 0;
  for (const auto& u : inv->units()) tensors += u.tensors_size();
  out["tensors"] = tensors;
  {
    absl::MutexLock lock(&h.mu);
    out["registrations_answered_s"] = Since(t0, registered_at);
    out["ready_s"] = h.reference.empty() ? -1.0 : Since(t0, h.first_at);
    out["all_nodes_hold_plan_s"] = h.holding == o.nodes ? Since(t0, h.all_at) : -1.0;
    out["nodes_holding_plan"] = h.holding;
    out["mismatched_plans"] = h.mismatched;
    out["plan_wire_bytes"] = static_cast<int64_t>(h.reference.size());
    if (!h.reference.empty()) {
      out["plan_bytes"] = static_cast<int64_t>(DecodePlan(h.reference, "plan")->ByteSizeLong());
    }
    if (!h.error.empty()) out["error"] = h.error;
  }
  out["planner_sent_bytes"] = sent0 < 0 || sent1 < 0 ? -1 : sent1 - sent0;
  out["planner_cpu_s"] = cpu1 - cpu0;
  out["bench_cpu_s"] = self1 - self0;
  out["planner_peak_rss_bytes"] = bench::ProcStatus(pid, "VmHWM") * 1024;

  // The rendezvous each daemon then runs (server/daemon/daemon_job_setup.cc): the job's data
  // secret and its nodes, its own data address published, then every node's address in one call.
  // Every node publishes first, so that the calls do not wait on each other's threads here.
  {
    const int64_t rs0 = bench::TcpBytesSent(port);
    const double rcpu0 = bench::CpuSeconds(pid);
    const auto r0 = Clock::now();
    std::vector<std::string> keys;
    for (int64_t n = 0; n < o.nodes; ++n) keys.push_back("data/" + NodeId(n));
    std::atomic<int64_t> wrong{0};
    ParallelFor(o.nodes, 32, [&](int64_t n) {
      auto& c = *clients[n % o.channels];
      if (!c.GetDataSecret(kJob).ok()) failures.fetch_add(1);
      if (!c.Put(kJob, "data/" + NodeId(n), absl::StrCat("127.0.0.1:", 20000 + n % 40000)).ok()) {
        failures.fetch_add(1);
      }
    });
    ParallelFor(o.nodes, 32, [&](int64_t n) {
      auto& c = *clients[n % o.channels];
      auto nodes = c.ListJobNodes(kJob);
      if (!nodes.ok()) {
        failures.fetch_add(1);
      } else if (nodes->node_ids_size() != o.nodes || nodes->node_ids(n) != NodeId(n) ||
                 nodes->run_node_size() != o.nodes || nodes->run_node(n) != n ||
                 nodes->run_count(n) != o.ranks_per_node) {
        wrong.fetch_add(1);
      }
      auto addresses = c.GetKeys(kJob, keys, std::chrono::seconds(60));
      if (!addresses.ok()) {
        failures.fetch_add(1);
      } else if (static_cast<int64_t>(addresses->size()) != o.nodes) {
        wrong.fetch_add(1);
      }
    });
    out["rendezvous_s"] = Since(r0, Clock::now());
    const int64_t rs1 = bench::TcpBytesSent(port);
    out["rendezvous_sent_bytes"] = rs0 < 0 || rs1 < 0 ? -1 : rs1 - rs0;
    out["rendezvous_planner_cpu_s"] = bench::CpuSeconds(pid) - rcpu0;
    out["rendezvous_wrong_answers"] = wrong.load();
  }

  if (o.heartbeat_s > 0) {
    const int64_t db0 = StoreBytes(dir), beats0 = beats.beats();
    const double hcpu0 = bench::CpuSeconds(pid);
    const auto h0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(o.heartbeat_s));
    const double hcpu1 = bench::CpuSeconds(pid);
    const double elapsed = Since(h0, Clock::now());
    out["heartbeat_window_s"] = elapsed;
    out["heartbeats"] = beats.beats() - beats0;
    out["heartbeat_planner_cpu_share"] = (hcpu1 - hcpu0) / elapsed;
    out["heartbeat_store_bytes_before"] = db0;
    out["heartbeat_store_bytes_after"] = StoreBytes(dir);
  }
  beats.Stop();
  out["heartbeat_interval_ms"] = interval_ms.load();
  out["failed_calls"] = failures.load() + beats.failures();
  auto job = clients[0]->GetJob(kJob);
  out["final_job_status"] = job.ok() ? v1::JobStatus_Name(job->status()) : "?";
  watches.clear();

  if (o.json) {
    std::cout << out.dump() << "\n";
  } else {
    std::cout << out.dump(2) << "\n";
  }
  const bool ok = out["failed_calls"] == 0 && out["nodes_holding_plan"] == o.nodes &&
                  out["mismatched_plans"] == 0 && out["rendezvous_wrong_answers"] == 0 &&
                  out["final_job_status"] == "JOB_READY";
  return ok ? 0 : 1;
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app(
      "Simulated nodes (daemons) of one job register a model with a real ragshard-planner, each "
      "watching for the plan and beating; prints the figures");
  app.add_option("--nodes", o.nodes, "simulated nodes")->check(CLI::Range(1, 65536));
  app.add_option("--ranks-per-node", o.ranks_per_node, "ranks of each node")
      ->check(CLI::Range(1, 4096));
  app.add_option("--model", o.model, "zoo model (engine/models.h)");
  app.add_option("--granule", o.granule, "granule of 2-D+ tensors: element, rows:K or whole");
  app.add_option("--heartbeat-s", o.heartbeat_s,
                 "then measure this many seconds of heartbeats alone (0: none)")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--channels", o.channels,
                 "gRPC channels (connections) the simulated nodes share; 0: one per node, as "
                 "daemons have")
      ->check(CLI::Range(0, 65536));
  app.add_option("--planner", o.planner,
                 "the ragshard-planner binary (default: server/ragshard-planner of this build)");
  app.add_flag("--json", o.json, "print one JSON object on one line");
  CLI11_PARSE(app, argc, argv);
  if (o.nodes * o.ranks_per_node < 2) {
    std::cerr << "error: --nodes x --ranks-per-node must be at least 2\n";
    return 2;
  }
  if (o.channels == 0 || o.channels > o.nodes) o.channels = static_cast<int>(o.nodes);
  if (RaiseOpenFileLimit() < o.channels + 1024) {
    std::cerr << "error: " << o.channels << " connections need more open files than the limit ("
              << "ulimit -n); pass fewer --channels\n";
    return 2;
  }
  if (o.planner.empty()) {
    char self[4096] = {0};
    if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return 1;
    const std::filesystem::path exe(self);
    o.planner = (exe.parent_path().parent_path() / "server" / "ragshard-planner").string();
  }
  return Run(o);
}

}  // namespace
}  // namespace ragshard

int main(int argc, char** argv) { return ragshard::Main(argc, argv); }

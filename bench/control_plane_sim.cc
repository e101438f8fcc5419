#include "bench/control_plane_sim.h"

#include <unistd.h>

#include <atomic>
#include <functional>
#include <iostream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "bench/proc_stats.h"
#include "engine/inventory.h"
#include "engine/models.h"
#include "engine/plan_codec.h"
#include "openssl/sha.h"
#include "server/daemon/node_registration.h"

namespace ragshard::bench {
namespace {

using Clock = std::chrono::steady_clock;

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

int64_t Nanos(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

constexpr int kBeatThreads = 16;
constexpr int kCallThreads = 32;

}  // namespace

std::string SimNodeId(int64_t n) { return absl::StrCat("node-", n); }
std::string SimDataAddress(int64_t n) { return absl::StrCat("127.0.0.1:", 20000 + n % 40000); }

absl::StatusOr<std::unique_ptr<SimulatedNodes>> SimulatedNodes::Start(const SimOptions& o) {
  std::unique_ptr<SimulatedNodes> s(new SimulatedNodes(o));
  // Every process makes the model's inventory: node 0's sends it, and every rank its hash.
  {
    auto inv = GenerateModel(o.model);
    if (!inv.ok()) return inv.status();
    auto granule = ParseGranule(o.granule);
    if (!granule.ok()) return granule.status();
    ApplyGranule(&*inv, *granule);
    s->sha_ = InventorySha256(*inv);
    if (o.first == 0) s->inventory_ = std::move(*inv);
  }
  for (int64_t i = 0; i < o.count; ++i) {
    PlannerClientOptions c;
    c.address = o.planner;
    c.security.token_file = o.token_file;
    c.retry_window = std::chrono::milliseconds(0);  // measure; never retry
    c.rpc_timeout = std::chrono::seconds(300);
    c.decode_plans = false;
    c.heartbeat_stream = !o.unary_heartbeats;
    auto client = GrpcPlannerClient::Create(c);
    if (!client.ok()) return client.status();
    s->clients_.push_back(std::move(*client));
  }
  // The daemons start: they register their nodes and beat.
  std::atomic<int64_t> interval_ms{1000};
  ParallelFor(o.count, kCallThreads, [&](int64_t i) {
    v1::RegisterNodeRequest req;
    req.set_node_id(SimNodeId(o.first + i));
    req.set_data_address(SimDataAddress(o.first + i));
    req.set_capacity_bytes(int64_t{64} << 30);
    auto r = s->clients_[i]->RegisterNode(req);
    if (!r.ok()) {
      s->Failed("RegisterNode", r.status());
    } else if (r->heartbeat_interval_ms() > 0) {
      interval_ms.store(r->heartbeat_interval_ms());
    }
  });
  s->interval_ = std::chrono::milliseconds(interval_ms.load());
  for (int t = 0; t < std::min<int64_t>(kBeatThreads, o.count); ++t) {
    s->beaters_.emplace_back([p = s.get(), t] {
      const auto start = Clock::now();
      for (int64_t round = 1; !p->stop_.load(); ++round) {
        for (int64_t i = t; i < p->o_.count && !p->stop_.load(); i += kBeatThreads) {
          v1::HeartbeatRequest req;
          const int64_t node = p->o_.first + i;
          req.set_node_id(SimNodeId(node));
          req.add_jobs(kBenchJob);
          v1::NodeFigures* f = req.mutable_figures();
          f->set_pool_capacity_bytes(int64_t{64} << 30);
          f->set_pool_used_bytes(int64_t{12} << 30);
          f->set_pool_peak_bytes(int64_t{20} << 30);
          f->set_buffers(4 * p->o_.ranks_per_node);
          f->set_attachments(p->o_.ranks_per_node);
          f->set_jobs(1);
          for (int64_t r = 0; r < p->o_.ranks_per_node; ++r) {
            v1::RankProgress* g = f->add_ranks();
            g->set_job_id(kBenchJob);
            g->set_rank(node * p->o_.ranks_per_node + r);
            g->set_done_seq(1000);
            g->set_done("unshard unit 12");
            g->set_pending_seq(1001);
            g->set_pending("reduce-scatter unit 12");
          }
          if (auto r = p->clients_[i]->Heartbeat(req); r.ok()) {
            p->beats_.fetch_add(1);
          } else {
            p->beat_failures_.fetch_add(1);
            p->Failed("Heartbeat", r.status(), /*count=*/false);
          }
        }
        const auto next = start + round * p->interval_;
        while (!p->stop_.load() && Clock::now() < next) {
          std::this_thread::sleep_for(
              std::min<Clock::duration>(next - Clock::now(), std::chrono::milliseconds(50)));
        }
      }
    });
  }
  // Each daemon watches the job's plan.
  const int64_t world = o.nodes * o.ranks_per_node;
  for (int64_t i = 0; i < o.count; ++i) {
    s->watches_.push_back(s->clients_[i]->WatchPlan(
        kBenchJob, [p = s.get(), world, seen = false](const absl::Status& st,
                                                      const v1::WatchPlanEvent* ev) mutable {
          if (!st.ok() || ev == nullptr) return;
          if (!seen) p->connected_.fetch_add(1);
          seen = true;
          if (ev->plan_zstd().empty()) return;
          const auto now = Clock::now();
          absl::MutexLock lock(&p->mu_);
          if (p->reference_.empty()) {
            auto plan = DecodePlan(ev->plan_zstd(), "the plan event");
            if (!plan.ok() || plan->world_size() != world || plan->units_size() == 0) {
              p->error_ = plan.ok() ? absl::StrCat("the plan is for ", plan->world_size(),
                                                   " ranks with ", plan->units_size(), " units")
                                    : std::string(plan.status().message());
              ++p->corrupt_;
              return;
            }
            p->reference_ = ev->plan_zstd();
            p->first_at_ = now;
          } else if (ev->plan_zstd() != p->reference_) {
            ++p->mismatched_;
            return;
          }
          if (++p->holding_ == p->o_.count) p->all_at_ = now;
        }));
  }
  for (int i = 0; s->connected_.load() < o.count; ++i) {
    if (i == 12000) {
      return absl::DeadlineExceededError(
          absl::StrCat("only ", s->connected_.load(), " of ", o.count, " watches opened in 120 s"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return s;
}

SimulatedNodes::~SimulatedNodes() { Stop(); }

void SimulatedNodes::Failed(absl::string_view call, const absl::Status& why, bool count) {
  if (count) failures_.fetch_add(1);
  absl::MutexLock lock(&mu_);
  if (first_failure_.empty()) first_failure_ = absl::StrCat(call, ": ", why.ToString());
}

void SimulatedNodes::RegisterNode(int64_t n) {
  // Every rank's request is held until the node's K ranks have asked, then one
  // RegisterNodeRanks goes out. Rank 0 sends the model's inventory, the other ranks its hash
  // (a rank that sends its inventory in full costs its own daemon a hash of it, not the
  // planner). Ranks of other nodes than node 0 send the hash they were given.
  daemon::NodeRegistrations node(SimNodeId(n));
  std::vector<daemon::NodeRegistrationBatch> ready;
  std::atomic<int64_t> answered{0};
  for (int64_t r = 0; r < o_.ranks_per_node; ++r) {
    v1::RegisterRequest req;
    req.set_job_id(kBenchJob);
    req.set_rank(n * o_.ranks_per_node + r);
    req.set_node_id(SimNodeId(n));
    req.set_local_ranks(o_.ranks_per_node);
    req.set_timeout_ms(600'000);
    if (req.rank() == 0) {
      *req.mutable_inventory() = inventory_;
    } else {
      req.set_inventory_sha256(sha_);
    }
    auto batches = node.Add(req, absl::InfiniteFuture(), [&](const absl::StatusOr<v1::Job>& job) {
      if (!job.ok()) Failed("RegisterNodeRanks", job.status());
      answered.fetch_add(1);
    });
    if (!batches.ok()) {
      Failed("NodeRegistrations::Add", batches.status());
      return;
    }
    for (auto& b : *batches) ready.push_back(std::move(b));
  }
  if (ready.size() != 1) {  // one call per node
    Failed("RegisterNodeRanks", absl::InternalError(absl::StrCat(ready.size(), " calls")));
  }
  for (const auto& b : ready) daemon::SendNodeRegistration(client(n), b);
  if (answered.load() != o_.ranks_per_node) {
    Failed("RegisterNodeRanks",
           absl::InternalError(absl::StrCat(answered.load(), " ranks answered")));
  }
}

void SimulatedNodes::RegisterRanks(bool only_node_0) {
  if (only_node_0) {
    if (o_.first == 0) RegisterNode(0);
    return;
  }
  const int64_t skip = o_.first == 0 ? 1 : 0;
  ParallelFor(o_.count - skip, kCallThreads, [&](int64_t i) { RegisterNode(o_.first + skip + i); });
}

nlohmann::json SimulatedNodes::AwaitPlans() {
  absl::MutexLock lock(&mu_);
  // A failed registration (the call is not retried) may leave the job without a plan.
  auto done = [&] {
    return holding_ + mismatched_ + corrupt_ >= o_.count || corrupt_ > 0 || failures_.load() > 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(600)) && error_.empty()) {
    error_ = absl::StrCat(holding_, " of ", o_.count, " nodes (from ", SimNodeId(o_.first),
                          ") hold the plan after 600 s");
  }
  nlohmann::json out;
  out["holding"] = holding_;
  out["mismatched"] = mismatched_;
  out["corrupt"] = corrupt_;
  if (!reference_.empty()) {
    out["first_at_ns"] = Nanos(first_at_);
    if (holding_ == o_.count) out["all_at_ns"] = Nanos(all_at_);
    out["frame_sha256"] = Sha256Hex(reference_);
    out["plan_wire_bytes"] = static_cast<int64_t>(reference_.size());
    out["plan_bytes"] = static_cast<int64_t>(DecodePlan(reference_, "plan")->ByteSizeLong());
  }
  if (!error_.empty()) out["error"] = error_;
  return out;
}

void SimulatedNodes::Publish() {
  ParallelFor(o_.count, kCallThreads, [&](int64_t i) {
    const int64_t n = o_.first + i;
    if (auto r = client(n).GetDataSecret(kBenchJob); !r.ok()) Failed("GetDataSecret", r.status());
    if (auto r = client(n).Put(kBenchJob, "data/" + SimNodeId(n), SimDataAddress(n)); !r.ok()) {
      Failed("Put", r);
    }
  });
}

nlohmann::json SimulatedNodes::Fetch() {
  std::vector<std::string> keys;
  for (int64_t n = 0; n < o_.nodes; ++n) keys.push_back("data/" + SimNodeId(n));
  std::atomic<int64_t> wrong{0};
  ParallelFor(o_.count, kCallThreads, [&](int64_t i) {
    const int64_t me = o_.first + i;
    auto nodes = client(me).ListJobNodes(kBenchJob);
    if (!nodes.ok()) {
      Failed("ListJobNodes", nodes.status());
    } else {
      bool right = nodes->node_ids_size() == o_.nodes && nodes->run_node_size() == o_.nodes;
      for (int64_t n = 0; right && n < o_.nodes; ++n) {
        right = nodes->node_ids(static_cast<int>(n)) == SimNodeId(n) &&
                nodes->run_node(static_cast<int>(n)) == n &&
                nodes->run_first(static_cast<int>(n)) == n * o_.ranks_per_node &&
                nodes->run_count(static_cast<int>(n)) == o_.ranks_per_node;
      }
      if (!right) wrong.fetch_add(1);
    }
    auto addresses = client(me).GetKeys(kBenchJob, keys, std::chrono::seconds(60));
    if (!addresses.ok()) {
      Failed("GetKeys", addresses.status());
    } else {
      bool right = static_cast<int64_t>(addresses->size()) == o_.nodes;
      for (int64_t n = 0; right && n < o_.nodes; ++n) {
        right = (*addresses)[static_cast<size_t>(n)] == SimDataAddress(n);
      }
      if (!right) wrong.fetch_add(1);
    }
  });
  return {{"wrong", wrong.load()}};
}

nlohmann::json SimulatedNodes::Stop() {
  stop_.store(true);
  for (auto& th : beaters_) th.join();
  beaters_.clear();
  watches_.clear();
  nlohmann::json out = {{"failures", failures_.load()}, {"beat_failures", beat_failures_.load()}};
  absl::MutexLock lock(&mu_);
  if (!first_failure_.empty()) out["first_failure"] = first_failure_;
  return out;
}

int RunSimWorker(const SimOptions& o) {
  auto say = [](nlohmann::json j) { std::cout << j.dump() << std::endl; };
  auto nodes = SimulatedNodes::Start(o);
  if (!nodes.ok()) {
    say({{"error", std::string(nodes.status().message())}});
    return 1;
  }
  say({{"phase", "connected"},
       {"heartbeat_interval_ms", (*nodes)->interval_ms()},
       {"cpu_s", CpuSeconds(getpid())}});
  for (std::string command; std::getline(std::cin, command);) {
    nlohmann::json out;
    if (command == "register-0" || command == "register") {
      (*nodes)->RegisterRanks(command == "register-0");
    } else if (command == "plans") {
      out = (*nodes)->AwaitPlans();
    } else if (command == "publish") {
      (*nodes)->Publish();
    } else if (command == "fetch") {
      out = (*nodes)->Fetch();
    } else if (command == "beats") {
      out["beats"] = (*nodes)->beats();
    } else if (command == "stop") {
      out = (*nodes)->Stop();
      out["cpu_s"] = CpuSeconds(getpid());
      say(out);
      return 0;
    } else {
      say({{"error", absl::StrCat("unknown command '", command, "'")}});
      return 1;
    }
    out["phase"] = command;
    out["cpu_s"] = CpuSeconds(getpid());
    say(out);
  }
  return 1;  // the bench went away
}

}  // namespace ragshard::bench

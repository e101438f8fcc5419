// The planner under load, under kills and under large refused requests (issue 26), against a real
// ragshard-planner process on 127.0.0.1. Prints one JSON object (bench/chaos_report.py renders it
// in docs/benchmarks/reliability.md).
//
//   planner_soak --mode soak [--jobs 40000]: first, ten jobs of the largest world: the largest
//     CreateJob response, and ListJobs' bytes and time over them; then `jobs` jobs planned in a
//     row (created, one rank registered with a full inventory, planned; kept), sampling the
//     planner's threads, memory maps and RSS; at the end the planner must still answer.
//   planner_soak --mode kills [--kills 20]: client threads create jobs and register their ranks
//     in bursts while the planner is killed (SIGKILL) and restarted on the same address `kills`
//     times; then every acknowledged creation and registration must be in the restarted
//     planner, and every job whose ranks were all acknowledged must become READY.
//   planner_soak --mode reject: a 200 MiB Put and a 1,000,001-tensor registration, both refused;
//     the planner's RSS before, after each (a second later) and at its peak.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "bench/proc_stats.h"
#include "engine/inventory.h"
#include "nlohmann/json.hpp"
#include "protocol/planner_client.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using Clock = std::chrono::steady_clock;
using testing::PlannerProcess;
using namespace std::chrono_literals;

using bench::ProcStatus;

int64_t Maps(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  int64_t n = 0;
  std::string line;
  while (std::getline(maps, line)) ++n;
  return n;
}

Inventory SmallInventory() {
  return *ParseInventoryJson(R"({"units": [
      {"name": "layers.0", "tensors": [
        {"name": "layers.0.w", "shape": [256, 64], "dtype": "bf16", "granule": "rows:32"},
        {"name": "layers.0.b", "shape": [64], "dtype": "bf16"}]},
      {"name": "layers.1", "tensors": [
        {"name": "layers.1.w", "shape": [256, 64], "dtype": "bf16"}]}]})");
}

v1::CreateJobRequest Create(const std::string& id, int64_t world) {
  v1::CreateJobRequest req;
  req.set_job_id(id);
  req.mutable_mesh()->set_shard_size(world);
  req.mutable_mesh()->set_replicate_size(1);
  return req;
}

v1::RegisterRankRequest Register(const std::string& job, int64_t rank, const Inventory& inv) {
  v1::RegisterRankRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_node_id(absl::StrCat("node-", rank));
  if (rank == 0) {
    *req.mutable_inventory() = inv;
  } else {
    req.set_inventory_sha256(InventorySha256(inv));
  }
  return req;
}

std::unique_ptr<GrpcPlannerClient> Connect(const std::string& address,
                                           std::chrono::milliseconds retry) {
  PlannerClientOptions o;
  o.address = address;
  o.security = ClientSecurityFromEnv();
  o.retry_window = retry;
  auto c = GrpcPlannerClient::Create(o);
  if (!c.ok()) {
    std::cerr << "error: " << c.status() << "\n";
    std::exit(1);
  }
  return std::move(*c);
}

struct Planner {
  std::string binary;
  std::string data_dir;
  PlannerProcess process;

  bool Start(const std::string& listen = "127.0.0.1:0") {
    process = PlannerProcess::Start(binary, data_dir, {}, listen);
    if (process.address.empty()) {
      std::cerr << "error: the planner did not start; its log: " << data_dir << "/planner.log\n";
      return false;
    }
    return true;
  }
};

int Soak(Planner& planner, int64_t jobs, nlohmann::json* out) {
  auto client = Connect(planner.process.address, 0ms);
  const pid_t pid = planner.process.child.pid();
  // Ten jobs of the largest world first, on the empty planner.
  size_t create_max = 0;
  for (int i = 0; i < 10; ++i) {
    auto job = client->CreateJob(Create(absl::StrCat("max-", i), 131072));
    if (!job.ok()) {
      std::cerr << "error: CreateJob at the largest world: " << job.status() << "\n";
      return 1;
    }
    create_max = std::max(create_max, job->ByteSizeLong());
  }
  const auto listed = Clock::now();
  auto page = client->ListJobsPage(v1::ListJobsRequest());
  (*out)["list_jobs_seconds"] = std::chrono::duration<double>(Clock::now() - listed).count();
  if (!page.ok() || page->jobs_size() != 10) {
    std::cerr << "error: ListJobs: " << page.status() << "\n";
    return 1;
  }
  (*out)["list_jobs_bytes"] = page->ByteSizeLong();
  (*out)["create_response_bytes_max"] = create_max;

  const Inventory inv = SmallInventory();
  std::atomic<int64_t> next{0}, failed{0};
  std::mutex mu;
  std::string first_error;
  int64_t threads_max = 0, maps_max = 0, rss_max = 0;
  auto sample = [&] {
    threads_max = std::max(threads_max, ProcStatus(pid, "Threads"));
    maps_max = std::max(maps_max, Maps(pid));
    rss_max = std::max(rss_max, ProcStatus(pid, "VmRSS") * 1024);
  };
  (*out)["threads_start"] = ProcStatus(pid, "Threads");
  (*out)["maps_start"] = Maps(pid);
  sample();
  const auto started = Clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&] {
      auto c = Connect(planner.process.address, 0ms);
      for (int64_t i = next++; i < jobs; i = next++) {
        const std::string id = absl::StrCat("soak-", i);
        absl::Status s = c->CreateJob(Create(id, 1)).status();
        if (s.ok()) s = c->RegisterRank(Register(id, 0, inv)).status();
        if (s.ok()) s = c->WaitForPlan(id, 60s).status();
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (failed++ == 0) first_error = s.ToString();
        }
      }
    });
  }
  while (next.load() < jobs) {
    std::this_thread::sleep_for(200ms);
    sample();
  }
  for (auto& t : workers) t.join();
  sample();
  (*out)["seconds"] = std::chrono::duration<double>(Clock::now() - started).count();
  // Still healthy: it answers a health check, a read and a new job.
  absl::Status alive = client->Health();
  if (alive.ok()) alive = client->GetJob(absl::StrCat("soak-", jobs - 1)).status();
  if (alive.ok()) alive = client->CreateJob(Create("after", 1)).status();
  (*out)["jobs"] = jobs;
  (*out)["failed_calls"] = failed.load();
  if (!first_error.empty()) (*out)["first_error"] = first_error;
  (*out)["healthy_after"] = alive.ok();
  if (!alive.ok()) (*out)["error_after"] = alive.ToString();
  (*out)["threads_max"] = threads_max;
  (*out)["threads_end"] = ProcStatus(pid, "Threads");
  (*out)["maps_max"] = maps_max;
  (*out)["maps_end"] = Maps(pid);
  (*out)["rss_max_bytes"] = rss_max;
  (*out)["rss_end_bytes"] = ProcStatus(pid, "VmRSS") * 1024;
  return 0;
}

int Kills(Planner& planner, int kills, nlohmann::json* out) {
  const std::string address = planner.process.address;
  const Inventory inv = SmallInventory();
  constexpr int kWorld = 4;
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::string> acked_jobs;
  std::vector<std::pair<std::string, int64_t>> acked_ranks;
  std::atomic<int64_t> unacked{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&, w] {
      // Rides through each restart (a few seconds); a call that still fails is not acknowledged.
      auto c = Connect(address, 20s);
      for (int n = 0; !stop.load(); ++n) {
        const std::string id = absl::StrCat("burst-", w, "-", n);
        if (!c->CreateJob(Create(id, kWorld)).ok()) {
          ++unacked;
          continue;
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          acked_jobs.push_back(id);
        }
        for (int64_t r = 0; r < kWorld; ++r) {
          if (!c->RegisterRank(Register(id, r, inv)).ok()) {
            ++unacked;
            break;
          }
          std::lock_guard<std::mutex> lock(mu);
          acked_ranks.emplace_back(id, r);
        }
      }
    });
  }
  std::mt19937 rng(26);
  for (int k = 0; k < kills; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 400));
    planner.process.child.Kill(SIGKILL);
    if (!planner.Start(address)) {
      stop = true;
      for (auto& t : workers) t.join();
      return 1;
    }
  }
  std::this_thread::sleep_for(300ms);  // one more burst against the last planner
  stop = true;
  for (auto& t : workers) t.join();

  auto client = Connect(address, 20s);
  int64_t lost_jobs = 0, lost_ranks = 0, not_ready = 0;
  std::map<std::string, int> complete;
  for (const auto& [id, rank] : acked_ranks) ++complete[id];
  std::vector<std::string> examples;
  for (const std::string& id : acked_jobs) {
    if (!client->GetJob(id).ok()) {
      ++lost_jobs;
      if (examples.size() < 5) examples.push_back("job " + id);
    }
  }
  std::map<std::string, std::vector<v1::RankState>> ranks;
  for (const auto& [id, rank] : acked_ranks) {
    if (!ranks.count(id)) ranks[id] = client->ListRanks(id).value_or(std::vector<v1::RankState>());
    const auto& rs = ranks[id];
    if (rank >= static_cast<int64_t>(rs.size()) || !rs[rank].registered()) {
      ++lost_ranks;
      if (examples.size() < 5) examples.push_back(absl::StrCat("rank ", rank, " of ", id));
    }
  }
  for (const auto& [id, n] : complete) {
    if (n == kWorld && !client->WaitForPlan(id, 120s).ok()) {
      ++not_ready;
      if (examples.size() < 5) examples.push_back("job " + id + " never READY");
    }
  }
  (*out)["kills"] = kills;
  (*out)["acked_creates"] = acked_jobs.size();
  (*out)["acked_registrations"] = acked_ranks.size();
  (*out)["unacked_calls"] = unacked.load();
  (*out)["lost_creates"] = lost_jobs;
  (*out)["lost_registrations"] = lost_ranks;
  (*out)["fully_registered_jobs"] = std::count_if(
      complete.begin(), complete.end(), [](const auto& kv) { return kv.second == kWorld; });
  (*out)["not_ready_jobs"] = not_ready;
  if (!examples.empty()) (*out)["lost_examples"] = examples;
  return 0;
}

// Large requests the planner refuses: a 200 MiB Put value (the limit is 1 MiB) and a
// registration of 1,000,001 tensors. Its RSS before, at the peak, and a second after each.
int Reject(Planner& planner, nlohmann::json* out) {
  auto client = Connect(planner.process.address, 0ms);
  const pid_t pid = planner.process.child.pid();
  if (!client->CreateJob(Create("big", 2)).ok()) return 1;
  (*out)["rss_start_bytes"] = ProcStatus(pid, "VmRSS") * 1024;
  auto settled = [&](const char* key) {
    std::this_thread::sleep_for(1s);  // the ticker trims at its next tick (50 ms)
    (*out)[key] = ProcStatus(pid, "VmRSS") * 1024;
  };
  constexpr int64_t kPutBytes = 200 << 20;
  constexpr int kTensors = 1'000'001;
  (*out)["put_bytes"] = kPutBytes;
  (*out)["register_tensors"] = kTensors;
  absl::Status put = client->Put("big", "k", std::string(kPutBytes, 'x'));
  (*out)["put_refused"] = !put.ok();
  (*out)["put_error"] = put.ToString().substr(0, 200);
  settled("rss_after_put_bytes");
  v1::RegisterRankRequest reg;
  reg.set_job_id("big");
  reg.set_node_id("n0");
  UnitSpec* unit = reg.mutable_inventory()->add_units();
  unit->set_name("u");
  for (int i = 0; i < kTensors; ++i) {
    TensorSpec* t = unit->add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->add_shape(1);
    t->set_dtype(v1::DTYPE_BF16);
  }
  absl::Status registered = client->RegisterRank(reg).status();
  (*out)["register_refused"] = !registered.ok();
  (*out)["register_error"] = registered.ToString().substr(0, 200);
  settled("rss_after_register_bytes");
  (*out)["rss_peak_bytes"] = ProcStatus(pid, "VmHWM") * 1024;
  (*out)["healthy_after"] = client->GetJob("big").ok();
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app("The planner under load (--mode soak) and under kills (--mode kills); prints JSON");
  std::string mode = "soak", binary;
  int64_t jobs = 40000;
  int kills = 20;
  app.add_option("--mode", mode, "soak, kills or reject")
      ->check(CLI::IsMember({"soak", "kills", "reject"}));
  app.add_option("--planner", binary, "the ragshard-planner binary")->required();
  app.add_option("--jobs", jobs, "soak: jobs planned in a row")->check(CLI::Range(1, 10'000'000));
  app.add_option("--kills", kills, "kills: planner kills")->check(CLI::Range(1, 1000));
  bool check = false;
  app.add_flag("--json", "print JSON (the only output format)");
  app.add_flag("--check", check,
               "exit 1 when an acknowledged call was lost, a job never became READY or a call "
               "failed (a test)");
  CLI11_PARSE(app, argc, argv);

  char tmpl[] = "/tmp/ragshard_soak.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  Planner planner{binary, tmpl, {}};
  nlohmann::json out;
  out["mode"] = mode;
  int rc = 1;
  if (planner.Start()) {
    rc = mode == "soak"    ? Soak(planner, jobs, &out)
         : mode == "kills" ? Kills(planner, kills, &out)
                           : Reject(planner, &out);
  }
  planner.process.child.Kill(SIGKILL);
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  if (rc == 0) std::cout << out.dump() << "\n";
  if (rc == 0 && check) {
    for (const char* key :
         {"lost_creates", "lost_registrations", "not_ready_jobs", "failed_calls"}) {
      if (out.value(key, 0) != 0) {
        std::cerr << "error: " << key << " = " << out[key] << "\n";
        rc = 1;
      }
    }
    if (out.contains("healthy_after") && !out["healthy_after"].get<bool>()) rc = 1;
  }
  return rc;
}

}  // namespace
}  // namespace ragshard

int main(int argc, char** argv) { return ragshard::Main(argc, argv); }

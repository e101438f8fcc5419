// Control-plane benchmark: N simulated nodes of K ranks each run one job's control plane against
// a real ragshard-planner process on 127.0.0.1, each over its own connection, with the protocol a
// node's daemon speaks (bench/control_plane_sim.h). The nodes are spread over --processes
// simulator processes (this program again, in its --worker mode), so that the planner is what is
// measured, not one simulator process; each reports its own CPU.
//
// Prints the figures (one JSON object with --json). With --heartbeat-s S it then measures S
// seconds of heartbeats alone: the planner's CPU share and its database's size.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "bench/control_plane_sim.h"
#include "bench/proc_stats.h"
#include "engine/inventory.h"
#include "engine/models.h"
#include "infra/open_files.h"
#include "nlohmann/json.hpp"
#include "protocol/planner_client.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using bench::kBenchJob;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// The bytes of the planner's SQLite files (the database and its write-ahead log).
int64_t StoreBytes(const std::string& dir) {
  int64_t total = 0;
  for (const char* f : {"/planner.db", "/planner.db-wal"}) {
    struct stat st {};
    if (::stat((dir + f).c_str(), &st) == 0) total += st.st_size;
  }
  return total;
}

struct Options {
  int64_t nodes = 64;
  int64_t ranks_per_node = 8;
  std::string model = "deepseek-v3";
  std::string granule = "rows:128";
  std::string planner;
  double heartbeat_s = 0;
  int processes = 0;  // 0: one per 512 nodes, 1 to 16
  bool json = false;
  // --worker: a simulator process of the bench's (bench/control_plane_sim.h)
  bool worker = false;
  bench::SimOptions sim;
};

// One simulator process: this program in --worker mode, commanded over its standard input,
// answering one JSON line per command on its standard output. Killed with the bench.
class Simulator {
 public:
  Simulator(const std::string& self, const Options& o, const std::string& planner,
            const std::string& token_file, int64_t first, int64_t count)
      : first_(first), count_(count) {
    std::vector<std::string> argv = {self,
                                     "--worker",
                                     "--nodes",
                                     std::to_string(o.nodes),
                                     "--ranks-per-node",
                                     std::to_string(o.ranks_per_node),
                                     "--model",
                                     o.model,
                                     "--granule",
                                     o.granule,
                                     "--planner-address",
                                     planner,
                                     "--token-file",
                                     token_file,
                                     "--first",
                                     std::to_string(first),
                                     "--count",
                                     std::to_string(count)};
    if (o.sim.unary_heartbeats) argv.push_back("--unary-heartbeats");
    std::vector<char*> args;  // made before the fork: the child only execs
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
      std::perror("control_plane_bench: pipe2");
      return;  // its answers say it failed
    }
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      dup2(in[0], 0);
      dup2(out[1], 1);
      execv(args[0], args.data());
      _exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = ::fdopen(in[1], "w");
    from_ = ::fdopen(out[0], "r");
  }
  ~Simulator() {
    if (to_ != nullptr) std::fclose(to_);
    if (from_ != nullptr) std::fclose(from_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Simulator(const Simulator&) = delete;
  Simulator& operator=(const Simulator&) = delete;

  int64_t first() const { return first_; }
  int64_t count() const { return count_; }
  bool Send(const std::string& command) {
    return to_ != nullptr && std::fprintf(to_, "%s\n", command.c_str()) > 0 &&
           std::fflush(to_) == 0;
  }
  // The next answer, or {"error": ...} when the process ended or answered no JSON.
  nlohmann::json Answer() {
    std::string line;
    for (int c; from_ != nullptr && (c = std::fgetc(from_)) != EOF && c != '\n';) {
      line.push_back(static_cast<char>(c));
    }
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return {{"error", absl::StrCat("simulator of nodes ", first_, "..", first_ + count_ - 1,
                                     " answered '", line, "'")}};
    }
    return j;
  }

 private:
  const int64_t first_, count_;
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

// Sends `command` to every simulator and collects their answers, in order; the first error
// (a simulator's, or its failing to answer) is kept in *error.
std::vector<nlohmann::json> Everyone(std::vector<std::unique_ptr<Simulator>>& sims,
                                     const std::string& command, std::string* error) {
  for (auto& s : sims) s->Send(command);
  std::vector<nlohmann::json> out;
  for (auto& s : sims) {
    out.push_back(s->Answer());
    if (out.back().contains("error") && error->empty()) {
      *error = out.back()["error"].get<std::string>();
    }
  }
  return out;
}

int Run(const Options& o, const std::string& self) {
  int64_t tensors = 0;
  {
    auto inv = GenerateModel(o.model);
    if (!inv.ok()) {
      std::cerr << "error: --model: " << inv.status() << "\n";
      return 2;
    }
    if (auto granule = ParseGranule(o.granule); !granule.ok()) {
      std::cerr << "error: --granule: " << granule.status() << "\n";
      return 2;
    }
    for (const auto& u : inv->units()) tensors += u.tensors_size();
  }
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

  PlannerClientOptions c;
  c.address = planner.address;
  c.security.token_file = planner.token_file;
  c.retry_window = std::chrono::milliseconds(0);  // measure; never retry
  auto client = GrpcPlannerClient::Create(c);
  if (!client.ok()) {
    std::cerr << "error: " << client.status() << "\n";
    return 1;
  }
  v1::CreateJobRequest create;
  create.set_job_id(kBenchJob);
  create.mutable_mesh()->set_shard_size(world);
  create.mutable_mesh()->set_replicate_size(1);
  if (auto j = (*client)->CreateJob(create); !j.ok()) {
    std::cerr << "error: CreateJob: " << j.status() << "\n";
    return 1;
  }

  // The simulators start: they register their nodes, beat and watch the plan.
  std::vector<std::unique_ptr<Simulator>> sims;
  for (int p = 0; p < o.processes; ++p) {
    const int64_t first = o.nodes * p / o.processes, last = o.nodes * (p + 1) / o.processes;
    sims.push_back(std::make_unique<Simulator>(self, o, planner.address, planner.token_file, first,
                                               last - first));
  }
  std::string error;
  int64_t interval_ms = 1000;
  std::vector<double> cpu_connected;
  for (auto& s : sims) {
    auto a = s->Answer();
    if (a.contains("error") && error.empty()) error = a["error"].get<std::string>();
    interval_ms = a.value("heartbeat_interval_ms", interval_ms);
    cpu_connected.push_back(a.value("cpu_s", 0.0));
  }
  if (!error.empty()) {
    std::cerr << "error: " << error << "\n";
    return 1;
  }

  // Registration: node 0 with the inventory, then every other node with its hash.
  const int64_t sent0 = bench::TcpBytesSent(port);
  const double cpu0 = bench::CpuSeconds(pid);
  const auto t0 = Clock::now();
  sims[0]->Send("register-0");
  if (auto a = sims[0]->Answer(); a.contains("error")) error = a["error"].get<std::string>();
  Everyone(sims, "register", &error);
  const auto registered_at = Clock::now();
  const auto plans = Everyone(sims, "plans", &error);
  const int64_t sent1 = bench::TcpBytesSent(port);
  const double cpu1 = bench::CpuSeconds(pid);

  nlohmann::json out;
  out["nodes"] = o.nodes;
  out["ranks_per_node"] = o.ranks_per_node;
  out["ranks"] = world;
  out["model"] = o.model;
  out["granule"] = o.granule;
  out["simulator_processes"] = o.processes;
  out["tensors"] = tensors;
  // The simulators' plans: each process's first frame was decoded and checked, its others
  // compared with it; the processes' frames are compared here by their SHA-256.
  int64_t holding = 0, mismatched = 0, corrupt = 0, first_ns = -1, all_ns = -1;
  std::string reference;
  double sim_cpu = 0;
  nlohmann::json per_process = nlohmann::json::array();
  for (size_t i = 0; i < plans.size(); ++i) {
    const auto& p = plans[i];
    const double cpu = p.value("cpu_s", 0.0) - cpu_connected[i];
    sim_cpu += cpu;
    per_process.push_back(cpu);
    if (p.contains("error") && error.empty()) error = p["error"].get<std::string>();
    corrupt += p.value("corrupt", int64_t{0});
    mismatched += p.value("mismatched", int64_t{0});
    if (!p.contains("frame_sha256")) continue;
    if (reference.empty()) {
      reference = p["frame_sha256"].get<std::string>();
      out["plan_wire_bytes"] = p["plan_wire_bytes"];
      out["plan_bytes"] = p["plan_bytes"];
    }
    if (p["frame_sha256"].get<std::string>() != reference) {
      mismatched += p.value("holding", int64_t{0});
      continue;
    }
    holding += p.value("holding", int64_t{0});
    const int64_t f = p["first_at_ns"].get<int64_t>();
    first_ns = first_ns < 0 ? f : std::min(first_ns, f);
    if (p.contains("all_at_ns")) all_ns = std::max(all_ns, p["all_at_ns"].get<int64_t>());
  }
  const int64_t t0_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
  out["registrations_answered_s"] = Since(t0, registered_at);
  out["ready_s"] = first_ns < 0 ? -1.0 : static_cast<double>(first_ns - t0_ns) / 1e9;
  out["all_nodes_hold_plan_s"] =
      holding == o.nodes ? static_cast<double>(all_ns - t0_ns) / 1e9 : -1.0;
  out["nodes_holding_plan"] = holding;
  out["mismatched_plans"] = mismatched;
  if (!reference.empty() && corrupt > 0) out["corrupt_plans"] = corrupt;
  out["planner_sent_bytes"] = sent0 < 0 || sent1 < 0 ? -1 : sent1 - sent0;
  out["planner_cpu_s"] = cpu1 - cpu0;
  out["planner_peak_rss_bytes"] = bench::ProcStatus(pid, "VmHWM") * 1024;
  // The simulators' CPU from registration to plan, in all and each process's.
  out["bench_cpu_s"] = sim_cpu;
  out["simulator_cpu_s"] = per_process;

  // The rendezvous each daemon then runs (server/daemon/daemon_job_setup.cc): the job's data
  // secret and its nodes, its own data address published, then every node's address in one call.
  // Every node publishes first, so that the calls do not wait on each other's threads here.
  {
    const int64_t rs0 = bench::TcpBytesSent(port);
    const double rcpu0 = bench::CpuSeconds(pid);
    const auto r0 = Clock::now();
    Everyone(sims, "publish", &error);
    int64_t wrong = 0;
    for (const auto& a : Everyone(sims, "fetch", &error)) wrong += a.value("wrong", int64_t{0});
    out["rendezvous_s"] = Since(r0, Clock::now());
    const int64_t rs1 = bench::TcpBytesSent(port);
    out["rendezvous_sent_bytes"] = rs0 < 0 || rs1 < 0 ? -1 : rs1 - rs0;
    out["rendezvous_planner_cpu_s"] = bench::CpuSeconds(pid) - rcpu0;
    out["rendezvous_wrong_answers"] = wrong;
  }

  auto beats = [&] {
    int64_t total = 0;
    for (const auto& a : Everyone(sims, "beats", &error)) total += a.value("beats", int64_t{0});
    return total;
  };
  if (o.heartbeat_s > 0) {
    const int64_t db0 = StoreBytes(dir), beats0 = beats();
    const double hcpu0 = bench::CpuSeconds(pid);
    const auto h0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(o.heartbeat_s));
    const double hcpu1 = bench::CpuSeconds(pid);
    const double elapsed = Since(h0, Clock::now());
    out["heartbeat_window_s"] = elapsed;
    out["heartbeats"] = beats() - beats0;
    out["heartbeat_planner_cpu_share"] = (hcpu1 - hcpu0) / elapsed;
    out["heartbeat_store_bytes_before"] = db0;
    out["heartbeat_store_bytes_after"] = StoreBytes(dir);
  }
  int64_t failures = 0;
  for (const auto& a : Everyone(sims, "stop", &error)) {
    failures += a.value("failures", int64_t{0}) + a.value("beat_failures", int64_t{0});
    if (a.contains("first_failure") && !out.contains("first_failure")) {
      out["first_failure"] = a["first_failure"];
    }
  }
  sims.clear();
  out["heartbeat_interval_ms"] = interval_ms;
  out["failed_calls"] = failures;
  auto job = (*client)->GetJob(kBenchJob);
  out["final_job_status"] = job.ok() ? v1::JobStatus_Name(job->status()) : "?";
  if (!error.empty()) out["error"] = error;

  if (o.json) {
    std::cout << out.dump() << "\n";
  } else {
    std::cout << out.dump(2) << "\n";
  }
  const bool ok = error.empty() && out["failed_calls"] == 0 &&
                  out["nodes_holding_plan"] == o.nodes && out["mismatched_plans"] == 0 &&
                  out["rendezvous_wrong_answers"] == 0 && out["final_job_status"] == "JOB_READY";
  if (!ok) {
    // The planner's last words, before its directory goes (and the whole log, kept).
    std::error_code ec;
    std::filesystem::copy_file(dir + "/planner.log", "/tmp/control_plane_bench.planner.log",
                               std::filesystem::copy_options::overwrite_existing, ec);
    std::ifstream log(dir + "/planner.log");
    std::vector<std::string> lines;
    for (std::string line; std::getline(log, line);) lines.push_back(line);
    std::cerr
        << "the planner's log (kept in /tmp/control_plane_bench.planner.log), its last lines:\n";
    for (size_t i = lines.size() > 30 ? lines.size() - 30 : 0; i < lines.size(); ++i) {
      std::cerr << lines[i] << "\n";
    }
  }
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
  app.add_option("--processes", o.processes,
                 "simulator processes the nodes are spread over (0: one per 512 nodes, 1 to 16)")
      ->check(CLI::Range(0, 64));
  app.add_option("--planner", o.planner,
                 "the ragshard-planner binary (default: server/ragshard-planner of this build)");
  app.add_flag("--json", o.json, "print one JSON object on one line");
  app.add_flag("--unary-heartbeats", o.sim.unary_heartbeats,
               "beat with a unary call per heartbeat (as before HeartbeatStream), not each node's "
               "stream");
  // A simulator process's (the bench starts them itself).
  app.add_flag("--worker", o.worker)->group("");
  app.add_option("--planner-address", o.sim.planner)->group("");
  app.add_option("--token-file", o.sim.token_file)->group("");
  app.add_option("--first", o.sim.first)->group("")->check(CLI::NonNegativeNumber);
  app.add_option("--count", o.sim.count)->group("")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (o.nodes * o.ranks_per_node < 2) {
    std::cerr << "error: --nodes x --ranks-per-node must be at least 2\n";
    return 2;
  }
  if (o.processes == 0) o.processes = static_cast<int>(std::clamp<int64_t>(o.nodes / 512, 1, 16));
  o.processes = static_cast<int>(std::min<int64_t>(o.processes, o.nodes));
  // Each simulated node has a connection of its own, as daemons have.
  const int64_t per_process = (o.worker ? o.sim.count : (o.nodes + o.processes - 1) / o.processes);
  if (RaiseOpenFileLimit() < per_process + 1024) {
    std::cerr << "error: " << per_process << " connections need more open files than the limit "
              << "(ulimit -n); pass more --processes\n";
    return 2;
  }
  if (o.worker) {
    o.sim.nodes = o.nodes;
    o.sim.ranks_per_node = o.ranks_per_node;
    o.sim.model = o.model;
    o.sim.granule = o.granule;  // (unary_heartbeats set by its flag)
    if (o.sim.first + o.sim.count > o.nodes) {
      std::cerr << "error: --first + --count exceeds --nodes\n";
      return 2;
    }
    return bench::RunSimWorker(o.sim);
  }
  char self[4096] = {0};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return 1;
  if (o.planner.empty()) {
    const std::filesystem::path exe(self);
    o.planner = (exe.parent_path().parent_path() / "server" / "ragshard-planner").string();
  }
  return Run(o, self);
}

}  // namespace
}  // namespace ragshard

int main(int argc, char** argv) { return ragshard::Main(argc, argv); }

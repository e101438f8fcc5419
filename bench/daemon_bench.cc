// Daemon-level collective benchmark: a real planner, D ragshardd daemons and D*K rank processes
// on loopback run unshard (all-gather) and reduce_scatter through ragshard, as training would.
// Also measures the latency of a no-op call from a client to its daemon: through the command
// queue (back to back, and after 1 ms idle) and over gRPC.
//   daemon_bench [--max-mib 256]    (prints CSV rows, bench_common.h)
//   daemon_bench --rank PLANNER SOCKET JOB RANK NODE BYTES   (internal: one rank process)
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_common.h"
#include "client/client.h"

namespace ragshard::bench {
namespace {

using namespace std::chrono_literals;

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Dir(const std::string& p) { return p.substr(0, p.rfind('/')); }

Inventory OneTensor(int64_t elems) {
  Inventory inv;
  auto* u = inv.add_units();
  u->set_name("unit");
  auto* t = u->add_tensors();
  t->set_name("w");
  t->add_shape(elems);
  t->set_dtype(v1::DTYPE_FP32);
  return inv;
}

int RankMain(char** argv) {
  const std::string planner = argv[0], socket = argv[1], job = argv[2], node = argv[4];
  int64_t rank = 0, bytes = 0;
  if (!absl::SimpleAtoi(argv[3], &rank) || !absl::SimpleAtoi(argv[5], &bytes)) return 2;
  PlannerClientOptions po;
  po.address = planner;
  po.security = ClientSecurityFromEnv();             // the parent's RAGSHARD_TOKEN_FILE
  po.retry_window = std::chrono::milliseconds(0);    // measure; never retry
  auto from_env = ClientOptions::FromEnvironment();  // RAGSHARD_COMMAND_QUEUE=0 measures gRPC
  if (!from_env.ok()) {
    std::fprintf(stderr, "rank %ld: %s\n", static_cast<long>(rank),
                 std::string(from_env.status().message()).c_str());
    return 2;
  }
  ClientOptions co = std::move(*from_env);
  co.planner = std::shared_ptr<PlannerClient>(std::move(*GrpcPlannerClient::Create(po)));
  co.daemon_socket = socket;
  co.job_id = job;
  co.rank = rank;
  co.node_id = node;
  co.timeout = 120s;
  auto c = std::move(*Client::Create(co));
  absl::Status st = c->Register(OneTensor(bytes / 4), rank == 0);
  if (st.ok()) st = c->Attach();
  if (!st.ok()) {
    std::fprintf(stderr, "rank %ld: %s\n", static_cast<long>(rank),
                 std::string(st.message()).c_str());
    return 3;
  }
  // --iters N (passed down in RAGSHARD_DAEMON_BENCH_ITERS) in place of the size's default.
  int iters = Iterations(static_cast<size_t>(bytes));
  if (const char* env = std::getenv("RAGSHARD_DAEMON_BENCH_ITERS"); env != nullptr) {
    if (!absl::SimpleAtoi(env, &iters) || iters < 1) return 2;
  }
  // Each operation as training issues it: the unshard allocates the unsharded buffer where it
  // was released; a reduce-scatter follows the allocation of the gradient buffer it releases.
  // `ran` adds up how long the daemon's job thread ran the collective (the command queue says).
  // Per operation, on the steady clock the daemon stamps too: issued -> the job thread starts it
  // (the command queue and the hand-off), started -> finished (the daemon's run), finished ->
  // the rank holds the answer (completion and wake-up). Medians, in microseconds, printed as the
  // `phases` row.
  std::vector<double> queued_us, run_us, answered_us;
  // The collective's time is from its call to its answer. A reduce-scatter's gradient buffer is
  // allocated (zero-filled by the daemon) and waited for before it: the allocation is timed
  // apart (`alloc_s`), as training issues it before backward, not with the collective.
  double alloc_s = 0;
  auto run = [&](bool gather, double* ran) -> double {
    double total = 0;
    auto once = [&] {
      if (!gather) {
        const double a0 = Now();
        auto a = c->AllocateGrad(0);
        if (!a.ok() || !a->Wait(120s).ok()) return false;
        alloc_s += Now() - a0;
      }
      const int64_t issued = SteadyNs();
      auto h = gather ? c->Unshard(0) : c->ReduceScatter(0, v1::REDUCE_SUM);
      if (!h.ok() || !h->Wait(120s).ok()) return false;
      const int64_t answered = SteadyNs();
      total += static_cast<double>(answered - issued) * 1e-9;
      *ran += static_cast<double>(h->finished_ns() - h->started_ns()) * 1e-9;
      queued_us.push_back(static_cast<double>(h->started_ns() - issued) * 1e-3);
      run_us.push_back(static_cast<double>(h->finished_ns() - h->started_ns()) * 1e-3);
      answered_us.push_back(static_cast<double>(answered - h->finished_ns()) * 1e-3);
      return true;
    };
    if (!once()) return -1;  // a warm-up, not counted
    *ran = 0;
    total = 0;
    alloc_s = 0;
    queued_us.clear();
    run_us.clear();
    answered_us.clear();
    for (int i = 0; i < iters; ++i) {
      if (!once()) return -1;
    }
    *ran /= iters;
    alloc_s /= iters;
    return total / iters;
  };
  // --only OP (passed down in RAGSHARD_DAEMON_BENCH_ONLY): one operation and no latency, for a
  // profile of the daemons running that operation alone.
  const char* only_env = std::getenv("RAGSHARD_DAEMON_BENCH_ONLY");
  const std::string only = only_env == nullptr ? "" : only_env;
  const auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const auto phases = [&](const char* op) {
    std::printf("phases,%s,%.1f,%.1f,%.1f\n", op, median(queued_us), median(run_us),
                median(answered_us));
    queued_us.clear();
    run_us.clear();
    answered_us.clear();
  };
  double ag_ran = 0, rs_ran = 0;
  const double ag = only == "reducescatter" ? 0 : run(true, &ag_ran);
  if (only != "reducescatter") phases("allgather");
  const double rs = only == "allgather" ? 0 : run(false, &rs_ran);
  if (only != "allgather") {
    phases("reducescatter");
    std::printf("alloc,%.6f\n", alloc_s);
  }
  if (ag < 0 || rs < 0) return 4;
  // The full buffer is W * S elements (S may be padded up by the plan's alignment).
  const int64_t full = c->plan().world_size() * c->plan().units(0).shard_elems() * 4;
  std::printf("allgather,%ld,%.6f\nreducescatter,%ld,%.6f\n", static_cast<long>(full), ag,
              static_cast<long>(full), rs);
  std::printf("ran,%.6f,%.6f\n", ag_ran, rs_ran);
  if (rank == 0 && only.empty()) {
    // The no-op's round trip: back to back through the command queue (the daemon's poller is
    // awake), the same after 1 ms idle each (the poller sleeps and is rung), and over gRPC.
    const auto latency = [&](const char* name, int n, bool idle, bool rpc) {
      std::vector<double> lat;
      for (int i = 0; i < n; ++i) {
        if (idle) std::this_thread::sleep_for(1ms);
        const double t0 = Now();
        if (!(rpc ? c->NoOpRpc() : c->NoOp()).ok()) return false;
        lat.push_back(Now() - t0);
      }
      std::sort(lat.begin(), lat.end());
      std::printf("%s,%.2f,%.2f\n", name, lat[lat.size() / 2] * 1e6,
                  lat[lat.size() * 99 / 100] * 1e6);
      return true;
    };
    if (!latency(c->command_queue() ? "noop" : "noop-rpc", 20000, false, !c->command_queue()) ||
        !latency("noop-idle", 2000, true, false) ||
        (c->command_queue() && !latency("noop-rpc", 20000, false, true))) {
      return 5;
    }
  }
  // The daemon's counter of writes into pool buffers outside the collectives.
  auto stats = c->DaemonStats();
  if (!stats.ok()) return 6;
  for (const auto& j : stats->jobs()) {
    if (j.job_id() == c->job_id()) {
      std::printf("staging,%ld,%ld\n", static_cast<long>(j.staging_bytes()),
                  static_cast<long>(j.operations()));
    }
  }
  std::fflush(stdout);
  return 0;
}

struct Proc {
  pid_t pid;
  std::string out;
};

Proc Spawn(const std::vector<std::string>& argv, const std::string& out) {
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // no server outlives the benchmark, even when it is killed
    FILE* f = std::fopen(out.c_str(), "w");
    dup2(fileno(f), 1);
    FILE* e = std::fopen((out + ".err").c_str(), "w");
    dup2(fileno(e), 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return {pid, out};
}

// The planner and the daemons, stopped (SIGTERM, then waited for) and their folder removed on
// every way out of Main.
struct Servers {
  std::string dir;
  std::vector<Proc> procs;
  ~Servers() {
    for (Proc& p : procs) kill(p.pid, SIGTERM);
    for (Proc& p : procs) waitpid(p.pid, nullptr, 0);
    if (!dir.empty()) std::system(("rm -rf '" + dir + "'").c_str());
  }
};

int Main(int argc, char** argv) {
  if (argc == 8 && std::string(argv[1]) == "--rank") return RankMain(argv + 2);
  int64_t max_mib = 256;
  int64_t only_bytes = 0;      // --bytes N: one size only (calibration of the strategy cost model)
  std::string only_config;     // --config DxK: one (daemons, ranks per daemon) pair only
  std::string views = "true";  // --views false: the daemons place shards by copying
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << "usage: daemon_bench [--max-mib N] [--bytes N] [--config DxK] [--views B]\n"
                   "                    [--only allgather|reducescatter] [--iters N]\n"
                   "  A planner, D ragshardd daemons and D*K rank processes on loopback: unshard\n"
                   "  and reduce_scatter through ragshard (CSV rows), and the no-op latency.\n"
                   "  --max-mib N   largest size, MiB (default 256)\n"
                   "  --bytes N     one size only (>= 4096)\n"
                   "  --config DxK  one (daemons x ranks per daemon) pair only\n"
                   "  --views B     the daemons' --unsharded-views (default true)\n"
                   "  --only OP     that operation alone and no latency (for a profile)\n"
                   "  --iters N     timed operations per size (default: 200, 50, 5 or 3 by size)\n";
      return 0;
    }
    if (i + 1 >= argc) {
      std::cerr << "error: " << flag << " needs a value\n";
      return 2;
    }
    if (flag == "--max-mib" && absl::SimpleAtoi(argv[i + 1], &max_mib) && max_mib >= 1) continue;
    if (flag == "--bytes" && absl::SimpleAtoi(argv[i + 1], &only_bytes) && only_bytes >= 4096)
      continue;
    if (flag == "--config") {
      only_config = argv[i + 1];
      continue;
    }
    if (flag == "--views" &&
        (std::string(argv[i + 1]) == "true" || std::string(argv[i + 1]) == "false")) {
      views = argv[i + 1];
      continue;
    }
    int64_t iters = 0;
    if (flag == "--iters" && absl::SimpleAtoi(argv[i + 1], &iters) && iters >= 1 &&
        iters <= 1000000) {
      ::setenv("RAGSHARD_DAEMON_BENCH_ITERS", argv[i + 1], 1);  // for the rank processes
      continue;
    }
    if (flag == "--only" &&
        (std::string(argv[i + 1]) == "allgather" || std::string(argv[i + 1]) == "reducescatter")) {
      ::setenv("RAGSHARD_DAEMON_BENCH_ONLY", argv[i + 1], 1);  // for the rank processes
      continue;
    }
    std::cerr << "error: " << flag << " " << argv[i + 1]
              << ": flags are --max-mib N (>= 1), --bytes N (>= 4096), --config DxK, "
                 "--views true|false, --only allgather|reducescatter, --iters N (1..1000000)\n";
    return 2;
  }
  char self[4096] = {0};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return 1;
  // The servers: beside this program (the GPU bundle's bin/), or in the build folder's server/.
  const std::string here = Dir(self);
  const std::string servers =
      access((here + "/ragshardd").c_str(), X_OK) == 0 ? here : Dir(here) + "/server";
  char tmpl[] = "/tmp/ragshard_daemon_bench.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  Servers running{dir, {}};
  running.procs.push_back(Spawn({servers + "/ragshard-planner", "--listen", "127.0.0.1:0",
                                 "--data-dir", dir, "--port-file", dir + "/port"},
                                dir + "/planner.out"));
  std::string address;
  for (int i = 0; i < 400 && address.empty(); ++i) {
    std::ifstream f(dir + "/port");
    std::getline(f, address);
    if (address.empty()) std::this_thread::sleep_for(25ms);
  }
  // The planner's own token (DATA_DIR/token), for this client, the daemons and the ranks.
  ::setenv("RAGSHARD_TOKEN_FILE", (dir + "/token").c_str(), 1);
  PlannerClientOptions po;
  po.address = address;
  po.security.token_file = dir + "/token";
  po.retry_window = std::chrono::milliseconds(0);  // measure; never retry
  auto created = GrpcPlannerClient::Create(po);
  if (address.empty() || !created.ok()) {
    std::cerr << "error: the planner did not start (" << servers << "/ragshard-planner; see " << dir
              << "/planner.out.err)\n";
    running.dir.clear();  // keep its log
    return 1;
  }
  auto admin = std::move(*created);
  for (int d = 0; d < 2; ++d) {
    const std::string sock = dir + "/d" + std::to_string(d) + ".sock";
    running.procs.push_back(Spawn(
        {servers + "/ragshardd", "--planner", address, "--node-id", "node-" + std::to_string(d),
         "--socket", sock, "--pool-bytes", std::to_string(int64_t{4} << 30), "--heartbeat-ms",
         "200", "--unsharded-views", views},
        dir + "/daemon" + std::to_string(d) + ".out"));
    struct stat st {};
    for (int i = 0; i < 500 && stat((sock + ".fd").c_str(), &st) != 0; ++i)
      std::this_thread::sleep_for(10ms);
  }
  int job_no = 0;
  // (daemons, ranks per daemon): across daemons, and within one daemon.
  for (auto [nd, k] : std::vector<std::pair<int, int>>{{2, 1}, {2, 2}, {1, 2}, {1, 4}}) {
    if (!only_config.empty() && only_config != absl::StrCat(nd, "x", k)) continue;
    const int w = nd * k;
    const std::vector<size_t> sizes =
        only_bytes > 0 ? std::vector<size_t>{static_cast<size_t>(only_bytes)}
                       : Sizes(size_t{1} << 20, static_cast<size_t>(max_mib) << 20);
    for (size_t bytes : sizes) {
      const std::string job = "bench" + std::to_string(job_no++);
      v1::CreateJobRequest req;
      req.set_job_id(job);
      req.mutable_mesh()->set_shard_size(w);
      req.mutable_mesh()->set_replicate_size(1);
      if (auto j = admin->CreateJob(req); !j.ok()) {
        std::cerr << "error: CreateJob " << job << ": " << j.status() << "\n";
        return 1;
      }
      std::vector<Proc> ranks;
      for (int r = 0; r < w; ++r) {
        const int d = r / k;
        ranks.push_back(
            Spawn({self, "--rank", address, dir + "/d" + std::to_string(d) + ".sock", job,
                   std::to_string(r), "node-" + std::to_string(d), std::to_string(bytes)},
                  dir + "/" + job + "." + std::to_string(r) + ".out"));
      }
      double ag = 0, rs = 0, ag0 = 0, rs0 = 0, ag_ran = 0, rs_ran = 0;
      size_t full = bytes;
      for (Proc& p : ranks) {
        int status = 0;
        waitpid(p.pid, &status, 0);
        std::ifstream in(p.out);
        std::string line;
        while (std::getline(in, line)) {
          std::vector<std::string> f;
          std::stringstream ss(line);
          std::string x;
          while (std::getline(ss, x, ',')) f.push_back(x);
          const bool first = p.pid == ranks[0].pid;
          if (f.size() == 3 && f[0] == "allgather") {
            ag = std::max(ag, std::stod(f[2]));
            full = std::stoull(f[1]);
            if (first) ag0 = std::stod(f[2]);
          } else if (f.size() == 3 && f[0] == "reducescatter") {
            rs = std::max(rs, std::stod(f[2]));
            if (first) rs0 = std::stod(f[2]);
          } else if (f.size() == 3 && f[0].rfind("noop", 0) == 0 && bytes == (size_t{1} << 20)) {
            std::printf("%s-latency-us,%dx%d,p50=%s,p99=%s\n", f[0].c_str(), nd, k, f[1].c_str(),
                        f[2].c_str());
          } else if (f.size() == 2 && f[0] == "alloc" && first) {
            std::printf("grad-alloc-s,%dx%d,%zu,%s\n", nd, k, bytes, f[1].c_str());
          } else if (f.size() == 5 && f[0] == "phases" && first) {
            std::printf("phases-us,%dx%d,%zu,%s,%s,%s,%s\n", nd, k, bytes, f[1].c_str(),
                        f[2].c_str(), f[3].c_str(), f[4].c_str());
          } else if (f.size() == 3 && f[0] == "ran" && first) {
            // Rank 0's mean end-to-end time of each operation beside the daemon's run of it.
            ag_ran = std::stod(f[1]);
            rs_ran = std::stod(f[2]);
          } else if (f.size() == 3 && f[0] == "staging" && first) {
            std::printf("staging-bytes,%dx%d,%zu,%s,%s\n", nd, k, bytes, f[1].c_str(),
                        f[2].c_str());
          }
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          std::cerr << "error: rank of " << job << " failed with "
                    << (WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                                          : "signal " + std::to_string(WTERMSIG(status)))
                    << " (see " << p.out << ".err):\n"
                    << std::ifstream(p.out + ".err").rdbuf();
          running.dir.clear();  // keep the logs
          return 1;
        }
      }
      const std::string impl =
          nd > 1 ? "ragshard-daemons-" + std::to_string(nd) + "x" + std::to_string(k)
                 : "ragshard-1daemon-" + std::to_string(k) + "ranks";
      PrintRow(impl, "allgather", w, full, ag);
      PrintRow(impl, "reducescatter", w, full, rs);
      // Rank 0's mean time per operation, end to end and the daemon's run of it.
      std::printf("daemon-ran,%dx%d,%zu,%.6f,%.6f,%.6f,%.6f\n", nd, k, full, ag0, ag_ran, rs0,
                  rs_ran);
      (void)admin->DeleteJob(job);
      // Wait until the daemons have released the job's buffers (through their heartbeats).
      for (int i = 0; i < 200; ++i) {
        auto nodes = admin->ListNodes();
        bool clean = nodes.ok();
        for (const auto& n : nodes.ok() ? *nodes : std::vector<v1::Node>()) {
          clean &= n.figures().pool_used_bytes() == 0;
        }
        if (clean) break;
        std::this_thread::sleep_for(50ms);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace ragshard::bench

int main(int argc, char** argv) { return ragshard::bench::Main(argc, argv); }

// ragshardd: the node daemon. Flags are defined here only.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "infra/server_process.h"
#include "infra/termination.h"
#include "protocol/planner_client.h"
#include "server/daemon/daemon.h"

namespace {

// A flag of microseconds in [0, 1e6] into `*spin`, whose value is the default it shows.
void AddSpinFlag(CLI::App* app, const std::string& name, std::chrono::microseconds* spin,
                 const std::string& help) {
  app->add_option_function<int64_t>(
         name, [spin](int64_t us) { *spin = std::chrono::microseconds(us); }, help)
      ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}))
      ->default_str(std::to_string(spin->count()));
}

}  // namespace

// Nothing below throws by design; a library exception (CLI11, the standard library) ends the
// process with its message instead of std::terminate.
int main(int argc, char** argv) try {
  ragshard::StartServerProcess(argv[0]);
  ragshard::daemon::DaemonOptions options;
  ragshard::PlannerClientOptions planner;
  // Calls that find the planner restarting retry for the window (a job set up meanwhile waits
  // for it); a shutdown stops the retries.
  auto stop_retrying = std::make_shared<std::atomic<bool>>(false);
  planner.stop_retrying = stop_retrying;
  double retry_s = 60;
  std::string data_listen = "127.0.0.1:0";
  int64_t heartbeat_ms = 1000;
  CLI::App app{"ragshardd: the ragshard node daemon"};
  app.add_option("--planner", planner.address, "planner address HOST:PORT")->required();
  app.add_option("--node-id", options.node_id, "this node's id")->required();
  // The path ragshard.Env() assumes under torchrun when RAGSHARD_SOCKET is not set, and the one
  // deploy/'s systemd unit and DaemonSet use.
  options.socket_path = "/run/ragshard/daemon.sock";
  app.add_option("--socket", options.socket_path, "Unix socket of the local service")
      ->capture_default_str();
  app.add_option("--socket-group", options.socket_group,
                 "give the sockets to this group, mode 0660, so that its members may attach "
                 "(default: the daemon's user alone, 0600)");
  app.add_option("--pool-bytes", options.pool_bytes, "size of the shared-memory pool")->required();
  app.add_flag("--pool-commit", options.pool_commit,
               "take the pool's pages at start (default: as they are first used)");
  app.add_option("--data-listen", data_listen, "HOST:PORT for data-plane listeners");
  planner.security = ragshard::ClientSecurityFromEnv();  // the flags' defaults
  app.add_option("--token-file", planner.security.token_file,
                 "planner bearer token file (env RAGSHARD_TOKEN_FILE)");
  app.add_option("--tls-ca", planner.security.tls_ca_file,
                 "planner CA (enables TLS; env RAGSHARD_TLS_CA)");
  app.add_option("--tls-cert", planner.security.tls_cert_file,
                 "client certificate (mutual TLS; env RAGSHARD_TLS_CERT)");
  app.add_option("--tls-key", planner.security.tls_key_file,
                 "client key (mutual TLS; env RAGSHARD_TLS_KEY)");
  app.add_option("--tls-server-name", planner.security.tls_server_name,
                 "name to check in the planner's certificate (env RAGSHARD_TLS_SERVER_NAME)");
  app.add_option("--heartbeat-ms", heartbeat_ms, "heartbeat interval")->capture_default_str();
  app.add_option("--planner-retry-s", retry_s,
                 "retry a call that finds the planner unavailable (a restart) for this long")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--backend", options.backend,
                 "data plane: host (memfd pool + UCX, unsharded buffers shared by the node's "
                 "ranks), device-shaped (the same with private per-rank buffers: the shape of "
                 "a GPU), cuda (CUDA slabs + NCCL; exits with the reason where this build has "
                 "no CUDA, no device is usable or NCCL does not open) or auto (cuda where it can "
                 "run, host elsewhere; logs which)")
      ->check(CLI::IsMember({"host", "device-shaped", "cuda", "auto"}))
      ->capture_default_str();
  app.add_option("--gpu-pool-bytes", options.gpu_pool_bytes, "CUDA slab per local GPU (cuda)")
      ->capture_default_str();
  app.add_option("--unsharded-views", options.unsharded_views,
                 "host backend: map a node's shards into unsharded buffers where they are whole "
                 "pages (docs/daemon.md); false places them by copying")
      ->capture_default_str();
  AddSpinFlag(&app, "--queue-spin-us", &options.queue_spin,
              "how long the command-queue poller keeps reading after a rank's last command "
              "before it sleeps (a sleeping poller is woken, which costs a thread wake-up per "
              "start, tens of microseconds); 0 sleeps at once (docs/daemon.md)");
  options.ucx_spin = ragshard::daemon::UcxSpinFromEnvironment();  // the flag's default
  AddSpinFlag(&app, "--ucx-spin-us", &options.ucx_spin,
              "how long a job's UCX worker polls for the next event, yielding the core, before "
              "it sleeps on its event fd (docs/collectives.md; env RAGSHARD_UCX_SPIN_US)");
  app.add_option("--metrics-listen", options.metrics_listen,
                 "serve Prometheus metrics on http://ADDR/metrics (HOST:PORT, or PORT on "
                 "127.0.0.1; port 0 picks one); off unless given");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (options.pool_bytes <= 0 || heartbeat_ms <= 0) {
    std::cerr << "error: --pool-bytes and --heartbeat-ms must be positive\n";
    return 2;
  }
  options.data_host = data_listen.substr(0, data_listen.rfind(':'));
  options.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
  planner.rpc_timeout = std::chrono::seconds(10);
  planner.retry_window = std::chrono::milliseconds(static_cast<int64_t>(retry_s * 1000));
  auto client = ragshard::GrpcPlannerClient::Create(planner);
  if (!client.ok()) {
    std::cerr << "error: " << client.status().message() << "\n";
    return 2;
  }
  std::shared_ptr<ragshard::PlannerClient> shared(std::move(*client));
  auto daemon = ragshard::daemon::NodeDaemon::Start(options, shared);
  if (!daemon.ok()) {
    std::cerr << "error: " << daemon.status().message() << "\n";
    return 1;
  }
  if (const std::string url = (*daemon)->metrics_url(); !url.empty()) {
    std::printf("ragshardd %s metrics on %s\n", options.node_id.c_str(), url.c_str());
  }
  std::printf("ragshardd %s ready on unix:%s\n", options.node_id.c_str(),
              options.socket_path.c_str());
  std::fflush(stdout);
  ragshard::WaitForTerminationSignal();
  stop_retrying->store(true);
  (*daemon)->Shutdown();
  std::printf("ragshardd %s stopped\n", options.node_id.c_str());
  std::fflush(stdout);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "fatal: %s\n", e.what());
  return 1;
}

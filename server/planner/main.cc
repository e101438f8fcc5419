// ragshard-planner: the central plan service. Flags are defined here only.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "glog/logging.h"
#include "infra/rpc.h"
#include "infra/server_process.h"
#include "infra/termination.h"
#include "server/planner/server.h"

// Nothing below throws by design; a library exception (CLI11, the standard library) ends the
// process with its message instead of std::terminate.
int main(int argc, char** argv) try {
  ragshard::StartServerProcess(argv[0]);
  ragshard::planner::PlannerServerOptions options;
  std::string port_file, token_file, admin_token_file;
  int64_t node_timeout_ms = 5000, heartbeat_ms = 1000, registration_timeout_ms = 300000;
  CLI::App app{"ragshard-planner: jobs, plans, nodes and rendezvous for ragshard"};
  app.add_option("--listen", options.listen, "HOST:PORT to listen on (port 0 picks one)")
      ->capture_default_str();
  app.add_flag("--insecure", options.insecure,
               "allow listening beyond loopback without TLS (tokens in clear text)");
  app.add_option("--data-dir", options.data_dir,
                 "directory for the SQLite state (WAL mode: must be on local disk, not NFS)")
      ->required();
  app.add_option("--port-file", port_file, "write the bound address here once listening");
  app.add_option("--token-file", token_file,
                 "bearer token every call must carry (default: DATA_DIR/token, created at the "
                 "first start, mode 0600)");
  app.add_option("--admin-token-file", admin_token_file, "bearer token for DeleteJob");
  app.add_option("--tls-cert", options.security.tls_cert_file, "server certificate (PEM)");
  app.add_option("--tls-key", options.security.tls_key_file, "server private key (PEM)");
  app.add_option("--tls-client-ca", options.security.tls_client_ca_file,
                 "CA of client certificates (mutual TLS)");
  app.add_option("--node-timeout-ms", node_timeout_ms, "a node is LOST after this silence")
      ->capture_default_str();
  app.add_option("--heartbeat-interval-ms", heartbeat_ms, "heartbeat interval told to daemons")
      ->capture_default_str();
  app.add_option("--registration-timeout-ms", registration_timeout_ms,
                 "default registration deadline of new jobs")
      ->capture_default_str();
  app.add_option("--max-world", options.service.limits.max_world,
                 "most ranks a job may have (shard_size x replicate_size)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  app.add_option("--plan-threads", options.service.plan_threads,
                 "threads that compute plans; further jobs wait their turn")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--metrics-listen", options.metrics_listen,
                 "serve Prometheus metrics on http://ADDR/metrics (HOST:PORT, or PORT on "
                 "127.0.0.1; port 0 picks one); off unless given");
  std::string cluster_profile;
  app.add_option("--cluster-profile", cluster_profile,
                 "cluster profile (profiles/*.json) for jobs of policy auto");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (node_timeout_ms < 1 || heartbeat_ms < 1 || registration_timeout_ms < 1) {
    std::cerr << "error: timeouts must be positive\n";
    return 2;
  }
  options.service.node_timeout = std::chrono::milliseconds(node_timeout_ms);
  options.service.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
  options.service.default_registration_timeout = std::chrono::milliseconds(registration_timeout_ms);
  options.default_token = token_file.empty();
  for (auto [path, out] : {std::pair{&token_file, &options.service.token},
                           std::pair{&admin_token_file, &options.service.admin_token}}) {
    if (path->empty()) continue;
    auto token = ragshard::ReadTokenFile(*path);
    if (!token.ok()) {
      std::cerr << "error: " << token.status().message() << "\n";
      return 2;
    }
    *out = *token;
  }
  if (!cluster_profile.empty()) {
    auto profile = ragshard::LoadClusterProfile(cluster_profile);
    if (!profile.ok()) {
      std::cerr << "error: --cluster-profile: " << profile.status().message() << "\n";
      return 2;
    }
    options.service.cluster_profile =
        std::make_shared<const ragshard::ClusterProfile>(std::move(*profile));
  }
  auto server = ragshard::planner::PlannerServer::Start(options);
  if (!server.ok()) {
    std::cerr << "error: " << server.status().message() << "\n";
    return 1;
  }
  const std::string& addr = (*server)->bound_address();
  if (!(*server)->token_file().empty()) {
    std::printf("ragshard-planner token in %s (clients: --token-file or RAGSHARD_TOKEN_FILE)\n",
                (*server)->token_file().c_str());
    std::fflush(stdout);
  }
  // Before the port file: whoever waits for it finds the metrics line already written.
  if (const std::string url = (*server)->metrics_url(); !url.empty()) {
    std::printf("ragshard-planner metrics on %s\n", url.c_str());
    std::fflush(stdout);
  }
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << addr << "\n";
    std::rename(tmp.c_str(), port_file.c_str());
  }
  std::printf("ragshard-planner listening on %s\n", addr.c_str());
  std::fflush(stdout);
  std::thread waiter([&] { (*server)->Wait(); });
  ragshard::WaitForTerminationSignal();
  LOG(INFO) << "planner stopping";
  (*server)->Shutdown();
  waiter.join();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "fatal: %s\n", e.what());
  return 1;
}

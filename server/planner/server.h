// Runs the planner service on a gRPC server: the listener, TLS, the health service.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "infra/metrics.h"
#include "infra/rpc.h"
#include "server/planner/service.h"

namespace ragshard::planner {

struct PlannerServerOptions {
  // host:port; port 0 picks a free port (see bound_address()).
  std::string listen = "127.0.0.1:7070";
  std::string data_dir;
  ServerSecurityOptions security;
  PlannerOptions service;
  // Listening beyond loopback without TLS is refused unless this is set (--insecure): a bearer
  // token must not cross a network in clear text.
  bool insecure = false;
  // Where to serve Prometheus metrics (infra/metrics.h: HOST:PORT, or PORT on loopback); empty:
  // no endpoint.
  std::string metrics_listen;
  // With no service.token: take DATA_DIR/token, creating it at the first start (auth.h
  // DefaultTokenFile). The binary sets it unless --token-file is given; token_file() names it.
  bool default_token = false;
};

// True for a listen address only this machine reaches: 127.0.0.0/8, ::1, localhost, unix:.
bool IsLoopbackListen(const std::string& listen);

class PlannerServer {
 public:
  static absl::StatusOr<std::unique_ptr<PlannerServer>> Start(const PlannerServerOptions& options);
  ~PlannerServer();
  PlannerServer(const PlannerServer&) = delete;
  PlannerServer& operator=(const PlannerServer&) = delete;

  // The default token's file (PlannerServerOptions::default_token), else empty.
  const std::string& token_file() const { return token_file_; }
  // The address actually bound, e.g. "127.0.0.1:40123".
  const std::string& bound_address() const { return bound_address_; }
  // "http://HOST:PORT/metrics", or empty without --metrics-listen.
  std::string metrics_url() const { return metrics_ ? metrics_->url() : std::string(); }
  // Blocks until Shutdown() is called from another thread.
  void Wait();
  // Completes parked calls and streams, stops the server. Idempotent.
  void Shutdown();

 private:
  PlannerServer() = default;
  std::unique_ptr<PlannerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string bound_address_;
  std::string token_file_;
  bool shut_down_ = false;
  // After service_: a scrape reads the service, so the endpoint stops first.
  std::shared_ptr<ScrapeCollectable> scrape_;
  std::unique_ptr<MetricsEndpoint> metrics_;
};

}  // namespace ragshard::planner

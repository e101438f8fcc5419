#include "server/planner/server.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/planner/auth.h"

namespace ragshard::planner {

bool IsLoopbackListen(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<std::unique_ptr<PlannerServer>> PlannerServer::Start(
    const PlannerServerOptions& options) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data-dir: required");
  if (!options.metrics_listen.empty()) {
    // Checked before the data directory is made: a bad flag leaves nothing behind.
    if (auto a = MetricsBindAddress(options.metrics_listen); !a.ok()) return a.status();
  }
  if (!IsLoopbackListen(options.listen) && options.security.tls_cert_file.empty() &&
      !options.insecure) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--listen ", options.listen, " reaches beyond this machine without TLS: bearer tokens ",
        "and plans would cross the network in clear text. Give --tls-cert and --tls-key, or ",
        "--insecure to accept that"));
  }
  if (!IsLoopbackListen(options.listen) && options.security.tls_cert_file.empty()) {
    LOG(WARNING) << "--insecure: listening on " << options.listen
                 << " without TLS; tokens and plans cross the network in clear text";
  }
  auto creds = LoadServerCredentials(options.security);
  if (!creds.ok()) return creds.status();
  PlannerOptions service_options = options.service;
  std::string token_file;
  if (options.default_token && service_options.token.empty()) {
    auto path = DefaultTokenFile(options.data_dir);
    if (!path.ok()) return path.status();
    auto token = ReadTokenFile(*path);
    if (!token.ok()) return token.status();
    token_file = *path;
    service_options.token = *token;
  }
  auto store = Store::Open(options.data_dir);
  if (!store.ok()) return store.status();
  std::unique_ptr<PlannerServer> server(new PlannerServer());
  server->token_file_ = token_file;
  auto svc = PlannerService::Create(std::move(*store), std::move(service_options));
  if (!svc.ok()) return svc.status();
  server->service_ = std::move(*svc);
  if (!options.metrics_listen.empty()) {
    auto endpoint = MetricsEndpoint::Start(options.metrics_listen);
    if (!endpoint.ok()) {
      server->service_->Shutdown();
      return endpoint.status();
    }
    server->metrics_ = std::move(*endpoint);
    PlannerService* service = server->service_.get();
    server->scrape_ =
        std::make_shared<ScrapeCollectable>([service] { return service->ScrapeFigures(); });
    server->metrics_->Register(service->metrics_registry());
    server->metrics_->Register(server->scrape_);
    LOG(INFO) << "planner metrics on " << server->metrics_->url();
  }

  const size_t colon = options.listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: expected HOST:PORT, got '", options.listen, "'"));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, *creds, &port);
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  server->server_ = builder.BuildAndStart();
  if (!server->server_ || port == 0) {
    server->service_->Shutdown();
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen, "'"));
  }
  server->bound_address_ = absl::StrCat(options.listen.substr(0, colon), ":", port);
  server->server_->GetHealthCheckService()->SetServingStatus(true);
  LOG(INFO) << "planner listening on " << server->bound_address_ << ", data dir "
            << options.data_dir;
  return server;
}

PlannerServer::~PlannerServer() { Shutdown(); }

void PlannerServer::Wait() {
  if (server_) server_->Wait();
}

void PlannerServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  metrics_.reset();
  if (service_) service_->Shutdown();
  if (server_) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
}

}  // namespace ragshard::planner

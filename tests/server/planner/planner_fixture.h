// A planner service on its real gRPC server (127.0.0.1:0, a temporary data directory) and a
// client of it, with helpers to create jobs, register ranks and read the planner's figures;
// restartable (Start after server_.reset()).
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "engine/models.h"
#include "protocol/planner_client.h"
#include "server/planner/server.h"
#include "tests/testing/test_util.h"

namespace ragshard::testing {

using namespace std::chrono_literals;

class PlannerFixture : public ::testing::Test {
 public:
  void SetUp() override { Start(); }

  void Start() {
    planner::PlannerServerOptions o;
    o.listen = "127.0.0.1:0";
    o.data_dir = dir_.path();
    o.service.node_timeout = node_timeout_;
    o.service.tick = 20ms;
    o.service.default_registration_timeout = 30s;
    o.service.cluster_profile = profile_;
    o.service.before_job_write = before_job_write_;
    o.service.after_park = after_park_;
    if (with_metrics_) o.metrics_listen = "127.0.0.1:0";
    auto server = planner::PlannerServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    PlannerClientOptions co;
    co.address = server_->bound_address();
    auto client = GrpcPlannerClient::Create(co);
    ASSERT_TRUE(client.ok());
    client_ = std::move(*client);
  }

  v1::Job Create(const std::string& id, int64_t shard, int64_t timeout_ms = 0) {
    v1::CreateJobRequest req;
    req.set_job_id(id);
    req.mutable_mesh()->set_shard_size(shard);
    req.mutable_mesh()->set_replicate_size(1);
    req.mutable_options()->set_registration_timeout_ms(timeout_ms);
    auto job = client_->CreateJob(req);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  static Inventory SmallInventory() {
    auto inv = ParseInventoryJson(R"({"units": [
        {"name": "layers.0", "tensors": [
          {"name": "layers.0.w", "shape": [256, 64], "dtype": "bf16", "granule": "rows:32",
           "optimizer": "matrix"},
          {"name": "layers.0.b", "shape": [64], "dtype": "bf16"}]},
        {"name": "layers.1", "tensors": [
          {"name": "layers.1.w", "shape": [256, 64], "dtype": "bf16", "granule": "rows:32"}]}]})");
    EXPECT_TRUE(inv.ok());
    return *inv;
  }

  absl::StatusOr<v1::Job> RegisterFull(const std::string& job, int64_t rank, const Inventory& inv,
                                       const std::string& node = "n0") {
    v1::RegisterRankRequest req;
    req.set_job_id(job);
    req.set_rank(rank);
    req.set_node_id(node);
    *req.mutable_inventory() = inv;
    return client_->RegisterRank(req);
  }

  absl::StatusOr<v1::Job> RegisterHash(const std::string& job, int64_t rank, const std::string& sha,
                                       const std::string& node = "n0") {
    v1::RegisterRankRequest req;
    req.set_job_id(job);
    req.set_rank(rank);
    req.set_node_id(node);
    req.set_inventory_sha256(sha);
    return client_->RegisterRank(req);
  }

  // Restarts the planner (nothing created yet) with its metrics endpoint on 127.0.0.1:0, for the
  // tests that read its figures. Off by default: stopping the endpoint takes up to 2 s.
  void RestartWithMetrics() {
    server_.reset();
    with_metrics_ = true;
    Start();
  }

  // The series of the planner's parked calls (server/planner/service.cc ScrapeFigures): a Get
  // or GetKeys waiting for its keys, a hash-only registration waiting for a full inventory.
  static constexpr char kParkedGets[] = "ragshard_planner_parked_calls{call=\"get\"}";
  static constexpr char kParkedRegistrations[] =
      "ragshard_planner_parked_calls{call=\"registration\"}";

  // The value of `series` (its name and labels as /metrics writes them) in one scrape of the
  // planner's metrics endpoint; -1 when the scrape does not have it.
  double Figure(const std::string& series) {
    const std::string url = server_->metrics_url();  // http://127.0.0.1:PORT/metrics
    const std::string prefix = "http://127.0.0.1:";
    const size_t slash = url.find('/', prefix.size());
    if (url.rfind(prefix, 0) != 0 || slash == std::string::npos) {
      ADD_FAILURE() << "no metrics endpoint: '" << url << "'";
      return -1;
    }
    const int port = std::atoi(url.substr(prefix.size(), slash - prefix.size()).c_str());
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string response;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string request = "GET " + url.substr(slash) + " HTTP/1.0\r\n\r\n";
      if (::write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
        char buf[4096];
        for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
      }
    }
    ::close(fd);
    const size_t at = response.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::atof(response.c_str() + at + 1 + series.size() + 1);
  }

  // Until `series` reads `value`: the planner's own report of the state a test waits for. The
  // bound is for a hang, not a delay; false when it passes.
  bool AwaitFigure(const std::string& series, double value) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (Figure(series) != value) {
      if (std::chrono::steady_clock::now() > give_up) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return true;
  }

  bool with_metrics_ = false;
  // A node silent this long is LOST (PlannerOptions::node_timeout) in the next Start: by
  // default none is (a loaded machine delays heartbeats by hundreds of milliseconds); a test of
  // node loss sets its own, far above its heartbeats' interval.
  std::chrono::milliseconds node_timeout_ = 60s;
  TempDir dir_;
  std::shared_ptr<const ClusterProfile> profile_;
  std::unique_ptr<planner::PlannerServer> server_;
  std::unique_ptr<GrpcPlannerClient> client_;
  // PlannerOptions::before_job_write of the next Start (set it in a fixture's constructor).
  std::function<void(const std::string& job_id)> before_job_write_;
  // PlannerOptions::after_park of the next Start (set it in a fixture's constructor).
  std::function<void(const std::string& job_id)> after_park_;
};

}  // namespace ragshard::testing

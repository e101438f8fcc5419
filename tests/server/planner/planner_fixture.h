// A planner service on its real gRPC server (127.0.0.1:0, a temporary data directory) and a
// client of it, with helpers to create jobs and register ranks; restartable (Start after
// server_.reset()).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/models.h"
#include "common/planner_client.h"
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
    o.service.node_timeout = 300ms;
    o.service.tick = 20ms;
    o.service.default_registration_timeout = 30s;
    o.service.cluster_profile = profile_;
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

  TempDir dir_;
  std::shared_ptr<const ClusterProfile> profile_;
  std::unique_ptr<planner::PlannerServer> server_;
  std::unique_ptr<GrpcPlannerClient> client_;
};

}  // namespace ragshard::testing

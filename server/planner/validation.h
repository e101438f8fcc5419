// Validators for every planner request. Each returns INVALID_ARGUMENT naming the field. They are
// pure functions; the fuzz test throws random and mutated requests at them.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "engine/inventory.h"
#include "infra/ids.h"
#include "ragshard/v1/planner.pb.h"

namespace ragshard::planner {

// Page sizes of ListJobs and ListRanks: the default (a request's 0) and the most.
inline constexpr int kDefaultJobsPage = 100;
inline constexpr int kMaxJobsPage = 1000;
inline constexpr int kDefaultRanksPage = 1024;
inline constexpr int kMaxRanksPage = 8192;

struct ServiceLimits {
  int64_t max_world = 131072;  // --max-world: ranks per job (shard_size x replicate_size)
  int64_t max_id_length = kMaxIdLength;
  int64_t max_key_length = 256;
  int64_t max_value_bytes = 1 << 20;
  int64_t max_address_length = 512;
  int64_t max_message_length = 4096;
  int64_t max_registration_timeout_ms = 24LL * 3600 * 1000;
  int64_t max_recovery_deadline_ms = 24LL * 3600 * 1000;
  int64_t max_wait_ms = 10LL * 60 * 1000;
  int64_t max_heartbeat_jobs = 10000;
  // Local ranks a heartbeat reports the progress of (ragshardctl job why).
  int64_t max_heartbeat_ranks = 4096;
  // Ranks one RegisterNodeRanks call may register.
  int64_t max_node_ranks = 4096;
  // Keys one GetKeys call may ask for (a job's nodes).
  int64_t max_get_keys = 65536;
  InventoryLimits inventory;
};

// Ids: infra/ids.h, shared with the daemon.
using ragshard::ValidateId;

absl::Status ValidateCreateJob(const v1::CreateJobRequest& req, const ServiceLimits& limits);
// A job's redundancy (part of ValidateCreateJob): a known one (engine/redundancy.h), a recovery
// deadline where it is not none, and a world size of at least the nodes it needs. Whether the
// nodes the ranks register from fit it is checked when they have all registered.
absl::Status ValidateRedundancy(const v1::JobOptions& o, int64_t world_size, int64_t replicas = 1);
absl::Status ValidateJobId(const std::string& job_id, const ServiceLimits& limits);
absl::Status ValidateListJobs(const v1::ListJobsRequest& req, const ServiceLimits& limits);
absl::Status ValidateListRanks(const v1::ListRanksRequest& req, const ServiceLimits& limits);
absl::Status ValidateRegisterRank(const v1::RegisterRankRequest& req, const ServiceLimits& limits);
absl::Status ValidateRegisterNodeRanks(const v1::RegisterNodeRanksRequest& req,
                                       const ServiceLimits& limits);
absl::Status ValidateRegisterNode(const v1::RegisterNodeRequest& req, const ServiceLimits& limits);
absl::Status ValidateHeartbeat(const v1::HeartbeatRequest& req, const ServiceLimits& limits);
absl::Status ValidateGetKeys(const v1::GetKeysRequest& req, const ServiceLimits& limits);
absl::Status ValidatePut(const v1::PutRequest& req, const ServiceLimits& limits);
absl::Status ValidateGet(const v1::GetRequest& req, const ServiceLimits& limits);
absl::Status ValidateReportFailure(const v1::ReportFailureRequest& req,
                                   const ServiceLimits& limits);
absl::Status ValidateReportRecovered(const v1::ReportRecoveredRequest& req,
                                     const ServiceLimits& limits);

}  // namespace ragshard::planner

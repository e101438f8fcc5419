// The client side of ragshard-planner: an interface and its gRPC implementation.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "infra/rpc.h"
#include "protocol/heartbeat_stream.h"
#include "ragshard/v1/planner.grpc.pb.h"

namespace ragshard {

// A running watch; destroying it stops the watch and joins its thread. The callback never runs
// after the destructor returns.
class PlanWatch {
 public:
  virtual ~PlanWatch() = default;
};

// Called for each event, in order, from the watch's own thread. A final call with a non-OK
// status ends the watch (job deleted or not found, or the watch was stopped by a permanent
// error); transient errors are retried with backoff and never reported.
using PlanWatchCallback =
    std::function<void(const absl::Status& status, const v1::WatchPlanEvent* event)>;

// What a job is created with: the one place a CreateJobRequest is built (ragshardctl's
// `job create` and the Python binding's create_job). Zero and empty fields take the planner's
// defaults.
struct JobSpec {
  std::string job_id;
  int64_t shard_size = 0;
  int64_t replicate_size = 1;
  std::string policy;           // ragged (default), ragged-paper or auto
  std::string default_granule;  // of 2-D+ tensors
  int32_t align_bytes = 0;
  int64_t registration_timeout_ms = 0;
  // Policy auto only.
  std::string strategy;
  std::string optimizer;
  int64_t memory_budget_bytes = 0;
  int64_t tokens_per_step = 0;
  // > 0: a lost rank is recovered in place within this many ms (docs/recovery.md).
  int64_t recovery_deadline_ms = 0;
  std::string redundancy;    // JobOptions.redundancy
  std::string on_node_loss;  // JobOptions.on_node_loss
};
v1::CreateJobRequest MakeCreateJobRequest(const JobSpec& spec);

// Thread-safe: every method may be called from any thread.
class PlannerClient {
 public:
  virtual ~PlannerClient() = default;

  // Jobs are summaries (O(1) in the world size); ListRanks pages their ranks.
  virtual absl::StatusOr<v1::Job> CreateJob(const v1::CreateJobRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> GetJob(const std::string& job_id) = 0;
  // The job's data-plane secret (for its daemons: infra/secrets.h DataPlaneCredential).
  virtual absl::StatusOr<std::string> GetDataSecret(const std::string& job_id) = 0;
  virtual absl::StatusOr<v1::ListJobsResponse> ListJobsPage(const v1::ListJobsRequest& request) = 0;
  virtual absl::StatusOr<v1::ListRanksResponse> ListRanksPage(
      const v1::ListRanksRequest& request) = 0;
  virtual absl::Status DeleteJob(const std::string& job_id) = 0;
  // The job's nodes in the order of their first rank, with their registered ranks as runs.
  virtual absl::StatusOr<v1::ListJobNodesResponse> ListJobNodes(const std::string& job_id) = 0;
  // Blocks while a hash-only registration waits for the full inventory.
  virtual absl::StatusOr<v1::Job> RegisterRank(const v1::RegisterRankRequest& request) = 0;
  // A node's ranks in one call (one store transaction); blocks like RegisterRank.
  virtual absl::StatusOr<v1::Job> RegisterNodeRanks(
      const v1::RegisterNodeRanksRequest& request) = 0;
  virtual absl::StatusOr<v1::Plan> GetPlan(const std::string& job_id) = 0;
  // Watches plan versions and status changes, reconnecting with backoff and resuming after the
  // last plan version seen.
  virtual std::unique_ptr<PlanWatch> WatchPlan(const std::string& job_id,
                                               PlanWatchCallback callback) = 0;
  virtual absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(
      const v1::RegisterNodeRequest& request) = 0;
  virtual absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request) = 0;
  virtual absl::StatusOr<std::vector<v1::Node>> ListNodes() = 0;
  virtual absl::Status Put(const std::string& job_id, const std::string& key,
                           const std::string& value) = 0;
  // Waits up to `wait` for the key; DEADLINE_EXCEEDED when it does not appear.
  virtual absl::StatusOr<std::string> Get(const std::string& job_id, const std::string& key,
                                          std::chrono::milliseconds wait) = 0;
  // Several keys at once, in order, waiting up to `wait` for all of them (DEADLINE_EXCEEDED
  // naming a missing one).
  virtual absl::StatusOr<std::vector<std::string>> GetKeys(const std::string& job_id,
                                                           const std::vector<std::string>& keys,
                                                           std::chrono::milliseconds wait) = 0;
  // The answer says whether the job now recovers in place (recovery_epoch > 0).
  virtual absl::StatusOr<v1::ReportFailureResponse> ReportFailure(
      const v1::ReportFailureRequest& request) = 0;
  // This node's ranks of the job re-attached in the recovery epoch (docs/recovery.md).
  virtual absl::StatusOr<v1::ReportRecoveredResponse> ReportRecovered(
      const v1::ReportRecoveredRequest& request) = 0;
  // SERVING according to the gRPC health service.
  virtual absl::Status Health() = 0;

  // Every job that is not deleted, and every rank of a job (registered or not), page by page.
  absl::StatusOr<std::vector<v1::Job>> ListJobs();
  absl::StatusOr<std::vector<v1::RankState>> ListRanks(const std::string& job_id);

  // Blocks until the job has a plan (returns it), fails, is deleted, or `timeout` passes.
  absl::StatusOr<v1::Plan> WaitForPlan(const std::string& job_id,
                                       std::chrono::milliseconds timeout);
};

struct PlannerClientOptions {
  std::string address;
  // Taken as given (an empty token_file: no token; an empty tls_ca_file: plaintext). The
  // programs and the C ABI start from the environment (ClientSecurityFromEnv: RAGSHARD_TOKEN_FILE
  // and the TLS variables), so that every client (ranks, daemons, ragshardctl, the benchmarks)
  // finds the planner's token the same way.
  ClientSecurityOptions security;
  // Deadline of each unary call (Get adds its wait).
  std::chrono::milliseconds rpc_timeout{30'000};
  // Watch reconnection backoff.
  std::chrono::milliseconds watch_initial_backoff{100};
  std::chrono::milliseconds watch_max_backoff{5'000};
  // Watches take plans compact (zstd) from the planner; with decode_plans (the default) an
  // event's callback gets `plan`, else the frame as it came in `plan_zstd` (a simulated node
  // in bench/control_plane_bench that only compares it).
  bool decode_plans = true;
  // Heartbeats go on one long-lived stream (HeartbeatStream), or on the unary call with a planner
  // without it; false: always the unary call (to measure the two side by side).
  bool heartbeat_stream = true;
  // Unary calls that find the planner UNAVAILABLE (a restart) are retried with exponential
  // backoff and jitter for this long, then fail saying for how long they tried. Retries are
  // idempotent: a CreateJob whose earlier attempt was committed returns that job (the same mesh
  // and options, still registering); RegisterRank and Put are idempotent on the planner; a
  // DeleteJob retried after its first attempt was committed answers NOT_FOUND. 0: one attempt.
  // The node calls (RegisterNode, Heartbeat, ReportFailure) always make one attempt: heartbeats
  // repeat, and a report must not hold the daemon's job thread.
  std::chrono::milliseconds retry_window{60'000};
  // When set, a call stops retrying once it turns true (its last error answers): a server that
  // shuts down does not wait out the window.
  std::shared_ptr<const std::atomic<bool>> stop_retrying;
};

// What every client program starts from before its flags: RAGSHARD_TOKEN_FILE, RAGSHARD_TLS_CA,
// RAGSHARD_TLS_CERT, RAGSHARD_TLS_KEY and RAGSHARD_TLS_SERVER_NAME, the defaults of --token-file,
// --tls-ca, --tls-cert, --tls-key and --tls-server-name (an unset or empty variable: none).
ClientSecurityOptions ClientSecurityFromEnv();

// The retry window a client library takes from RAGSHARD_PLANNER_RETRY_S (seconds, >= 0), or
// `fallback`. INVALID_ARGUMENT naming the variable when it is not a number.
absl::StatusOr<std::chrono::milliseconds> RetryWindowFromEnv(std::chrono::milliseconds fallback);

class GrpcPlannerClient final : public PlannerClient {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcPlannerClient>> Create(PlannerClientOptions options);

  absl::StatusOr<v1::Job> CreateJob(const v1::CreateJobRequest& request) override;
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) override;
  absl::StatusOr<std::string> GetDataSecret(const std::string& job_id) override;
  absl::StatusOr<v1::ListJobsResponse> ListJobsPage(const v1::ListJobsRequest& request) override;
  absl::StatusOr<v1::ListRanksResponse> ListRanksPage(const v1::ListRanksRequest& request) override;
  absl::Status DeleteJob(const std::string& job_id) override;
  absl::StatusOr<v1::ListJobNodesResponse> ListJobNodes(const std::string& job_id) override;
  absl::StatusOr<v1::Job> RegisterRank(const v1::RegisterRankRequest& request) override;
  absl::StatusOr<v1::Job> RegisterNodeRanks(const v1::RegisterNodeRanksRequest& request) override;
  absl::StatusOr<v1::Plan> GetPlan(const std::string& job_id) override;
  std::unique_ptr<PlanWatch> WatchPlan(const std::string& job_id,
                                       PlanWatchCallback callback) override;
  absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(
      const v1::RegisterNodeRequest& request) override;
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request) override;
  absl::StatusOr<std::vector<v1::Node>> ListNodes() override;
  absl::Status Put(const std::string& job_id, const std::string& key,
                   const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& job_id, const std::string& key,
                                  std::chrono::milliseconds wait) override;
  absl::StatusOr<std::vector<std::string>> GetKeys(const std::string& job_id,
                                                   const std::vector<std::string>& keys,
                                                   std::chrono::milliseconds wait) override;
  absl::StatusOr<v1::ReportFailureResponse> ReportFailure(
      const v1::ReportFailureRequest& request) override;
  absl::StatusOr<v1::ReportRecoveredResponse> ReportRecovered(
      const v1::ReportRecoveredRequest& request) override;
  absl::Status Health() override;

 private:
  GrpcPlannerClient(PlannerClientOptions options, ClientSecurity security);
  void Prepare(grpc::ClientContext* ctx, std::chrono::milliseconds extra = {}) const;
  // Prefixes errors with the planner address, so "unreachable" says where.
  absl::Status Wrap(const grpc::Status& status) const;
  // Runs `call` (one attempt on a fresh context) until it is not UNAVAILABLE or the retry
  // window is spent; *attempts counts the attempts. `extra` lengthens each attempt's deadline.
  grpc::Status Retry(const std::function<grpc::Status(grpc::ClientContext*)>& call, int* attempts,
                     std::chrono::milliseconds extra = {}) const;
  using Stub = v1::Planner::Stub;
  template <typename Request, typename Response>
  using UnaryMethod = grpc::Status (Stub::*)(grpc::ClientContext*, const Request&, Response*);
  // A unary call of the stub's `method`, retried (Retry) with `extra` added to each attempt's
  // deadline; its error wrapped (Wrap).
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryMethod<Request, Response> method, const Request& request,
                                std::chrono::milliseconds extra = {}) const;
  // The same in one attempt: the node calls (PlannerClientOptions::retry_window says why).
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallOnce(UnaryMethod<Request, Response> method,
                                    const Request& request) const;

  const PlannerClientOptions options_;
  const ClientSecurity security_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Planner::Stub> stub_;
  // The heartbeats' stream; unary calls for kUnaryBeatsFor once the planner answered
  // UNIMPLEMENTED to it (until then, on the steady clock).
  static constexpr std::chrono::milliseconds kUnaryBeatsFor{std::chrono::minutes(5)};
  std::unique_ptr<HeartbeatStream> beats_;
  std::atomic<int64_t> unary_beats_until_ms_{0};
};

}  // namespace ragshard

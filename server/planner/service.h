// The ragshard-planner gRPC service (callback API). Its handlers are defined by responsibility:
// service.cc (the job table, the handler prologue, job changes, the ticker), service_jobs.cc (the
// job lifecycle and plan reads), service_registration.cc (rank registration and planning),
// service_nodes.cc (node calls and failure reports), service_recovery.cc (recovery in place:
// recoverable reports, ReportRecovered, the recovery deadline), service_shrink.cc (a job that
// shrinks to its surviving ranks when a lost node is not rebuilt in time), service_rendezvous.cc
// (Put/Get).
// The state has four owners, each with its own lock: the job table and each job (below), the nodes
// (node_registry.h), the rendezvous keys and waiting gets (rendezvous.h), the watch streams
// (watch_registry.h; a stream is watch_channel.h). The token check is auth.h.
//
// Threading (docs/threading.md): handlers run on gRPC's callback threads and validate the
// request without locks. `jobs_mu_` guards only the table of jobs (id -> entry) and is held just
// to look an entry up or add one; each job's entry has its own mutex, held while a call reads or
// changes that job, including the job's store writes, so the database and memory agree and
// calls on different jobs run in parallel. Lock order: job -> rendezvous or watchers; the node
// registry is locked alone; `jobs_mu_` is never taken under a job's lock. Plans are computed
// outside every lock. Reactors of parked calls (hash-only registrations waiting for a full
// inventory, rendezvous gets waiting for a key) and watch streams are completed after the locks
// are released. One ticker thread of our own expires deadlines and marks nodes LOST.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/cluster.h"
#include "engine/redundancy.h"
#include "engine/strategy_search.h"
#include "prometheus/metric_family.h"
#include "ragshard/v1/planner.grpc.pb.h"
#include "server/planner/beat_streams.h"
#include "server/planner/job_status.h"
#include "server/planner/metrics.h"
#include "server/planner/node_registry.h"
#include "server/planner/parked.h"
#include "server/planner/plan_executor.h"
#include "server/planner/rendezvous.h"
#include "server/planner/store.h"
#include "server/planner/validation.h"
#include "server/planner/watch_channel.h"
#include "server/planner/watch_registry.h"

namespace ragshard::planner {

struct PlannerOptions {
  // A node that sends no heartbeat for this long becomes LOST.
  std::chrono::milliseconds node_timeout{5000};
  // The interval daemons are told to heartbeat at.
  std::chrono::milliseconds heartbeat_interval{1000};
  // How often deadlines and node liveness are checked.
  std::chrono::milliseconds tick{50};
  std::chrono::milliseconds default_registration_timeout{300'000};
  // Bearer tokens; empty disables authentication. DeleteJob needs admin_token when it is set
  // (else token).
  std::string token;
  std::string admin_token;
  ServiceLimits limits;
  int64_t max_watchers = 1'000'000;
  // Threads that compute plans (server/planner/plan_executor.h); more jobs wait in order.
  int plan_threads = 2;
  // The cluster jobs of policy auto are planned for; without one such jobs are refused.
  std::shared_ptr<const ClusterProfile> cluster_profile;
  // Tests only: called with the job's id before each store write of a job, under the job's lock
  // (tests/server/planner/planner_locks_test.cc stalls one there).
  std::function<void(const std::string& job_id)> before_job_write;
  // Tests only: called with the job's id when a Get or GetKeys has parked, with no lock held and
  // before its handler returns (planner_locks_test.cc answers the call there).
  std::function<void(const std::string& job_id)> after_park;
};

// WatchPlan is a raw (ByteBuffer) method: an event is serialized once and its slices are shared
// by every watcher's stream, so fanning a multi-MB plan out to 1024 watchers costs one
// serialization.
class PlannerService final
    : public v1::Planner::WithRawCallbackMethod_WatchPlan<v1::Planner::CallbackService> {
 public:
  // Loads the stored state. Stored plans are served as stored, never recomputed.
  static absl::StatusOr<std::unique_ptr<PlannerService>> Create(std::unique_ptr<Store> store,
                                                                PlannerOptions options);
  ~PlannerService() override;

  // Completes every parked call and watch stream with UNAVAILABLE and stops the ticker. Call
  // before shutting the grpc::Server down. Idempotent.
  void Shutdown();

  // The Prometheus figures (infra/metrics.h): the counters and histograms kept as the service
  // works, and ScrapeFigures, which reads jobs by state, nodes by state and the watch streams
  // from their owners when a scrape comes.
  const std::shared_ptr<prometheus::Registry>& metrics_registry() const {
    return metrics_.registry();
  }
  std::vector<prometheus::MetricFamily> ScrapeFigures() const;

  // The handlers. Each authenticates, then validates its request (INVALID_ARGUMENT naming the
  // field), before anything else; a call on a job that does not exist or was deleted answers
  // NOT_FOUND naming it.
  using Ctx = grpc::CallbackServerContext;
  using Unary = grpc::ServerUnaryReactor;

  // A new job, REGISTERING; ALREADY_EXISTS while a job of that id lives, FAILED_PRECONDITION for
  // policy auto on a planner without a cluster profile.
  // Every job response is the job's summary, O(1) in its world size; ListRanks pages its ranks.
  Unary* CreateJob(Ctx* ctx, const v1::CreateJobRequest* req, v1::CreateJobResponse* resp) override;
  Unary* GetJob(Ctx* ctx, const v1::GetJobRequest* req, v1::GetJobResponse* resp) override;
  // The jobs that are not deleted, a page at a time, by job id.
  Unary* ListJobs(Ctx* ctx, const v1::ListJobsRequest* req, v1::ListJobsResponse* resp) override;
  Unary* ListRanks(Ctx* ctx, const v1::ListRanksRequest* req, v1::ListRanksResponse* resp) override;
  // The nodes of a job's registered ranks, with the ranks as runs (O(nodes) for a daemon).
  Unary* ListJobNodes(Ctx* ctx, const v1::ListJobNodesRequest* req,
                      v1::ListJobNodesResponse* resp) override;
  // Admin token only. Aborts the job's parked calls, closes its watch streams and purges its
  // plan and keys from the store.
  Unary* DeleteJob(Ctx* ctx, const v1::DeleteJobRequest* req, v1::DeleteJobResponse* resp) override;
  // Records a rank's node and inventory (or the inventory's hash, parked until some rank has sent
  // the inventory itself); the last rank to register makes the job plan.
  Unary* RegisterRank(Ctx* ctx, const v1::RegisterRankRequest* req,
                      v1::RegisterRankResponse* resp) override;
  // RegisterRank for several ranks of one node (its daemon's), in one store transaction.
  Unary* RegisterNodeRanks(Ctx* ctx, const v1::RegisterNodeRanksRequest* req,
                           v1::RegisterNodeRanksResponse* resp) override;
  // FAILED_PRECONDITION until the job is planned.
  Unary* GetPlan(Ctx* ctx, const v1::GetPlanRequest* req, v1::GetPlanResponse* resp) override;
  // The job's plan events, from after the version the request names.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchPlan(Ctx* ctx,
                                                        const grpc::ByteBuffer* request) override;
  // Records (again) a node and its data address; answers the heartbeat interval.
  Unary* RegisterNode(Ctx* ctx, const v1::RegisterNodeRequest* req,
                      v1::RegisterNodeResponse* resp) override;
  // Refreshes a registered node's figures and names the jobs it holds that are gone.
  Unary* Heartbeat(Ctx* ctx, const v1::HeartbeatRequest* req, v1::HeartbeatResponse* resp) override;
  // Heartbeat on one stream per node: each request answered in turn, as Heartbeat answers it.
  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* HeartbeatStream(
      Ctx* ctx) override;
  Unary* ListNodes(Ctx* ctx, const v1::ListNodesRequest* req, v1::ListNodesResponse* resp) override;
  // The rendezvous: Put stores a job's key and answers the Gets waiting for it; Get answers a
  // stored key at once, else waits up to wait_ms (DEADLINE_EXCEEDED naming the key).
  Unary* Put(Ctx* ctx, const v1::PutRequest* req, v1::PutResponse* resp) override;
  Unary* Get(Ctx* ctx, const v1::GetRequest* req, v1::GetResponse* resp) override;
  // Get for many keys at once: answers when every one is put (DEADLINE_EXCEEDED naming the
  // missing ones after wait_ms).
  Unary* GetKeys(Ctx* ctx, const v1::GetKeysRequest* req, v1::GetKeysResponse* resp) override;
  // A daemon's report of a lost peer marks a live job DEGRADED with the message; a recoverable
  // one, on a job with a recovery deadline, starts (or joins) a recovery in place instead
  // (RECOVERING, service_recovery.cc), and the answer names its epoch and deadline.
  Unary* ReportFailure(Ctx* ctx, const v1::ReportFailureRequest* req,
                       v1::ReportFailureResponse* resp) override;
  // A node's ranks re-attached in the recovery's epoch (a replacement daemon's: after it rebuilt
  // the lost node's state); the last of the job's nodes to say so makes it READY.
  // FAILED_PRECONDITION naming the job's status and epoch for a job that is not recovering that
  // epoch, or a node that holds none of its ranks; naming why for a replacement the job cannot
  // rebuild (which ends the recovery DEGRADED).
  Unary* ReportRecovered(Ctx* ctx, const v1::ReportRecoveredRequest* req,
                         v1::ReportRecoveredResponse* resp) override;

 private:
  struct PendingHash {
    std::vector<int64_t> ranks;  // sorted
    std::string node_id;
    std::string sha256;
    v1::Job* job_out = nullptr;  // the call's response job
    Parked parked;
  };
  struct JobState {
    v1::Job job;                         // empty (no job id) until CreateJob has stored it
    std::optional<Inventory> inventory;  // the reference
    std::optional<v1::Plan> plan;
    std::string plan_zstd;  // the plan's compact form (engine/plan_codec.h), as stored
    // The event that carries the plan, serialized once for every watcher that needs it, plain and
    // compact; rebuilt when the status, error or version it was made for changes.
    struct PlanEvents {
      v1::JobStatus status = v1::JOB_STATUS_UNSPECIFIED;
      std::string error;
      uint64_t version = 0;
      WatchChannel::Event plain, zstd;
    } plan_events;
    // The registered ranks (job.registered_ranks() of them); the others are implicit.
    std::map<int64_t, v1::RankState> ranks;
    // ListJobNodes' answer, made at its first call after the ranks last changed.
    std::optional<v1::ListJobNodesResponse> nodes;
    bool planning = false;
    std::vector<PendingHash> pending_hash;
    // What watchers were last told, so that rank registrations do not wake them.
    v1::JobStatus notified_status = v1::JOB_STATUS_UNSPECIFIED;
    std::string notified_error;
    uint64_t notified_version = 0;
  };
  // One job's state and the lock that guards it (and its store rows). Entries are never removed
  // (a deleted job's stays as its tombstone), so a pointer to one stays valid.
  struct JobEntry {
    absl::Mutex mu;
    JobState state ABSL_GUARDED_BY(mu);
  };
  using EntryPtr = std::shared_ptr<JobEntry>;

  PlannerService(std::unique_ptr<Store> store, PlannerOptions options);
  // The job a valid CreateJobRequest describes, with the defaults filled in, registering.
  v1::Job NewJob(const v1::CreateJobRequest& req) const;
  absl::StatusOr<AutoPlan> PlanAutoForJob(const Inventory& inventory, const v1::JobOptions& o,
                                          const std::vector<std::string>& rank_nodes,
                                          const PlanOptions& options) const;

  // The entry of job `id`, or null; with `create`, a new empty entry when there is none.
  EntryPtr Entry(const std::string& id, bool create = false) ABSL_LOCKS_EXCLUDED(jobs_mu_);
  // The entries, by job id, from after `after` (all when empty).
  std::vector<std::pair<std::string, EntryPtr>> Entries(const std::string& after = "") const
      ABSL_LOCKS_EXCLUDED(jobs_mu_);

  // Who may make a call: any holder of the token, or (DeleteJob) of the admin token.
  enum class Access { kUser, kAdmin };
  // The prologue of every handler: authenticates, then (for an authenticated caller only)
  // validates the request. A non-OK status is the call's answer.
  absl::Status Admit(grpc::CallbackServerContext* ctx, Access access,
                     const std::function<absl::Status()>& validate) const;
  // A unary call that needs no job: Admit, then `body`; the work body defers runs after it, and
  // body's status answers.
  grpc::ServerUnaryReactor* Unlocked(grpc::CallbackServerContext* ctx, Access access,
                                     const std::function<absl::Status()>& validate,
                                     const std::function<absl::Status(Deferred*)>& body);
  // A unary call on one job: Admit, then under the job's lock find it live (LiveJob) and run
  // `body` on it. A null `validate` validates `job_id` alone.
  grpc::ServerUnaryReactor* OnJob(grpc::CallbackServerContext* ctx, Access access,
                                  const std::string& job_id,
                                  const std::function<absl::Status()>& validate,
                                  const std::function<absl::Status(JobState&, Deferred*)>& body);
  // OnJob on request `req`'s job, validated by `validate(req, the service's limits)`.
  template <typename Request>
  grpc::ServerUnaryReactor* OnJob(grpc::CallbackServerContext* ctx, Access access,
                                  const Request& req,
                                  absl::Status (*validate)(const Request&, const ServiceLimits&),
                                  const std::function<absl::Status(JobState&, Deferred*)>& body) {
    return OnJob(
        ctx, access, req.job_id(), [&] { return validate(req, options_.limits); }, body);
  }
  // `state` (its entry's lock held) when its job lives (created, not deleted), else NOT_FOUND
  // naming `id`; UNAVAILABLE once shutting down.
  absl::StatusOr<JobState*> LiveJob(const std::string& id, JobState* state) const;
  // The job as answered: without its data secret (GetJob adds it where asked).
  static v1::Job Summary(const v1::Job& job);
  static int64_t NowMs();
  // The job's status event, without the plan.
  static v1::WatchPlanEvent StatusEvent(const JobState& js);
  // The serialized event with the job's plan (which it must have), plain or compact, for one
  // watcher: counted as a plan sent.
  WatchChannel::Event PlanEvent(JobState* js, bool zstd);
  // Adds `channel` to the watchers of the job `req` names, with `first` the event it starts
  // with; not OK (NOT_FOUND, RESOURCE_EXHAUSTED past max_watchers): why it closes at once.
  grpc::Status AddWatcher(const v1::WatchPlanRequest& req,
                          const std::shared_ptr<WatchChannel>& channel, WatchChannel::Event* first);
  // The functions below take a job's state with its entry's lock held.
  // Runs options_.before_job_write, if any.
  void BeforeJobWrite(const std::string& job_id) const;
  // Persists the job and tells its watchers.
  absl::Status JobChanged(JobState* js, Deferred* deferred);
  // A node's heartbeat (unary or on its stream): records it, answers the lease and the jobs the
  // node holds that it must release, fail or recover.
  absl::Status Beat(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* resp,
                    Deferred* deferred);
  // Tells the job's watchers what changed (JobChanged without the store write).
  void NotifyWatchers(JobState* js, Deferred* deferred);
  // A registration of one rank (RegisterRank) or of a node's ranks (RegisterNodeRanks).
  struct Registration {
    std::string job_id, node_id;
    std::vector<int64_t> ranks;            // sorted, distinct
    const Inventory* inventory = nullptr;  // the full inventory, or
    std::string sha;                       // its SHA-256
    // The registration `req` (either request) makes for `ranks`; it points into `req`.
    template <typename Request>
    static Registration Of(const Request& req, std::vector<int64_t> ranks) {
      Registration r;
      r.job_id = req.job_id();
      r.node_id = req.node_id();
      r.ranks = std::move(ranks);
      r.inventory = req.has_inventory() ? &req.inventory() : nullptr;
      r.sha = req.inventory_sha256();
      return r;
    }
  };
  // Admits a registration call (`node`: RegisterNodeRanks), then registers what `make` makes,
  // or parks it until a reference inventory, and answers `job_out`.
  Unary* Register(Ctx* ctx, bool node, const std::function<absl::Status()>& validate,
                  const std::function<Registration()>& make, v1::Job* job_out);
  // Registers or parks on the job's state; std::nullopt when parked.
  std::optional<grpc::Status> RegisterOnJob(JobState& js, const Registration& reg, v1::Job* job_out,
                                            grpc::ServerUnaryReactor* reactor, Deferred* deferred);
  // Records ranks' registration: their rows, the job's summary and (the first full one) the
  // reference inventory in one store transaction, then in memory. Nothing changes when the
  // store fails, and the error answers the registration: an acknowledged one is durable.
  absl::Status RecordRanks(JobState* js, const std::vector<int64_t>& ranks, const std::string& node,
                           const std::string& sha, const std::string* inventory_bytes = nullptr);
  // Starts planning when every rank is registered, unless the job's nodes do not fit its
  // redundancy (JobOptions.redundancy): the job then FAILS, and that error is returned.
  absl::Status MaybePlan(const std::string& job_id, JobState* js, Deferred* deferred);
  void ComputePlan(const std::string& job_id);
  // What ComputePlan reads of the job, under its lock; false when there is nothing to plan.
  bool PlanInputs(JobState& js, Inventory* inventory, PlanOptions* options,
                  v1::JobOptions* job_options, std::vector<std::string>* rank_nodes) const;
  // Records a computed plan (or the failure) on the job.
  void PlanDone(JobState* js, absl::StatusOr<v1::Plan> plan, std::string bytes, int64_t shard,
                int64_t replicate, uint64_t version, Deferred* deferred);
  void FailJob(JobState* js, const std::string& error, Deferred* deferred);
  void ResolvePendingHashes(JobState* js, Deferred* deferred);
  // Marks DEGRADED the live jobs with a rank on a lost node; a job with redundancy recovers
  // instead (NodeLostRecovery). `why`: the loss as the jobs name it (default: the node timeout).
  void DegradeJobsOn(const std::vector<std::string>& lost_nodes, Deferred* deferred,
                     const std::string& why = "");
  // The nodes of the job's registered ranks, with the ranks as runs (ListJobNodes' answer),
  // built at the first call after the ranks changed.
  static const v1::ListJobNodesResponse& JobNodes(JobState* js);
  // What a failure report says, as a job's error ("node 'n0' reports: ...").
  static std::string ReportText(const v1::ReportFailureRequest& req);
  // Recovery in place (service_recovery.cc). A failure report that starts a recovery (a
  // recoverable one, on a READY job with a recovery deadline, of its epoch), joins the one in
  // progress (a recoverable one of an earlier epoch) or ends it (any other: a second failure);
  // false when it concerns no recovery (the job turns DEGRADED as for any report).
  bool RecoveryReport(JobState* js, const v1::ReportFailureRequest& req,
                      v1::ReportFailureResponse* resp, Deferred* deferred);
  // Starts recovery epoch E + 1 of a READY job: RECOVERING, with what was `lost`, who reported
  // it ("" for the planner itself), the lost node a replacement daemon rebuilds ("" for lost rank
  // processes), the deadline, and `error` as the job's error. Stored and told to its watchers.
  void StartRecovery(JobState* js, const std::string& lost, const std::string& reporter,
                     const std::string& lost_node_id, int64_t now_ms, const std::string& error,
                     Deferred* deferred);
  // The job rebuilds a lost node on a replacement daemon: it has redundancy and a recovery
  // deadline (JobOptions.redundancy, recovery_deadline_ms).
  static bool Rebuilds(const v1::Job& job);
  // Node `node_id` of the job, `lost` (the words of its loss), in a job that Rebuilds: a READY
  // job starts a recovery for it, a RECOVERING one names it the node being rebuilt, or ends
  // DEGRADED when another node is being rebuilt. False where the job does not rebuild (it turns
  // DEGRADED as before).
  bool NodeLostRecovery(JobState* js, const std::string& node_id, const std::string& lost,
                        Deferred* deferred);
  // ReportRecovered's part on the lost node: a replacement's report names it and records the
  // bytes rebuilt (`counted`: the node had already reported this epoch); the lost node's own
  // daemon back with its state clears it. A replacement in a job without redundancy, or for a
  // second node, ends the recovery DEGRADED and is that error (FAILED_PRECONDITION).
  absl::Status CountReplacement(JobState* js, const v1::ReportRecoveredRequest& req, bool counted,
                                Deferred* deferred);
  // Ends the job's recovery: DEGRADED with `error`, counted by `outcome`.
  void EndRecovery(JobState* js, RecoveryOutcome outcome, const std::string& error,
                   Deferred* deferred);
  // A RECOVERING job whose deadline has passed turns DEGRADED, naming the nodes that did not
  // recover; or, where it shrinks on a node's loss and the nodes that did not recover include the
  // lost node, SHRUNK (Shrink), else DEGRADED with why it could not shrink.
  void ExpireRecovery(JobState* js, int64_t now_ms, Deferred* deferred);
  // Shrink in place (service_shrink.cc; JobOptions.on_node_loss "shrink", JOB_SHRUNK).
  // The job recovers from a lost node (NodeLostRecovery) to shrink if it is not back in time.
  static bool ShrinksOnNodeLoss(const v1::Job& job);
  // The recovering job, its recovery past the deadline, without the ranks on the `lost` nodes:
  // SHRUNK, with `why` (what was lost, in words) and its successor and survivors in its error;
  // stored and told to its watchers, and its successor created once the locks are released
  // (CreateSuccessor). FAILED_PRECONDITION saying why it cannot shrink (the lost nodes held part
  // of a shard group, or every group; the successor's id is too long), with nothing changed.
  absl::Status Shrink(JobState* js, const std::set<std::string>& lost, const std::string& why,
                      Deferred* deferred);
  // The successor of SHRUNK `js`, as CreateJob would make it: REGISTERING, its survivors'
  // mesh (one shard group of them where they re-cut), the job's options (redundancy hsdp left to
  // the default again; none where a re-cut's nodes left cannot hold it), its predecessor named.
  v1::Job SuccessorOf(const JobState& js) const;
  // Whether the survivors of one shard group can re-cut it after losing the nodes `lost`: each
  // lost node's copy (redundancy replica or parity:1) is on a node left, and the plan has no
  // separate factors. FAILED_PRECONDITION naming the node and its copy's holder otherwise.
  static absl::Status CheckReCut(JobState* js, const std::set<std::string>& lost,
                                 const Redundancy& redundancy);
  // Stores and adds `successor` unless a job of its id lives (a restarted planner made it
  // already). Takes jobs_mu_ and the successor's lock: call with no lock held.
  void CreateSuccessor(const v1::Job& successor);
  // What a call that would go on with a SHRUNK job is refused with (FAILED_PRECONDITION): the
  // successor, the lost nodes and the ranks that go on there.
  static std::string ShrunkText(const JobState& js);
  // The ticker's checks, each in the file of its responsibility.
  void Tick();
  // Answers `keys` of a job from its stored keys at once, or parks the call until they are all
  // put (`answer` fills the response).
  Unary* GetOrWait(Ctx* ctx, const std::string& job_id, const std::vector<std::string>& keys,
                   int64_t wait_ms, const Rendezvous::Answer& answer);
  void ExpireRegistration(JobState* js, int64_t now_ms, Deferred* deferred);
  void RunTicker();

  const PlannerOptions options_;
  std::unique_ptr<Store> store_;
  PlannerMetrics metrics_;
  NodeRegistry nodes_{store_.get()};
  Rendezvous rendezvous_{store_.get()};
  WatchRegistry watchers_{options_.max_watchers};
  BeatStreams beat_streams_;

  mutable absl::Mutex jobs_mu_;
  std::map<std::string, EntryPtr> jobs_ ABSL_GUARDED_BY(jobs_mu_);
  std::atomic<bool> shutdown_{false};

  absl::Notification stop_;
  std::thread ticker_;
  // Set by a refused request: the ticker returns freed memory to the system (malloc_trim).
  mutable std::atomic<bool> trim_memory_{false};
  // Last: stopped and destroyed before the state its plans use.
  PlanExecutor executor_{options_.plan_threads};
};

}  // namespace ragshard::planner

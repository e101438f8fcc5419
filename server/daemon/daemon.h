// ragshardd: the per-node daemon. It registers with the planner and heartbeats, serves its
// node's training processes on a Unix socket, owns the memory pool and every job's RaggedShard
// buffers, passes the pool's memfd over a SCM_RIGHTS side channel, and runs the collectives
// with the other nodes' daemons over UCX.
//
// Threading (docs/threading.md): gRPC callback threads validate requests and take `mu_`; each
// job has one thread that owns its UCX worker and runs its operations in order; one thread
// serves the descriptor side channel and notices clients that die; one thread heartbeats.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "infra/fd.h"
#include "infra/metrics.h"
#include "protocol/planner_client.h"
#include "ragshard/v1/daemon.grpc.pb.h"
#include "server/daemon/command_poller.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/metrics.h"
#include "server/daemon/node_lease.h"
#include "server/daemon/node_registration.h"
#include "server/daemon/pool.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

struct DaemonOptions {
  std::string node_id;
  // The Unix socket of the local service; the descriptor side channel is "<socket_path>.fd".
  std::string socket_path;
  int socket_mode = 0600;
  // Where set, both sockets belong to this group with mode 0660, so that the group's members
  // (the training users) may attach to a daemon that runs as its own user; the kernel checks a
  // connecting process against the socket file's mode. Empty: the daemon's user alone (0600).
  std::string socket_group;
  int64_t pool_bytes = int64_t{1} << 30;
  // Take the pool's pages at start (--pool-commit), so that no operation pays for pages touched
  // the first time (a protect's parities and staging land at new offsets for the first steps).
  bool pool_commit = false;
  // Host the data-plane listeners bind (each job's UCX worker gets a port of its own, published
  // through the planner's rendezvous).
  std::string data_host = "127.0.0.1";
  std::chrono::milliseconds heartbeat_interval{1000};
  // "host", "device-shaped", "cuda" or "auto" (data_backend.h: ResolveBackendKind); "cuda"
  // where the CUDA backend cannot run fails Start with the reason, "auto" runs host there.
  std::string backend = "host";
  // Bytes of the CUDA slab per local GPU (cuda backend).
  int64_t gpu_pool_bytes = int64_t{1} << 30;
  // Host backend: unsharded buffers as views over the node's shards (protocol/unsharded_view.h),
  // which needs page-aligned pool leases; false: every lease 256-aligned and shards copied.
  bool unsharded_views = true;
  // Where to serve Prometheus metrics (infra/metrics.h: HOST:PORT, or PORT on loopback); empty:
  // no endpoint. It serves before the daemon appears ready.
  std::string metrics_listen;
  // The command-queue poller's spin after a rank's last command (CommandPoller::Options).
  std::chrono::microseconds queue_spin{0};
  // How long a job's UCX worker polls before it sleeps (UcxWorker::Create).
  std::chrono::microseconds ucx_spin = kUcxDefaultSpin;
};

class JobRuntime;

// ragshardd's exit status when the planner refused it as stale (NodeDaemon::FenceStale).
inline constexpr int kStaleExitCode = 3;

class NodeDaemon final : public v1::Daemon::CallbackService {
 public:
  static absl::StatusOr<std::unique_ptr<NodeDaemon>> Start(DaemonOptions options,
                                                           std::shared_ptr<PlannerClient> planner);
  ~NodeDaemon() override;
  void Shutdown();
  void Wait();

  PoolStats pool_stats() const { return pool_->Stats(); }
  // "http://HOST:PORT/metrics", or empty without metrics_listen.
  std::string metrics_url() const { return endpoint_ ? endpoint_->url() : std::string(); }

  // The handlers. A call naming an attachment this daemon does not hold answers NOT_FOUND.
  using Ctx = grpc::CallbackServerContext;
  using Unary = grpc::ServerUnaryReactor;

  // A rank registers with the planner through its node's daemon, which sends the node's ranks in
  // one call (node_registration.h); answers when that call has.
  Unary* Register(Ctx* ctx, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override;
  // A rank joins its job on this node. The job is set up (plan, peers, shards) on one of at most
  // kMaxAttaching setup threads; RESOURCE_EXHAUSTED beyond that.
  Unary* Attach(Ctx* ctx, const v1::AttachRequest* req, v1::AttachResponse* resp) override;
  // The rank leaves its job on this node.
  Unary* Detach(Ctx* ctx, const v1::DetachRequest* req, v1::DetachResponse* resp) override;
  // Queues an operation and answers its sequence number; Wait answers when it has run.
  Unary* Start(Ctx* ctx, const v1::StartRequest* req, v1::StartResponse* resp) override;
  Unary* Wait(Ctx* ctx, const v1::WaitRequest* req, v1::WaitResponse* resp) override;
  // Answers at once: the control path's round trip.
  Unary* NoOp(Ctx* ctx, const v1::NoOpRequest* req, v1::NoOpResponse* resp) override;
  // The pool's and the jobs' figures.
  Unary* Stats(Ctx* ctx, const v1::StatsRequest* req, v1::StatsResponse* resp) override;
  // A buffer of the attachment's rank, kept by name for the job's life (docs/recovery.md).
  Unary* StateBuffer(Ctx* ctx, const v1::StateBufferRequest* req,
                     v1::StateBufferResponse* resp) override;

 private:
  struct Attachment {
    std::string job_id;
    int64_t rank = 0;
    int local = 0;
    uint64_t generation = 0;  // JobRuntime::Rejoined's
    bool salvage = false;     // AttachRequest.salvage: reads a stopped job's state, nothing else
  };
  NodeDaemon(DaemonOptions options, std::shared_ptr<PlannerClient> planner,
             std::unique_ptr<Pool> pool);
  // The job, set up by the first of its ranks to attach; its other ranks wait for that setup,
  // other jobs' attaches do not.
  // The job a salvage attach reads (AttachRequest.salvage): held here and stopped by the
  // planner (waited for until `deadline`), else FAILED_PRECONDITION or NOT_FOUND naming why.
  absl::StatusOr<std::shared_ptr<JobRuntime>> SalvagedJob(const v1::AttachRequest& req,
                                                          absl::Time deadline);
  absl::StatusOr<std::shared_ptr<JobRuntime>> GetOrCreateJob(const std::string& job_id,
                                                             int64_t rank, absl::Time deadline);
  // The setup itself (the plan, the peers' addresses, the data plane), under the job's lock.
  absl::StatusOr<std::shared_ptr<JobRuntime>> SetUpJob(const std::string& job_id, int64_t rank,
                                                       absl::Time deadline);
  // The job and local index of an attachment; NOT_FOUND names an unknown one.
  absl::StatusOr<std::pair<std::shared_ptr<JobRuntime>, int>> FindAttachment(
      const std::string& id) const;
  // Runs `work` on a thread of its own (a job setup, a node's registration call: each waits on
  // others), joined at a later Spawn or at Shutdown; RESOURCE_EXHAUSTED beyond kMaxAttaching
  // at once, UNAVAILABLE once shut down.
  absl::Status Spawn(std::function<void()> work);
  // A rank's registration (Register, once the node is not fenced): batched with the node's
  // other ranks and sent to the planner; `reactor` answers it.
  void StartRegistration(const v1::RegisterRequest& req, v1::RegisterResponse* resp,
                         grpc::ServerUnaryReactor* reactor, absl::Time deadline);
  // Sends a node's registration calls (NodeRegistrations' batches), each on a thread.
  void SendRegistrations(std::vector<NodeRegistrationBatch> batches);
  absl::Status DoAttach(const v1::AttachRequest& request, v1::AttachResponse* resp);
  // `clean`: the rank detached (Detach); else its process was lost (the side channel closed).
  void ReleaseAttachment(const std::string& id, bool clean);
  // Takes job `job_id` out of the daemon (the planner deleted it, or a shrink's survivors took
  // its state over): its attachments end (their waiters hear that the job was released); null
  // where it is not held. The last reference's release joins the job's thread and returns its
  // buffers to the pool.
  std::shared_ptr<JobRuntime> TakeJob(const std::string& job_id);
  // The job `job_id` held here, or null.
  std::shared_ptr<JobRuntime> FindJob(const std::string& job_id);
  // TakeJob, and that release here; `why` goes to the log.
  void DropJob(const std::string& job_id, std::string_view why);
  // DetachRequest.release_salvaged: a salvage attachment detaches and drops its stopped job.
  absl::Status ReleaseSalvaged(const std::string& id);
  // For a job with redundancy (docs/recovery.md, "A lost node"): where this daemon replaces a
  // lost node of the job (the job is RECOVERING, or this node published a data address in the
  // job's epoch before, by a daemon now gone), the job as it recovers, in an epoch this node has
  // not joined yet (waiting for the recovery to start, until `deadline`); nullopt for a node's
  // first setup of the job.
  absl::StatusOr<std::optional<v1::Job>> AwaitReplacementEpoch(const v1::Job& job,
                                                               absl::Time deadline);
  // The job's data plane to the other nodes in recovery epoch `epoch` (docs/recovery.md):
  // publishes this node's address under "data/<node>" (epoch 0) or "data/epoch-<epoch>/<node>" and
  // connects to every other node's.
  absl::StatusOr<std::pair<std::unique_ptr<UcxWorker>, std::unique_ptr<Comm>>> ConnectNodes(
      const std::string& job_id, const std::vector<std::string>& nodes, int64_t epoch,
      absl::Time deadline);
  void RunSideChannel();
  void RunHeartbeats();
  // Every 50 ms, answers the waits whose deadline passed, also while an operation blocks its
  // job's thread: a rank hears from its daemon at each wait's deadline, which tells it the
  // daemon is alive (the client's liveness check).
  void RunWaiterClock();
  // The jobs held now, each with its stats (Stats, the heartbeats and the metrics share it), and
  // where given, where each local rank stands (the heartbeats).
  std::vector<std::pair<std::string, v1::JobStats>> JobsSnapshot(
      std::vector<v1::RankProgress>* progress = nullptr) const;
  // The pool's, the jobs' and the attachments' figures, read when a scrape comes.
  std::vector<prometheus::MetricFamily> ScrapeFigures() const;

  // This daemon's registration with the planner (its incarnation included).
  v1::RegisterNodeRequest Registration() const;
  // The planner refused a heartbeat of this incarnation (another daemon registered the node id):
  // fails every job's operations naming it and ends the process with kStaleExitCode.
  [[noreturn]] void FenceStale(const absl::Status& refused);
  // The lease ran out (lease_): fails the operations of every job that goes on without this
  // node (JobRuntime::fenced_with_node) with `fence`.
  void FenceJobs(const absl::Status& fence);

  const DaemonOptions options_;
  const std::shared_ptr<PlannerClient> planner_;
  // Drawn at the start, nonzero (RegisterNodeRequest.incarnation).
  uint64_t incarnation_ = 0;

  const std::unique_ptr<Pool> pool_;
  const std::shared_ptr<DaemonMetrics> metrics_ = std::make_shared<DaemonMetrics>();
  BackendKind backend_ = BackendKind::kHost;
  gid_t socket_gid_ = static_cast<gid_t>(-1);  // --socket-group's, or -1
  std::unique_ptr<grpc::Server> server_;
  ScopedFd fd_listener_;
  // The ranks' command queues (docs/daemon.md): one per attachment whose side channel is open.
  std::unique_ptr<CommandPoller> poller_;
  // Whether the planner acknowledges this node's heartbeats (node_lease.h).
  NodeLease lease_;
  // The node's ranks' registrations, held until the node's call (node_registration.h).
  NodeRegistrations registrations_{options_.node_id};

  mutable absl::Mutex mu_;
  // Each job's setup lock, while an attach sets the job up (connecting to peers can take a
  // while): a job's attaches wait for its one setup, other jobs' do not.
  std::map<std::string, std::shared_ptr<absl::Mutex>> job_setups_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<JobRuntime>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Attachment> attachments_ ABSL_GUARDED_BY(mu_);
  uint64_t next_attachment_ ABSL_GUARDED_BY(mu_) = 1;
  // Job setups and registration calls in flight, one thread each (a setup waits for the plan
  // and the node's other ranks, which attach concurrently, so a fixed pool could deadlock). A
  // finished one is joined at the next Spawn; at most kMaxAttaching at once.
  struct AttachThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  static constexpr size_t kMaxAttaching = 1024;
  std::list<AttachThread> attach_threads_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;

  absl::Notification stop_;
  std::thread side_channel_;
  std::thread heartbeats_;
  std::thread waiter_clock_;
  // Last: a scrape reads the daemon, so the endpoint stops (Shutdown) and goes first.
  std::shared_ptr<ScrapeCollectable> scrape_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
};

}  // namespace ragshard::daemon

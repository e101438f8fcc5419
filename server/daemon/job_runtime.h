// One job on a node: its data plane, its UCX worker, and the thread that runs its operations.
// The node's local ranks each start every operation (StartOp); the job thread runs it once all
// have, in order, and answers the waiters (AddWaiter). A lost peer, a missed deadline or ranks
// that disagree stop the job: later operations fail the same way and the planner is told.
//
// Thread-safe: StartOp, AddWaiter, LocalRankLeft, Rejoined and FillStats may be called from any
// thread (gRPC handlers, the side channel); waiter callbacks never run under the job's mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "protocol/planner_client.h"
#include "ragshard/v1/daemon.pb.h"
#include "server/daemon/comm.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/metrics.h"
#include "server/daemon/op_target.h"
#include "server/daemon/pool.h"
#include "server/daemon/redundancy.h"
#include "server/daemon/relay_comm.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

class JobRuntime final : public OpTarget {
 public:
  // Starts the job's thread, which runs the operations in order.
  JobRuntime(std::string job_id, std::string node_id, v1::Plan plan,
             std::vector<int64_t> local_ranks, std::unique_ptr<UcxWorker> worker,
             std::unique_ptr<Comm> comm, std::unique_ptr<DataBackend> dp,
             std::shared_ptr<PlannerClient> planner, std::shared_ptr<DaemonMetrics> metrics);

  // Stops the thread; the data plane returns its leases before the communicator closes.
  ~JobRuntime() override;

  const v1::Plan& plan() const { return plan_; }
  const std::vector<int64_t>& local_ranks() const { return local_ranks_; }
  const DataBackend& dp() const { return *dp_; }
  void FillStats(v1::JobStats* out);
  // Where each local rank stands: the last operation done, the one it waits on and on whom
  // (ragshardctl job why, through the heartbeats).
  void FillProgress(std::vector<v1::RankProgress>* out);

  // Local rank `local` starts the operation `req` names: its sequence number, shared by the
  // node's local ranks, which must agree on it (else the job stops, naming both). The job thread
  // runs it once every local rank has started it.
  absl::StatusOr<uint64_t> StartOp(int local, const OpRequest& req) override;

  // A local rank detached (its process exited or called Detach): the operations that wait for
  // it to start can never run. They fail now, naming the rank, and the planner hears of it.
  // In a job that recovers in place, a process lost without Detach (`clean` false) starts a
  // recovery instead (EnableRecovery). `generation`: the attachment's (Rejoined); an older
  // attachment of a rank that has attached again since is ignored.
  void LocalRankLeft(int local, int64_t rank, uint64_t generation = 0, bool clean = true);

  // Recovery in place (docs/recovery.md). The job runs in recovery epoch `epoch`; a lost rank
  // process (or a peer's notice) fails every pending and later operation with a recovery
  // notice (ABORTED, "ragshard recovery in progress"), the planner names the next epoch, and
  // once every local rank has attached again the job's thread returns the transient buffers,
  // connects the next epoch through `reconnect` (null for a job on one node) into `relay`, and
  // runs again from operation 1. `deadline`: how long that may take.
  using Reconnect =
      std::function<absl::StatusOr<std::pair<std::unique_ptr<UcxWorker>, std::unique_ptr<Comm>>>(
          int64_t epoch, absl::Time deadline)>;
  void EnableRecovery(int64_t epoch, absl::Duration deadline, Reconnect reconnect,
                      RelayComm* relay);
  // The planner says the job recovers in epoch `epoch` until `deadline` (a heartbeat).
  void BeginRecovery(int64_t epoch, absl::Time deadline, const std::string& lost);
  // Waits until no recovery is in progress: OK, the job's failure, or DEADLINE_EXCEEDED.
  absl::Status AwaitRunning(absl::Time deadline);
  // The planner's failure of the job (its heartbeat's failed_jobs), while the job still holds
  // its buffers (not released): OK while it may still run.
  absl::Status Stopped() {
    absl::MutexLock lock(&mu_);
    return stopping_ ? absl::AbortedError("the job was released") : failed_;
  }
  int64_t epoch() {
    absl::MutexLock lock(&mu_);
    return epoch_;
  }
  bool recoverable() {
    absl::MutexLock lock(&mu_);
    return recoverable_;
  }

  // A buffer of rank `rank`'s own, kept by name for the job's life (StateBuffer RPC): the
  // lease, and whether it existed. FAILED_PRECONDITION when it exists with another size.
  absl::StatusOr<std::pair<const Lease*, bool>> StateBuffer(int64_t rank, const std::string& name,
                                                            int64_t bytes, Pool* pool);

  // A shrink that re-cuts the shards (docs/recovery.md, "Shrinking in place"): on a stopped job,
  // the state of local rank `local`'s counterpart on the node whose whole copy this node holds
  // at `step` (replica, parity:1; NodeRedundancy::CopyHeld), as state buffers of the local rank,
  // each made when first asked for (`name`): "copy/<step>/directory" (text: "node <name> rank
  // <its rank>", then "<bytes> <segment>" per line) of "copy/<step>/directory.bytes" bytes (an
  // int64; left zeros where this node holds no such copy), and "copy/<step>/<segment>" for each
  // segment. The copy's CRC is checked once: DATA_LOSS naming the chunk where it differs.
  absl::Status ExposeCopy(int local, int64_t step, const std::string& name, Pool* pool);

  // Redundancy of the local ranks' persistent state across the job's nodes (docs/recovery.md, "A
  // lost node"; redundancy.h): OP_PROTECT and OP_REBUILD run with it. This node is `node` of
  // `nodes`; `replacement`: this daemon replaces a lost node of the job, and its ranks' state is
  // rebuilt by the next OP_REBUILD (after which it tells the planner, ReportRecovered).
  // `text`: the job's JobOptions.redundancy, for the attaches.
  void EnableRedundancy(RedundancyScheme scheme, const std::string& text, int node,
                        std::vector<std::string> nodes, bool replacement, Pool* pool);
  std::string redundancy() {
    absl::MutexLock lock(&mu_);
    return redundancy_text_;
  }
  bool replacement() {
    absl::MutexLock lock(&mu_);
    return replacement_;
  }

  // Tells the planner that the job cannot proceed (it turns the job DEGRADED).
  void Report(const absl::Status& error);

  // The planner says the job cannot go on (`error` names the lost node or rank): its pending
  // operations, the one running included, and every later one fail with it at once, and their
  // waiters are answered. The operation running goes on to its own end, its result unused.
  void Fail(const absl::Status& error);

  // Answers the waiters whose operation finished or whose deadline passed. The job thread calls
  // it after each operation; the daemon also calls it periodically, so that waits end at their
  // deadline while an operation blocks the job thread.
  void ServeWaiters();

  // A new process attached for local rank `local`: its attachment's generation, and whether a
  // process of this rank had attached before (it adopts the rank's state).
  struct Joined {
    uint64_t generation = 0;
    bool adopted = false;
  };
  Joined Rejoined(int local);

  // Calls `done(true, status, placement, times)` once the operation completes (placement: where
  // local rank `local`'s buffers of the operation's unit are then, or nullptr), or `done(false,
  // OK, nullptr, {})` at `deadline`. Never blocks; `done` runs on the job's thread or the
  // caller's, never under the job's mutex.
  void AddWaiter(uint64_t seq, int local, absl::Time deadline, WaitCallback done) override;

 private:
  struct Op {
    v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
    int unit = 0;
    v1::ReduceKind reduce = v1::REDUCE_SUM;
    int64_t keep = 0;
    bool accumulate = false;  // OR of the local ranks' requests
    absl::Time deadline;
    absl::Time first_start;  // when the first local rank started it
    int started = 0;
    int waited = 0;
    bool done = false;
    absl::Status status;
    std::vector<v1::UnitBuffers> placements;  // by local rank, once done without error
    OpTimes times;                            // when the job's thread ran it
    struct Waiter {
      absl::Time deadline;
      int local;
      WaitCallback done;
    };
    std::vector<Waiter> waiters;
  };

  static ReduceOp ToReduceOp(v1::ReduceKind k) {
    return k == v1::REDUCE_AVG ? ReduceOp::kAvg : ReduceOp::kSum;
  }

  // "OP_UNSHARD of unit 3 'layers.1'".
  std::string Describe(const Op& op) const;
  // Operations pending when the job fails (queued, or started by some local ranks) fail with
  // its first failure.
  void FailPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Waited(std::map<uint64_t, Op>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (++it->second.waited >= static_cast<int>(local_ranks_.size())) ops_.erase(it);
  }

  void Run();
  enum class Phase { kRunning, kReporting, kRecovering };
  // A recovery starts: every operation not done fails with `notice_`, and the job's thread
  // aborts the connection (telling the other nodes). Returns false where one runs already.
  void StartRecovery(const std::string& lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job thread's part of a recovery (without mu_): asks the planner for the epoch, waits for
  // the local ranks, reconnects, and runs again; or fails the job, named.
  void Recover();
  void FailRecovery(const absl::Status& error);
  // The rank's committed and begun steps from its journal's state buffer, or -1 and -1.
  void JournalSteps(int64_t rank, v1::RankProgress* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs one operation on the data plane (the job thread, without mu_).
  absl::Status Execute(const Op& op);
  // OP_PROTECT and OP_REBUILD (job_redundancy.cc; the job thread, without mu_).
  absl::Status Protect(const Op& op);
  absl::Status Rebuild(const Op& op);
  // FAILED_PRECONDITION naming `what` where the job has no redundancy across nodes.
  absl::Status HasRedundancy(const char* what) const;
  // The local ranks' protected segments: their parameter shards, then their state buffers by
  // name, but the step journal's ("journal/...": its marks, which a commit or a rollback changes
  // outside the step's state, its manifest, and the undo copies).
  absl::StatusOr<std::vector<std::vector<StateSegment>>> ProtectedState() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The local ranks' journal field (0: committed, 1: begun), which they must agree on.
  absl::StatusOr<int64_t> LocalStep(int field, const char* what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string job_id_, node_id_;
  const v1::Plan plan_;
  const std::vector<int64_t> local_ranks_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<Comm> comm_;
  std::unique_ptr<DataBackend> dp_;
  std::shared_ptr<PlannerClient> planner_;
  const std::shared_ptr<DaemonMetrics> metrics_;  // never null
  absl::Mutex mu_;
  std::vector<uint64_t> next_seq_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Op> ops_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t operations_ ABSL_GUARDED_BY(mu_) = 0;
  // Operations run, by (unit, kind): the job's stats report them.
  std::map<std::pair<int, v1::OpKind>, int64_t> unit_operations_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> departed_ ABSL_GUARDED_BY(mu_);  // local index -> rank
  bool departure_reported_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status report_ ABSL_GUARDED_BY(mu_);  // for the job thread to send to the planner
  absl::Status abort_ ABSL_GUARDED_BY(mu_);   // for the job thread to tell the other nodes
  int64_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t running_seq_ ABSL_GUARDED_BY(mu_) = 0;  // the operation on the job's thread, or 0
  uint64_t last_done_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Recovery in place (EnableRecovery).
  bool recoverable_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration recovery_deadline_ ABSL_GUARDED_BY(mu_);
  Reconnect reconnect_;
  RelayComm* relay_ = nullptr;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kRunning;
  int64_t target_ ABSL_GUARDED_BY(mu_) = 0;  // the epoch being recovered
  absl::Time deadline_ ABSL_GUARDED_BY(mu_);
  absl::Status notice_ ABSL_GUARDED_BY(mu_);  // what operations get while recovering
  std::string lost_ ABSL_GUARDED_BY(mu_);     // what was lost, for the planner and errors
  bool comm_aborted_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<uint64_t> generation_ ABSL_GUARDED_BY(mu_);  // per local rank
  std::vector<bool> rejoined_ ABSL_GUARDED_BY(mu_);        // attached since the recovery began
  // (rank, name) -> the buffer and the bytes asked for (the lease may be larger: aligned).
  std::map<std::pair<int64_t, std::string>, std::pair<Lease, int64_t>> state_ ABSL_GUARDED_BY(mu_);
  // ExposeCopy's copies whose CRC was checked: (local rank, step).
  std::set<std::pair<int, int64_t>> copies_checked_ ABSL_GUARDED_BY(mu_);
  Op last_done_ ABSL_GUARDED_BY(mu_);  // its kind and unit only
  // Redundancy (EnableRedundancy); redundancy_ is used by the job's thread only.
  std::unique_ptr<NodeRedundancy> redundancy_;
  std::string redundancy_text_ ABSL_GUARDED_BY(mu_);
  bool replacement_ ABSL_GUARDED_BY(mu_) = false;
  Pool* state_pool_ = nullptr;
  std::thread thread_;
};

}  // namespace ragshard::daemon

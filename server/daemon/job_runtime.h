// One job on a node: its data plane, its UCX worker, and the thread that runs its operations.
// The node's local ranks each start every operation (StartOp); the job thread runs it once all
// have, in order, and answers the waiters (AddWaiter). A lost peer, a missed deadline or ranks
// that disagree stop the job: later operations fail the same way and the planner is told.
//
// Thread-safe: StartOp, AddWaiter, LocalRankLeft, Rejoined and FillStats may be called from any
// thread (gRPC handlers, the side channel); waiter callbacks never run under the job's mutex.
#pragma once

#include <atomic>
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
#include "server/daemon/job_redundancy.h"
#include "server/daemon/metrics.h"
#include "server/daemon/op_target.h"
#include "server/daemon/pool.h"
#include "server/daemon/rank_states.h"
#include "server/daemon/recovery_state.h"
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
  // The daemon's incarnation, which its reports of failures carry (the planner refuses those of
  // a stale daemon). Set once, before the job can fail.
  void set_incarnation(uint64_t incarnation) { incarnation_.store(incarnation); }
  // Whether the job goes on without a lost node (it recovers in place, or shrinks): such a job
  // stops where its node is fenced (node_lease.h), since another node takes over its part.
  void set_fenced_with_node(bool fenced) { fenced_with_node_.store(fenced); }
  bool fenced_with_node() const { return fenced_with_node_.load(); }
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
  using Reconnect = RecoveryState::Reconnect;
  void EnableRecovery(int64_t epoch, absl::Duration deadline, Reconnect reconnect,
                      RelayComm* relay);
  // The planner says the job recovers in epoch `epoch` until `deadline` (a heartbeat).
  void BeginRecovery(int64_t epoch, absl::Time deadline, const std::string& lost);
  // The node is fenced (node_lease.h): a job that recovers in place starts a recovery (its
  // state stays; its operations end with the notice naming `fence`; the report waits for the
  // planner: a short partition is recovered in place, and after a long one the planner refuses
  // the daemon as stale); any other job fails with `fence`.
  void Fence(const absl::Status& fence);
  // Waits until no recovery is in progress: OK, the job's failure, or DEADLINE_EXCEEDED.
  absl::Status AwaitRunning(absl::Time deadline);
  // The planner's failure of the job (its heartbeat's failed_jobs), while the job still holds
  // its buffers (not released): OK while it may still run.
  absl::Status Stopped() {
    absl::MutexLock lock(&mu_);
    return stopping_ ? absl::AbortedError("the job was released") : failed_;
  }
  int64_t epoch() { return recovery_.epoch(); }
  bool recoverable() { return recovery_.recoverable(); }

  // A buffer of rank `rank`'s own (local rank `local`), kept by name for the job's life
  // (StateBuffer RPC; RankStates::Get: in the rank's memory or the pool). FAILED_PRECONDITION
  // when it exists with another size.
  absl::StatusOr<RankStates::Buffer> StateBuffer(int64_t rank, int local, const std::string& name,
                                                 int64_t bytes, Pool* pool);

  // A shrink's salvage attachment asks for the whole copy this node holds (JobRedundancy::
  // ExposeCopy); nothing where the job has no redundancy.
  absl::Status ExposeCopy(int local, int64_t step, const std::string& name, Pool* pool);

  // Redundancy of the local ranks' persistent state across the job's nodes (docs/recovery.md, "A
  // lost node"; redundancy.h): OP_PROTECT and OP_REBUILD run with it. This node is `node` of
  // `nodes`; `replacement`: this daemon replaces a lost node of the job, and its ranks' state is
  // rebuilt by the next OP_REBUILD (after which it tells the planner, ReportRecovered).
  // `text`: the job's JobOptions.redundancy, for the attaches.
  void EnableRedundancy(RedundancyScheme scheme, const std::string& text, int node,
                        std::vector<std::string> nodes, bool replacement, Pool* pool);
  std::string redundancy() {
    JobRedundancy* r = redundancy_state();
    return r != nullptr ? r->text() : std::string();
  }
  bool replacement() {
    JobRedundancy* r = redundancy_state();
    return r != nullptr && r->replacement();
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
  using Joined = RecoveryState::Joined;
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
  // Every operation not done fails with `error` (a rank already waiting on one hears it), and
  // the queue empties.
  void FailUnfinished(const absl::Status& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Operations pending when the job fails (queued, or started by some local ranks) fail with
  // its first failure.
  void FailPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { FailUnfinished(failed_); }

  void Waited(std::map<uint64_t, Op>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (++it->second.waited >= static_cast<int>(local_ranks_.size())) ops_.erase(it);
  }

  void Run();
  // A recovery starts (RecoveryState::Start): every operation not done fails with its notice,
  // and the job's thread aborts the connection (telling the other nodes).
  void StartRecovery(const std::string& lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A recovery's `notice` ends the job's operations, the running one too: the job's thread may
  // be in a collective with a node that cannot answer, which ends at once (Comm::Interrupt).
  void StopForRecovery(const absl::Status& notice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job thread's part of a recovery (without mu_): asks the planner for the epoch, waits for
  // the local ranks, reconnects, and runs again; or fails the job, named.
  void Recover();
  void FailRecovery(const absl::Status& error);
  // Runs one operation (the job thread, without mu_).
  absl::Status Execute(uint64_t seq, const Op& op);
  // OP_PROTECT, OP_PROTECT_FINISH and OP_REBUILD (JobRedundancy's).
  absl::Status Redundancy(uint64_t seq, const Op& op);
  // After each operation and in the idle moments of the job's thread (without mu_): moves a
  // protect running in the background on (redundancy.h), without waiting for its messages, while
  // the ranks compute. Returns whether it still has windows to move (the thread then comes back
  // within kBackgroundPoll rather than sleeping until the next operation). Its failure is the
  // job's, as an operation's would be: a recovery where the job recovers in place.
  bool AdvanceProtect();
  JobRedundancy* redundancy_state() {
    absl::MutexLock lock(&mu_);
    return redundancy_.get();
  }

  const std::string job_id_, node_id_;
  const v1::Plan plan_;
  const std::vector<int64_t> local_ranks_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<Comm> comm_;
  std::unique_ptr<DataBackend> dp_;
  std::shared_ptr<PlannerClient> planner_;
  std::atomic<uint64_t> incarnation_{0};  // the daemon's, in its reports
  std::atomic<bool> fenced_with_node_{false};
  const std::shared_ptr<DaemonMetrics> metrics_;  // never null
  // The ranks' state buffers and the recovery's state, each with its own lock (after mu_).
  RankStates states_;
  RecoveryState recovery_;
  absl::Mutex mu_;
  std::vector<uint64_t> next_seq_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Op> ops_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Operations run, by (unit, kind): the job's stats report them.
  std::map<std::pair<int, v1::OpKind>, int64_t> unit_operations_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> departed_ ABSL_GUARDED_BY(mu_);  // local index -> rank
  bool departure_reported_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status report_ ABSL_GUARDED_BY(mu_);       // for the job thread to send to the planner
  absl::Status abort_ ABSL_GUARDED_BY(mu_);        // for the job thread to tell the other nodes
  uint64_t running_seq_ ABSL_GUARDED_BY(mu_) = 0;  // the operation on the job's thread, or 0
  uint64_t last_done_seq_ ABSL_GUARDED_BY(mu_) = 0;
  Op last_done_ ABSL_GUARDED_BY(mu_);  // its kind and unit only
  // Redundancy across nodes (EnableRedundancy, once, before the job's first operation).
  std::unique_ptr<JobRedundancy> redundancy_ ABSL_GUARDED_BY(mu_);
  // The job's stats, written by the job's thread.
  std::atomic<int64_t> operations_{0};
  std::atomic<int64_t> staging_bytes_{0};
  std::thread thread_;
};

}  // namespace ragshard::daemon

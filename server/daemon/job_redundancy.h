// A job's redundancy of its local ranks' persistent state across its nodes on this node
// (docs/recovery.md, "A lost node"; the algorithm is redundancy.h's): what OP_PROTECT and
// OP_REBUILD run, whether this daemon replaces a lost node, and the whole copies a shrink's
// salvage attachment reads (ExposeCopy).
//
// Thread-safe where said: the job's thread runs Protect and Rebuild, one at a time; the attaches
// and the stats read the rest.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
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
#include "server/daemon/pool.h"
#include "server/daemon/rank_states.h"
#include "server/daemon/redundancy.h"

namespace ragshard::daemon {

class JobRedundancy {
 public:
  // Job `job_id` on node `node_id`, the `node`-th of `nodes`, with `local_ranks`. `text`: the
  // job's JobOptions.redundancy, for the attaches. `replacement`: this daemon replaces a lost
  // node, and its ranks' state is rebuilt by the next OP_REBUILD. Parities and rebuilt buffers
  // are leased from `pool`; the ranks' state buffers are `states`'s.
  JobRedundancy(std::string job_id, std::string node_id, RedundancyScheme scheme, std::string text,
                int node, std::vector<std::string> nodes, std::vector<int64_t> local_ranks,
                bool replacement, Pool* pool, RankStates* states,
                std::shared_ptr<PlannerClient> planner, std::shared_ptr<DaemonMetrics> metrics);

  const std::string& text() const { return text_; }
  bool replacement() {
    absl::MutexLock lock(&mu_);
    return replacement_;
  }
  void FillStats(v1::JobStats* out) const;

  // OP_PROTECT (the job's thread): starts protecting the local ranks' state at the step they
  // have begun, in the background of the operations that follow (NodeRedundancy's StartProtect;
  // a protect still under way is finished first). OP_PROTECT_FINISH: the protect under way, whole.
  // Advance: moves it on without waiting (after each operation of the job's thread and in its
  // idle moments); in_flight: whether it has something to move.
  absl::Status Protect(Comm& comm, const DataBackend& dp, absl::Time deadline, uint64_t seq);
  absl::Status FinishProtect(Comm& comm, absl::Time deadline) {
    return redundancy_.FinishProtect(comm, deadline);
  }
  absl::Status AdvanceProtect(Comm& comm, absl::Duration patience) {
    return redundancy_.AdvanceProtect(comm, NodeRedundancy::kWindowsPerOperation, patience);
  }
  bool protect_in_flight() const { return redundancy_.protect_in_flight(); }
  bool protecting() const { return redundancy_.protecting(); }
  // A recovery in place: the protect under way is given up (its messages died with the
  // connection); the parities made whole before it stay.
  void AbandonProtect() { redundancy_.AbandonProtect(); }
  // OP_REBUILD (the job's thread): every node at the step its ranks committed; a replacement
  // gets its ranks' state from the others and tells the planner (ReportRecovered, in `epoch`).
  // A state that cannot be rebuilt, or rebuilt wrong, is named and given to `stop` (which stops
  // the job) before it returns; a lost peer or the deadline are the recovery's own failures,
  // returned as every operation's.
  absl::Status Rebuild(Comm& comm, const DataBackend& dp, int64_t epoch, absl::Time deadline,
                       uint64_t seq, const std::function<void(const absl::Status&)>& stop);

  // A shrink that re-cuts the shards (docs/recovery.md, "Shrinking in place"): on a stopped job,
  // the state of local rank `local`'s counterpart on the node whose whole copy this node holds
  // at `step` (replica, parity:1; NodeRedundancy::CopyHeld), as state buffers of the local rank,
  // each made when first asked for (`name`): "copy/<step>/directory" (text: "node <name> rank
  // <its rank>", then "<bytes> <segment>" per line) of "copy/<step>/directory.bytes" bytes (an
  // int64; left zeros where this node holds no such copy), and "copy/<step>/<segment>" for each
  // segment. The copy's CRC is checked once: DATA_LOSS naming the chunk where it differs.
  absl::Status ExposeCopy(int local, int64_t step, const std::string& name, Pool* pool);

 private:
  // The local ranks' journal field (committed or begun), which they must agree on.
  absl::StatusOr<int64_t> LocalStep(bool committed, const char* what);
  // The local ranks' protected segments: their parameter shards, then their state buffers.
  absl::StatusOr<std::vector<std::vector<StateSegment>>> ProtectedState(const DataBackend& dp);

  const std::string job_id_, node_id_, text_;
  const std::vector<int64_t> local_ranks_;
  Pool* const pool_;
  RankStates* const states_;
  const std::shared_ptr<PlannerClient> planner_;
  const std::shared_ptr<DaemonMetrics> metrics_;
  // The job's thread's (and ExposeCopy's on a stopped job, which protects nothing any more).
  NodeRedundancy redundancy_;
  absl::Mutex mu_;
  bool replacement_ ABSL_GUARDED_BY(mu_);
  // ExposeCopy's copies whose CRC was checked: (local rank, step).
  std::set<std::pair<int, int64_t>> copies_checked_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard::daemon

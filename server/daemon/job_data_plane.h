// The data plane of one job on one node: the RaggedShard buffers of the node's ranks in the pool,
// and the collectives over them. Ranks on the node share memory, so the node reduces their
// gradients in memory and only the node's sum crosses the network; across nodes it runs the
// ring collectives over a Comm whose members are the job's nodes.
//
// Requirements of this version: every node holds the same number of ranks and they are
// consecutive (node i holds ranks [i*k, (i+1)*k)). Create() returns UNIMPLEMENTED otherwise.
//
// Thread-compatible: the daemon runs one operation at a time per job.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ragshard/v1/plan.pb.h"
#include "server/daemon/collectives.h"
#include "server/daemon/comm.h"
#include "server/daemon/pool.h"

namespace ragshard::daemon {

class JobDataPlane {
 public:
  // `local_ranks` are the ranks of `plan` on this node; `nodes` is the communicator among the
  // job's nodes (member i holds ranks [i*k, (i+1)*k)), or nullptr for a single node.
  static absl::StatusOr<std::unique_ptr<JobDataPlane>> Create(const v1::Plan& plan,
                                                              std::vector<int64_t> local_ranks,
                                                              Pool* pool, Comm* nodes);

  int units() const { return static_cast<int>(units_.size()); }
  int local_ranks() const { return static_cast<int>(local_ranks_.size()); }

  // Buffer views (into the pool's shared arena; the same bytes local clients map).
  // Parameter shard: shard_elems of the unit's dtype. Unsharded parameter: W * shard_elems.
  // Gradient: W * shard_elems of the unit's dtype (per local rank). Gradient shard:
  // shard_elems fp32 (per local rank).
  char* param_shard(int unit, int local) const;
  char* unsharded(int unit) const;
  char* grad(int unit, int local) const;
  float* grad_shard(int unit, int local) const;
  // Arena byte offsets of the same buffers, for local clients that map the arena.
  struct Offsets {
    int64_t param_shard, unsharded, grad, grad_shard;
  };
  Offsets offsets(int unit, int local) const;
  v1::DType dtype(int unit) const { return units_[unit].dtype; }
  int64_t shard_elems(int unit) const { return units_[unit].shard_elems; }

  // All-gather of every rank's parameter shard into the node's unsharded buffer.
  absl::Status Unshard(int unit, absl::Time deadline);
  // Sum (or mean) over all W ranks of the gradients into each local rank's gradient shard,
  // accumulated in fp32 (gradients may be fp32, bf16 or fp16).
  absl::Status ReduceScatter(int unit, ReduceOp op, absl::Time deadline);

 private:
  struct Unit {
    v1::DType dtype;
    int64_t shard_elems = 0;
    int64_t item = 0;
    std::vector<Lease> param_shard, grad, grad_shard;
    Lease unsharded;
    Lease scratch;  // fp32 node sum of the gradients (W * S) and ring scratch
  };
  JobDataPlane() = default;

  std::vector<Unit> units_;
  std::vector<int64_t> local_ranks_;
  int64_t world_ = 0;
  Comm* nodes_ = nullptr;
  uint64_t op_seq_ = 0;
};

}  // namespace ragshard::daemon

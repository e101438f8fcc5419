// The data plane of one job on one node: the RaggedShard buffers of the node's ranks in the pool,
// and the collectives over them. Ranks on the node share memory, so the node reduces their
// gradients in memory and only the node's sum crosses the network; across nodes it runs the
// ring collectives over a Comm whose members are the job's nodes.
//
// Mesh: W = F * R ranks, R replicas (HSDP) of a shard group of F ranks; the plan is computed for
// F. Rank r is shard position r % F of replica r / F. A node holds k consecutive ranks (node i
// holds [i*k, (i+1)*k)) and a shard group is made of whole nodes (F % k == 0); Create() returns
// UNIMPLEMENTED otherwise.
//
// Buffers: a local rank's parameter shard is its slice of the node's unsharded buffer, so
// unsharding moves only the other nodes' shards and copies nothing; the node's gradient shards
// are one contiguous fp32 block that the reduce-scatter writes and the replicate all-reduce
// updates in place. `staging_bytes()` counts every write into pool buffers outside the
// collectives' own transfers and reductions (DESIGN.md's copy-in/copy-out); none exist today and
// the counter proves it.
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
#include "server/daemon/data_backend.h"
#include "server/daemon/pool.h"

namespace ragshard::daemon {

class JobDataPlane final : public DataBackend {
 public:
  // `local_ranks` are the ranks of the job on this node; `nodes` is the communicator among the
  // job's nodes (member i holds ranks [i*k, (i+1)*k)), or nullptr for a single node;
  // `replicas` is R.
  static absl::StatusOr<std::unique_ptr<JobDataPlane>> Create(const v1::Plan& plan,
                                                              std::vector<int64_t> local_ranks,
                                                              Pool* pool, Comm* nodes,
                                                              int64_t replicas = 1);

  const char* name() const override { return "host"; }
  int units() const override { return static_cast<int>(units_.size()); }
  int local_ranks() const { return static_cast<int>(local_ranks_.size()); }
  int64_t shard_group_size() const { return shard_; }
  int64_t replicas() const override { return replicas_; }

  // Buffer views (into the pool's shared arena; the same bytes local clients map).
  // Parameter shard: shard_elems of the unit's dtype. Unsharded parameter: F * shard_elems.
  // Gradient: F * shard_elems of the unit's dtype (per local rank). Gradient shard:
  // shard_elems fp32 (per local rank). Owner buffer: F * shard_elems fp32, laid out like the
  // unsharded unit, for local ranks that own a matrix tensor of the unit (nullptr otherwise).
  char* param_shard(int unit, int local) const;
  char* unsharded(int unit) const;
  char* grad(int unit, int local) const;
  float* grad_shard(int unit, int local) const;
  float* owner_buffer(int unit, int local) const;
  // Arena byte offsets of the same buffers, for local clients that map the arena (-1: none).
  struct Offsets {
    int64_t param_shard, unsharded, grad, grad_shard, owner;
  };
  Offsets offsets(int unit, int local) const;
  v1::DType dtype(int unit) const { return units_[unit].dtype; }
  int64_t shard_elems(int unit) const { return units_[unit].shard_elems; }
  int64_t staging_bytes() const override { return staging_bytes_; }
  void Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const override;

  // All-gather of the shard group's parameter shards into the node's unsharded buffer.
  absl::Status Unshard(int unit, absl::Time deadline) override;
  // Sum (or mean) over the shard group's F ranks of the gradients into each local rank's
  // gradient shard, accumulated in fp32 (gradients may be fp32, bf16 or fp16).
  absl::Status ReduceScatter(int unit, ReduceOp op, absl::Time deadline) override;
  // Sum (or mean) of the gradient shards over the R replicas, in place (HSDP); nothing to do
  // when R = 1.
  absl::Status AllReduce(int unit, ReduceOp op, absl::Time deadline) override;
  // For every OPTIMIZER_MATRIX tensor of the unit: the pieces of the gradient shards (fp32) of
  // the shard group go to the tensor's owner (the planner's owner_rank), into its owner buffer
  // at the tensor's place in the unit. Point-to-point: only the owner receives each tensor.
  absl::Status GatherToOwner(int unit, absl::Time deadline) override;
  // The inverse: each owner's buffer, cut at the tensor's pieces, into the gradient shards of the
  // ranks that hold them (elements of other tensors are left as they are).
  absl::Status ScatterFromOwner(int unit, absl::Time deadline) override;

 private:
  using Piece = MatrixPiece;
  struct Unit {
    v1::DType dtype;
    int64_t shard_elems = 0;
    int64_t item = 0;
    std::vector<Lease> grad;
    std::vector<Lease> owner;      // per local rank; empty lease when it owns nothing here
    Lease unsharded;               // F * S of dtype; local rank i's shard is its slice
    Lease grad_shards;             // k * S fp32, local rank i at i * S
    int64_t grad_shard_elems = 0;  // k * S rounded up to a multiple of R (the lease may be larger)
    Lease scratch;                 // fp32 node sum of the gradients (F * S) and ring scratch
    std::vector<Piece> pieces;     // of the matrix tensors, in plan order
  };
  JobDataPlane() = default;
  absl::Status CheckUnit(int unit) const;
  // Moves the unit's matrix pieces between gradient shards and owner buffers.
  absl::Status MovePieces(int unit, bool to_owner, absl::Time deadline);
  int NodeOf(int64_t shard_position) const {
    return static_cast<int>(shard_position / static_cast<int64_t>(local_ranks_.size()));
  }

  std::vector<Unit> units_;
  std::vector<int64_t> local_ranks_;
  int64_t shard_ = 0, replicas_ = 1;
  int64_t first_position_ = 0;                         // shard position of local rank 0
  std::unique_ptr<Comm> shard_comm_, replicate_comm_;  // nullptr when of size 1
  uint64_t op_seq_ = 0;
  int64_t staging_bytes_ = 0;
};

}  // namespace ragshard::daemon

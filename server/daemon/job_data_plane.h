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
// Buffers (DESIGN.md, "Data plane"). Persistent, per local rank: the parameter shard (S of the
// unit's dtype) and the gradient shard (S fp32). Transient, per unit:
// * the unsharded parameters (F * S of dtype), from Unshard (or AllocateUnsharded) to Reshard:
//   one per node, shared by its ranks (Shape::kNode), or one per rank (Shape::kDevice, the
//   shape of a GPU: nothing is shared by a node's ranks);
// * the unsharded gradients (F * S of dtype per local rank), from AllocateGrad to the end of
//   ReduceScatter;
// * the owner buffers of matrix optimizers (the owned matrices, packed), from GatherToOwner to
//   the end of ScatterFromOwner;
// * the collectives' scratch, for the duration of one operation: 2 * k * S fp32 for the ring
//   reduce-scatter between nodes (the node's ranks are summed as the ring goes, never into an
//   F * S buffer) and two chunks of the replicate all-reduce.
// Unsharding places the local shards into the unsharded buffer as part of the all-gather (as
// ncclAllGather with separate send and receive buffers). `staging_bytes()` counts every write
// into pool buffers outside the collectives' own transfers and reductions (DESIGN.md's
// copy-in/copy-out); none exist and the counter proves it.
//
// An allocation the pool cannot serve fails the operation with RESOURCE_EXHAUSTED naming the
// unit, the buffer and the bytes; nothing waits for memory.
//
// Thread-compatible: the daemon runs one operation at a time per job.
#pragma once

#include <memory>
#include <string>
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
  enum class Shape { kNode, kDevice };

  // `local_ranks` are the ranks of the job on this node; `nodes` is the communicator among the
  // job's nodes (member i holds ranks [i*k, (i+1)*k)), or nullptr for a single node;
  // `replicas` is R.
  static absl::StatusOr<std::unique_ptr<JobDataPlane>> Create(const v1::Plan& plan,
                                                              std::vector<int64_t> local_ranks,
                                                              Pool* pool, Comm* nodes,
                                                              int64_t replicas = 1,
                                                              Shape shape = Shape::kNode);

  ~JobDataPlane() override;
  const char* name() const override { return shape_ == Shape::kNode ? "host" : "device-shaped"; }
  int units() const override { return static_cast<int>(units_.size()); }
  int local_ranks() const { return static_cast<int>(local_ranks_.size()); }
  int64_t shard_group_size() const { return shard_; }
  int64_t replicas() const override { return replicas_; }

  // Buffer views (into the pool's shared arena; the same bytes local clients map); nullptr for a
  // transient buffer that is not allocated. Parameter shard: shard_elems of the unit's dtype.
  // Unsharded parameter: F * shard_elems (local rank `local`'s own with Shape::kDevice).
  // Gradient: F * shard_elems of the unit's dtype (per local rank). Gradient shard: shard_elems
  // fp32 (per local rank). Owner buffer: owner_elems(unit, local) fp32.
  char* param_shard(int unit, int local) const;
  char* unsharded(int unit, int local = 0) const;
  char* grad(int unit, int local) const;
  float* grad_shard(int unit, int local) const;
  float* owner_buffer(int unit, int local) const;
  int64_t owner_elems(int unit, int local) const;
  v1::DType dtype(int unit) const { return units_[unit].dtype; }
  int64_t shard_elems(int unit) const { return units_[unit].shard_elems; }
  int64_t staging_bytes() const override { return staging_bytes_; }
  void Placement(int unit, int local, v1::UnitBuffers* out) const override;
  void Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const override;

  // All-gather of the shard group's parameter shards into the unsharded buffer(s).
  absl::Status Unshard(int unit, absl::Time deadline) override;
  absl::Status AllocateUnsharded(int unit) override;
  // keep > 1 (a divisor of the local ranks): the node buffer stays (kNode), or each rank keeps
  // its 1/keep of the unit (kDevice); the next Unshard rebuilds the unit within the node.
  absl::Status Reshard(int unit, int64_t keep) override;
  absl::Status AllocateGrad(int unit) override;
  // Sum (or mean) over the shard group's F ranks of the gradients into each local rank's
  // gradient shard, accumulated in fp32 (gradients may be fp32, bf16 or fp16); then the
  // gradients are released. FAILED_PRECONDITION when they were not allocated.
  absl::Status ReduceScatter(int unit, ReduceOp op, absl::Time deadline) override;
  // Sum (or mean) of the gradient shards over the R replicas, in place (HSDP); nothing to do
  // when R = 1.
  absl::Status AllReduce(int unit, ReduceOp op, absl::Time deadline) override;
  // For every OPTIMIZER_MATRIX tensor of the unit: the pieces of the gradient shards (fp32) of
  // the shard group go to the tensor's owner (the planner's owner_rank), into its owner buffer
  // (allocated here) at the tensor's packed place. Point-to-point: only the owner receives each
  // tensor.
  absl::Status GatherToOwner(int unit, absl::Time deadline) override;
  // The inverse: each owner's buffer, cut at the tensor's pieces, into the gradient shards of the
  // ranks that hold them (elements of other tensors are left as they are); then the owner
  // buffers are released.
  absl::Status ScatterFromOwner(int unit, absl::Time deadline) override;

 private:
  using Piece = MatrixPiece;
  struct Unit {
    std::string name;
    v1::DType dtype;
    int64_t shard_elems = 0;
    int64_t item = 0;
    Lease shards;                  // k * S of dtype, local rank i at i * S (persistent)
    Lease grad_shards;             // k * S fp32, local rank i at i * S (persistent)
    int64_t grad_shard_elems = 0;  // k * S rounded up to a multiple of R (the lease may be larger)
    std::vector<Lease> unsharded;  // none, or 1 (kNode) or k (kDevice) of F * S of dtype
    int64_t kept = 0;              // > 1: resharded to groups of `kept` local ranks
    std::vector<Lease> parts;      // kDevice while kept: local rank i's 1/kept of the unit
    std::vector<Lease> grad;       // none, or k of F * S of dtype
    std::vector<Lease> owner;      // none, or k (empty leases where a rank owns nothing)
    std::vector<int64_t> owner_elems;  // per local rank
    std::vector<Piece> pieces;         // of the matrix tensors, in plan order
  };
  JobDataPlane() = default;
  absl::Status CheckUnit(int unit) const;
  // `count` leases of `bytes` each for `what` of the unit; RESOURCE_EXHAUSTED names all three.
  absl::StatusOr<std::vector<Lease>> AllocateFor(const Unit& u, const char* what, int count,
                                                 int64_t bytes, bool zero);
  // Moves the unit's matrix pieces between gradient shards and owner buffers.
  absl::Status MovePieces(int unit, bool to_owner, absl::Time deadline);
  // Unshards a unit kept over groups of local ranks: within the node only.
  absl::Status Rebuild(int unit);
  // The next operation's message tag (MessageStamp with index 0).
  uint64_t NextTag(int unit, uint32_t kind);
  // "OP_UNSHARD of unit 3 'layers.1' (operation 12 modulo 8192)", for mismatch errors.
  std::string DescribeTag(uint64_t tag) const;
  int NodeOf(int64_t shard_position) const {
    return static_cast<int>(shard_position / static_cast<int64_t>(local_ranks_.size()));
  }

  Pool* pool_ = nullptr;
  Shape shape_ = Shape::kNode;
  std::vector<Unit> units_;
  std::vector<int64_t> local_ranks_;
  int64_t shard_ = 0, replicas_ = 1;
  int64_t first_position_ = 0;                         // shard position of local rank 0
  std::unique_ptr<Comm> shard_comm_, replicate_comm_;  // nullptr when of size 1
  Comm* nodes_ = nullptr;                              // their base, or nullptr
  uint64_t op_seq_ = 0;
  int64_t staging_bytes_ = 0;
};

}  // namespace ragshard::daemon

// The data plane of one job on one node, for every backend: the units, the lifetimes of their
// buffers, the routes of the matrix pieces and the sequence of operations. A Transport
// (transport.h) supplies the memory of each local rank and the collectives over it: the host
// one (host_transport.h: the memfd pool, node-level reduction, UCX between nodes, in the node
// shape or the device shape) or the CUDA one (cuda/cuda_transport.h: a slab per GPU, NCCL).
//
// Mesh: NodeMesh (transport.h), with the AMSP factors of engine/sharding.h: parameters sharded
// over p (S_p = the plan's shard_elems), gradients over g (S_g, the "g" factor plan), optimizer
// state over os (S_os). Create() returns UNIMPLEMENTED for a mesh the transport does not run.
//
// Buffers (docs/design.md). Persistent, per local rank: the parameter shard (S_p of the
// unit's dtype) and the gradient shard (S_g fp32), one block for the node's ranks where the
// transport works on node blocks: A slots of the factor where local replicas share one
// (host memory), a slot per rank otherwise. Transient, per unit:
// * the unsharded parameters (F * S of dtype), from Unshard (or AllocateUnsharded) to Reshard:
//   one per node where the transport shares it, else one per rank (a GPU's shape);
// * the unsharded gradients (F * S of dtype per local rank), from AllocateGrad to the end of
//   ReduceScatter;
// * the owner buffers of matrix optimizers (the owned matrices, packed), from GatherToOwner to
//   the end of ScatterFromOwner;
// * the transport's scratch, for the duration of one operation (bounded by the transport: never
//   F * S for every unit).
// Unsharding places the local shards into the unsharded buffer as part of the all-gather (as
// ncclAllGather with separate send and receive buffers). Where the node shares the buffer
// (the host backend) and its shard block is a whole number of pages, nothing is placed: the
// buffer is a view that maps the shard block beside a transient (F - k) * S rest
// (protocol/unsharded_view.h), and the all-gather only receives the other nodes' shards.
// `staging_bytes()` counts every write into pool buffers outside the collectives' own transfers and
// reductions (docs/design.md's copy-in/copy-out); on the host none exist and the counter proves it.
//
// An allocation the memory cannot serve fails the operation with RESOURCE_EXHAUSTED naming the
// unit, the buffer and the bytes; nothing waits for memory.
//
// Thread-compatible: the daemon runs one operation at a time per job.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "protocol/unsharded_view.h"
#include "ragshard/v1/plan.pb.h"
#include "server/daemon/collectives.h"
#include "server/daemon/comm.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/host_transport.h"
#include "server/daemon/pool.h"
#include "server/daemon/transport.h"

namespace ragshard::daemon {

class JobDataPlane final : public DataBackend {
 public:
  using Shape = HostShape;

  // The host backend: `local_ranks` are the ranks of the job on this node; `nodes` is the
  // communicator among the job's nodes (member i holds ranks [i*k, (i+1)*k)), or nullptr for a
  // single node; `replicas` is R.
  static absl::StatusOr<std::unique_ptr<JobDataPlane>> Create(
      const v1::Plan& plan, const std::vector<int64_t>& local_ranks, Pool* pool, Comm* nodes,
      int64_t replicas = 1, Shape shape = Shape::kNode);
  // Any backend: `mesh` from NodeMesh::Of; `nodes`, when given, names the units in its message
  // errors.
  static absl::StatusOr<std::unique_ptr<JobDataPlane>> Create(const v1::Plan& plan,
                                                              const NodeMesh& mesh,
                                                              std::unique_ptr<Transport> transport,
                                                              Comm* nodes);

  ~JobDataPlane() override;
  const char* name() const override { return transport_->name(); }
  int units() const override { return static_cast<int>(units_.size()); }
  int local_ranks() const { return static_cast<int>(mesh_.local); }
  int64_t shard_group_size() const { return mesh_.shard; }
  int64_t replicas() const override { return mesh_.replicas; }
  const Transport& transport() const { return *transport_; }

  // Buffer views (into local rank `local`'s arena; the same bytes its client maps); nullptr for a
  // transient buffer that is not allocated. Parameter shard: shard_elems of the unit's dtype.
  // Unsharded parameter: F * shard_elems (local rank `local`'s own unless the node shares it).
  // Gradient: F * shard_elems of the unit's dtype (per local rank). Gradient shard: grad_elems
  // fp32 (per local rank). Owner buffer: owner_elems(unit, local) fp32.
  char* param_shard(int unit, int local) const;
  StateSegment ParamShardSegment(int unit, int local) const override {
    return {pool::ShardName(unit), param_shard(unit, local),
            units_[unit].shard_elems * units_[unit].item, transport_->memory(local)};
  }
  absl::StatusOr<Lease> AllocateRankState(int local, int64_t bytes) const override;
  const SegmentMemory* rank_memory(int local) const override { return transport_->memory(local); }
  char* unsharded(int unit, int local = 0) const;
  char* grad(int unit, int local) const;
  float* grad_shard(int unit, int local) const;
  float* owner_buffer(int unit, int local) const;
  int64_t owner_elems(int unit, int local) const;
  v1::DType dtype(int unit) const { return units_[unit].dtype; }
  int64_t shard_elems(int unit) const { return units_[unit].shard_elems; }
  int64_t grad_elems(int unit) const { return units_[unit].grad_elems; }
  int64_t os_elems(int unit) const { return units_[unit].os_elems; }
  const NodeMesh& mesh() const { return mesh_; }
  int64_t staging_bytes() const override { return transport_->staging_bytes(); }
  void Placement(int unit, int local, v1::UnitBuffers* out) const override;
  void Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const override;

  // All-gather of the shard group's parameter shards into the unsharded buffer(s).
  absl::Status Unshard(int unit, absl::Time deadline) override;
  absl::Status AllocateUnsharded(int unit) override;
  // keep > 1 (a divisor of the local ranks): the node's shared buffer stays, or each rank keeps
  // its 1/keep of the unit; the next Unshard rebuilds the unit within the node.
  absl::Status Reshard(int unit, int64_t keep) override;
  absl::Status AllocateGrad(int unit) override;
  // Sum (or mean) over the shard group's F ranks of the gradients into each local rank's
  // gradient shard, accumulated in fp32 (gradients may be fp32, bf16 or fp16); then the
  // gradients are released. FAILED_PRECONDITION when they were not allocated. `accumulate`:
  // each gradient shard receives what it held plus the reduction (the reduction is formed in
  // the shard's place, then the held values, kept aside in pool scratch, are added back), so
  // repeated backward passes add up as PyTorch's .grad does.
  absl::Status ReduceScatter(int unit, ReduceOp op, bool accumulate, absl::Time deadline) override;
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
  // AMSP's update gather: each local rank stepped its os range of its parameter shard; the
  // ranges reach the other shards that hold them (transport.h). Nothing to do when p = g = os.
  absl::Status UpdateGather(int unit, absl::Time deadline) override;
  void ResetTransient() override;

 private:
  using Piece = MatrixPiece;
  struct Unit {
    std::string name;
    v1::DType dtype;
    int64_t shard_elems = 0;  // S_p
    int64_t grad_elems = 0;   // S_g
    int64_t os_elems = 0;     // S_os
    int64_t item = 0;
    std::vector<Lease> shards;       // persistent: 1 block of slots * S_p, or k of S_p, of dtype
    std::vector<Lease> grad_shards;  // persistent: 1 block (GradShardBlockElems), or k of S_g,
                                     // fp32
    std::vector<Lease> unsharded;    // none, or 1 (shared) or k of F * S of dtype; composed:
                                     // the transient rest, (F - k) * S (none when F = k)
    bool composed = false;           // unsharded through `view`: the node's shards mapped in
    std::unique_ptr<UnshardedView> view;  // kept between unshards (remapped when the rest moves)
    int64_t kept = 0;                     // > 1: resharded to groups of `kept` local ranks
    std::vector<Lease> parts;             // unshared while kept: local rank i's 1/kept of the unit
    std::vector<Lease> grad;              // none, or k of F * S of dtype
    std::vector<Lease> owner;             // none, or k (empty leases where a rank owns nothing)
    std::vector<int64_t> owner_elems;     // per local rank
    std::vector<Piece> pieces;            // of the matrix tensors (os positions), in plan order
  };
  JobDataPlane() = default;
  absl::Status CheckUnit(int unit) const;
  static bool IsUnsharded(const Unit& u) { return u.composed || !u.unsharded.empty(); }
  // Local rank `local`'s slot of factor f's block: its slot where replicas share one, else its
  // own. Slots per block: SlotCount.
  int SlotIndex(Factor f, int local) const;
  int64_t SlotCount(Factor f) const;
  // The local rank whose memory holds os position `position` on this node (the first of its
  // replicas), or -1 when another node holds it.
  int LocalOfOs(int64_t position) const;
  // Maps the unit's unsharded view over its shard block and a transient rest; false (and
  // nothing allocated) where the transport or the sizes do not allow it (the copy path then).
  absl::StatusOr<bool> Compose(Unit& u);
  // One lease of `bytes` in local rank `local`'s memory for `what` of the unit; RESOURCE_EXHAUSTED
  // names all three.
  absl::StatusOr<Lease> AllocateFor(const Unit& u, const char* what, int local, int64_t bytes,
                                    bool zero);
  // A lease per local rank (or one for the node, `per_rank` false).
  absl::StatusOr<std::vector<Lease>> AllocateEach(const Unit& u, const char* what, bool per_rank,
                                                  int64_t bytes, bool zero);
  ScratchFn ScratchFor(const Unit& u);
  // Moves the unit's matrix pieces between gradient shards and owner buffers.
  absl::Status MovePieces(int unit, bool to_owner, absl::Time deadline);
  // Unshards a unit kept over groups of local ranks: within the node only.
  absl::Status Rebuild(int unit, absl::Time deadline);
  // The next operation's message tag (MessageStamp with index 0).
  uint64_t NextTag(int unit, uint32_t kind);
  // "OP_UNSHARD of unit 3 'layers.1' (operation 12 modulo 8192)", for mismatch errors.
  std::string DescribeTag(uint64_t tag) const;

  NodeMesh mesh_;
  std::unique_ptr<Transport> transport_;
  std::vector<Unit> units_;
  Comm* nodes_ = nullptr;  // whose describer names this plane's units, or nullptr
  uint64_t op_seq_ = 0;
};

}  // namespace ragshard::daemon

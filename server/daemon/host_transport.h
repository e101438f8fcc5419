// The host backend's transport (transport.h): the daemon's memfd pool, shared with the node's
// ranks, and the collectives of a node. The node's ranks share memory, so the node reduces their
// gradients in memory and only the node's sum crosses the network; across nodes it runs the
// ring collectives (collectives.h) over a Comm whose members are the job's nodes.
//
// Every factor (engine/sharding.h) is a group of A ranks in each of B nodes. The node's A slots
// of a factor are one block; the collectives of a factor run between the B nodes of the node's
// group, each node contributing its block:
//   * the all-gather of the parameters over p (blocks of A_p shards, adjacent positions);
//   * the reduce-scatter of the gradients over g, summing every local rank's gradients in
//     memory (the node's replicas of g included), each node's chunk its g slots' runs;
//   * the all-reduce of the gradient shards over the nodes that hold the same g positions;
//   * the update gather over the nodes of the os group that hold the same p positions: the
//     optimizer ranges each rank updated, into the other nodes' parameter shards;
//   * the matrix pieces between os positions (Muon's and Shampoo's owners).
//
// Two shapes: kNode, one block per factor shared by the node's ranks (local replicas share a
// slot, and one unsharded buffer serves the node); kDevice, one slot per rank and one private
// unsharded buffer per rank, exactly the shape of a GPU, so that the GPU path's logic runs
// without one: there slots 0..A-1 hold the node's block and the collectives copy it into the
// replicas' slots (and gather the replicas' optimizer ranges into it) as their intra-node part.
//
// Scratch, for one operation: 2 * A_g * S_g fp32 for the ring reduce-scatter between nodes (the
// node's ranks are summed as the ring goes, never into an F * S buffer) and two chunks of the
// replicate all-reduce.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/daemon/comm.h"
#include "server/daemon/pool.h"
#include "server/daemon/transport.h"

namespace ragshard::daemon {

enum class HostShape { kNode, kDevice };

class HostTransport final : public Transport {
 public:
  // `nodes` is the communicator among the job's nodes (member i is node i), or nullptr for one
  // node; it and `pool` must outlive the transport.
  HostTransport(const NodeMesh& mesh, Pool* pool, Comm* nodes, HostShape shape);

  const char* name() const override {
    return shape_ == HostShape::kNode ? "host" : "device-shaped";
  }
  bool shares_unsharded() const override { return shape_ == HostShape::kNode; }
  bool node_blocks() const override { return true; }
  bool shares_replicas() const override { return shape_ == HostShape::kNode; }
  bool runs_sharding(const NodeMesh&) const override { return true; }
  absl::StatusOr<Lease> Allocate(int local, int64_t bytes) override;
  absl::Status Zero(int local, char* data, int64_t bytes) override;
  absl::Status Copy(int dst_local, char* dst, int src_local, const char* src, int64_t bytes,
                    absl::Time deadline) override;
  absl::Status Add(int local, float* dst, const float* src, int64_t elems,
                   absl::Time deadline) override;
  int view_fd() const override;
  const char* base(int local) const override { return pool_->base(); }
  // Device-shaped: the ranks' memory is reached through copies, as a GPU's is.
  const SegmentMemory* memory(int) const override {
    return shape_ == HostShape::kDevice ? &copied_ : nullptr;
  }
  void DescribeMemory(int, v1::AttachResponse*) const override {}  // the daemon sends the memfd
  int64_t staging_bytes() const override { return 0; }

  absl::Status AllGather(const std::vector<const char*>& shards, const std::vector<char*>& out,
                         int64_t shard_elems, v1::DType dtype, absl::Time deadline,
                         uint64_t tag) override;
  absl::Status ReduceScatter(const std::vector<const void*>& grads, v1::DType dtype,
                             int64_t shard_elems, const std::vector<float*>& out, ReduceOp op,
                             const ScratchFn& scratch, absl::Time deadline, uint64_t tag) override;
  absl::Status AllReduce(const std::vector<float*>& shards, int64_t shard_elems, ReduceOp op,
                         const ScratchFn& scratch, absl::Time deadline, uint64_t tag) override;
  absl::Status UpdateGather(const std::vector<char*>& shards, int64_t shard_elems, int64_t os_elems,
                            v1::DType dtype, absl::Time deadline, uint64_t tag) override;
  absl::Status MovePieces(const std::vector<PieceMove>& moves, absl::Time deadline,
                          uint64_t tag) override;

 private:
  // Device shape: slot t's `bytes` at `offset` copied into every replica slot l (l mod A = t,
  // l >= A) of factor f; `at(l)` is local rank l's slot. Nothing to do in the node shape.
  void CopyToReplicas(Factor f, const std::function<char*(int)>& at, size_t offset,
                      size_t bytes) const;
  // The reduced gradient shards (fp32, `shard_elems` each) into their replica slots of g.
  void CopyGradShardsToReplicas(const std::vector<float*>& shards, int64_t shard_elems) const;

  NodeMesh mesh_;
  Pool* pool_;
  HostShape shape_;
  CopiedHostMemory copied_;
  // Over the nodes of this node's group of each collective; nullptr where that is this node
  // alone. grad_replicas_: the nodes holding the same g positions; update_: the nodes of the os
  // group holding the same p positions; os_: the os group (matrix pieces).
  std::unique_ptr<Comm> p_comm_, g_comm_, grad_replicas_, update_, os_comm_;
  // Per member of g_comm_ (of update_): the g (os) positions of its node's slots, in slot order.
  std::vector<std::vector<int64_t>> g_positions_, update_positions_;
  std::vector<int> os_member_;  // os position -> the member of os_comm_ whose node holds it
};

}  // namespace ragshard::daemon

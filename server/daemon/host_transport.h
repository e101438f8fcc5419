// The host backend's transport (transport.h): the daemon's memfd pool, shared with the node's
// ranks, and the collectives of a node. The node's ranks share memory, so the node reduces their
// gradients in memory and only the node's sum crosses the network; across nodes it runs the
// ring collectives (collectives.h) over a Comm whose members are the job's nodes.
//
// Two shapes: kNode, one unsharded buffer per node shared by its ranks; kDevice, one private
// unsharded buffer per rank and nothing shared by a node's ranks, exactly the shape of a GPU, so
// that the GPU path's logic runs without one.
//
// Scratch, for one operation: 2 * k * S fp32 for the ring reduce-scatter between nodes (the
// node's ranks are summed as the ring goes, never into an F * S buffer) and two chunks of the
// replicate all-reduce.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/daemon/comm.h"
#include "server/daemon/pool.h"
#include "server/daemon/transport.h"

namespace ragshard::daemon {

enum class HostShape { kNode, kDevice };

class HostTransport final : public Transport {
 public:
  // `nodes` is the communicator among the job's nodes (member i holds ranks [i*k, (i+1)*k)), or
  // nullptr for one node; it and `pool` must outlive the transport.
  HostTransport(const NodeMesh& mesh, Pool* pool, Comm* nodes, HostShape shape);

  const char* name() const override {
    return shape_ == HostShape::kNode ? "host" : "device-shaped";
  }
  bool shares_unsharded() const override { return shape_ == HostShape::kNode; }
  bool node_blocks() const override { return true; }
  absl::StatusOr<Lease> Allocate(int local, int64_t bytes) override;
  absl::Status Zero(int local, char* data, int64_t bytes) override;
  absl::Status Copy(int dst_local, char* dst, int src_local, const char* src, int64_t bytes,
                    absl::Time deadline) override;
  int view_fd() const override;
  const char* base(int local) const override { return pool_->base(); }
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
  absl::Status MovePieces(const std::vector<PieceMove>& moves, absl::Time deadline,
                          uint64_t tag) override;

 private:
  NodeMesh mesh_;
  Pool* pool_;
  HostShape shape_;
  std::unique_ptr<Comm> shard_comm_, replicate_comm_;  // nullptr when of size 1
};

}  // namespace ragshard::daemon

#include "server/daemon/host_transport.h"

#include <algorithm>
#include <cstring>

#include "common/dtype.h"
#include "common/unsharded_view.h"
#include "server/daemon/stream_copy.h"

namespace ragshard::daemon {
HostTransport::HostTransport(const NodeMesh& mesh, Pool* pool, Comm* nodes, HostShape shape)
    : mesh_(mesh), pool_(pool), shape_(shape) {
  // Nodes per shard group; this node's replica and its position in the shard group.
  const int g = static_cast<int>(mesh.nodes_per_group());
  const int replica = mesh.node / g, position = mesh.node % g;
  if (g > 1) {
    std::vector<int> members;
    members.reserve(g);
    for (int j = 0; j < g; ++j) members.push_back(replica * g + j);
    shard_comm_ = std::make_unique<SubComm>(nodes, std::move(members));
  }
  if (mesh.replicas > 1) {
    std::vector<int> members;
    members.reserve(mesh.replicas);
    for (int j = 0; j < mesh.replicas; ++j) members.push_back(j * g + position);
    replicate_comm_ = std::make_unique<SubComm>(nodes, std::move(members));
  }
}

int HostTransport::view_fd() const {
  // Views need the pool's memfd and page-aligned leases.
  const bool can =
      shape_ == HostShape::kNode && pool_->has_arena() && pool_->alignment() % kViewPageBytes == 0;
  return can ? pool_->arena().fd() : -1;
}

absl::StatusOr<Lease> HostTransport::Allocate(int, int64_t bytes) {
  return pool_->Allocate(std::max<int64_t>(bytes, 1));
}

absl::Status HostTransport::Zero(int, char* data, int64_t bytes) {
  std::memset(data, 0, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status HostTransport::Copy(int, char* dst, int, const char* src, int64_t bytes, absl::Time) {
  std::memcpy(dst, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status HostTransport::AllGather(const std::vector<const char*>& shards,
                                      const std::vector<char*>& out, int64_t shard_elems,
                                      v1::DType dtype, absl::Time deadline, uint64_t tag) {
  const size_t shard_bytes = static_cast<size_t>(shard_elems * DTypeSize(dtype));
  const size_t node_bytes = shard_bytes * shards.size();
  char* full = out[0];
  if (shard_comm_ == nullptr) {
    // The node holds the whole shard group: the all-gather is the placement of its ranks'
    // shards (the send buffers) into the receive buffer.
    for (size_t i = 0; i < shards.size(); ++i) {
      char* slot = full + (static_cast<size_t>(mesh_.first_position) + i) * shard_bytes;
      if (slot != shards[i]) StreamCopy(slot, shards[i], shard_bytes);  // else a view's own part
    }
  } else {
    // The ring between the group's nodes, each sending its block from the persistent shards
    // (the node's shards are one block: node_blocks()) and placing it while it waits.
    absl::Status st = daemon::AllGather(*shard_comm_, shards[0], full, node_bytes, deadline, tag);
    if (!st.ok()) return st;
  }
  // Device shape: every rank's own copy, as the intra-node part of a device all-gather.
  for (size_t i = 1; i < out.size(); ++i) {
    StreamCopy(out[i], full, static_cast<size_t>(mesh_.shard) * shard_bytes);
  }
  return absl::OkStatus();
}

absl::Status HostTransport::ReduceScatter(const std::vector<const void*>& grads, v1::DType dtype,
                                          int64_t shard_elems, const std::vector<float*>& out,
                                          ReduceOp op, const ScratchFn& scratch,
                                          absl::Time deadline, uint64_t tag) {
  const int64_t n = mesh_.local * shard_elems;  // the node's block of gradient shards
  float* block = out[0];
  absl::Status st;
  if (shard_comm_ == nullptr) {
    // One node holds the whole shard group: each local rank's shard is the in-memory sum of the
    // local gradients' chunk, written straight into its gradient shard.
    std::fill(block, block + n, 0.0f);
    for (const void* in : grads) Accumulate(in, dtype, static_cast<size_t>(n), block);
  } else {
    // The ring between the group's nodes, one chunk per node (its ranks' k shards), adding the
    // node's ranks' gradients as it goes.
    auto s = scratch(0, "reduce-scatter scratch", 2 * n * 4);
    if (!s.ok()) return s.status();
    st = daemon::ReduceScatter(*shard_comm_, grads, dtype, static_cast<size_t>(n), block,
                               ReduceOp::kSum, reinterpret_cast<float*>(s->data()), deadline, tag);
  }
  if (st.ok() && op == ReduceOp::kAvg) {
    const float scale = 1.0f / static_cast<float>(mesh_.shard);
    for (int64_t e = 0; e < n; ++e) block[e] *= scale;
  }
  return st;
}

absl::Status HostTransport::AllReduce(const std::vector<float*>& shards, int64_t shard_elems,
                                      ReduceOp op, const ScratchFn& scratch, absl::Time deadline,
                                      uint64_t tag) {
  if (replicate_comm_ == nullptr) return absl::OkStatus();
  // The padded block (a multiple of R elements), not the lease, whose size the pool rounds up:
  // the scratch holds two chunks of exactly this block.
  const int64_t block = GradShardBlockElems(mesh_, shard_elems);
  auto s = scratch(0, "all-reduce scratch", 2 * block / mesh_.replicas * 4);
  if (!s.ok()) return s.status();
  return AllReduceInPlace(*replicate_comm_, shards[0], static_cast<size_t>(block), op,
                          reinterpret_cast<float*>(s->data()), deadline, tag);
}

absl::Status HostTransport::MovePieces(const std::vector<PieceMove>& moves, absl::Time deadline,
                                       uint64_t tag) {
  std::vector<uint64_t> requests;
  // Messages are numbered per peer: both ends walk the pieces in the same order.
  std::vector<uint64_t> messages_with(shard_comm_ ? shard_comm_->size() : 0, 0);
  for (const PieceMove& m : moves) {
    const size_t bytes = static_cast<size_t>(m.count) * sizeof(float);
    if (m.src_local >= 0 && m.dst_local >= 0) {
      // Both ranks share this node's memory: the transfer itself.
      std::memcpy(m.dst, m.src, bytes);
      continue;
    }
    const bool send = m.src_local >= 0;
    const int peer = mesh_.NodeOf(send ? m.dst_position : m.src_position);
    const uint64_t index = messages_with[peer]++;
    auto r = send ? shard_comm_->PostSend(peer, tag + index, m.src, bytes)
                  : shard_comm_->PostRecv(peer, tag + index, m.dst, bytes);
    if (!r.ok()) return r.status();
    requests.push_back(*r);
  }
  return requests.empty() ? absl::OkStatus() : shard_comm_->WaitAll(requests, deadline);
}

}  // namespace ragshard::daemon

#include "server/daemon/host_transport.h"

#include <algorithm>
#include <cstring>

#include "engine/dtype.h"
#include "protocol/unsharded_view.h"
#include "server/daemon/stream_copy.h"

namespace ragshard::daemon {
namespace {

// A communicator over `members` (node indices), or nullptr when that is this node alone.
std::unique_ptr<Comm> Over(Comm* nodes, std::vector<int> members) {
  if (members.size() <= 1 || nodes == nullptr) return nullptr;
  return std::make_unique<SubComm>(nodes, std::move(members));
}

}  // namespace

HostTransport::HostTransport(const NodeMesh& mesh, Pool* pool, Comm* nodes, HostShape shape)
    : mesh_(mesh), pool_(pool), shape_(shape) {
  const Sharding& s = mesh.sharding;
  const int n = mesh.node;
  p_comm_ = Over(nodes, s.GroupNodes(Factor::kP, n));
  const std::vector<int> g_nodes = s.GroupNodes(Factor::kG, n);
  g_comm_ = Over(nodes, g_nodes);
  for (int m : g_nodes) {
    std::vector<int64_t>& pos = g_positions_.emplace_back();
    for (int64_t t = 0; t < mesh.slots(Factor::kG); ++t) {
      pos.push_back(s.SlotPosition(Factor::kG, m, t));
    }
  }
  grad_replicas_ = Over(nodes, s.GradReplicaNodes(n));
  const std::vector<int> update_nodes = s.UpdateNodes(n);
  update_ = Over(nodes, update_nodes);
  for (int m : update_nodes) {
    std::vector<int64_t>& pos = update_positions_.emplace_back();
    for (int64_t t = 0; t < mesh.slots(Factor::kOs); ++t) {
      pos.push_back(s.SlotPosition(Factor::kOs, m, t));
    }
  }
  const std::vector<int> os_nodes = s.GroupNodes(Factor::kOs, n);
  os_comm_ = Over(nodes, os_nodes);
  os_member_.assign(static_cast<size_t>(s.os.size()), -1);
  for (size_t i = 0; i < os_nodes.size(); ++i) {
    for (int64_t t = 0; t < mesh.slots(Factor::kOs); ++t) {
      os_member_[s.SlotPosition(Factor::kOs, os_nodes[i], t)] = static_cast<int>(i);
    }
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

absl::Status HostTransport::Add(int, float* dst, const float* src, int64_t elems, absl::Time) {
  for (int64_t i = 0; i < elems; ++i) dst[i] += src[i];
  return absl::OkStatus();
}

void HostTransport::CopyToReplicas(Factor f, const std::function<char*(int)>& at, size_t offset,
                                   size_t bytes) const {
  if (shape_ == HostShape::kNode) return;
  const int a = static_cast<int>(mesh_.slots(f));
  for (int l = a; l < mesh_.local; ++l) StreamCopy(at(l) + offset, at(l % a) + offset, bytes);
}

void HostTransport::CopyGradShardsToReplicas(const std::vector<float*>& shards,
                                             int64_t shard_elems) const {
  CopyToReplicas(
      Factor::kG, [&](int l) { return reinterpret_cast<char*>(shards[l]); }, 0,
      static_cast<size_t>(shard_elems) * sizeof(float));
}

absl::Status HostTransport::AllGather(const std::vector<const char*>& shards,
                                      const std::vector<char*>& out, int64_t shard_elems,
                                      v1::DType dtype, absl::Time deadline, uint64_t tag) {
  const size_t shard_bytes = static_cast<size_t>(shard_elems * DTypeSize(dtype));
  const int64_t slots = mesh_.slots(Factor::kP);
  char* full = out[0];
  if (p_comm_ == nullptr) {
    // The node holds the whole p group: the all-gather is the placement of its slots' shards
    // (the send buffers) into the receive buffer.
    for (int64_t t = 0; t < slots; ++t) {
      char* slot = full + static_cast<size_t>(mesh_.Position(Factor::kP, t)) * shard_bytes;
      if (slot != shards[t]) StreamCopy(slot, shards[t], shard_bytes);  // else a view's own part
    }
  } else {
    // The ring between the group's nodes, each sending its block of slots from the persistent
    // shards (slots 0..A-1 are one block: node_blocks()) and placing it while it waits.
    absl::Status st = daemon::AllGather(*p_comm_, shards[0], full,
                                        shard_bytes * static_cast<size_t>(slots), deadline, tag);
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
  const int64_t slots = mesh_.slots(Factor::kG);
  const int64_t n = slots * shard_elems;  // the node's block of gradient shards
  float* block = out[0];
  // Every local rank's gradient is summed: the node's replicas of g too.
  ChunkRuns runs;
  runs.runs = static_cast<size_t>(slots);
  runs.run_elems = static_cast<size_t>(shard_elems);
  for (const std::vector<int64_t>& member : g_positions_) {
    for (int64_t pos : member) runs.offsets.push_back(static_cast<size_t>(pos * shard_elems));
  }
  absl::Status st;
  if (g_comm_ == nullptr) {
    // One node holds the whole g group: each slot's shard is the in-memory sum of the local
    // gradients' chunk at its position, written straight into the gradient shard.
    for (int64_t t = 0; t < slots; ++t) {
      float* shard = block + t * shard_elems;
      std::fill(shard, shard + shard_elems, 0.0f);
      const size_t at = runs.offsets[static_cast<size_t>(t)] * DTypeSize(dtype);
      for (const void* in : grads) {
        Accumulate(static_cast<const char*>(in) + at, dtype, static_cast<size_t>(shard_elems),
                   shard);
      }
    }
  } else {
    // The ring between the group's nodes, one chunk per node (its slots' shards), adding the
    // node's ranks' gradients as it goes.
    auto s = scratch(0, "reduce-scatter scratch", 2 * n * 4);
    if (!s.ok()) return s.status();
    // Adjacent positions (shard groups of whole nodes) are the plain layout of chunks.
    bool adjacent = true;
    for (size_t i = 0; i < runs.offsets.size(); ++i) {
      adjacent &= runs.offsets[i] == i * runs.run_elems;
    }
    st = daemon::ReduceScatter(*g_comm_, grads, dtype, static_cast<size_t>(n), block,
                               ReduceOp::kSum, reinterpret_cast<float*>(s->data()), deadline, tag,
                               adjacent ? nullptr : &runs);
  }
  if (st.ok() && op == ReduceOp::kAvg) {
    // The mean over the ranks summed: the node's k ranks on each of the group's nodes.
    const float scale = 1.0f / static_cast<float>(mesh_.local * mesh_.sharding.g.inter);
    for (int64_t e = 0; e < n; ++e) block[e] *= scale;
  }
  if (st.ok()) CopyGradShardsToReplicas(out, shard_elems);
  return st;
}

absl::Status HostTransport::AllReduce(const std::vector<float*>& shards, int64_t shard_elems,
                                      ReduceOp op, const ScratchFn& scratch, absl::Time deadline,
                                      uint64_t tag) {
  if (grad_replicas_ == nullptr) return absl::OkStatus();
  // The padded block of the node's g slots (a multiple of the replicas), not the lease, whose
  // size the pool rounds up: the scratch holds two chunks of exactly this block.
  const int64_t r = mesh_.node_replicas();
  const int64_t block = GradShardBlockElems(mesh_, mesh_.slots(Factor::kG), shard_elems);
  auto s = scratch(0, "all-reduce scratch", 2 * block / r * 4);
  if (!s.ok()) return s.status();
  absl::Status st = AllReduceInPlace(*grad_replicas_, shards[0], static_cast<size_t>(block), op,
                                     reinterpret_cast<float*>(s->data()), deadline, tag);
  if (st.ok()) CopyGradShardsToReplicas(shards, shard_elems);
  return st;
}

absl::Status HostTransport::UpdateGather(const std::vector<char*>& shards, int64_t shard_elems,
                                         int64_t os_elems, v1::DType dtype, absl::Time deadline,
                                         uint64_t tag) {
  const size_t item = DTypeSize(dtype);
  const size_t os_bytes = static_cast<size_t>(os_elems) * item;
  const int64_t first = mesh_.first_position();  // p position of the block's start
  // Byte offset, in the node's p block, of os position q's range.
  auto offset = [&](int64_t q) {
    return static_cast<size_t>(q * os_elems - first * shard_elems) * item;
  };
  const int a_p = static_cast<int>(mesh_.slots(Factor::kP));
  const int a_os = static_cast<int>(std::min<int64_t>(mesh_.slots(Factor::kOs), mesh_.local));
  if (shape_ == HostShape::kDevice) {
    // Each rank stepped its own copy: the ranges of the ranks beyond the block's slots go into
    // the block first (the intra-node part of the gather).
    for (int l = a_p; l < a_os; ++l) {
      // Its os range, from the start of its slot (of the same p position as slot l mod A_p).
      const size_t at = static_cast<size_t>(mesh_.Position(Factor::kOs, l) * os_elems -
                                            mesh_.Position(Factor::kP, l) * shard_elems) *
                        item;
      StreamCopy(shards[l % a_p] + at, shards[l] + at, os_bytes);
    }
  }
  if (update_ != nullptr) {
    std::vector<ByteRuns> runs;
    for (const std::vector<int64_t>& member : update_positions_) {
      ByteRuns& r = runs.emplace_back();
      for (int64_t q : member) r.emplace_back(offset(q), os_bytes);
    }
    absl::Status st = AllGatherRuns(*update_, shards[0], runs, deadline, tag);
    if (!st.ok()) return st;
  }
  CopyToReplicas(
      Factor::kP, [&](int l) { return shards[l]; }, 0, static_cast<size_t>(shard_elems) * item);
  return absl::OkStatus();
}

absl::Status HostTransport::MovePieces(const std::vector<PieceMove>& moves, absl::Time deadline,
                                       uint64_t tag) {
  std::vector<uint64_t> requests;
  // Messages are numbered per peer: both ends walk the pieces in the same order.
  std::vector<uint64_t> messages_with(os_comm_ ? os_comm_->size() : 0, 0);
  for (const PieceMove& m : moves) {
    const size_t bytes = static_cast<size_t>(m.count) * sizeof(float);
    if (m.src_local >= 0 && m.dst_local >= 0) {
      // Both ranks share this node's memory: the transfer itself.
      std::memcpy(m.dst, m.src, bytes);
      continue;
    }
    const bool send = m.src_local >= 0;
    const int peer = os_member_[send ? m.dst_position : m.src_position];
    const uint64_t index = messages_with[peer]++;
    auto r = send ? os_comm_->PostSend(peer, tag + index, m.src, bytes)
                  : os_comm_->PostRecv(peer, tag + index, m.dst, bytes);
    if (!r.ok()) return r.status();
    requests.push_back(*r);
  }
  return requests.empty() ? absl::OkStatus() : os_comm_->WaitAll(requests, deadline);
}

}  // namespace ragshard::daemon

#include "server/daemon/job_data_plane.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace ragshard::daemon {
namespace {

constexpr uint64_t kPiecesPerOp = uint64_t{1} << 20;  // tags of one operation

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

absl::StatusOr<std::unique_ptr<JobDataPlane>> JobDataPlane::Create(const v1::Plan& plan,
                                                                   std::vector<int64_t> local_ranks,
                                                                   Pool* pool, Comm* nodes,
                                                                   int64_t replicas) {
  const int64_t f = plan.world_size();
  const int64_t k = static_cast<int64_t>(local_ranks.size());
  const int n = nodes ? nodes->size() : 1;
  const int me = nodes ? nodes->rank() : 0;
  if (k == 0) return absl::InvalidArgumentError("no local ranks");
  if (replicas < 1) return absl::InvalidArgumentError("replicas must be at least 1");
  if (k * n != f * replicas) {
    return absl::UnimplementedError(absl::StrCat("every node must hold the same number of ranks (",
                                                 k, " here, ", n, " nodes, world ", f * replicas,
                                                 ")"));
  }
  for (int64_t i = 0; i < k; ++i) {
    if (local_ranks[i] != me * k + i) {
      return absl::UnimplementedError(absl::StrCat("node ", me, " must hold ranks [", me * k, ", ",
                                                   (me + 1) * k, "); got rank ", local_ranks[i]));
    }
  }
  if (f % k != 0) {
    return absl::UnimplementedError(
        absl::StrCat("a shard group (", f, " ranks) must be made of whole nodes of ", k, " ranks"));
  }
  std::unique_ptr<JobDataPlane> dp(new JobDataPlane());
  dp->local_ranks_ = std::move(local_ranks);
  dp->shard_ = f;
  dp->replicas_ = replicas;
  dp->first_position_ = (me * k) % f;
  // Nodes per shard group; the node's replica and its position in the shard group.
  const int g = static_cast<int>(f / k);
  const int replica = me / g, position = me % g;
  if (g > 1) {
    std::vector<int> members;
    for (int j = 0; j < g; ++j) members.push_back(replica * g + j);
    dp->shard_comm_ = std::make_unique<SubComm>(nodes, std::move(members));
  }
  if (replicas > 1) {
    std::vector<int> members;
    for (int j = 0; j < replicas; ++j) members.push_back(j * g + position);
    dp->replicate_comm_ = std::make_unique<SubComm>(nodes, std::move(members));
  }
  for (const v1::UnitPlan& up : plan.units()) {
    Unit u;
    u.dtype = up.dtype();
    u.shard_elems = up.shard_elems();
    u.item = DTypeSize(up.dtype());
    const int64_t s = u.shard_elems;
    const int64_t shard_bytes = s * u.item;
    // Zero-filled at allocation (not on the hot path).
    auto alloc = [&](int64_t bytes) -> absl::StatusOr<Lease> {
      auto l = pool->Allocate(std::max<int64_t>(bytes, 1));
      if (!l.ok()) {
        return absl::Status(l.status().code(),
                            absl::StrCat("unit '", up.unit(), "': ", l.status().message()));
      }
      std::memset(l->data(), 0, static_cast<size_t>(l->size()));
      return std::move(*l);
    };
    auto pieces = MatrixPieces(up, f);
    if (!pieces.ok()) return pieces.status();
    u.pieces = std::move(*pieces);
    if (u.pieces.size() >= kPiecesPerOp) {
      return absl::UnimplementedError(absl::StrCat("unit '", up.unit(), "' has ", u.pieces.size(),
                                                   " matrix pieces; at most ", kPiecesPerOp - 1));
    }
    for (int64_t i = 0; i < k; ++i) {
      auto gr = alloc(f * shard_bytes);
      if (!gr.ok()) return gr.status();
      u.grad.push_back(std::move(*gr));
      const int64_t pos = dp->first_position_ + i;
      const bool owns = std::any_of(u.pieces.begin(), u.pieces.end(),
                                    [&](const Piece& p) { return p.owner == pos; });
      Lease owner;
      if (owns) {
        auto o = alloc(f * s * 4);
        if (!o.ok()) return o.status();
        owner = std::move(*o);
      }
      u.owner.push_back(std::move(owner));
    }
    auto un = alloc(f * shard_bytes);
    if (!un.ok()) return un.status();
    u.unsharded = std::move(*un);
    // Padded so that the replicate all-reduce splits it into equal chunks in place.
    const int64_t gs_elems = RoundUp(std::max<int64_t>(k * s, 1), replicas);
    auto gs = alloc(gs_elems * 4);
    if (!gs.ok()) return gs.status();
    u.grad_shards = std::move(*gs);
    u.grad_shard_elems = gs_elems;
    // Node sum of the gradients (F * S fp32), the ring's scratch (two node chunks) and the
    // replicate all-reduce's scratch (two of its chunks).
    const int64_t scratch =
        f * s + (g > 1 ? 2 * k * s : 0) + (replicas > 1 ? 2 * gs_elems / replicas : 0);
    auto sc = alloc(scratch * 4);
    if (!sc.ok()) return sc.status();
    u.scratch = std::move(*sc);
    dp->units_.push_back(std::move(u));
  }
  return dp;
}

char* JobDataPlane::param_shard(int unit, int local) const {
  const Unit& u = units_[unit];
  return u.unsharded.data() + (first_position_ + local) * u.shard_elems * u.item;
}
char* JobDataPlane::unsharded(int unit) const { return units_[unit].unsharded.data(); }
char* JobDataPlane::grad(int unit, int local) const { return units_[unit].grad[local].data(); }
float* JobDataPlane::grad_shard(int unit, int local) const {
  return reinterpret_cast<float*>(units_[unit].grad_shards.data()) +
         local * units_[unit].shard_elems;
}
float* JobDataPlane::owner_buffer(int unit, int local) const {
  const Lease& l = units_[unit].owner[local];
  return l.size() > 0 ? reinterpret_cast<float*>(l.data()) : nullptr;
}

JobDataPlane::Offsets JobDataPlane::offsets(int unit, int local) const {
  const Unit& u = units_[unit];
  const char* base = u.unsharded.data() - u.unsharded.offset();
  return {param_shard(unit, local) - base, u.unsharded.offset(), u.grad[local].offset(),
          reinterpret_cast<const char*>(grad_shard(unit, local)) - base,
          u.owner[local].size() > 0 ? u.owner[local].offset() : -1};
}

void JobDataPlane::Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const {
  resp->set_replicas(replicas_);
  resp->set_backend(name());
  for (int u = 0; u < units(); ++u) {
    v1::UnitBuffers* b = resp->add_units();
    b->set_unit(plan.units(u).unit());
    b->set_dtype(dtype(u));
    b->set_shard_elems(shard_elems(u));
    const Offsets off = offsets(u, local);
    b->set_param_shard_offset(off.param_shard);
    b->set_unsharded_offset(off.unsharded);
    b->set_grad_offset(off.grad);
    b->set_grad_shard_offset(off.grad_shard);
    b->set_owner_offset(off.owner);
  }
}

absl::Status JobDataPlane::CheckUnit(int unit) const {
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit index ", unit, " out of range [0, ", units(), ")"));
  }
  return absl::OkStatus();
}

absl::Status JobDataPlane::Unshard(int unit, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = (++op_seq_) << 20;
  Unit& u = units_[unit];
  // The local ranks' shards are already in place: they are slices of the unsharded buffer.
  if (shard_comm_ == nullptr) return absl::OkStatus();
  const size_t node_bytes =
      static_cast<size_t>(u.shard_elems * u.item) * static_cast<size_t>(local_ranks());
  return AllGather(*shard_comm_, u.unsharded.data(), node_bytes, deadline, tag);
}

absl::Status JobDataPlane::ReduceScatter(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = (++op_seq_) << 20;
  Unit& u = units_[unit];
  if (u.dtype != v1::DTYPE_FP32 && u.dtype != v1::DTYPE_BF16 && u.dtype != v1::DTYPE_FP16) {
    return absl::InvalidArgumentError("reduce_scatter: gradients must be fp32, bf16 or fp16");
  }
  const int64_t k = local_ranks(), s = u.shard_elems;
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(shard_) : 1.0f;
  float* out = grad_shard(unit, 0);  // k * S
  if (shard_comm_ == nullptr) {
    // One node holds the whole shard group: each local rank's shard is the in-memory sum of the
    // local gradients' chunk, written straight into its gradient shard.
    std::fill(out, out + k * s, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      Accumulate(u.grad[j].data() + first_position_ * s * u.item, u.dtype,
                 static_cast<size_t>(k * s), out);
    }
    if (scale != 1.0f) {
      for (int64_t e = 0; e < k * s; ++e) out[e] *= scale;
    }
    return absl::OkStatus();
  }
  float* sum = reinterpret_cast<float*>(u.scratch.data());  // F * S
  float* ring = sum + shard_ * s;                           // 2 * k * S
  // In-memory reduction of the node's ranks, in fp32; then across the group's nodes, whose ring
  // writes the node's chunk (its ranks' k shards) into the gradient shards.
  std::fill(sum, sum + shard_ * s, 0.0f);
  for (int64_t j = 0; j < k; ++j)
    Accumulate(u.grad[j].data(), u.dtype, static_cast<size_t>(shard_ * s), sum);
  absl::Status st =
      daemon::ReduceScatter(*shard_comm_, sum, v1::DTYPE_FP32, static_cast<size_t>(k * s), out,
                            ReduceOp::kSum, ring, deadline, tag);
  if (!st.ok()) return st;
  if (scale != 1.0f) {
    for (int64_t e = 0; e < k * s; ++e) out[e] *= scale;
  }
  return absl::OkStatus();
}

absl::Status JobDataPlane::AllReduce(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = (++op_seq_) << 20;
  if (replicate_comm_ == nullptr) return absl::OkStatus();
  Unit& u = units_[unit];
  // The padded block (a multiple of R elements), not the lease, whose size the pool rounds up:
  // the scratch holds two chunks of exactly this block.
  float* scratch = reinterpret_cast<float*>(u.scratch.data()) + shard_ * u.shard_elems +
                   (shard_comm_ ? 2 * local_ranks() * u.shard_elems : 0);
  return AllReduceInPlace(*replicate_comm_, grad_shard(unit, 0),
                          static_cast<size_t>(u.grad_shard_elems), op, scratch, deadline, tag);
}

absl::Status JobDataPlane::GatherToOwner(int unit, absl::Time deadline) {
  return MovePieces(unit, /*to_owner=*/true, deadline);
}
absl::Status JobDataPlane::ScatterFromOwner(int unit, absl::Time deadline) {
  return MovePieces(unit, /*to_owner=*/false, deadline);
}

absl::Status JobDataPlane::MovePieces(int unit, bool to_owner, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = (++op_seq_) << 20;
  const Unit& u = units_[unit];
  const int64_t s = u.shard_elems, k = local_ranks();
  const int me = NodeOf(first_position_);
  std::vector<uint64_t> requests;
  for (size_t i = 0; i < u.pieces.size(); ++i) {
    const Piece& p = u.pieces[i];
    const int owner_node = NodeOf(p.owner), holder_node = NodeOf(p.holder);
    if (owner_node != me && holder_node != me) continue;
    float* shard = holder_node == me ? grad_shard(unit, static_cast<int>(p.holder - me * k)) +
                                           (p.elem - p.holder * s)
                                     : nullptr;
    float* whole = owner_node == me
                       ? owner_buffer(unit, static_cast<int>(p.owner - me * k)) + p.elem
                       : nullptr;
    const size_t bytes = static_cast<size_t>(p.count) * sizeof(float);
    if (owner_node == me && holder_node == me) {
      // Both ranks share this node's memory: the transfer itself.
      if (to_owner) {
        std::memcpy(whole, shard, bytes);
      } else {
        std::memcpy(shard, whole, bytes);
      }
      continue;
    }
    absl::StatusOr<uint64_t> r;
    const int peer = owner_node == me ? holder_node : owner_node;
    float* local = owner_node == me ? whole : shard;
    const bool send = (owner_node == me) != to_owner;
    r = send ? shard_comm_->PostSend(peer, tag + i, local, bytes)
             : shard_comm_->PostRecv(peer, tag + i, local, bytes);
    if (!r.ok()) return r.status();
    requests.push_back(*r);
  }
  if (requests.empty()) return absl::OkStatus();
  return shard_comm_->WaitAll(requests, deadline);
}

}  // namespace ragshard::daemon

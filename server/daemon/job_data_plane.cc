#include "server/daemon/job_data_plane.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace ragshard::daemon {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

absl::StatusOr<std::unique_ptr<JobDataPlane>> JobDataPlane::Create(const v1::Plan& plan,
                                                                   std::vector<int64_t> local_ranks,
                                                                   Pool* pool, Comm* nodes,
                                                                   int64_t replicas, Shape shape) {
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
  dp->pool_ = pool;
  dp->shape_ = shape;
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
    u.name = up.unit();
    u.dtype = up.dtype();
    u.shard_elems = up.shard_elems();
    u.item = DTypeSize(up.dtype());
    const int64_t s = u.shard_elems;
    std::vector<int64_t> packed;
    auto pieces = MatrixPieces(up, f, &packed);
    if (!pieces.ok()) return pieces.status();
    u.pieces = std::move(*pieces);
    if (u.pieces.size() > MessageStamp::kMaxDataIndex) {
      // Each piece between two nodes is one message of the operation, numbered in 16 bits.
      return absl::UnimplementedError(absl::StrCat("unit '", up.unit(), "' has ", u.pieces.size(),
                                                   " matrix pieces; at most ",
                                                   MessageStamp::kMaxDataIndex));
    }
    for (int64_t i = 0; i < k; ++i) u.owner_elems.push_back(packed[dp->first_position_ + i]);
    // The persistent shards, zero-filled at allocation (not on the hot path).
    auto shards = dp->AllocateFor(u, "parameter shards", 1, k * s * u.item, /*zero=*/true);
    if (!shards.ok()) return shards.status();
    u.shards = std::move(shards->front());
    // Padded so that the replicate all-reduce splits it into equal chunks in place.
    const int64_t gs_elems = RoundUp(std::max<int64_t>(k * s, 1), replicas);
    auto gs = dp->AllocateFor(u, "gradient shards", 1, gs_elems * 4, /*zero=*/true);
    if (!gs.ok()) return gs.status();
    u.grad_shards = std::move(gs->front());
    u.grad_shard_elems = gs_elems;
    dp->units_.push_back(std::move(u));
  }
  if (nodes != nullptr) {
    dp->nodes_ = nodes;
    nodes->SetDescriber([self = dp.get()](uint64_t tag) { return self->DescribeTag(tag); });
  }
  return dp;
}

JobDataPlane::~JobDataPlane() {
  if (nodes_ != nullptr) nodes_->SetDescriber(nullptr);
}

uint64_t JobDataPlane::NextTag(int unit, uint32_t kind) {
  return MessageStamp{++op_seq_, static_cast<uint64_t>(unit), kind, 0}.Tag();
}

std::string JobDataPlane::DescribeTag(uint64_t tag) const {
  const MessageStamp s = MessageStamp::FromTag(tag);
  // The daemon's names for the operations, by MessageStamp::Kind.
  static const v1::OpKind kOps[] = {v1::OP_KIND_UNSPECIFIED, v1::OP_UNSHARD,
                                    v1::OP_REDUCE_SCATTER,   v1::OP_ALL_REDUCE,
                                    v1::OP_GATHER_TO_OWNER,  v1::OP_SCATTER_FROM_OWNER};
  if (s.kind == MessageStamp::kNone || s.kind >= std::size(kOps)) return daemon::DescribeTag(tag);
  const std::string kind = v1::OpKind_Name(kOps[s.kind]);
  // The stamp keeps the unit modulo 2^16: name it when that is unambiguous.
  std::string unit = absl::StrCat("unit ", s.unit);
  if (units_.size() <= (size_t{1} << MessageStamp::kUnitBits) && s.unit < units_.size()) {
    absl::StrAppend(&unit, " '", units_[s.unit].name, "'");
  }
  return absl::StrCat(kind, " of ", unit, " (operation ", s.seq, " modulo ",
                      uint64_t{1} << MessageStamp::kSeqBits, ")");
}

absl::StatusOr<std::vector<Lease>> JobDataPlane::AllocateFor(const Unit& u, const char* what,
                                                             int count, int64_t bytes, bool zero) {
  std::vector<Lease> out;
  for (int i = 0; i < count; ++i) {
    auto l = pool_->Allocate(std::max<int64_t>(bytes, 1));
    if (!l.ok()) {
      // The leases taken so far go back with `out`.
      return absl::Status(
          l.status().code(),
          absl::StrCat("unit '", u.name, "': ", what, " need ", count, " x ", bytes, " bytes (",
                       count * bytes, " in all): ", l.status().message()));
    }
    if (zero) std::memset(l->data(), 0, static_cast<size_t>(l->size()));
    out.push_back(std::move(*l));
  }
  return out;
}

char* JobDataPlane::param_shard(int unit, int local) const {
  const Unit& u = units_[unit];
  return u.shards.data() + local * u.shard_elems * u.item;
}
char* JobDataPlane::unsharded(int unit, int local) const {
  const Unit& u = units_[unit];
  if (u.unsharded.empty()) return nullptr;
  return u.unsharded[shape_ == Shape::kNode ? 0 : local].data();
}
char* JobDataPlane::grad(int unit, int local) const {
  const Unit& u = units_[unit];
  return u.grad.empty() ? nullptr : u.grad[local].data();
}
float* JobDataPlane::grad_shard(int unit, int local) const {
  return reinterpret_cast<float*>(units_[unit].grad_shards.data()) +
         local * units_[unit].shard_elems;
}
float* JobDataPlane::owner_buffer(int unit, int local) const {
  const Unit& u = units_[unit];
  if (u.owner.empty() || u.owner[local].size() == 0) return nullptr;
  return reinterpret_cast<float*>(u.owner[local].data());
}
int64_t JobDataPlane::owner_elems(int unit, int local) const {
  return units_[unit].owner_elems[local];
}

void JobDataPlane::Placement(int unit, int local, v1::UnitBuffers* out) const {
  const Unit& u = units_[unit];
  const char* base = u.shards.data() - u.shards.offset();  // arena offset 0
  auto offset = [&](const char* p) -> int64_t { return p == nullptr ? -1 : p - base; };
  out->set_dtype(u.dtype);
  out->set_shard_elems(u.shard_elems);
  out->set_param_shard_offset(offset(param_shard(unit, local)));
  out->set_unsharded_offset(offset(unsharded(unit, local)));
  out->set_grad_offset(offset(grad(unit, local)));
  out->set_grad_shard_offset(offset(reinterpret_cast<const char*>(grad_shard(unit, local))));
  out->set_owner_offset(offset(reinterpret_cast<const char*>(owner_buffer(unit, local))));
  out->set_owner_elems(u.owner_elems[local]);
}

void JobDataPlane::Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const {
  resp->set_replicas(replicas_);
  resp->set_backend(name());
  for (int u = 0; u < units(); ++u) {
    v1::UnitBuffers* b = resp->add_units();
    b->set_unit(plan.units(u).unit());
    Placement(u, local, b);
  }
}

absl::Status JobDataPlane::CheckUnit(int unit) const {
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit index ", unit, " out of range [0, ", units(), ")"));
  }
  return absl::OkStatus();
}

absl::Status JobDataPlane::AllocateUnsharded(int unit) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  Unit& u = units_[unit];
  if (!u.unsharded.empty()) return absl::OkStatus();
  auto leases = AllocateFor(u, "unsharded parameters", shape_ == Shape::kNode ? 1 : local_ranks(),
                            shard_ * u.shard_elems * u.item, /*zero=*/false);
  if (!leases.ok()) return leases.status();
  u.unsharded = std::move(*leases);
  return absl::OkStatus();
}

absl::Status JobDataPlane::Unshard(int unit, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  if (units_[unit].kept > 1) return Rebuild(unit);
  if (auto s = AllocateUnsharded(unit); !s.ok()) return s;
  const uint64_t tag = NextTag(unit, MessageStamp::kAllGather);
  Unit& u = units_[unit];
  const size_t shard_bytes = static_cast<size_t>(u.shard_elems * u.item);
  // The all-gather's own placement of the local shards (the send buffers) into the receive
  // buffer, then the other nodes' shards over the ring.
  char* full = u.unsharded[0].data();
  for (int i = 0; i < local_ranks(); ++i) {
    std::memcpy(full + static_cast<size_t>(first_position_ + i) * shard_bytes, param_shard(unit, i),
                shard_bytes);
  }
  if (shard_comm_ != nullptr) {
    absl::Status st = AllGather(*shard_comm_, full,
                                shard_bytes * static_cast<size_t>(local_ranks()), deadline, tag);
    if (!st.ok()) {
      u.unsharded.clear();
      return st;
    }
  }
  // Device shape: every rank's own copy, as the intra-node part of a device all-gather.
  for (size_t i = 1; i < u.unsharded.size(); ++i) {
    std::memcpy(u.unsharded[i].data(), full, static_cast<size_t>(shard_) * shard_bytes);
  }
  return absl::OkStatus();
}

absl::Status JobDataPlane::Reshard(int unit, int64_t keep) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  Unit& u = units_[unit];
  if (keep <= 1 || u.unsharded.empty()) {
    u.unsharded.clear();
    u.parts.clear();
    u.kept = 0;
    return absl::OkStatus();
  }
  if (local_ranks() % keep != 0) {
    return absl::UnimplementedError(absl::StrCat("reshard of unit '", u.name, "' to groups of ",
                                                 keep, " ranks: it must divide the ", local_ranks(),
                                                 " ranks of a node"));
  }
  u.kept = keep;
  if (shape_ == Shape::kNode) return absl::OkStatus();  // the node's buffer serves its groups
  // Each rank keeps its 1/keep of the unit; the full copies go back to the pool.
  const int64_t part = shard_ * u.shard_elems * u.item / keep;
  auto parts = AllocateFor(u, "kept parameters", local_ranks(), part, /*zero=*/false);
  if (!parts.ok()) {
    u.kept = 0;
    return parts.status();
  }
  for (int i = 0; i < local_ranks(); ++i) {
    std::memcpy((*parts)[i].data(), u.unsharded[i].data() + (i % keep) * part,
                static_cast<size_t>(part));
  }
  u.parts = std::move(*parts);
  u.unsharded.clear();
  return absl::OkStatus();
}

absl::Status JobDataPlane::Rebuild(int unit) {
  Unit& u = units_[unit];
  const int64_t keep = std::exchange(u.kept, 0);
  if (shape_ == Shape::kNode) return absl::OkStatus();  // the node's buffer stayed
  // The all-gather within each group of `keep` ranks, from their parts.
  const int64_t part = shard_ * u.shard_elems * u.item / keep;
  auto full = AllocateFor(u, "unsharded parameters", local_ranks(), keep * part, false);
  if (!full.ok()) {
    u.kept = keep;
    return full.status();
  }
  for (int i = 0; i < local_ranks(); ++i) {
    const int first = i - static_cast<int>(i % keep);
    for (int64_t j = 0; j < keep; ++j) {
      std::memcpy((*full)[i].data() + j * part, u.parts[first + j].data(),
                  static_cast<size_t>(part));
    }
  }
  u.unsharded = std::move(*full);
  u.parts.clear();
  return absl::OkStatus();
}

absl::Status JobDataPlane::AllocateGrad(int unit) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  Unit& u = units_[unit];
  if (!u.grad.empty()) return absl::OkStatus();  // accumulating without reduction
  auto leases = AllocateFor(u, "unsharded gradients", local_ranks(),
                            shard_ * u.shard_elems * u.item, /*zero=*/true);
  if (!leases.ok()) return leases.status();
  u.grad = std::move(*leases);
  return absl::OkStatus();
}

absl::Status JobDataPlane::ReduceScatter(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = NextTag(unit, MessageStamp::kReduceScatter);
  Unit& u = units_[unit];
  if (u.dtype != v1::DTYPE_FP32 && u.dtype != v1::DTYPE_BF16 && u.dtype != v1::DTYPE_FP16) {
    return absl::InvalidArgumentError("reduce_scatter: gradients must be fp32, bf16 or fp16");
  }
  if (u.grad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("reduce_scatter of unit '", u.name,
                     "': its gradients are not allocated (allocate_grad starts a backward)"));
  }
  const int64_t k = local_ranks(), s = u.shard_elems;
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(shard_) : 1.0f;
  float* out = grad_shard(unit, 0);  // k * S
  std::vector<const void*> inputs;
  for (const Lease& g : u.grad) inputs.push_back(g.data());
  absl::Status st;
  if (shard_comm_ == nullptr) {
    // One node holds the whole shard group (first_position_ is 0): each local rank's shard is
    // the in-memory sum of the local gradients' chunk, written straight into its gradient shard.
    std::fill(out, out + k * s, 0.0f);
    for (const void* in : inputs) Accumulate(in, u.dtype, static_cast<size_t>(k * s), out);
  } else {
    // The ring between the group's nodes, one chunk per node (its ranks' k shards), adding the
    // node's ranks' gradients as it goes.
    auto scratch = AllocateFor(u, "reduce-scatter scratch", 1, 2 * k * s * 4, /*zero=*/false);
    if (!scratch.ok()) return scratch.status();
    st = daemon::ReduceScatter(*shard_comm_, inputs, u.dtype, static_cast<size_t>(k * s), out,
                               ReduceOp::kSum, reinterpret_cast<float*>(scratch->front().data()),
                               deadline, tag);
  }
  if (st.ok() && scale != 1.0f) {
    for (int64_t e = 0; e < k * s; ++e) out[e] *= scale;
  }
  u.grad.clear();
  return st;
}

absl::Status JobDataPlane::AllReduce(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = NextTag(unit, MessageStamp::kAllReduce);
  if (replicate_comm_ == nullptr) return absl::OkStatus();
  Unit& u = units_[unit];
  // The padded block (a multiple of R elements), not the lease, whose size the pool rounds up:
  // the scratch holds two chunks of exactly this block.
  auto scratch =
      AllocateFor(u, "all-reduce scratch", 1, 2 * u.grad_shard_elems / replicas_ * 4, false);
  if (!scratch.ok()) return scratch.status();
  return AllReduceInPlace(*replicate_comm_, grad_shard(unit, 0),
                          static_cast<size_t>(u.grad_shard_elems), op,
                          reinterpret_cast<float*>(scratch->front().data()), deadline, tag);
}

absl::Status JobDataPlane::GatherToOwner(int unit, absl::Time deadline) {
  return MovePieces(unit, /*to_owner=*/true, deadline);
}
absl::Status JobDataPlane::ScatterFromOwner(int unit, absl::Time deadline) {
  return MovePieces(unit, /*to_owner=*/false, deadline);
}

absl::Status JobDataPlane::MovePieces(int unit, bool to_owner, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag =
      NextTag(unit, to_owner ? MessageStamp::kGatherToOwner : MessageStamp::kScatterFromOwner);
  Unit& u = units_[unit];
  const int64_t s = u.shard_elems, k = local_ranks();
  const int me = NodeOf(first_position_);
  if (to_owner && u.owner.empty()) {
    // Every element of an owner buffer is a piece of an owned matrix: no zero-fill needed.
    for (int64_t i = 0; i < k; ++i) {
      if (u.owner_elems[i] == 0) {
        u.owner.emplace_back();
        continue;
      }
      auto l = AllocateFor(u, "owner buffer", 1, u.owner_elems[i] * 4, /*zero=*/false);
      if (!l.ok()) {
        u.owner.clear();
        return l.status();
      }
      u.owner.push_back(std::move(l->front()));
    }
  } else if (!to_owner && u.owner.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "scatter_from_owner of unit '", u.name, "': gather_to_owner has not run since the last"));
  }
  std::vector<uint64_t> requests;
  // Messages are numbered per peer: both ends walk the pieces in the same order.
  std::vector<uint64_t> messages_with(shard_comm_ ? shard_comm_->size() : 0, 0);
  for (size_t i = 0; i < u.pieces.size(); ++i) {
    const Piece& p = u.pieces[i];
    const int owner_node = NodeOf(p.owner), holder_node = NodeOf(p.holder);
    if (owner_node != me && holder_node != me) continue;
    float* shard = holder_node == me ? grad_shard(unit, static_cast<int>(p.holder - me * k)) +
                                           (p.elem - p.holder * s)
                                     : nullptr;
    float* whole = owner_node == me
                       ? owner_buffer(unit, static_cast<int>(p.owner - me * k)) + p.packed
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
    const uint64_t index = messages_with[peer]++;
    r = send ? shard_comm_->PostSend(peer, tag + index, local, bytes)
             : shard_comm_->PostRecv(peer, tag + index, local, bytes);
    if (!r.ok()) return r.status();
    requests.push_back(*r);
  }
  absl::Status st = requests.empty() ? absl::OkStatus() : shard_comm_->WaitAll(requests, deadline);
  if (!to_owner || !st.ok()) u.owner.clear();
  return st;
}

}  // namespace ragshard::daemon

#include "server/daemon/job_data_plane.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace ragshard::daemon {

absl::StatusOr<std::unique_ptr<JobDataPlane>> JobDataPlane::Create(const v1::Plan& plan,
                                                                   std::vector<int64_t> local_ranks,
                                                                   Pool* pool, Comm* nodes) {
  const int64_t w = plan.world_size();
  const int64_t k = static_cast<int64_t>(local_ranks.size());
  const int n = nodes ? nodes->size() : 1;
  const int me = nodes ? nodes->rank() : 0;
  if (k == 0) return absl::InvalidArgumentError("no local ranks");
  if (k * n != w) {
    return absl::UnimplementedError(absl::StrCat("every node must hold the same number of ranks (",
                                                 k, " here, ", n, " nodes, world ", w, ")"));
  }
  for (int64_t i = 0; i < k; ++i) {
    if (local_ranks[i] != me * k + i) {
      return absl::UnimplementedError(absl::StrCat("node ", me, " must hold ranks [", me * k, ", ",
                                                   (me + 1) * k, "); got rank ", local_ranks[i]));
    }
  }
  std::unique_ptr<JobDataPlane> dp(new JobDataPlane());
  dp->local_ranks_ = std::move(local_ranks);
  dp->world_ = w;
  dp->nodes_ = nodes;
  for (const v1::UnitPlan& up : plan.units()) {
    Unit u;
    u.dtype = up.dtype();
    u.shard_elems = up.shard_elems();
    u.item = DTypeSize(up.dtype());
    const int64_t shard_bytes = u.shard_elems * u.item;
    auto alloc = [&](int64_t bytes) -> absl::StatusOr<Lease> {
      auto l = pool->Allocate(std::max<int64_t>(bytes, 1));
      if (!l.ok()) {
        return absl::Status(l.status().code(),
                            absl::StrCat("unit '", up.unit(), "': ", l.status().message()));
      }
      std::memset(l->data(), 0, static_cast<size_t>(l->size()));
      return std::move(*l);
    };
    for (int64_t i = 0; i < k; ++i) {
      auto p = alloc(shard_bytes);
      if (!p.ok()) return p.status();
      u.param_shard.push_back(std::move(*p));
      auto g = alloc(w * shard_bytes);
      if (!g.ok()) return g.status();
      u.grad.push_back(std::move(*g));
      auto gs = alloc(u.shard_elems * 4);
      if (!gs.ok()) return gs.status();
      u.grad_shard.push_back(std::move(*gs));
    }
    auto un = alloc(w * shard_bytes);
    if (!un.ok()) return un.status();
    u.unsharded = std::move(*un);
    // Node sum of the gradients in fp32, then the ring output (one node chunk) and its scratch
    // (two node chunks).
    auto sc = alloc((w + (n > 1 ? 3 * k : 0)) * u.shard_elems * 4);
    if (!sc.ok()) return sc.status();
    u.scratch = std::move(*sc);
    dp->units_.push_back(std::move(u));
  }
  return dp;
}

char* JobDataPlane::param_shard(int unit, int local) const {
  return units_[unit].param_shard[local].data();
}
JobDataPlane::Offsets JobDataPlane::offsets(int unit, int local) const {
  const Unit& u = units_[unit];
  return {u.param_shard[local].offset(), u.unsharded.offset(), u.grad[local].offset(),
          u.grad_shard[local].offset()};
}

char* JobDataPlane::unsharded(int unit) const { return units_[unit].unsharded.data(); }
char* JobDataPlane::grad(int unit, int local) const { return units_[unit].grad[local].data(); }
float* JobDataPlane::grad_shard(int unit, int local) const {
  return reinterpret_cast<float*>(units_[unit].grad_shard[local].data());
}

absl::Status JobDataPlane::Unshard(int unit, absl::Time deadline) {
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit index ", unit, " out of range [0, ", units(), ")"));
  }
  Unit& u = units_[unit];
  const int64_t k = local_ranks();
  const size_t shard_bytes = static_cast<size_t>(u.shard_elems * u.item);
  // The local ranks' shards land in their places of the node's unsharded buffer (the receive
  // step of the all-gather for ranks that share this node's memory).
  for (int64_t i = 0; i < k; ++i) {
    std::memcpy(u.unsharded.data() + local_ranks_[i] * shard_bytes, u.param_shard[i].data(),
                shard_bytes);
  }
  if (nodes_ == nullptr || nodes_->size() == 1) return absl::OkStatus();
  return AllGather(*nodes_, u.unsharded.data(), shard_bytes * static_cast<size_t>(k), deadline,
                   (++op_seq_) << 20);
}

absl::Status JobDataPlane::ReduceScatter(int unit, ReduceOp op, absl::Time deadline) {
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit index ", unit, " out of range [0, ", units(), ")"));
  }
  Unit& u = units_[unit];
  if (u.dtype != v1::DTYPE_FP32 && u.dtype != v1::DTYPE_BF16 && u.dtype != v1::DTYPE_FP16) {
    return absl::InvalidArgumentError("reduce_scatter: gradients must be fp32, bf16 or fp16");
  }
  const int64_t k = local_ranks(), s = u.shard_elems;
  float* sum = reinterpret_cast<float*>(u.scratch.data());  // W * S
  float* ring = sum + world_ * s;                           // 3 * k * S
  // In-memory reduction of the node's ranks, in fp32.
  std::fill(sum, sum + world_ * s, 0.0f);
  for (int64_t i = 0; i < k; ++i)
    Accumulate(u.grad[i].data(), u.dtype, static_cast<size_t>(world_ * s), sum);
  const int n = nodes_ ? nodes_->size() : 1;
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  float* mine = sum + (nodes_ ? nodes_->rank() : 0) * k * s;
  if (n > 1) {
    // Across nodes: the node's chunk is its ranks' k shards.
    absl::Status st =
        daemon::ReduceScatter(*nodes_, sum, v1::DTYPE_FP32, static_cast<size_t>(k * s), ring + 0,
                              ReduceOp::kSum, ring + k * s, deadline, (++op_seq_) << 20);
    if (!st.ok()) return st;
    // The ring wrote the node's reduced chunk to `ring`; the scratch after it is free again.
    mine = ring;
  }
  for (int64_t i = 0; i < k; ++i) {
    float* out = grad_shard(unit, static_cast<int>(i));
    const float* src = mine + i * s;
    for (int64_t e = 0; e < s; ++e) out[e] = src[e] * scale;
  }
  return absl::OkStatus();
}

}  // namespace ragshard::daemon

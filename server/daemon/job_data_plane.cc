#include "server/daemon/job_data_plane.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "glog/logging.h"

namespace ragshard::daemon {

absl::StatusOr<std::unique_ptr<JobDataPlane>> JobDataPlane::Create(
    const v1::Plan& plan, const std::vector<int64_t>& local_ranks, Pool* pool, Comm* nodes,
    int64_t replicas, Shape shape) {
  auto mesh = NodeMesh::Of(plan, local_ranks, nodes ? nodes->rank() : 0, nodes ? nodes->size() : 1,
                           replicas);
  if (!mesh.ok()) return mesh.status();
  return Create(plan, *mesh, std::make_unique<HostTransport>(*mesh, pool, nodes, shape), nodes);
}

absl::StatusOr<std::unique_ptr<JobDataPlane>> JobDataPlane::Create(
    const v1::Plan& plan, const NodeMesh& mesh, std::unique_ptr<Transport> transport, Comm* nodes) {
  if (!transport->runs_sharding(mesh)) {
    return absl::UnimplementedError(
        absl::StrCat("the ", transport->name(),
                     " backend runs shard groups of whole nodes with p = g = os; "
                     "this job's sharding is ",
                     mesh.sharding.Describe()));
  }
  std::unique_ptr<JobDataPlane> dp(new JobDataPlane());
  dp->mesh_ = mesh;
  dp->transport_ = std::move(transport);
  const bool blocks = dp->transport_->node_blocks();
  const auto& g_units = FactorUnits(plan, Factor::kG);
  const auto& os_units = FactorUnits(plan, Factor::kOs);
  const int64_t os_size = mesh.sharding.os.size();
  for (int i = 0; i < plan.units_size(); ++i) {
    const v1::UnitPlan& up = plan.units(i);
    Unit u;
    u.name = up.unit();
    u.dtype = up.dtype();
    u.shard_elems = up.shard_elems();
    u.grad_elems = g_units.Get(i).shard_elems();
    u.os_elems = os_units.Get(i).shard_elems();
    u.item = DTypeSize(up.dtype());
    std::vector<int64_t> packed;
    auto pieces = MatrixPieces(os_units.Get(i), os_size, &packed);
    if (!pieces.ok()) return pieces.status();
    u.pieces = std::move(*pieces);
    if (u.pieces.size() > MessageStamp::kMaxDataIndex) {
      // Each piece between two nodes is one message of the operation, numbered in 16 bits.
      return absl::UnimplementedError(absl::StrCat("unit '", up.unit(), "' has ", u.pieces.size(),
                                                   " matrix pieces; at most ",
                                                   MessageStamp::kMaxDataIndex));
    }
    // Owner buffers on the first local rank of each os position (its replicas use its own).
    for (int64_t l = 0; l < mesh.local; ++l) {
      const bool first = l < mesh.slots(Factor::kOs);
      u.owner_elems.push_back(first ? packed[mesh.Position(Factor::kOs, l)] : 0);
    }
    // The persistent shards, zero-filled at allocation (not on the hot path).
    const int64_t p_slots = dp->SlotCount(Factor::kP), g_slots = dp->SlotCount(Factor::kG);
    auto shards = dp->AllocateEach(u, "parameter shards", !blocks,
                                   (blocks ? p_slots : 1) * u.shard_elems * u.item, /*zero=*/true);
    if (!shards.ok()) return shards.status();
    u.shards = std::move(*shards);
    auto gs = dp->AllocateEach(
        u, "gradient shards", !blocks,
        (blocks ? GradShardBlockElems(mesh, g_slots, u.grad_elems) : u.grad_elems) * 4,
        /*zero=*/true);
    if (!gs.ok()) return gs.status();
    u.grad_shards = std::move(*gs);
    dp->units_.push_back(std::move(u));
  }
  if (nodes != nullptr) {
    dp->nodes_ = nodes;
    nodes->SetDescriber([self = dp.get()](uint64_t tag) { return self->DescribeTag(tag); });
  }
  return dp;
}

int JobDataPlane::SlotIndex(Factor f, int local) const {
  return transport_->shares_replicas() ? mesh_.Slot(f, local) : local;
}

int64_t JobDataPlane::SlotCount(Factor f) const {
  return transport_->shares_replicas() ? mesh_.slots(f) : mesh_.local;
}

int JobDataPlane::LocalOfOs(int64_t position) const {
  for (int64_t l = 0; l < std::min(mesh_.local, mesh_.slots(Factor::kOs)); ++l) {
    if (mesh_.Position(Factor::kOs, l) == position) return static_cast<int>(l);
  }
  return -1;
}

JobDataPlane::~JobDataPlane() {
  if (nodes_ != nullptr) nodes_->SetDescriber(nullptr);
  units_.clear();  // the leases go back before the transport's memory
}

uint64_t JobDataPlane::NextTag(int unit, uint32_t kind) {
  return MessageStamp{++op_seq_, static_cast<uint64_t>(unit), kind, 0}.Tag();
}

std::string JobDataPlane::DescribeTag(uint64_t tag) const {
  const MessageStamp s = MessageStamp::FromTag(tag);
  // The daemon's names for the operations, by MessageStamp::Kind.
  static const v1::OpKind kOps[] = {v1::OP_KIND_UNSPECIFIED, v1::OP_UNSHARD,
                                    v1::OP_REDUCE_SCATTER,   v1::OP_ALL_REDUCE,
                                    v1::OP_GATHER_TO_OWNER,  v1::OP_SCATTER_FROM_OWNER,
                                    v1::OP_UPDATE_GATHER};
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

absl::StatusOr<Lease> JobDataPlane::AllocateFor(const Unit& u, const char* what, int local,
                                                int64_t bytes, bool zero) {
  auto l = transport_->Allocate(local, std::max<int64_t>(bytes, 1));
  if (!l.ok()) {
    return absl::Status(l.status().code(), absl::StrCat("unit '", u.name, "': ", what, " need ",
                                                        bytes, " bytes: ", l.status().message()));
  }
  if (zero) {
    if (absl::Status z = transport_->Zero(local, l->data(), l->size()); !z.ok()) return z;
  }
  return std::move(*l);
}

absl::StatusOr<std::vector<Lease>> JobDataPlane::AllocateEach(const Unit& u, const char* what,
                                                              bool per_rank, int64_t bytes,
                                                              bool zero) {
  const int count = per_rank ? local_ranks() : 1;
  std::vector<Lease> out;
  for (int i = 0; i < count; ++i) {
    auto l = AllocateFor(u, what, i, bytes, zero);
    if (!l.ok()) {
      // The leases taken so far go back with `out`.
      if (count == 1) return l.status();
      return absl::Status(l.status().code(),
                          absl::StrCat(l.status().message(), " (", count, " x ", bytes, " = ",
                                       count * bytes, " bytes for the node's ranks)"));
    }
    out.push_back(std::move(*l));
  }
  return out;
}

ScratchFn JobDataPlane::ScratchFor(const Unit& u) {
  return [this, &u](int local, const char* what, int64_t bytes) {
    return AllocateFor(u, what, local, bytes, /*zero=*/false);
  };
}

absl::StatusOr<Lease> JobDataPlane::AllocateRankState(int local, int64_t bytes) const {
  auto lease = transport_->Allocate(local, bytes);
  if (!lease.ok()) return lease.status();
  if (absl::Status s = transport_->Zero(local, lease->data(), bytes); !s.ok()) return s;
  return lease;
}

char* JobDataPlane::param_shard(int unit, int local) const {
  const Unit& u = units_[unit];
  if (u.shards.size() == 1) {
    return u.shards[0].data() + SlotIndex(Factor::kP, local) * u.shard_elems * u.item;
  }
  return u.shards[local].data();
}
char* JobDataPlane::unsharded(int unit, int local) const {
  const Unit& u = units_[unit];
  if (u.composed) return u.view->data();
  if (u.unsharded.empty()) return nullptr;
  return u.unsharded[u.unsharded.size() == 1 ? 0 : local].data();
}
char* JobDataPlane::grad(int unit, int local) const {
  const Unit& u = units_[unit];
  return u.grad.empty() ? nullptr : u.grad[local].data();
}
float* JobDataPlane::grad_shard(int unit, int local) const {
  const Unit& u = units_[unit];
  if (u.grad_shards.size() == 1) {
    return reinterpret_cast<float*>(u.grad_shards[0].data()) +
           SlotIndex(Factor::kG, local) * u.grad_elems;
  }
  return reinterpret_cast<float*>(u.grad_shards[local].data());
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
  const char* base = transport_->base(local);
  auto offset = [&](const void* p) -> int64_t {
    return p == nullptr ? -1 : static_cast<const char*>(p) - base;
  };
  out->set_dtype(u.dtype);
  out->set_shard_elems(u.shard_elems);
  out->set_param_shard_offset(offset(param_shard(unit, local)));
  if (u.composed) {
    // The view's parts: the rest (or, with no rest, the shard block) and the shard block.
    const ViewLayout& l = u.view->layout();
    out->set_unsharded_offset(l.rest_offset);
    v1::UnshardedViewLayout* v = out->mutable_unsharded_view();
    v->set_own_at(l.own_at);
    v->set_own_bytes(l.own_bytes);
    v->set_own_offset(l.own_offset);
  } else {
    out->set_unsharded_offset(offset(unsharded(unit, local)));
    out->clear_unsharded_view();
  }
  out->set_grad_offset(offset(grad(unit, local)));
  out->set_grad_shard_offset(offset(grad_shard(unit, local)));
  out->set_owner_offset(offset(owner_buffer(unit, local)));
  out->set_owner_elems(u.owner_elems[local]);
  out->set_grad_shard_elems(u.grad_elems);
  out->set_os_elems(u.os_elems);
  const int64_t os_start = mesh_.Position(Factor::kOs, local) * u.os_elems;
  out->set_os_param_offset(os_start - mesh_.Position(Factor::kP, local) * u.shard_elems);
  out->set_os_grad_offset(os_start - mesh_.Position(Factor::kG, local) * u.grad_elems);
}

void JobDataPlane::Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const {
  resp->set_replicas(mesh_.replicas);
  resp->set_backend(name());
  v1::RankPositions* pos = resp->mutable_positions();
  pos->set_p(mesh_.Position(Factor::kP, local));
  pos->set_g(mesh_.Position(Factor::kG, local));
  pos->set_os(mesh_.Position(Factor::kOs, local));
  pos->set_steps_optimizer(!transport_->shares_replicas() || local < mesh_.slots(Factor::kOs));
  pos->set_os_group(mesh_.sharding.OsGroup(mesh_.node, local));
  transport_->DescribeMemory(local, resp);
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
  if (IsUnsharded(u)) return absl::OkStatus();
  auto leases = AllocateEach(u, "unsharded parameters", !transport_->shares_unsharded(),
                             mesh_.shard * u.shard_elems * u.item, /*zero=*/false);
  if (!leases.ok()) return leases.status();
  u.unsharded = std::move(*leases);
  return absl::OkStatus();
}

absl::StatusOr<bool> JobDataPlane::Compose(Unit& u) {
  const int fd = transport_->view_fd();
  const int64_t slots = SlotCount(Factor::kP);
  if (fd < 0 || u.shards.size() != 1 || !AliasesShards(slots, u.shard_elems, u.item)) {
    return false;
  }
  const int64_t rank_bytes = u.shard_elems * u.item;
  ViewLayout l;
  l.bytes = mesh_.shard * rank_bytes;
  l.own_at = mesh_.first_position() * rank_bytes;
  l.own_bytes = slots * rank_bytes;
  l.own_offset = u.shards[0].offset();
  l.rest_offset = l.own_offset;
  std::vector<Lease> rest;
  if (l.bytes > l.own_bytes) {
    auto r = AllocateFor(u, "unsharded parameters", 0, l.bytes - l.own_bytes, /*zero=*/false);
    if (!r.ok()) return r.status();
    l.rest_offset = r->offset();
    rest.push_back(std::move(*r));
  }
  if (!u.view) u.view = std::make_unique<UnshardedView>();
  if (absl::Status st = u.view->Map(fd, l, /*private_own=*/false); !st.ok()) {
    // Address space or mappings ran out: the copy path still works.
    LOG(WARNING) << "unit '" << u.name << "': " << st.message() << "; placing shards by copying";
    u.view.reset();
    return false;
  }
  u.unsharded = std::move(rest);
  u.composed = true;
  return true;
}

absl::Status JobDataPlane::Unshard(int unit, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  if (units_[unit].kept > 1) return Rebuild(unit, deadline);
  Unit& u = units_[unit];
  if (!IsUnsharded(u)) {
    auto composed = Compose(u);
    if (!composed.ok()) return composed.status();
    if (!*composed) {
      if (auto s = AllocateUnsharded(unit); !s.ok()) return s;
    }
  }
  const uint64_t tag = NextTag(unit, MessageStamp::kAllGather);
  std::vector<const char*> shards;
  std::vector<char*> out;
  const int64_t rank_bytes = u.shard_elems * u.item;
  shards.reserve(local_ranks());
  for (int i = 0; i < local_ranks(); ++i) {
    // A view's own part is the shard block itself: the all-gather finds it in place.
    shards.push_back(u.composed
                         ? u.view->data() +
                               (mesh_.first_position() + SlotIndex(Factor::kP, i)) * rank_bytes
                         : param_shard(unit, i));
  }
  if (u.composed) {
    out.push_back(u.view->data());
  } else {
    for (Lease& l : u.unsharded) out.push_back(l.data());
  }
  absl::Status st = transport_->AllGather(shards, out, u.shard_elems, u.dtype, deadline, tag);
  if (!st.ok()) {
    u.unsharded.clear();
    u.composed = false;
  }
  return st;
}

void JobDataPlane::ResetTransient() {
  for (Unit& u : units_) {
    u.unsharded.clear();
    u.composed = false;
    u.parts.clear();
    u.kept = 0;
    u.grad.clear();
    u.owner.clear();
  }
  op_seq_ = 0;  // the daemons' next operation tags agree again
}

absl::Status JobDataPlane::Reshard(int unit, int64_t keep) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  Unit& u = units_[unit];
  if (keep <= 1 || !IsUnsharded(u)) {
    u.unsharded.clear();
    u.composed = false;
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
  if (transport_->shares_unsharded()) return absl::OkStatus();  // the node's buffer serves them
  // Each rank keeps its 1/keep of the unit; the full copies go back to the memory.
  const int64_t part = mesh_.shard * u.shard_elems * u.item / keep;
  auto parts = AllocateEach(u, "kept parameters", true, part, /*zero=*/false);
  absl::Status st = parts.status();
  for (int i = 0; st.ok() && i < local_ranks(); ++i) {
    st = transport_->Copy(i, (*parts)[i].data(), i, u.unsharded[i].data() + (i % keep) * part, part,
                          absl::InfiniteFuture());
  }
  if (!st.ok()) {
    u.kept = 0;
    return st;
  }
  u.parts = std::move(*parts);
  u.unsharded.clear();
  return absl::OkStatus();
}

absl::Status JobDataPlane::Rebuild(int unit, absl::Time deadline) {
  Unit& u = units_[unit];
  const int64_t keep = std::exchange(u.kept, 0);
  if (transport_->shares_unsharded()) return absl::OkStatus();  // the node's buffer stayed
  // The all-gather within each group of `keep` ranks, from their parts.
  const int64_t part = mesh_.shard * u.shard_elems * u.item / keep;
  auto full = AllocateEach(u, "unsharded parameters", true, keep * part, false);
  absl::Status st = full.status();
  for (int i = 0; st.ok() && i < local_ranks(); ++i) {
    const int first = i - static_cast<int>(i % keep);
    for (int64_t j = 0; st.ok() && j < keep; ++j) {
      const int from = first + static_cast<int>(j);
      st = transport_->Copy(i, (*full)[i].data() + j * part, from, u.parts[from].data(), part,
                            deadline);
    }
  }
  if (!st.ok()) {
    u.kept = keep;
    return st;
  }
  u.unsharded = std::move(*full);
  u.parts.clear();
  return absl::OkStatus();
}

absl::Status JobDataPlane::AllocateGrad(int unit) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  Unit& u = units_[unit];
  if (!u.grad.empty()) return absl::OkStatus();  // accumulating without reduction
  auto leases = AllocateEach(u, "unsharded gradients", true, mesh_.shard * u.shard_elems * u.item,
                             /*zero=*/true);
  if (!leases.ok()) return leases.status();
  u.grad = std::move(*leases);
  return absl::OkStatus();
}

absl::Status JobDataPlane::ReduceScatter(int unit, ReduceOp op, bool accumulate,
                                         absl::Time deadline) {
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
  std::vector<const void*> inputs;
  std::vector<float*> out;
  inputs.reserve(u.grad.size());
  out.reserve(local_ranks());
  for (const Lease& g : u.grad) inputs.push_back(g.data());
  for (int i = 0; i < local_ranks(); ++i) out.push_back(grad_shard(unit, i));
  // Accumulating: what each distinct gradient shard holds (local ranks may share one), kept
  // aside in its rank's memory while the reduction is formed in its place, then added back.
  std::vector<std::pair<int, Lease>> held;
  if (accumulate) {
    const int64_t bytes = u.grad_elems * 4;
    for (int i = 0; i < local_ranks(); ++i) {
      if (std::find(out.begin(), out.begin() + i, out[i]) != out.begin() + i) continue;
      auto l = AllocateFor(u, "accumulated gradient shard", i, bytes, /*zero=*/false);
      if (!l.ok()) {
        u.grad.clear();
        return l.status();
      }
      if (auto s = transport_->Copy(i, l->data(), i, reinterpret_cast<const char*>(out[i]), bytes,
                                    deadline);
          !s.ok()) {
        u.grad.clear();
        return s;
      }
      held.emplace_back(i, std::move(*l));
    }
  }
  absl::Status st = transport_->ReduceScatter(inputs, u.dtype, u.grad_elems, out, op, ScratchFor(u),
                                              deadline, tag);
  u.grad.clear();
  for (auto& [i, l] : held) {
    if (!st.ok()) break;
    st = transport_->Add(i, out[static_cast<size_t>(i)], reinterpret_cast<const float*>(l.data()),
                         u.grad_elems, deadline);
  }
  return st;
}

absl::Status JobDataPlane::AllReduce(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = NextTag(unit, MessageStamp::kAllReduce);
  if (mesh_.replicas == 1) return absl::OkStatus();
  const Unit& u = units_[unit];
  std::vector<float*> shards;
  shards.reserve(local_ranks());
  for (int i = 0; i < local_ranks(); ++i) shards.push_back(grad_shard(unit, i));
  return transport_->AllReduce(shards, u.grad_elems, op, ScratchFor(u), deadline, tag);
}

absl::Status JobDataPlane::UpdateGather(int unit, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  const uint64_t tag = NextTag(unit, MessageStamp::kUpdateGather);
  const Unit& u = units_[unit];
  if (u.os_elems == u.shard_elems) return absl::OkStatus();  // each rank stepped its whole shard
  std::vector<char*> shards;
  shards.reserve(local_ranks());
  for (int i = 0; i < local_ranks(); ++i) shards.push_back(param_shard(unit, i));
  return transport_->UpdateGather(shards, u.shard_elems, u.os_elems, u.dtype, deadline, tag);
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
  if (to_owner && u.owner.empty()) {
    // Every element of an owner buffer is a piece of an owned matrix: no zero-fill needed.
    for (int i = 0; i < local_ranks(); ++i) {
      if (u.owner_elems[i] == 0) {
        u.owner.emplace_back();
        continue;
      }
      auto l = AllocateFor(u, "owner buffer", i, u.owner_elems[i] * 4, /*zero=*/false);
      if (!l.ok()) {
        u.owner.clear();
        return l.status();
      }
      u.owner.push_back(std::move(*l));
    }
  } else if (!to_owner && u.owner.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "scatter_from_owner of unit '", u.name, "': gather_to_owner has not run since the last"));
  }
  std::vector<PieceMove> moves;
  for (const Piece& p : u.pieces) {
    const int holder = LocalOfOs(p.holder), owner = LocalOfOs(p.owner);
    if (holder < 0 && owner < 0) continue;
    // The holder's os range lies in its gradient shard, at its g position.
    float* shard = holder >= 0 ? grad_shard(unit, holder) +
                                     (p.elem - mesh_.Position(Factor::kG, holder) * u.grad_elems)
                               : nullptr;
    float* whole = owner >= 0 ? owner_buffer(unit, owner) + p.packed : nullptr;
    moves.push_back(to_owner ? PieceMove{holder, owner, p.holder, p.owner, shard, whole, p.count}
                             : PieceMove{owner, holder, p.owner, p.holder, whole, shard, p.count});
  }
  absl::Status st = transport_->MovePieces(moves, deadline, tag);
  if (st.ok() && !to_owner && !transport_->shares_replicas()) {
    // Ranks with slots of their own: the replicas of an os position take its updated range.
    for (int l = static_cast<int>(mesh_.slots(Factor::kOs)); st.ok() && l < local_ranks(); ++l) {
      const int first = mesh_.Slot(Factor::kOs, l);
      const int64_t at = mesh_.Position(Factor::kOs, l) * u.os_elems -
                         mesh_.Position(Factor::kG, l) * u.grad_elems;
      st = transport_->Copy(l, reinterpret_cast<char*>(grad_shard(unit, l) + at), first,
                            reinterpret_cast<const char*>(grad_shard(unit, first) + at),
                            u.os_elems * 4, deadline);
    }
  }
  if (!to_owner || !st.ok()) u.owner.clear();
  return st;
}

}  // namespace ragshard::daemon

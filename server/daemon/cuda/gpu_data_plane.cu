#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/daemon/cuda/cuda_device.h"
#include "server/daemon/cuda/cuda_status.h"
#include "server/daemon/cuda/gpu_data_plane.h"

namespace ragshard::gpu {
namespace {

using daemon::BackendContext;
using daemon::ReduceOp;

absl::StatusOr<ncclDataType_t> NcclType(v1::DType d) {
  switch (d) {
    case v1::DTYPE_FP32:
      return ncclFloat32;
    case v1::DTYPE_BF16:
      return ncclBfloat16;
    case v1::DTYPE_FP16:
      return ncclFloat16;
    case v1::DTYPE_INT8:
      return ncclInt8;
    case v1::DTYPE_UINT8:
    case v1::DTYPE_FP8E4M3:
    case v1::DTYPE_FP8E5M2:
      return ncclUint8;  // moved as bytes; never reduced
    case v1::DTYPE_INT32:
      return ncclInt32;
    case v1::DTYPE_INT64:
      return ncclInt64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", v1::DType_Name(d), " has no NCCL type"));
  }
}

__global__ void ToFloat(const uint16_t* in, bool bf16, float* out, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (bf16) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  } else {
    out[i] = __half2float(__ushort_as_half(in[i]));
  }
}

// A CUDA slab on one device, exported as an IPC handle, sub-allocated by a Pool.
struct Slab {
  int device = 0;
  char* base = nullptr;
  cudaIpcMemHandle_t handle{};
  std::unique_ptr<daemon::Pool> pool;
  ~Slab() {
    pool.reset();
    if (base != nullptr) {
      cudaSetDevice(device);
      cudaFree(base);
    }
  }
};

// The communicators of one process group, one per local GPU that belongs to it.
struct NcclGroup {
  std::vector<ncclComm_t> comms;  // by local rank
  bool aborted = false;
  ~NcclGroup() {
    for (ncclComm_t c : comms) {
      if (c == nullptr) continue;
      if (aborted) {
        ncclCommAbort(c);
      } else {
        ncclCommDestroy(c);
      }
    }
  }
};

class GpuDataPlane final : public daemon::DataBackend {
 public:
  static absl::StatusOr<std::unique_ptr<GpuDataPlane>> Create(const BackendContext& c);
  ~GpuDataPlane() override {
    units_.clear();  // leases go back before the slabs
    for (size_t i = 0; i < streams_.size(); ++i) {
      cudaSetDevice(slabs_[i]->device);
      cudaStreamDestroy(streams_[i]);
    }
  }

  const char* name() const override { return "cuda"; }
  int units() const override { return static_cast<int>(units_.size()); }
  int64_t replicas() const override { return replicas_; }
  int64_t staging_bytes() const override { return staging_bytes_; }

  absl::Status Unshard(int unit, absl::Time deadline) override;
  // This backend still keeps every buffer for the job's life (the host data plane's transient
  // buffers are not yet its own: docs/gpu.md), so these only check the unit.
  absl::Status AllocateUnsharded(int unit) override { return CheckUnit(unit); }
  absl::Status Reshard(int unit, int64_t) override { return CheckUnit(unit); }
  absl::Status AllocateGrad(int unit) override { return CheckUnit(unit); }
  absl::Status ReduceScatter(int unit, ReduceOp op, absl::Time deadline) override;
  absl::Status AllReduce(int unit, ReduceOp op, absl::Time deadline) override;
  absl::Status GatherToOwner(int unit, absl::Time deadline) override {
    return MovePieces(unit, true, deadline);
  }
  absl::Status ScatterFromOwner(int unit, absl::Time deadline) override {
    return MovePieces(unit, false, deadline);
  }
  void Placement(int unit, int local, v1::UnitBuffers* out) const override;
  void Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const override;
  char* slab_base(int local) const { return slabs_[local]->base; }

 private:
  using Piece = daemon::MatrixPiece;
  struct Buffers {
    daemon::Lease unsharded, grad, grad_shard, scratch, owner;
  };
  struct Unit {
    v1::DType dtype;
    int64_t shard_elems = 0, item = 0;
    std::vector<Buffers> local;  // by local rank
    std::vector<Piece> pieces;
  };

  absl::Status CheckUnit(int unit) const {
    if (unit < 0 || unit >= units()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit index ", unit, " out of range [0, ", units(), ")"));
    }
    return absl::OkStatus();
  }
  int64_t Position(int local) const { return local_ranks_[local] % shard_; }
  // Waits for every local stream; aborts `group` at the deadline or on an NCCL error.
  absl::Status Wait(NcclGroup* group, const char* what, absl::Time deadline);
  absl::Status MovePieces(int unit, bool to_owner, absl::Time deadline);

  std::vector<int64_t> local_ranks_;
  int64_t shard_ = 0, replicas_ = 1;
  std::vector<std::unique_ptr<Slab>> slabs_;  // by local rank
  std::vector<cudaStream_t> streams_;         // by local rank
  std::unique_ptr<NcclGroup> shard_group_, replicate_group_;
  std::vector<Unit> units_;
  int64_t staging_bytes_ = 0;
};

// Creates the communicators of the groups named by `key(local)` in which local rank i has rank
// `rank(local)` of `size`: the first member of each group publishes a fresh unique id.
absl::StatusOr<std::unique_ptr<NcclGroup>> CreateGroups(const BackendContext& c,
                                                        const std::vector<int>& devices, int size,
                                                        const std::function<std::string(int)>& key,
                                                        const std::function<int(int)>& rank) {
  const int k = static_cast<int>(devices.size());
  std::vector<ncclUniqueId> ids(k);
  for (int i = 0; i < k; ++i) {
    if (rank(i) == 0) {
      absl::Status s = NcclStatus(ncclGetUniqueId(&ids[i]), "ncclGetUniqueId");
      if (!s.ok()) return s;
      s = c.put(key(i),
                absl::BytesToHexString(absl::string_view(ids[i].internal, NCCL_UNIQUE_ID_BYTES)));
      if (!s.ok()) return s;
    }
  }
  for (int i = 0; i < k; ++i) {
    if (rank(i) == 0) continue;
    auto hex = c.get(key(i));
    if (!hex.ok()) return hex.status();
    const std::string raw = absl::HexStringToBytes(*hex);
    if (raw.size() != NCCL_UNIQUE_ID_BYTES) {
      return absl::DataLossError(absl::StrCat("rendezvous key '", key(i), "' holds no NCCL id"));
    }
    std::copy(raw.begin(), raw.end(), ids[i].internal);
  }
  auto group = std::make_unique<NcclGroup>();
  group->comms.assign(k, nullptr);
  absl::Status s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (int i = 0; i < k && s.ok(); ++i) {
    s = CudaStatus(cudaSetDevice(devices[i]), "cudaSetDevice");
    if (s.ok()) {
      s = NcclStatus(ncclCommInitRank(&group->comms[i], size, ids[i], rank(i)), "ncclCommInitRank");
    }
  }
  absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd (communicator setup)");
  if (!s.ok()) return s;
  if (!end.ok()) return end;
  return group;
}

absl::StatusOr<std::unique_ptr<GpuDataPlane>> GpuDataPlane::Create(const BackendContext& c) {
  const v1::Plan& plan = *c.plan;
  const int count = DeviceCount();
  if (count == 0) return absl::FailedPreconditionError("GPU backend: no CUDA device");
  std::unique_ptr<GpuDataPlane> dp(new GpuDataPlane());
  dp->local_ranks_ = c.local_ranks;
  dp->shard_ = plan.world_size();
  dp->replicas_ = c.replicas;
  const int k = static_cast<int>(c.local_ranks.size());
  std::vector<int> devices;
  for (int i = 0; i < k; ++i) {
    devices.push_back(i % count);
    auto slab = std::make_unique<Slab>();
    slab->device = devices[i];
    absl::Status s = CudaStatus(cudaSetDevice(slab->device), "cudaSetDevice");
    if (s.ok()) s = CudaStatus(cudaMalloc(&slab->base, c.gpu_pool_bytes), "cudaMalloc (GPU pool)");
    if (s.ok())
      s = CudaStatus(cudaIpcGetMemHandle(&slab->handle, slab->base), "cudaIpcGetMemHandle");
    if (!s.ok()) return s;
    auto pool = daemon::Pool::CreateOver(slab->base, c.gpu_pool_bytes);
    if (!pool.ok()) return pool.status();
    slab->pool = std::move(*pool);
    cudaStream_t stream = nullptr;
    s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    if (!s.ok()) return s;
    dp->slabs_.push_back(std::move(slab));
    dp->streams_.push_back(stream);
  }
  const int64_t f = dp->shard_;
  auto shard = CreateGroups(
      c, devices, static_cast<int>(f),
      [&](int i) { return absl::StrCat("nccl/shard/", c.local_ranks[i] / f); },
      [&](int i) { return static_cast<int>(c.local_ranks[i] % f); });
  if (!shard.ok()) return shard.status();
  dp->shard_group_ = std::move(*shard);
  if (c.replicas > 1) {
    auto rep = CreateGroups(
        c, devices, static_cast<int>(c.replicas),
        [&](int i) { return absl::StrCat("nccl/replicate/", c.local_ranks[i] % f); },
        [&](int i) { return static_cast<int>(c.local_ranks[i] / f); });
    if (!rep.ok()) return rep.status();
    dp->replicate_group_ = std::move(*rep);
  }
  for (const v1::UnitPlan& up : plan.units()) {
    Unit u;
    u.dtype = up.dtype();
    u.shard_elems = up.shard_elems();
    u.item = DTypeSize(up.dtype());
    const int64_t s = u.shard_elems;
    auto pieces = daemon::MatrixPieces(up, f);
    if (!pieces.ok()) return pieces.status();
    u.pieces = std::move(*pieces);
    for (int i = 0; i < k; ++i) {
      daemon::Pool* pool = dp->slabs_[i]->pool.get();
      auto alloc = [&](int64_t bytes) -> absl::StatusOr<daemon::Lease> {
        auto l = pool->Allocate(std::max<int64_t>(bytes, 1));
        if (!l.ok()) {
          return absl::Status(l.status().code(),
                              absl::StrCat("unit '", up.unit(), "' on GPU ", devices[i], ": ",
                                           l.status().message()));
        }
        absl::Status z =
            CudaStatus(cudaMemset(l->data(), 0, static_cast<size_t>(l->size())), "cudaMemset");
        if (!z.ok()) return z;
        return std::move(*l);
      };
      Buffers b;
      for (auto [lease, bytes] :
           {std::pair{&b.unsharded, f * s * u.item}, std::pair{&b.grad, f * s * u.item},
            std::pair{&b.grad_shard, s * 4},
            std::pair{&b.scratch, u.dtype == v1::DTYPE_FP32 ? int64_t{0} : f * s * 4}}) {
        if (bytes == 0) continue;
        auto l = alloc(bytes);
        if (!l.ok()) return l.status();
        *lease = std::move(*l);
      }
      const int64_t pos = c.local_ranks[i] % f;
      if (std::any_of(u.pieces.begin(), u.pieces.end(),
                      [&](const Piece& p) { return p.owner == pos; })) {
        auto l = alloc(f * s * 4);
        if (!l.ok()) return l.status();
        b.owner = std::move(*l);
      }
      u.local.push_back(std::move(b));
    }
    dp->units_.push_back(std::move(u));
  }
  return dp;
}

absl::Status GpuDataPlane::Wait(NcclGroup* group, const char* what, absl::Time deadline) {
  while (true) {
    bool done = true;
    for (size_t i = 0; i < streams_.size(); ++i) {
      cudaError_t e = cudaStreamQuery(streams_[i]);
      if (e == cudaErrorNotReady) {
        done = false;
      } else if (e != cudaSuccess) {
        return CudaStatus(e, absl::StrCat(what, " on GPU ", slabs_[i]->device));
      }
    }
    if (done) return absl::OkStatus();
    if (group != nullptr) {
      for (ncclComm_t comm : group->comms) {
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          group->aborted = true;
          return absl::UnavailableError(
              absl::StrCat(what, ": NCCL reported ", ncclGetErrorString(async),
                           " (a peer is lost or failed); the job's communicators are aborted"));
        }
      }
    }
    if (absl::Now() >= deadline) {
      if (group != nullptr) {
        group->aborted = true;
        for (ncclComm_t comm : group->comms) ncclCommAbort(comm);
        group->comms.clear();
      }
      return absl::DeadlineExceededError(absl::StrCat(
          what,
          " did not complete before the deadline (a peer is lost or stalled); the job's "
          "NCCL communicators are aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

absl::Status GpuDataPlane::Unshard(int unit, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  if (shard_group_->comms.empty()) return absl::FailedPreconditionError("communicators aborted");
  const Unit& u = units_[unit];
  auto type = NcclType(u.dtype);
  if (!type.ok()) return type.status();
  absl::Status s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < u.local.size() && s.ok(); ++i) {
    char* full = u.local[i].unsharded.data();
    // In place: the send buffer is this rank's slice of the receive buffer.
    s = NcclStatus(ncclAllGather(full + Position(static_cast<int>(i)) * u.shard_elems * u.item,
                                 full, static_cast<size_t>(u.shard_elems), *type,
                                 shard_group_->comms[i], streams_[i]),
                   "ncclAllGather");
  }
  absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (!s.ok()) return s;
  if (!end.ok()) return end;
  return Wait(shard_group_.get(), "unshard", deadline);
}

absl::Status GpuDataPlane::ReduceScatter(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  if (shard_group_->comms.empty()) return absl::FailedPreconditionError("communicators aborted");
  const Unit& u = units_[unit];
  if (u.dtype != v1::DTYPE_FP32 && u.dtype != v1::DTYPE_BF16 && u.dtype != v1::DTYPE_FP16) {
    return absl::InvalidArgumentError("reduce_scatter: gradients must be fp32, bf16 or fp16");
  }
  const int64_t n = shard_ * u.shard_elems;
  for (size_t i = 0; i < u.local.size() && u.dtype != v1::DTYPE_FP32; ++i) {
    // Accumulate in fp32: convert the gradient first (counted as staging).
    cudaSetDevice(slabs_[i]->device);
    ToFloat<<<static_cast<unsigned>((n + 255) / 256), 256, 0, streams_[i]>>>(
        reinterpret_cast<const uint16_t*>(u.local[i].grad.data()), u.dtype == v1::DTYPE_BF16,
        reinterpret_cast<float*>(u.local[i].scratch.data()), n);
    absl::Status s = CudaStatus(cudaGetLastError(), "ToFloat launch");
    if (!s.ok()) return s;
    staging_bytes_ += n * 4;
  }
  absl::Status s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < u.local.size() && s.ok(); ++i) {
    const void* src =
        u.dtype == v1::DTYPE_FP32 ? u.local[i].grad.data() : u.local[i].scratch.data();
    s = NcclStatus(
        ncclReduceScatter(src, u.local[i].grad_shard.data(), static_cast<size_t>(u.shard_elems),
                          ncclFloat32, op == ReduceOp::kAvg ? ncclAvg : ncclSum,
                          shard_group_->comms[i], streams_[i]),
        "ncclReduceScatter");
  }
  absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (!s.ok()) return s;
  if (!end.ok()) return end;
  return Wait(shard_group_.get(), "reduce_scatter", deadline);
}

absl::Status GpuDataPlane::AllReduce(int unit, ReduceOp op, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  if (replicate_group_ == nullptr) return absl::OkStatus();
  if (replicate_group_->comms.empty())
    return absl::FailedPreconditionError("communicators aborted");
  const Unit& u = units_[unit];
  absl::Status s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < u.local.size() && s.ok(); ++i) {
    float* g = reinterpret_cast<float*>(u.local[i].grad_shard.data());
    s = NcclStatus(ncclAllReduce(g, g, static_cast<size_t>(u.shard_elems), ncclFloat32,
                                 op == ReduceOp::kAvg ? ncclAvg : ncclSum,
                                 replicate_group_->comms[i], streams_[i]),
                   "ncclAllReduce");
  }
  absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (!s.ok()) return s;
  if (!end.ok()) return end;
  return Wait(replicate_group_.get(), "all_reduce", deadline);
}

absl::Status GpuDataPlane::MovePieces(int unit, bool to_owner, absl::Time deadline) {
  if (auto s = CheckUnit(unit); !s.ok()) return s;
  if (shard_group_->comms.empty()) return absl::FailedPreconditionError("communicators aborted");
  const Unit& u = units_[unit];
  const int64_t s = u.shard_elems;
  const int64_t first = Position(0);
  const int64_t k = static_cast<int64_t>(local_ranks_.size());
  auto local_of = [&](int64_t pos) { return pos >= first && pos < first + k ? pos - first : -1; };
  absl::Status st = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (const Piece& p : u.pieces) {
    if (!st.ok()) break;
    const int64_t hl = local_of(p.holder), ol = local_of(p.owner);
    if (hl < 0 && ol < 0) continue;
    float* shard =
        hl >= 0 ? reinterpret_cast<float*>(u.local[hl].grad_shard.data()) + (p.elem - p.holder * s)
                : nullptr;
    float* whole = ol >= 0 ? reinterpret_cast<float*>(u.local[ol].owner.data()) + p.elem : nullptr;
    const size_t count = static_cast<size_t>(p.count);
    if (hl >= 0 && hl == ol) {
      cudaSetDevice(slabs_[hl]->device);
      st =
          CudaStatus(cudaMemcpyAsync(to_owner ? whole : shard, to_owner ? shard : whole,
                                     count * sizeof(float), cudaMemcpyDeviceToDevice, streams_[hl]),
                     "cudaMemcpyAsync");
      continue;
    }
    if (hl >= 0) {
      st = to_owner ? NcclStatus(ncclSend(shard, count, ncclFloat32, p.owner,
                                          shard_group_->comms[hl], streams_[hl]),
                                 "ncclSend")
                    : NcclStatus(ncclRecv(shard, count, ncclFloat32, p.owner,
                                          shard_group_->comms[hl], streams_[hl]),
                                 "ncclRecv");
    }
    if (ol >= 0 && st.ok()) {
      st = to_owner ? NcclStatus(ncclRecv(whole, count, ncclFloat32, p.holder,
                                          shard_group_->comms[ol], streams_[ol]),
                                 "ncclRecv")
                    : NcclStatus(ncclSend(whole, count, ncclFloat32, p.holder,
                                          shard_group_->comms[ol], streams_[ol]),
                                 "ncclSend");
    }
  }
  absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (!st.ok()) return st;
  if (!end.ok()) return end;
  return Wait(shard_group_.get(), to_owner ? "gather_to_owner" : "scatter_from_owner", deadline);
}

void GpuDataPlane::Placement(int unit, int local, v1::UnitBuffers* out) const {
  const Unit& un = units_[unit];
  const Buffers& b = un.local[local];
  out->set_dtype(un.dtype);
  out->set_shard_elems(un.shard_elems);
  out->set_param_shard_offset(b.unsharded.offset() + Position(local) * un.shard_elems * un.item);
  out->set_unsharded_offset(b.unsharded.offset());
  out->set_grad_offset(b.grad.offset());
  out->set_grad_shard_offset(b.grad_shard.offset());
  out->set_owner_offset(b.owner.size() > 0 ? b.owner.offset() : -1);
  out->set_owner_elems(b.owner.size() > 0 ? shard_ * un.shard_elems : 0);
}

void GpuDataPlane::Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const {
  resp->set_replicas(replicas_);
  resp->set_backend(name());
  resp->set_cuda_device(slabs_[local]->device);
  resp->set_cuda_ipc_handle(
      std::string(slabs_[local]->handle.reserved, sizeof(slabs_[local]->handle.reserved)));
  for (int u = 0; u < units(); ++u) {
    v1::UnitBuffers* out = resp->add_units();
    out->set_unit(plan.units(u).unit());
    Placement(u, local, out);
  }
}

}  // namespace

absl::StatusOr<char*> SlabBase(const daemon::DataBackend& backend, int local) {
  const auto* gpu = dynamic_cast<const GpuDataPlane*>(&backend);
  if (gpu == nullptr) return absl::InvalidArgumentError("not a GPU backend");
  return gpu->slab_base(local);
}

absl::StatusOr<std::unique_ptr<daemon::DataBackend>> CreateGpuDataPlane(
    const daemon::BackendContext& context) {
  auto dp = GpuDataPlane::Create(context);
  if (!dp.ok()) return dp.status();
  return std::unique_ptr<daemon::DataBackend>(std::move(*dp));
}

}  // namespace ragshard::gpu

// The CUDA backend's transport (transport.h) under the one data plane (job_data_plane.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "server/daemon/cuda/cuda_device.h"
#include "server/daemon/cuda/cuda_status.h"
#include "server/daemon/cuda/gpu_data_plane.h"
#include "server/daemon/cuda/nccl_api.h"
#include "server/daemon/job_data_plane.h"

namespace ragshard::gpu {
namespace {

using daemon::BackendContext;
using daemon::ReduceOp;

// NCCL's table. A transport exists only once NCCL has opened (CudaTransport::Create), so every
// use below finds it.
const NcclApi& N() { return **Nccl(); }

// fp32 scratch per GPU for one chunk of a bf16/fp16 reduce-scatter (F chunks of `width`).
constexpr int64_t kConvertChunkBytes = int64_t{64} << 20;
// An operation's wait queries its streams without sleeping for this long (yielding the core
// between queries), then every kWaitSleep: a sleep of the kernel's timer (50 us and its slack)
// after each launch was the operations' fixed cost (about 110 us each, docs/benchmarks/gpu.md).
constexpr auto kWaitSpin = std::chrono::microseconds(500);
constexpr auto kWaitSleep = std::chrono::microseconds(50);

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

// out[j * width + i] = in[j * stride + first + i] as fp32, for j < groups and i < width: chunk
// [first, first + width) of each of the gradient's F blocks, side by side for ncclReduceScatter.
__global__ void ToFloat(const uint16_t* in, bool bf16, int64_t stride, int64_t first, int64_t width,
                        int64_t groups, float* out) {
  const int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (x >= width * groups) return;
  const uint16_t v = in[(x / width) * stride + first + x % width];
  out[x] =
      bf16 ? __uint_as_float(static_cast<uint32_t>(v) << 16) : __half2float(__ushort_as_half(v));
}

// dst[i] += src[i]: a reduction added to what a gradient shard held (gradient accumulation).
__global__ void AddKernel(float* dst, const float* src, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

// The daemon's reads and writes of one GPU's memory (the redundancy's segments: state_blob.h):
// synchronous copies. Nothing else writes that memory meanwhile: the transport's operations are
// complete on return, and a rank synchronizes its streams before it issues an operation.
class DeviceMemory final : public daemon::SegmentMemory {
 public:
  explicit DeviceMemory(const int* device) : device_(device) {}
  absl::Status ToHost(char* out, const char* from, int64_t n) const override {
    return Copy(out, from, n, cudaMemcpyDeviceToHost, "cudaMemcpy (device to host)");
  }
  absl::Status FromHost(char* to, const char* in, int64_t n) const override {
    return Copy(to, in, n, cudaMemcpyHostToDevice, "cudaMemcpy (host to device)");
  }

 private:
  absl::Status Copy(char* dst, const char* src, int64_t n, cudaMemcpyKind kind,
                    const char* what) const {
    absl::Status s = CudaStatus(cudaSetDevice(*device_), "cudaSetDevice");
    if (s.ok()) s = CudaStatus(cudaMemcpy(dst, src, static_cast<size_t>(n), kind), what);
    return s;
  }
  const int* device_;
};

// A CUDA slab on one device, exported as an IPC handle, sub-allocated by a Pool.
struct Slab {
  int device = 0;
  DeviceMemory memory{&device};
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
        N().CommAbort(c);
      } else {
        N().CommDestroy(c);
      }
    }
  }
};

// Each local rank is one GPU (local rank i on device i): its memory is a CUDA
// slab of that device, its collectives run on NCCL communicators, one per process group on each
// GPU (the shard group and, with HSDP, the replicate group), each created from its own unique
// id passed through the planner's rendezvous. Calls for several local GPUs go inside
// ncclGroupStart/ncclGroupEnd. bf16/fp16 gradients are converted to fp32 in chunks of
// kConvertChunkBytes per GPU (NCCL would otherwise accumulate in the gradient's dtype; counted
// as staging). Waiting polls the streams and ncclCommGetAsyncError; at the deadline, or on an
// asynchronous NCCL error, the job's communicators are aborted and the operation fails with an
// error that says so (NCCL does not name the lost peer).
class CudaTransport final : public daemon::Transport {
 public:
  static absl::StatusOr<std::unique_ptr<CudaTransport>> Create(const BackendContext& c,
                                                               const daemon::NodeMesh& mesh);
  ~CudaTransport() override {
    for (size_t i = 0; i < streams_.size(); ++i) {
      cudaSetDevice(slabs_[i]->device);
      cudaStreamDestroy(streams_[i]);
    }
  }

  const char* name() const override { return "cuda"; }
  bool shares_unsharded() const override { return false; }
  bool node_blocks() const override { return false; }
  absl::StatusOr<daemon::Lease> Allocate(int local, int64_t bytes) override {
    auto l = slabs_[local]->pool->Allocate(bytes);
    if (!l.ok()) {
      return absl::Status(l.status().code(), absl::StrCat("on GPU ", slabs_[local]->device, ": ",
                                                          l.status().message()));
    }
    return l;
  }
  absl::Status Zero(int local, char* data, int64_t bytes) override {
    absl::Status s = CudaStatus(cudaSetDevice(slabs_[local]->device), "cudaSetDevice");
    if (s.ok()) {
      s = CudaStatus(cudaMemsetAsync(data, 0, static_cast<size_t>(bytes), streams_[local]),
                     "cudaMemsetAsync");
    }
    if (s.ok()) s = CudaStatus(cudaStreamSynchronize(streams_[local]), "cudaStreamSynchronize");
    return s;
  }
  absl::Status Copy(int dst_local, char* dst, int src_local, const char* src, int64_t bytes,
                    absl::Time deadline) override {
    absl::Status s = CudaStatus(cudaSetDevice(slabs_[dst_local]->device), "cudaSetDevice");
    if (s.ok()) {
      s = CudaStatus(
          cudaMemcpyPeerAsync(dst, slabs_[dst_local]->device, src, slabs_[src_local]->device,
                              static_cast<size_t>(bytes), streams_[dst_local]),
          "cudaMemcpyPeerAsync");
    }
    return s.ok() ? Wait(nullptr, "copy within the node", deadline) : s;
  }
  absl::Status Add(int local, float* dst, const float* src, int64_t elems,
                   absl::Time deadline) override {
    if (elems <= 0) return absl::OkStatus();
    absl::Status s = CudaStatus(cudaSetDevice(slabs_[local]->device), "cudaSetDevice");
    if (!s.ok()) return s;
    AddKernel<<<static_cast<unsigned>((elems + 255) / 256), 256, 0, streams_[local]>>>(dst, src,
                                                                                       elems);
    s = CudaStatus(cudaGetLastError(), "AddKernel launch");
    return s.ok() ? Wait(nullptr, "gradient accumulation", deadline) : s;
  }
  const char* base(int local) const override { return slabs_[local]->base; }
  const daemon::SegmentMemory* memory(int local) const override { return &slabs_[local]->memory; }
  void DescribeMemory(int local, v1::AttachResponse* resp) const override {
    resp->set_cuda_device(slabs_[local]->device);
    resp->set_cuda_ipc_handle(
        std::string(slabs_[local]->handle.reserved, sizeof(slabs_[local]->handle.reserved)));
  }
  int64_t staging_bytes() const override { return staging_bytes_; }

  absl::Status AllGather(const std::vector<const char*>& shards, const std::vector<char*>& out,
                         int64_t shard_elems, v1::DType dtype, absl::Time deadline,
                         uint64_t tag) override;
  absl::Status ReduceScatter(const std::vector<const void*>& grads, v1::DType dtype,
                             int64_t shard_elems, const std::vector<float*>& out, ReduceOp op,
                             const daemon::ScratchFn& scratch, absl::Time deadline,
                             uint64_t tag) override;
  absl::Status AllReduce(const std::vector<float*>& shards, int64_t shard_elems, ReduceOp op,
                         const daemon::ScratchFn& scratch, absl::Time deadline,
                         uint64_t tag) override;
  absl::Status MovePieces(const std::vector<daemon::PieceMove>& moves, absl::Time deadline,
                          uint64_t tag) override;

 private:
  CudaTransport() = default;
  // Waits for every local stream; aborts `group` at the deadline or on an NCCL error.
  absl::Status Wait(NcclGroup* group, const char* what, absl::Time deadline);
  // After a failure with work of `group` queued: aborts its communicators (their kernels exit)
  // and drains every stream, so that no queued kernel outlives the buffers the data plane then
  // releases; later operations fail at once (Usable). Returns `why`.
  absl::Status Fail(NcclGroup* group, absl::Status why);
  static absl::Status Usable(const NcclGroup* group) {
    if (group == nullptr || group->comms.empty()) {
      return absl::FailedPreconditionError(
          "the job's NCCL communicators were aborted by an earlier failure");
    }
    return absl::OkStatus();
  }

  int64_t shard_ = 0;
  std::vector<std::unique_ptr<Slab>> slabs_;  // by local rank
  std::vector<cudaStream_t> streams_;         // by local rank
  std::unique_ptr<NcclGroup> shard_group_, replicate_group_;
  int64_t staging_bytes_ = 0;
};

// Runs `body` between ncclGroupStart and ncclGroupEnd; the first error wins.
absl::Status Grouped(const std::function<absl::Status()>& body) {
  absl::Status s = NcclStatus(N().GroupStart(), "ncclGroupStart");
  if (s.ok()) s = body();
  absl::Status end = NcclStatus(N().GroupEnd(), "ncclGroupEnd");
  return s.ok() ? end : s;
}

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
      absl::Status s = NcclStatus(N().GetUniqueId(&ids[i]), "ncclGetUniqueId");
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
  absl::Status s = Grouped([&] {
    for (int i = 0; i < k; ++i) {
      absl::Status st = CudaStatus(cudaSetDevice(devices[i]), "cudaSetDevice");
      if (st.ok()) {
        st = NcclStatus(N().CommInitRank(&group->comms[i], size, ids[i], rank(i)),
                        "ncclCommInitRank");
      }
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return group;
}

absl::StatusOr<std::unique_ptr<CudaTransport>> CudaTransport::Create(const BackendContext& c,
                                                                     const daemon::NodeMesh& mesh) {
  const int count = DeviceCount();
  if (count == 0) return absl::FailedPreconditionError("GPU backend: no CUDA device");
  if (auto nccl = Nccl(); !nccl.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("GPU backend: ", nccl.status().message()));
  }
  const int k = static_cast<int>(c.local_ranks.size());
  if (k > count) {
    // NCCL refuses two ranks of one communicator on one device.
    return absl::FailedPreconditionError(
        absl::StrCat("GPU backend: the job has ", k, " ranks on this node and it has ", count,
                     " visible GPU(s); each local rank needs a GPU of its own"));
  }
  std::unique_ptr<CudaTransport> t(new CudaTransport());
  t->shard_ = mesh.shard;
  std::vector<int> devices;
  for (int i = 0; i < k; ++i) {
    devices.push_back(i);
    auto slab = std::make_unique<Slab>();
    slab->device = devices[i];
    absl::Status s = CudaStatus(cudaSetDevice(slab->device), "cudaSetDevice");
    if (s.ok()) s = CudaStatus(cudaMalloc(&slab->base, c.gpu_pool_bytes), "cudaMalloc (GPU pool)");
    if (s.ok()) {
      s = CudaStatus(cudaIpcGetMemHandle(&slab->handle, slab->base), "cudaIpcGetMemHandle");
    }
    if (!s.ok()) return s;
    auto pool = daemon::Pool::CreateOver(slab->base, c.gpu_pool_bytes);
    if (!pool.ok()) return pool.status();
    slab->pool = std::move(*pool);
    cudaStream_t stream = nullptr;
    s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    if (!s.ok()) return s;
    t->slabs_.push_back(std::move(slab));
    t->streams_.push_back(stream);
  }
  const int64_t f = mesh.shard;
  auto shard = CreateGroups(
      c, devices, static_cast<int>(f),
      [&](int i) { return absl::StrCat("nccl/shard/", c.local_ranks[i] / f); },
      [&](int i) { return static_cast<int>(c.local_ranks[i] % f); });
  if (!shard.ok()) return shard.status();
  t->shard_group_ = std::move(*shard);
  if (mesh.replicas > 1) {
    auto rep = CreateGroups(
        c, devices, static_cast<int>(mesh.replicas),
        [&](int i) { return absl::StrCat("nccl/replicate/", c.local_ranks[i] % f); },
        [&](int i) { return static_cast<int>(c.local_ranks[i] / f); });
    if (!rep.ok()) return rep.status();
    t->replicate_group_ = std::move(*rep);
  }
  return t;
}

absl::Status CudaTransport::Wait(NcclGroup* group, const char* what, absl::Time deadline) {
  const auto spin_until = std::chrono::steady_clock::now() + kWaitSpin;
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
        N().CommGetAsyncError(comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          return Fail(group, absl::UnavailableError(absl::StrCat(
                                 what, ": NCCL reported ", N().GetErrorString(async),
                                 " (a peer is lost or failed); the job's communicators are "
                                 "aborted")));
        }
      }
    }
    if (absl::Now() >= deadline) {
      return Fail(group, absl::DeadlineExceededError(absl::StrCat(
                             what,
                             " did not complete before the deadline (a peer is lost or "
                             "stalled); the job's NCCL communicators are aborted")));
    }
    if (std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kWaitSleep);
    }
  }
}

absl::Status CudaTransport::Fail(NcclGroup* group, absl::Status why) {
  if (group != nullptr) {
    group->aborted = true;
    for (ncclComm_t comm : group->comms) N().CommAbort(comm);
    group->comms.clear();
  }
  for (size_t i = 0; i < streams_.size(); ++i) {
    if (cudaSetDevice(slabs_[i]->device) == cudaSuccess) (void)cudaStreamSynchronize(streams_[i]);
  }
  return why;
}

absl::Status CudaTransport::AllGather(const std::vector<const char*>& shards,
                                      const std::vector<char*>& out, int64_t shard_elems,
                                      v1::DType dtype, absl::Time deadline, uint64_t) {
  if (absl::Status s = Usable(shard_group_.get()); !s.ok()) return s;
  auto type = NcclType(dtype);
  if (!type.ok()) return type.status();
  absl::Status s = Grouped([&] {
    for (size_t i = 0; i < out.size(); ++i) {
      // The persistent shard is the send buffer; NCCL places it in its slice of the output.
      absl::Status st =
          NcclStatus(N().AllGather(shards[i], out[i], static_cast<size_t>(shard_elems), *type,
                                   shard_group_->comms[i], streams_[i]),
                     "ncclAllGather");
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  });
  return s.ok() ? Wait(shard_group_.get(), "unshard", deadline) : Fail(shard_group_.get(), s);
}

absl::Status CudaTransport::ReduceScatter(const std::vector<const void*>& grads, v1::DType dtype,
                                          int64_t shard_elems, const std::vector<float*>& out,
                                          ReduceOp op, const daemon::ScratchFn& scratch,
                                          absl::Time deadline, uint64_t) {
  if (absl::Status s = Usable(shard_group_.get()); !s.ok()) return s;
  const ncclRedOp_t red = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
  const size_t k = grads.size();
  if (dtype == v1::DTYPE_FP32) {
    absl::Status s = Grouped([&] {
      for (size_t i = 0; i < k; ++i) {
        absl::Status st =
            NcclStatus(N().ReduceScatter(grads[i], out[i], static_cast<size_t>(shard_elems),
                                         ncclFloat32, red, shard_group_->comms[i], streams_[i]),
                       "ncclReduceScatter");
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    });
    return s.ok() ? Wait(shard_group_.get(), "reduce_scatter", deadline)
                  : Fail(shard_group_.get(), s);
  }
  // Accumulate in fp32: each chunk of the F blocks converted side by side, then reduced; the
  // stream orders the next chunk's conversion after this chunk's reduction.
  const int64_t width =
      std::max<int64_t>(1, std::min(shard_elems, kConvertChunkBytes / (4 * shard_)));
  std::vector<daemon::Lease> bufs;
  for (size_t i = 0; i < k; ++i) {
    auto l = scratch(static_cast<int>(i), "reduce-scatter conversion scratch", shard_ * width * 4);
    if (!l.ok()) return l.status();
    bufs.push_back(std::move(*l));
  }
  for (int64_t first = 0; first < shard_elems; first += width) {
    const int64_t w = std::min(width, shard_elems - first);
    for (size_t i = 0; i < k; ++i) {
      absl::Status s = CudaStatus(cudaSetDevice(slabs_[i]->device), "cudaSetDevice");
      if (!s.ok()) return Fail(shard_group_.get(), s);
      ToFloat<<<static_cast<unsigned>((w * shard_ + 255) / 256), 256, 0, streams_[i]>>>(
          static_cast<const uint16_t*>(grads[i]), dtype == v1::DTYPE_BF16, shard_elems, first, w,
          shard_, reinterpret_cast<float*>(bufs[i].data()));
      s = CudaStatus(cudaGetLastError(), "ToFloat launch");
      if (!s.ok()) return Fail(shard_group_.get(), s);
      staging_bytes_ += w * shard_ * 4;
    }
    absl::Status s = Grouped([&] {
      for (size_t i = 0; i < k; ++i) {
        absl::Status st =
            NcclStatus(N().ReduceScatter(bufs[i].data(), out[i] + first, static_cast<size_t>(w),
                                         ncclFloat32, red, shard_group_->comms[i], streams_[i]),
                       "ncclReduceScatter");
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    });
    if (!s.ok()) return Fail(shard_group_.get(), s);
  }
  // The scratch goes back to the pool only once the streams are done with it.
  return Wait(shard_group_.get(), "reduce_scatter", deadline);
}

absl::Status CudaTransport::AllReduce(const std::vector<float*>& shards, int64_t shard_elems,
                                      ReduceOp op, const daemon::ScratchFn&, absl::Time deadline,
                                      uint64_t) {
  if (absl::Status s = Usable(replicate_group_.get()); !s.ok()) return s;
  absl::Status s = Grouped([&] {
    for (size_t i = 0; i < shards.size(); ++i) {
      absl::Status st =
          NcclStatus(N().AllReduce(shards[i], shards[i], static_cast<size_t>(shard_elems),
                                   ncclFloat32, op == ReduceOp::kAvg ? ncclAvg : ncclSum,
                                   replicate_group_->comms[i], streams_[i]),
                     "ncclAllReduce");
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  });
  return s.ok() ? Wait(replicate_group_.get(), "all_reduce", deadline)
                : Fail(replicate_group_.get(), s);
}

absl::Status CudaTransport::MovePieces(const std::vector<daemon::PieceMove>& moves,
                                       absl::Time deadline, uint64_t) {
  if (absl::Status s = Usable(shard_group_.get()); !s.ok()) return s;
  absl::Status s = Grouped([&] {
    for (const daemon::PieceMove& m : moves) {
      const size_t count = static_cast<size_t>(m.count);
      absl::Status st;
      if (m.src_local >= 0 && m.src_local == m.dst_local) {
        st = CudaStatus(cudaSetDevice(slabs_[m.src_local]->device), "cudaSetDevice");
        if (!st.ok()) return st;
        st = CudaStatus(cudaMemcpyAsync(m.dst, m.src, count * sizeof(float),
                                        cudaMemcpyDeviceToDevice, streams_[m.src_local]),
                        "cudaMemcpyAsync");
        if (!st.ok()) return st;
        continue;
      }
      // Between GPUs, local or not: a send on the source's communicator, a receive on the
      // destination's, in one group.
      if (m.src_local >= 0) {
        st = NcclStatus(N().Send(m.src, count, ncclFloat32, static_cast<int>(m.dst_position),
                                 shard_group_->comms[m.src_local], streams_[m.src_local]),
                        "ncclSend");
      }
      if (st.ok() && m.dst_local >= 0) {
        st = NcclStatus(N().Recv(m.dst, count, ncclFloat32, static_cast<int>(m.src_position),
                                 shard_group_->comms[m.dst_local], streams_[m.dst_local]),
                        "ncclRecv");
      }
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  });
  return s.ok() ? Wait(shard_group_.get(), "matrix pieces", deadline) : Fail(shard_group_.get(), s);
}

}  // namespace

absl::StatusOr<char*> SlabBase(const daemon::DataBackend& backend, int local) {
  const auto* dp = dynamic_cast<const daemon::JobDataPlane*>(&backend);
  if (dp == nullptr || std::string(dp->name()) != "cuda") {
    return absl::InvalidArgumentError("not a GPU backend");
  }
  return const_cast<char*>(dp->transport().base(local));
}

absl::StatusOr<std::unique_ptr<daemon::DataBackend>> CreateGpuDataPlane(
    const daemon::BackendContext& context) {
  auto mesh = daemon::NodeMesh::Of(*context.plan, context.local_ranks,
                                   context.nodes ? context.nodes->rank() : context.node_index,
                                   context.nodes ? context.nodes->size() : context.node_count,
                                   context.replicas);
  if (!mesh.ok()) return mesh.status();
  auto transport = CudaTransport::Create(context, *mesh);
  if (!transport.ok()) return transport.status();
  auto dp = daemon::JobDataPlane::Create(*context.plan, *mesh, std::move(*transport), nullptr);
  if (!dp.ok()) return dp.status();
  return std::unique_ptr<daemon::DataBackend>(std::move(*dp));
}

}  // namespace ragshard::gpu

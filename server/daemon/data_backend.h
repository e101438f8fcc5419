// What a job's operations run on, behind one interface: the host data plane (memfd pool,
// in-memory reduction on the node, UCX between daemons; job_data_plane.h) in its two shapes
// (node-shared unsharded buffers, or the device shape: one private unsharded buffer per rank),
// or the GPU one (CUDA slabs exported as IPC handles, NCCL communicators per process group;
// cuda/gpu_data_plane.h), all one JobDataPlane over a Transport (transport.h). CreateDataBackend
// picks one. The daemon's job thread calls one operation at a time.
//
// JobDataPlane is its one production implementation, and Transport is where the backends
// differ; the interface stays as the job layer's seam: JobRuntime runs any DataBackend, and
// tests/server/daemon/job_runtime_test.cc drives it with a fake one that fails or blocks on cue
// (a lost peer, an operation stuck on the job thread), which no Transport below JobDataPlane's
// unit bookkeeping could express.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "protocol/pool_contract.h"
#include "ragshard/v1/daemon.pb.h"
#include "ragshard/v1/plan.pb.h"
#include "server/daemon/collectives.h"
#include "server/daemon/comm.h"
#include "server/daemon/pool.h"
#include "server/daemon/state_blob.h"

namespace ragshard::daemon {

class DataBackend {
 public:
  virtual ~DataBackend() = default;
  virtual const char* name() const = 0;
  virtual int units() const = 0;
  virtual int64_t replicas() const = 0;
  // Bytes written into pool buffers outside the collectives' own transfers and reductions.
  virtual int64_t staging_bytes() const = 0;

  // Allocates the unit's unsharded parameters (when released) and all-gathers into them.
  virtual absl::Status Unshard(int unit, absl::Time deadline) = 0;
  // The same allocation without the all-gather (the client fills the buffer).
  virtual absl::Status AllocateUnsharded(int unit) = 0;
  // Releases the unsharded parameters, or with keep > 1 keeps them over groups of `keep` local
  // ranks until the next Unshard (FSDP2's reshard_after_forward=keep).
  virtual absl::Status Reshard(int unit, int64_t keep) = 0;
  // Allocates the unit's unsharded gradients, zero-filled, unless they exist.
  virtual absl::Status AllocateGrad(int unit) = 0;
  // Reduces the gradients into the gradient shards (`accumulate`: added to what each holds) and
  // releases them.
  virtual absl::Status ReduceScatter(int unit, ReduceOp op, bool accumulate,
                                     absl::Time deadline) = 0;
  virtual absl::Status AllReduce(int unit, ReduceOp op, absl::Time deadline) = 0;
  virtual absl::Status GatherToOwner(int unit, absl::Time deadline) = 0;
  virtual absl::Status ScatterFromOwner(int unit, absl::Time deadline) = 0;
  // AMSP's update gather after an optimizer step on separate factors (OP_UPDATE_GATHER).
  virtual absl::Status UpdateGather(int unit, absl::Time deadline) = 0;

  // A recovery in place (docs/recovery.md): every transient buffer (unsharded parameters, kept
  // parts, gradients, owner buffers) goes back to the pool and the operation count restarts,
  // as at setup; the persistent shards keep their contents.
  virtual void ResetTransient() = 0;

  // Local rank `local`'s persistent parameter shard of `unit` as a segment of its protected
  // state (named pool::ShardName(unit), in the memory it lives in: the redundancy of
  // docs/recovery.md, "A lost node", reads and rebuilds it through it); data nullptr where the
  // backend has none.
  virtual StateSegment ParamShardSegment(int unit, int local) const {
    (void)local;
    return {pool::ShardName(unit)};
  }
  // A state buffer of local rank `local`'s that lives beside its parameter shards
  // (pool::InRankMemory): `bytes`, zeroed, from the rank's own memory (its GPU's slab on the
  // CUDA backend), and how the daemon reaches it (nullptr: host memory). UNIMPLEMENTED where the
  // backend has no memory of its own (such buffers are then the pool's, as the others).
  virtual absl::StatusOr<Lease> AllocateRankState(int local, int64_t bytes) const {
    (void)local;
    (void)bytes;
    return absl::UnimplementedError("no memory of the ranks' own");
  }
  virtual const SegmentMemory* rank_memory(int local) const {
    (void)local;
    return nullptr;
  }

  // Where local rank `local`'s buffers of `unit` are now (transient ones -1 while released).
  virtual void Placement(int unit, int local, v1::UnitBuffers* out) const = 0;
  // The buffers of local rank `local` (and whatever a client needs to map them) for Attach.
  virtual void Describe(int local, const v1::Plan& plan, v1::AttachResponse* resp) const = 0;
};

// One piece of an OPTIMIZER_MATRIX tensor: the part of it that one rank's shard holds.
struct MatrixPiece {
  int owner;     // os position of the tensor's owner (the planner's owner_rank)
  int holder;    // os position of the rank holding the piece
  int64_t elem;  // element offset of the piece in the unit's unsharded layout
  int64_t count;
  // Element offset of the piece in its owner's packed buffer: the owner's matrices of the unit
  // one after another in plan order.
  int64_t packed = 0;
};

// The pieces of the unit's matrix tensors in plan order, for a shard group of `f` ranks;
// INVALID_ARGUMENT names a tensor whose owner is not in [0, f). `packed_elems`, when given,
// receives each shard position's packed owner-buffer size.
absl::StatusOr<std::vector<MatrixPiece>> MatrixPieces(const v1::UnitPlan& unit, int64_t f,
                                                      std::vector<int64_t>* packed_elems = nullptr);

// kDeviceShaped is the host data plane in the shape of a GPU: each rank has private unsharded
// buffers and nothing is shared by a node's ranks, so the GPU path's logic runs without a GPU.
// kAuto is a request only: ResolveBackendKind turns it into kCuda or kHost.
enum class BackendKind { kHost, kDeviceShaped, kCuda, kAuto };

// Parses "host", "device-shaped", "cuda" or "auto"; INVALID_ARGUMENT names anything else.
absl::StatusOr<BackendKind> ParseBackendKind(const std::string& name);

struct BackendContext {
  const v1::Plan* plan = nullptr;
  std::vector<int64_t> local_ranks;
  int64_t replicas = 1;
  Pool* host_pool = nullptr;  // the daemon's memfd pool (host backend)
  Comm* nodes = nullptr;      // among the job's nodes, or nullptr for one node
  int node_index = 0, node_count = 1;
  // The job's rendezvous through the planner (GPU backend: NCCL unique ids).
  std::function<absl::Status(const std::string& key, const std::string& value)> put;
  std::function<absl::StatusOr<std::string>(const std::string& key)> get;
  absl::Time deadline = absl::InfiniteFuture();
  int64_t gpu_pool_bytes = 0;
};

// The backend jobs will use; the daemon calls it once at start. The CUDA backend can run where
// this build has CUDA, a CUDA device is usable and NCCL opens (nccl_api.h). kAuto gives kCuda
// there and kHost elsewhere, logging which and why. kCuda where the CUDA backend cannot run is
// FAILED_PRECONDITION naming the reason (the daemon exits with it: it does not fall back).
absl::StatusOr<BackendKind> ResolveBackendKind(BackendKind requested);

// Creates a job's backend from a resolved kind (not kAuto); kCuda must have been resolved to a
// usable device first.
absl::StatusOr<std::unique_ptr<DataBackend>> CreateDataBackend(BackendKind kind,
                                                               const BackendContext& context);

}  // namespace ragshard::daemon

// What a data-plane backend supplies to the one data plane (job_data_plane.h): memory for each
// local rank and the collectives over it. The data plane owns everything else (units, buffer
// lifetimes, the matrix pieces' routes, operation sequencing and message stamps), so the host
// backend (memfd pool, node-level reduction, UCX between daemons: host_transport.h) and the CUDA
// backend (a slab per device, NCCL: cuda/cuda_transport.h) run the same code above this line.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "engine/sharding.h"
#include "ragshard/v1/daemon.pb.h"
#include "ragshard/v1/plan.pb.h"
#include "server/daemon/collectives.h"
#include "server/daemon/pool.h"
#include "server/daemon/state_blob.h"

namespace ragshard::daemon {

// The job's sharding as one node sees it (engine/sharding.h): N nodes of k ranks, node i
// holding ranks [i*k, (i+1)*k). For each factor x (p: parameters, g: gradients, os: optimizer
// state) of shape A x B the node holds A "slots": slot t serves its local ranks l with
// l mod A == t, which are replicas of each other in x. Without separate factors p = g = os is a
// shard group of F ranks (whole nodes, or a divisor of a node's ranks) repeated W / F times.
struct NodeMesh {
  Sharding sharding;
  int node = 0, nodes = 1;
  int64_t local = 0;     // k
  int64_t shard = 0;     // |p|: the plan's world size (the unsharded buffer is |p| shards)
  int64_t replicas = 1;  // W / |g|: the gradients' replicas, which the all-reduce sums

  // UNIMPLEMENTED names the rule a mesh breaks; INVALID_ARGUMENT for no ranks or R < 1.
  static absl::StatusOr<NodeMesh> Of(const v1::Plan& plan, const std::vector<int64_t>& local_ranks,
                                     int node, int nodes, int64_t replicas);
  int64_t slots(Factor f) const { return sharding.shape(f).intra; }
  int Slot(Factor f, int local_rank) const { return static_cast<int>(local_rank % slots(f)); }
  // The position of local rank (or slot) `l` in factor f's layout.
  int64_t Position(Factor f, int64_t l) const { return sharding.Position(f, node, l); }
  // The p position of slot 0: the node's p slots hold positions [first_position, + slots(p)).
  int64_t first_position() const { return Position(Factor::kP, 0); }
  // Nodes over which the gradient shards are all-reduced (W / |g| replicas, less the ones on
  // this node, which the reduce-scatter sums in memory).
  int64_t node_replicas() const { return sharding.nodes / sharding.g.inter; }
  // True when every local rank has positions of its own in every factor and the node's p, g
  // and os slots are its ranks in order (shard groups of whole nodes, p = g = os): the only
  // shape some backends run.
  bool whole_nodes_uniform() const { return sharding.uniform() && slots(Factor::kP) == local; }
};

// Elements of a node's block of gradient shards (`slots` * S), padded to a multiple of the
// node-level replicas so that the replicate all-reduce splits it into equal chunks in place.
int64_t GradShardBlockElems(const NodeMesh& mesh, int64_t slots, int64_t shard_elems);

// Transient memory for one operation of a unit, named in RESOURCE_EXHAUSTED (the data plane's).
using ScratchFn = std::function<absl::StatusOr<Lease>(int local, const char* what, int64_t bytes)>;

// One matrix piece's move between a gradient shard and an owner buffer (fp32). A local end has
// its local rank and pointer; a remote end has local -1 and only its shard position.
struct PieceMove {
  int src_local = -1, dst_local = -1;
  int64_t src_position = 0, dst_position = 0;
  const float* src = nullptr;
  float* dst = nullptr;
  int64_t count = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // True: the node's ranks share one unsharded buffer of a unit (host memory). False: each rank
  // has its own (the shape of a GPU).
  virtual bool shares_unsharded() const = 0;
  // True: the node's ranks' parameter shards and gradient shards of a unit are one block each
  // (local rank i at i * S), the node's collectives working on the block. False: one per rank.
  virtual bool node_blocks() const = 0;
  // True: local ranks that are replicas in a factor (NodeMesh) share one slot of its block
  // (host memory); false: every rank has a slot of its own (the shape of a GPU).
  virtual bool shares_replicas() const { return false; }
  // Whether the transport runs this sharding; the data plane refuses others, naming the mesh.
  virtual bool runs_sharding(const NodeMesh& mesh) const { return mesh.whole_nodes_uniform(); }

  // Memory of local rank `local` (the node's pool, or the rank's device). The data plane names
  // the unit in a RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<Lease> Allocate(int local, int64_t bytes) = 0;
  // Zero-fills, complete on return.
  virtual absl::Status Zero(int local, char* data, int64_t bytes) = 0;
  // Copies between local ranks' memory (within a node: the intra-node part of a collective);
  // complete on return.
  virtual absl::Status Copy(int dst_local, char* dst, int src_local, const char* src, int64_t bytes,
                            absl::Time deadline) = 0;
  // dst[i] += src[i] for i < elems, both fp32 in local rank `local`'s memory (gradient
  // accumulation: a reduction added to what a gradient shard held); complete on return.
  virtual absl::Status Add(int local, float* dst, const float* src, int64_t elems,
                           absl::Time deadline) = 0;
  // How the daemon reads and writes local rank `local`'s memory (the redundancy's segments:
  // state_blob.h): nullptr where it is this process's host memory, used directly.
  virtual const SegmentMemory* memory(int local) const { return nullptr; }
  // The memfd of the node's shared memory, into which the data plane may map unsharded views
  // (protocol/unsharded_view.h), or -1 where buffers cannot be composed so.
  virtual int view_fd() const { return -1; }
  // Offset 0 of local rank `local`'s arena: Placement's offsets are from it.
  virtual const char* base(int local) const = 0;
  // What a client needs to map local rank `local`'s memory besides offsets (a CUDA IPC handle).
  virtual void DescribeMemory(int local, v1::AttachResponse* resp) const = 0;
  // Bytes the transport wrote outside the collectives' transfers and reductions.
  virtual int64_t staging_bytes() const = 0;

  // Unshard: `shards[i]` is local rank i's parameter shard (`shard_elems` of `dtype`); `out`
  // holds one buffer (shares_unsharded) or one per local rank, each F * shard_elems. Placing
  // the local shards is part of the collective.
  virtual absl::Status AllGather(const std::vector<const char*>& shards,
                                 const std::vector<char*>& out, int64_t shard_elems,
                                 v1::DType dtype, absl::Time deadline, uint64_t tag) = 0;
  // `grads[i]` is local rank i's unsharded gradient (F * shard_elems of `dtype`: fp32, bf16 or
  // fp16); `out[i]` its gradient shard, which receives the sum (or mean) over the shard group,
  // accumulated in fp32.
  virtual absl::Status ReduceScatter(const std::vector<const void*>& grads, v1::DType dtype,
                                     int64_t shard_elems, const std::vector<float*>& out,
                                     ReduceOp op, const ScratchFn& scratch, absl::Time deadline,
                                     uint64_t tag) = 0;
  // In-place sum (or mean) of the gradient shards over the R replicas; `shards` as in
  // ReduceScatter's `out`. Called only when R > 1.
  virtual absl::Status AllReduce(const std::vector<float*>& shards, int64_t shard_elems,
                                 ReduceOp op, const ScratchFn& scratch, absl::Time deadline,
                                 uint64_t tag) = 0;
  // AMSP's update gather, after an optimizer step on separate factors: `shards[i]` is local rank
  // i's parameter shard (`shard_elems` of `dtype`), of which it updated its os range
  // (`os_elems` at its os position); on return every shard holds every update of its range.
  virtual absl::Status UpdateGather(const std::vector<char*>& shards, int64_t shard_elems,
                                    int64_t os_elems, v1::DType dtype, absl::Time deadline,
                                    uint64_t tag) {
    return absl::UnimplementedError(absl::StrCat(name(), ": no update gather (separate factors)"));
  }
  // The matrix pieces this node takes part in, in plan order (both ends of the job walk the same
  // order): local copies, and transfers with the shard group's other ranks.
  virtual absl::Status MovePieces(const std::vector<PieceMove>& moves, absl::Time deadline,
                                  uint64_t tag) = 0;
};

}  // namespace ragshard::daemon

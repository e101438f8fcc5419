// What the daemon's data plane allocates at its peak (server/daemon/job_data_plane.h), as one
// function that both the strategy model (engine/strategy.h) and the memory benchmark
// (bench/memory_report.py, through the Python binding) use, so the model's memory is the data
// plane's by construction.
//
// Persistent: the parameter shards (S_p of the parameter dtype) and the fp32 gradient shards
// (S_g; S_p when p = g), one per slot of the node's blocks: A_p and A_g slots where the ranks
// share memory (the host backend, whose local replicas of a factor share a slot), one per rank
// otherwise (engine/sharding.h). Transient: the unsharded parameters of the units in flight
// (the one in use and `prefetch` ahead: U of the parameter dtype each, one per node when the
// node's ranks share it, else one per rank) and one unit's unsharded gradients (U of the
// parameter dtype per rank), where U is the largest unit's |p| * S_p. A shared buffer whose
// node's shards are whole pages is a view over them (protocol/unsharded_view.h) and allocates only
// U - A_p * S_p. Optimizer state (fp32 masters, moments) and activations live in the training
// process and are modelled apart. The host transport's reduce-scatter ring between nodes takes
// 2 * A_g * S_g fp32 of scratch for the operation (the largest unit's), beside its gradients:
// counted where `g_ring_nodes` (B_g) is above 1; a GPU's NCCL needs none.
#pragma once

#include <cstdint>
#include <vector>

namespace ragshard {

struct DataPlaneUnit {
  int64_t shard_elems = 0;        // S_p
  int64_t group = 1;              // |p| (F): the unsharded buffer is group * S_p
  double param_bytes = 4;         // bytes per element of the parameter dtype
  int64_t grad_shard_elems = -1;  // S_g; -1: S_p
};

struct DataPlaneMemory {
  double shards = 0;       // parameter shards
  double grad_shards = 0;  // fp32 gradient shards
  double unsharded = 0;    // unsharded parameters in flight
  double grads = 0;        // one unit's unsharded gradients
  double scratch = 0;      // the reduce-scatter ring's, between nodes
  double total() const { return shards + grad_shards + unsharded + grads + scratch; }
};

// The peak for `ranks` ranks whose memory is counted together (a node's k ranks, or 1 for a
// device), with unsharded parameters shared by those ranks (`shared`: the host backend) or one
// per rank (the device shape and GPUs); the node's blocks hold `p_slots` parameter and `g_slots`
// gradient shards (-1: one per rank); the gradients' reduce-scatter runs a ring between
// `g_ring_nodes` nodes whose chunks are `g_ring_slots` gradient shards (A_g; -1: g_slots).
DataPlaneMemory DataPlanePeak(const std::vector<DataPlaneUnit>& units, int64_t ranks, bool shared,
                              int64_t prefetch, int64_t p_slots = -1, int64_t g_slots = -1,
                              int64_t g_ring_nodes = 1, int64_t g_ring_slots = -1);

}  // namespace ragshard

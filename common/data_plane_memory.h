// What the daemon's data plane allocates at its peak (server/daemon/job_data_plane.h), as one
// function that both the strategy model (common/strategy.h) and the memory benchmark
// (bench/memory_report.py, through the Python binding) use, so the model's memory is the data
// plane's by construction.
//
// Persistent, per rank: the parameter shard (S of the parameter dtype) and the fp32 gradient
// shard (S). Transient: the unsharded parameters of the units in flight (the one in use and
// `prefetch` ahead: U of the parameter dtype each, one per node when the node's ranks share it,
// else one per rank) and one unit's unsharded gradients (U of the parameter dtype per rank),
// where U is the largest unit's F * S. A shared buffer whose node's shards are whole pages is a
// view over them (common/unsharded_view.h) and allocates only F * S - k * S. Optimizer state
// (fp32 masters, moments) and activations live in the training process and are modelled apart.
// The reduce-scatter's ring scratch between nodes (2 * k * S fp32 of the largest unit, for one
// operation) is left out: it is under 1 / F of U per rank.
#pragma once

#include <cstdint>
#include <vector>

namespace ragshard {

struct DataPlaneUnit {
  int64_t shard_elems = 0;  // S
  int64_t group = 1;        // F, the shard group's size
  double param_bytes = 4;   // bytes per element of the parameter dtype
};

struct DataPlaneMemory {
  double shards = 0;       // parameter shards
  double grad_shards = 0;  // fp32 gradient shards
  double unsharded = 0;    // unsharded parameters in flight
  double grads = 0;        // one unit's unsharded gradients
  double total() const { return shards + grad_shards + unsharded + grads; }
};

// The peak for `ranks` ranks whose memory is counted together (a node's k ranks, or 1 for a
// device), with unsharded parameters shared by those ranks (`shared`: the host backend) or one
// per rank (the device shape and GPUs).
DataPlaneMemory DataPlanePeak(const std::vector<DataPlaneUnit>& units, int64_t ranks, bool shared,
                              int64_t prefetch);

}  // namespace ragshard

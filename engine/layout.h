// A policy-neutral description of how a model's tensors are spread over ranks, and the metric
// code that judges every policy (RaggedShard plans and the baselines) the same way.
//
// Every policy we model gives each rank an equal-size buffer per collective group, and maps a
// tensor's elements to ranks periodically: element x of a tensor lies on rank
//   rank_base + floor((start + x) / period).
// A flat layout (RaggedShard, FSDP1, Megatron) has period = the shard size and start = the
// tensor's offset in the group's flat buffer; a per-parameter layout (FSDP2, ZeRO-3) has
// start = 0 and period = the tensor's chunk size. This keeps the description O(tensors), never
// O(tensors x W), so DeepSeek-V3 at W = 65536 is cheap to measure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

struct TensorLayout {
  // Not owned; they outlive the layout (they point into the inventory or the plan).
  const std::string* name = nullptr;
  const google::protobuf::RepeatedField<int64_t>* shape = nullptr;
  int64_t numel = 0;
  int64_t start = 0;
  int64_t period = 1;
  int64_t rank_base = 0;
};

struct GroupLayout {
  std::string name;  // unit, or bucket for Megatron
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  int64_t per_rank_elems = 0;  // buffer each rank holds for this group, padding included
  std::vector<TensorLayout> tensors;
  // Bytes one rank copies per step for this group outside the collectives (see policies).
  int64_t copy_bytes_per_step = 0;
};

struct Layout {
  int64_t world = 0;
  std::vector<GroupLayout> groups;
};

// One contiguous run of a tensor on one rank: tensor elements [tensor_begin, tensor_begin+count).
struct Segment {
  int64_t rank = 0;
  int64_t tensor_begin = 0;
  int64_t count = 0;
};

// The runs of one tensor, rank by rank (O(ranks touched)).
std::vector<Segment> TensorSegments(const TensorLayout& t);

// Blocks of `block` x `block` elements (over the last two dimensions, per matrix of a 3-D or
// higher tensor) that hold elements of more than one rank. Vectors have no blocks.
struct BlockCount {
  int64_t split = 0;
  int64_t total = 0;
};
BlockCount CountSplitBlocks(const TensorLayout& t, int64_t block);

// Computes every layout figure except the lower-bound gaps and owner figures, which depend on
// the planner. Checks that each tensor lies on ranks [0, W); an error names the tensor.
absl::Status ComputeLayoutMetrics(const Layout& layout, v1::LayoutMetrics* out);

// Per-group figures, in group order.
absl::Status ComputeGroupMetrics(const Layout& layout, size_t group, v1::LayoutMetrics* out);

// The page of a node's unsharded views (protocol/unsharded_view.h).
inline constexpr int64_t kViewPageBytes = 4096;

// True when a node's k shards of S elements of `item` bytes can be mapped into its unsharded
// view (k * S * item a whole number of pages): the daemon's rule for composing a view, which the
// data plane's memory model (data_plane_memory.h) and the strategy model follow.
inline bool AliasesShards(int64_t local_ranks, int64_t shard_elems, int64_t item_bytes) {
  const int64_t own = local_ranks * shard_elems * item_bytes;
  return own > 0 && own % kViewPageBytes == 0;
}

}  // namespace ragshard

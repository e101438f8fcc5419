// Collectives over a Comm: ring algorithms for large messages, direct exchange for small ones
// (docs/collectives.md explains the choice). Every call has a deadline; an error names the peer.
// `tag_base` is the operation's MessageStamp tag with index 0 (comm.h); the collectives number
// their messages from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "ragshard/v1/plan.pb.h"
#include "server/daemon/comm.h"
#include "server/daemon/reduce_kernels.h"  // the element kernels, for the collectives' users

namespace ragshard::daemon {

enum class ReduceOp { kSum, kAvg };

// Below this many bytes per block, all-gather exchanges directly with every peer at once.
inline constexpr size_t kDirectMaxBlockBytes = 64 * 1024;

// `buffer` holds size() blocks of `block_bytes`; block rank() is filled on entry, every block on
// return. Nothing is copied outside the transfers themselves.
absl::Status AllGather(Comm& comm, char* buffer, size_t block_bytes, absl::Time deadline,
                       uint64_t tag_base);
// The same with this member's block read from `own` (its persistent shard), as ncclAllGather
// with separate send and receive buffers: the collective places it into block rank() of
// `buffer` itself, in steps of kPlacementStepBytes while it waits for its peers (Comm's idle
// work), so that the copy takes the time the transfers leave this thread, not time of its own.
// `own` must not overlap the other blocks of `buffer`.
absl::Status AllGather(Comm& comm, const char* own, char* buffer, size_t block_bytes,
                       absl::Time deadline, uint64_t tag_base);
inline constexpr size_t kPlacementStepBytes = size_t{1} << 20;

// Ring steps are pipelined: a step's message travels in pieces of at least kMinPieceBytes (at
// most kMaxPieces of them), so that reducing or forwarding one piece overlaps the transfer of
// the next (docs/collectives.md). PiecesFor gives the count for one step's bytes.
inline constexpr size_t kMinPieceBytes = size_t{1} << 20;
inline constexpr size_t kMaxPieces = 16;
size_t PiecesFor(size_t step_bytes, int members);

// `input` holds size() chunks of `count` elements of `dtype` (fp32, bf16 or fp16); on return
// `output` (count fp32 elements) holds the sum (or mean) over members of chunk rank(),
// accumulated in fp32. `scratch` must hold 2 * count floats.
absl::Status ReduceScatter(Comm& comm, const void* input, v1::DType dtype, size_t count,
                           float* output, ReduceOp op, float* scratch, absl::Time deadline,
                           uint64_t tag_base);
// Where each member's chunk lies in the inputs when chunks are not consecutive (a node's slots
// of a factor whose positions are not adjacent, engine/sharding.h): `runs` runs of `run_elems`
// elements each, run t of member c at element `offsets[c * runs + t]` of every input. The
// chunk's elements (and `output`) are its runs in order: count = runs * run_elems.
struct ChunkRuns {
  size_t runs = 1;
  size_t run_elems = 0;
  std::vector<size_t> offsets;
};

// The same over the sum of several inputs of that layout (a node's ranks' gradients), added
// chunk by chunk as the ring goes: the inputs' sum is never formed in a buffer of its own.
// With `runs`, member c's chunk is its runs instead of elements [c * count, (c + 1) * count).
absl::Status ReduceScatter(Comm& comm, absl::Span<const void* const> inputs, v1::DType dtype,
                           size_t count, float* output, ReduceOp op, float* scratch,
                           absl::Time deadline, uint64_t tag_base, const ChunkRuns* runs = nullptr);

// All-gather in place of blocks that are runs of `buffer`: member c owns the byte ranges
// `runs[c]` (offset, bytes), holds its own on entry and every member's on return. A ring over
// the members (each run one message), as AMSP's update gather needs: the updated optimizer
// ranges of a parameter shard, scattered over it.
using ByteRuns = std::vector<std::pair<size_t, size_t>>;
absl::Status AllGatherRuns(Comm& comm, char* buffer, const std::vector<ByteRuns>& runs,
                           absl::Time deadline, uint64_t tag_base);

// In-place sum (or mean) of `count` fp32 elements over the members (reduce-scatter + all-gather).
// This form copies into a padded buffer; AllReduceInPlace needs `count` to be a multiple of
// size() and `scratch` of 2 * count / size() floats, and copies nothing.
absl::Status AllReduce(Comm& comm, float* data, size_t count, ReduceOp op, absl::Time deadline,
                       uint64_t tag_base);

absl::Status AllReduceInPlace(Comm& comm, float* data, size_t count, ReduceOp op, float* scratch,
                              absl::Time deadline, uint64_t tag_base);

}  // namespace ragshard::daemon

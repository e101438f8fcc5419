// The GPU backend of the data plane: each local rank is one GPU (local rank i on device
// i % device count). Its buffers live in a CUDA slab of that device (cudaMalloc once, shared
// with the training process as a CUDA IPC handle, sub-allocated by the daemon's best-fit Pool);
// its collectives run on NCCL communicators, one per process group on each GPU (the shard group
// and, with HSDP, the replicate group), each created from its own unique id passed through the
// planner's rendezvous. Calls for several local GPUs go inside ncclGroupStart/ncclGroupEnd.
//
// Buffers per unit and local rank: the unsharded parameter (F * S of the unit's dtype; the
// rank's shard is its slice, so the all-gather runs in place), the gradient (F * S), the
// gradient shard (S fp32), an fp32 scratch of F * S for bf16/fp16 gradients (NCCL would
// otherwise accumulate in the gradient's dtype; the conversion is counted as staging), and the
// owner buffer (F * S fp32) on owners of matrix tensors.
//
// Waiting polls the streams and ncclCommGetAsyncError; at the deadline, or on an asynchronous
// NCCL error, the job's communicators are aborted and the operation fails with an error that
// says so (NCCL does not name the lost peer).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/daemon/data_backend.h"

namespace ragshard::gpu {

absl::StatusOr<std::unique_ptr<daemon::DataBackend>> CreateGpuDataPlane(
    const daemon::BackendContext& context);

// The device address of arena offset 0 of local rank `local`'s slab, for tests in the daemon's
// own process (a process cannot open its own IPC handle). INVALID_ARGUMENT for a host backend.
absl::StatusOr<char*> SlabBase(const daemon::DataBackend& backend, int local);

}  // namespace ragshard::gpu

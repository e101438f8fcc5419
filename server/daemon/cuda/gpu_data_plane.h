// The GPU backend of the data plane: the one data plane (server/daemon/job_data_plane.h) over
// the CUDA transport (cuda_transport.cu): each local rank is one GPU (local rank i on device
// i; a node with fewer GPUs than local ranks is refused) whose buffers live in a CUDA slab of that
// device (cudaMalloc once, shared with the training process as a CUDA IPC handle, sub-allocated by
// the daemon's best-fit Pool); its collectives run on NCCL communicators, one per process group on
// each GPU, each created from its own unique id passed through the planner's rendezvous. Buffer
// lifetimes are the host backend's: persistent shards, transient unsharded parameters, gradients,
// owner buffers and scratch (the bf16/fp16 conversion scratch is bounded by a fixed chunk per GPU).
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

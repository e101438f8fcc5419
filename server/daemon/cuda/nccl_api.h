// NCCL, opened at run time rather than linked, as PyTorch's and vLLM's wheels take it from the
// machine: a program of ours starts (and runs on the host backend) where there is no NCCL, and
// on a GPU machine it uses the NCCL that is there (its torch's nvidia-nccl wheel, or the
// system's). nccl.h gives the types; every call goes through this table.
#pragma once

#include <nccl.h>

#include <string>

#include "absl/status/statusor.h"

namespace ragshard::gpu {

struct NcclApi {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  std::string path;  // the file it was opened from
};

// The environment variable naming the library's file; without it, libnccl.so.2 as the dynamic
// loader finds it (LD_LIBRARY_PATH, the cache, the system's folders).
inline constexpr char kNcclLibraryEnv[] = "RAGSHARD_NCCL_LIBRARY";

// Opens the NCCL at `file` (a path, or a name for the dynamic loader) and binds the table; the
// library stays open for the life of the process.
absl::StatusOr<NcclApi> OpenNccl(const std::string& file);

// Opens NCCL on first use (thread-safe) and returns its table for the life of the process, or
// FAILED_PRECONDITION naming the file and the loader's error, or a missing symbol.
absl::StatusOr<const NcclApi*> Nccl();

}  // namespace ragshard::gpu

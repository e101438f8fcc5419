// GPU discovery for the GPU backend. Built only when CUDA and NCCL are found
// (RAGSHARD_WITH_CUDA); callers that may run without a device check IsViable() first.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ragshard::gpu {

// Number of visible CUDA devices; 0 (not an error) when the driver reports none.
int DeviceCount();

// True when at least one device is usable. `reason` receives a one-line explanation otherwise.
bool IsViable(std::string* reason);

// NCCL version as an integer (e.g. 22703), from ncclGetVersion of the NCCL that Nccl() opens
// (nccl_api.h); FAILED_PRECONDITION where there is none.
absl::StatusOr<int> NcclVersion();

// Fills `n` floats on device `device` with `value` through a kernel, copies them back and
// returns their sum: a smoke test that the device, the runtime and kernel launches work.
absl::StatusOr<double> FillAndSum(int device, int64_t n, float value);

}  // namespace ragshard::gpu

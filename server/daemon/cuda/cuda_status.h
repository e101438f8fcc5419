// The one place where CUDA and NCCL error codes become absl::Status.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ragshard::gpu {

// `code` is a cudaError_t / ncclResult_t value; `what` names the call.
absl::Status CudaStatus(int code, absl::string_view what);
absl::Status NcclStatus(int code, absl::string_view what);

}  // namespace ragshard::gpu

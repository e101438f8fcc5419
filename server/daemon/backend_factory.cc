// The backend factory (data_backend.h): the one place that knows every backend, in a target of
// its own above the data-plane core and the CUDA backend, so that neither depends on the other.
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/job_data_plane.h"
#ifdef RAGSHARD_HAVE_CUDA
#include "server/daemon/cuda/cuda_device.h"
#include "server/daemon/cuda/gpu_data_plane.h"
#endif

namespace ragshard::daemon {

BackendKind ResolveBackendKind(BackendKind requested) {
  if (requested != BackendKind::kCuda) return requested;
#ifdef RAGSHARD_HAVE_CUDA
  std::string reason;
  if (gpu::IsViable(&reason)) return BackendKind::kCuda;
  LOG(WARNING) << "GPU backend skipped: " << reason << "; jobs use the host backend";
#else
  LOG(WARNING) << "GPU backend skipped: this build has no CUDA (configure with "
                  "RAGSHARD_WITH_CUDA=AUTO or ON where nvcc and NCCL exist); jobs use the host "
                  "backend";
#endif
  return BackendKind::kHost;
}

absl::StatusOr<std::unique_ptr<DataBackend>> CreateDataBackend(BackendKind kind,
                                                               const BackendContext& context) {
  if (kind == BackendKind::kCuda) {
#ifdef RAGSHARD_HAVE_CUDA
    return gpu::CreateGpuDataPlane(context);
#else
    return absl::FailedPreconditionError("the GPU backend is not in this build");
#endif
  }
  auto dp = JobDataPlane::Create(*context.plan, context.local_ranks, context.host_pool,
                                 context.nodes, context.replicas,
                                 kind == BackendKind::kDeviceShaped ? JobDataPlane::Shape::kDevice
                                                                    : JobDataPlane::Shape::kNode);
  if (!dp.ok()) return dp.status();
  return std::unique_ptr<DataBackend>(std::move(*dp));
}

}  // namespace ragshard::daemon

// The backend factory (data_backend.h): the one place that knows every backend, in a target of
// its own above the data-plane core and the CUDA backend, so that neither depends on the other.
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/job_data_plane.h"
#ifdef RAGSHARD_HAVE_CUDA
#include "server/daemon/cuda/cuda_device.h"
#include "server/daemon/cuda/gpu_data_plane.h"
#include "server/daemon/cuda/nccl_api.h"
#endif

namespace ragshard::daemon {

namespace {

// Whether the CUDA backend can run here: empty where it can (`found` then describes the device
// and NCCL), otherwise why not.
std::string CudaUnusable(std::string* found) {
#ifdef RAGSHARD_HAVE_CUDA
  std::string reason;
  if (!gpu::IsViable(&reason)) return reason;
  auto nccl = gpu::Nccl();
  if (!nccl.ok()) return absl::StrCat("no NCCL: ", nccl.status().message());
  auto version = gpu::NcclVersion();
  if (!version.ok()) return absl::StrCat("no NCCL: ", version.status().message());
  *found =
      absl::StrCat(gpu::DeviceCount(), " CUDA device(s), NCCL ", *version, " from ", (*nccl)->path);
  return "";
#else
  return "this build has no CUDA (configure with RAGSHARD_WITH_CUDA=AUTO or ON where nvcc and "
         "NCCL's header exist)";
#endif
}

}  // namespace

absl::StatusOr<BackendKind> ResolveBackendKind(BackendKind requested) {
  if (requested != BackendKind::kCuda && requested != BackendKind::kAuto) return requested;
  std::string found;
  const std::string unusable = CudaUnusable(&found);
  if (requested == BackendKind::kCuda) {
    if (!unusable.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend=cuda: the CUDA backend cannot run here: ", unusable,
                       " (--backend=auto runs the host backend where CUDA cannot run)"));
    }
    LOG(INFO) << "--backend=cuda: " << found;
    return BackendKind::kCuda;
  }
  if (unusable.empty()) {
    LOG(INFO) << "--backend=auto: the CUDA backend (" << found << ")";
    return BackendKind::kCuda;
  }
  LOG(INFO) << "--backend=auto: the host backend (" << unusable << ")";
  return BackendKind::kHost;
}

absl::StatusOr<std::unique_ptr<DataBackend>> CreateDataBackend(BackendKind kind,
                                                               const BackendContext& context) {
  if (kind == BackendKind::kAuto) {
    return absl::InternalError("CreateDataBackend: --backend=auto was not resolved");
  }
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

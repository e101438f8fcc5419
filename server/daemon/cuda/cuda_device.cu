#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "server/daemon/cuda/cuda_device.h"
#include "server/daemon/cuda/cuda_status.h"
#include "server/daemon/cuda/nccl_api.h"

namespace ragshard::gpu {

absl::Status CudaStatus(int code, absl::string_view what) {
  if (code == cudaSuccess) return absl::OkStatus();
  auto err = static_cast<cudaError_t>(code);
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::Status NcclStatus(int code, absl::string_view what) {
  if (code == ncclSuccess) return absl::OkStatus();
  auto nccl = Nccl();
  return absl::InternalError(
      absl::StrCat(what, ": ",
                   nccl.ok() ? (*nccl)->GetErrorString(static_cast<ncclResult_t>(code))
                             : absl::StrCat("NCCL error ", code)));
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return 0;
  }
  return n;
}

bool IsViable(std::string* reason) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (reason) *reason = absl::StrCat("no usable CUDA device: ", cudaGetErrorString(err));
    cudaGetLastError();
    return false;
  }
  if (n == 0) {
    if (reason) *reason = "no CUDA device present";
    return false;
  }
  return true;
}

absl::StatusOr<int> NcclVersion() {
  auto nccl = Nccl();
  if (!nccl.ok()) return nccl.status();
  int v = 0;
  absl::Status s = NcclStatus((*nccl)->GetVersion(&v), "ncclGetVersion");
  if (!s.ok()) return s;
  return v;
}

namespace {
__global__ void Fill(float* p, int64_t n, float v) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = v;
}
}  // namespace

absl::StatusOr<double> FillAndSum(int device, int64_t n, float value) {
  absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  if (!s.ok()) return s;
  float* d = nullptr;
  s = CudaStatus(cudaMalloc(&d, n * sizeof(float)), "cudaMalloc");
  if (!s.ok()) return s;
  Fill<<<static_cast<unsigned>((n + 255) / 256), 256>>>(d, n, value);
  std::vector<float> h(static_cast<size_t>(n));
  s = CudaStatus(cudaGetLastError(), "Fill launch");
  if (s.ok())
    s = CudaStatus(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost),
                   "cudaMemcpy");
  (void)cudaFree(d);
  if (!s.ok()) return s;
  double sum = 0;
  for (float x : h) sum += x;
  return sum;
}

}  // namespace ragshard::gpu

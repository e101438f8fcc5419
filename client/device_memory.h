// Device memory a client maps: the CUDA slab of the daemon's GPU backend, opened from its CUDA
// IPC handle through the CUDA driver (libcuda.so.1, loaded at run time: the client library has
// no link dependency on CUDA and runs without it wherever no GPU backend is used). The pointer
// lives in the device's primary context, the one torch uses, so torch builds CUDA tensors on it
// without a copy (ragshard._core's __cuda_array_interface__).
//
// The daemon and the client must see the GPU under the same ordinal (the same
// CUDA_VISIBLE_DEVICES), since the attach response names it by ordinal.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ragshard {

class DeviceMapping {
 public:
  virtual ~DeviceMapping() = default;
  // The device address of offset 0 of the slab.
  virtual uintptr_t base() const = 0;
  virtual int device() const = 0;
  // Waits for all work queued in the device's primary context (torch's kernels that write the
  // mapped buffers), so that the daemon's next operation reads what they wrote.
  virtual absl::Status Synchronize() const = 0;
};

// Opens `handle` (a cudaIpcMemHandle_t's 64 bytes) on device ordinal `device`. UNAVAILABLE when
// the CUDA driver cannot be loaded; INTERNAL with the driver's error string when it refuses.
absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenCudaIpc(int device, const std::string& handle);

}  // namespace ragshard

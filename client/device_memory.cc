#include "client/device_memory.h"

#include <dlfcn.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

// The few CUDA driver API types this file needs (cuda.h's, ABI-stable), so that the client
// builds without the CUDA toolkit.
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;  // NOLINT(google-runtime-int): the driver's type
struct CUipcMemHandle {
  char reserved[64];
};
constexpr unsigned kLazyEnablePeerAccess = 1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

struct Driver {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_retain)(CUcontext*, CUdevice);
  CUresult (*primary_release)(CUdevice);
  CUresult (*push)(CUcontext);
  CUresult (*pop)(CUcontext*);
  CUresult (*synchronize)();
  CUresult (*open)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*close)(CUdeviceptr);
  CUresult (*error_string)(CUresult, const char**);

  std::string Error(CUresult r, const char* call) const {
    const char* s = nullptr;
    if (error_string != nullptr) error_string(r, &s);
    return absl::StrCat(call, ": CUDA driver error ", r, s ? absl::StrCat(" (", s, ")") : "");
  }
};

absl::StatusOr<const Driver*> LoadDriver() {
  static const absl::StatusOr<Driver>* driver = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return new absl::StatusOr<Driver>(absl::UnavailableError(
          absl::StrCat("the CUDA driver (libcuda.so.1) cannot be loaded: ", dlerror())));
    }
    Driver d{};
    struct Symbol {
      void** slot;
      const char* name;
    } symbols[] = {{reinterpret_cast<void**>(&d.init), "cuInit"},
                   {reinterpret_cast<void**>(&d.device_get), "cuDeviceGet"},
                   {reinterpret_cast<void**>(&d.primary_retain), "cuDevicePrimaryCtxRetain"},
                   {reinterpret_cast<void**>(&d.primary_release), "cuDevicePrimaryCtxRelease_v2"},
                   {reinterpret_cast<void**>(&d.push), "cuCtxPushCurrent_v2"},
                   {reinterpret_cast<void**>(&d.pop), "cuCtxPopCurrent_v2"},
                   {reinterpret_cast<void**>(&d.synchronize), "cuCtxSynchronize"},
                   {reinterpret_cast<void**>(&d.open), "cuIpcOpenMemHandle_v2"},
                   {reinterpret_cast<void**>(&d.close), "cuIpcCloseMemHandle"},
                   {reinterpret_cast<void**>(&d.error_string), "cuGetErrorString"}};
    for (const Symbol& s : symbols) {
      *s.slot = dlsym(lib, s.name);
      if (*s.slot == nullptr) {
        return new absl::StatusOr<Driver>(
            absl::UnavailableError(absl::StrCat("the CUDA driver (libcuda.so.1) has no ", s.name)));
      }
    }
    if (CUresult r = d.init(0); r != 0) {
      return new absl::StatusOr<Driver>(absl::UnavailableError(d.Error(r, "cuInit")));
    }
    return new absl::StatusOr<Driver>(d);
  }();
  if (!driver->ok()) return driver->status();
  return &**driver;
}

class CudaIpcMapping final : public DeviceMapping {
 public:
  CudaIpcMapping(const Driver* driver, int device, CUdevice dev, CUcontext ctx, CUdeviceptr base)
      : driver_(driver), device_(device), dev_(dev), ctx_(ctx), base_(base) {}
  ~CudaIpcMapping() override {
    if (driver_->push(ctx_) == 0) {
      driver_->close(base_);
      CUcontext popped = nullptr;
      driver_->pop(&popped);
    }
    driver_->primary_release(dev_);
  }
  uintptr_t base() const override { return static_cast<uintptr_t>(base_); }
  int device() const override { return device_; }
  absl::Status Synchronize() const override {
    CUresult r = driver_->push(ctx_);
    if (r == 0) {
      r = driver_->synchronize();
      CUcontext popped = nullptr;
      driver_->pop(&popped);
    }
    if (r != 0) return absl::InternalError(driver_->Error(r, "cuCtxSynchronize"));
    return absl::OkStatus();
  }

 private:
  const Driver* driver_;
  int device_;
  CUdevice dev_;
  CUcontext ctx_;
  CUdeviceptr base_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenCudaIpc(int device, const std::string& handle) {
  CUipcMemHandle h{};
  if (handle.size() != sizeof(h.reserved)) {
    return absl::InvalidArgumentError(absl::StrCat("the CUDA IPC handle has ", handle.size(),
                                                   " bytes; a handle has ", sizeof(h.reserved)));
  }
  std::memcpy(h.reserved, handle.data(), sizeof(h.reserved));
  auto driver = LoadDriver();
  if (!driver.ok()) return driver.status();
  const Driver& d = **driver;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (CUresult r = d.device_get(&dev, device); r != 0) {
    return absl::InternalError(d.Error(r, absl::StrCat("cuDeviceGet(", device, ")").c_str()));
  }
  if (CUresult r = d.primary_retain(&ctx, dev); r != 0) {
    return absl::InternalError(d.Error(r, "cuDevicePrimaryCtxRetain"));
  }
  CUdeviceptr base = 0;
  CUresult r = d.push(ctx);
  if (r == 0) {
    r = d.open(&base, h, kLazyEnablePeerAccess);
    CUcontext popped = nullptr;
    d.pop(&popped);
  }
  if (r != 0) {
    d.primary_release(dev);
    return absl::InternalError(d.Error(r, "cuIpcOpenMemHandle (the daemon's GPU slab)"));
  }
  return std::make_unique<CudaIpcMapping>(&d, device, dev, ctx, base);
}

}  // namespace ragshard

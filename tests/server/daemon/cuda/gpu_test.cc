// GPU backend smoke tests. They skip, with the reason, when no CUDA device is present.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

#include "server/daemon/cuda/cuda_device.h"

namespace ragshard::gpu {
namespace {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (!IsViable(&reason)) GTEST_SKIP() << "GPU backend not viable: " << reason;
  }
};

TEST_F(GpuTest, KernelLaunchAndCopyWork) {
  auto sum = FillAndSum(0, 1 << 20, 0.5f);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_DOUBLE_EQ(*sum, 0.5 * (1 << 20));
}

TEST_F(GpuTest, NcclOpensAndReportsItsVersion) {
  auto v = NcclVersion();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_GT(*v, 20000);
}

// The CUDA driver's own count of the visible devices, through the driver API (libcuda.so.1,
// loaded here rather than through the runtime that DeviceCount uses); -1 with the reason in `why`
// where the driver cannot answer (not installed, no device, cuInit failing).
int DriverDeviceCount(std::string* why) {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda == nullptr) {
    *why = std::string("no CUDA driver: ") + dlerror();
    return -1;
  }
  using Init = int (*)(unsigned int);
  using GetCount = int (*)(int*);
  auto init = reinterpret_cast<Init>(dlsym(cuda, "cuInit"));
  auto get_count = reinterpret_cast<GetCount>(dlsym(cuda, "cuDeviceGetCount"));
  int n = -1;
  if (init == nullptr || get_count == nullptr) {
    *why = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
  } else if (int err = init(0); err != 0) {
    *why = "cuInit failed with CUresult " + std::to_string(err);
  } else if (int err = get_count(&n); err != 0) {
    *why = "cuDeviceGetCount failed with CUresult " + std::to_string(err);
    n = -1;
  }
  dlclose(cuda);
  return n;
}

// DeviceCount (the runtime API) agrees with the driver API's count of the devices this process
// may see (both honour CUDA_VISIBLE_DEVICES); where the driver cannot answer, DeviceCount is 0
// and IsViable is false with a reason, not a crash.
TEST(GpuProbeTest, DeviceCountAgreesWithTheDriver) {
  std::string driver_why;
  const int driver = DriverDeviceCount(&driver_why);
  std::string reason;
  const bool viable = IsViable(&reason);
  if (driver < 0) {
    EXPECT_EQ(DeviceCount(), 0) << driver_why;
    EXPECT_FALSE(viable) << driver_why;
    EXPECT_FALSE(reason.empty());
    std::cout << "checked the no-device path (" << driver_why << "; IsViable: " << reason << ")\n";
    return;
  }
  EXPECT_EQ(DeviceCount(), driver);
  EXPECT_EQ(viable, driver > 0) << reason;
  if (!viable) {
    EXPECT_FALSE(reason.empty());
  }
  std::cout << "the driver and the runtime both count " << driver << " device(s)\n";
}

}  // namespace
}  // namespace ragshard::gpu

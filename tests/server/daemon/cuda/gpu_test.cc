// GPU backend smoke tests. They skip, with the reason, when no CUDA device is present.
#include <gtest/gtest.h>

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

TEST(GpuProbeTest, DeviceCountNeverFails) {
  // Without a driver or device this is 0, not a crash.
  EXPECT_GE(DeviceCount(), 0);
}

}  // namespace
}  // namespace ragshard::gpu

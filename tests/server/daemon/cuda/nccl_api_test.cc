// NCCL opened at run time: no GPU needed, only the library's file (RAGSHARD_NCCL_LIBRARY's, or
// the toolkit's found at configure time; the test skips, saying so, where there is none).
#include "server/daemon/cuda/nccl_api.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace ragshard::gpu {
namespace {

TEST(NcclApiTest, AMissingLibraryIsAnErrorNamingTheFileAndTheVariable) {
  auto api = OpenNccl("/nonexistent/libnccl.so.2");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string m(api.status().message());
  EXPECT_NE(m.find("'/nonexistent/libnccl.so.2'"), std::string::npos) << m;
  EXPECT_NE(m.find(kNcclLibraryEnv), std::string::npos) << m;
}

TEST(NcclApiTest, ALibraryThatIsNotNcclIsNamedByItsMissingSymbol) {
  auto api = OpenNccl("libz.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_NE(std::string(api.status().message()).find("has no ncclGetVersion"), std::string::npos)
      << api.status();
}

TEST(NcclApiTest, TheToolkitsNcclOpensAndReportsItsVersion) {
  // The file the environment names (a GPU machine's), else the toolkit's found at configure time.
  const char* env = std::getenv(kNcclLibraryEnv);
  const std::string file = env != nullptr && *env != '\0' ? env : RAGSHARD_TEST_NCCL_LIBRARY;
  if (file.empty() || access(file.c_str(), R_OK) != 0) {
    GTEST_SKIP() << "no libnccl.so.2 to open ('" << file << "'; set " << kNcclLibraryEnv << ")";
  }
  auto api = OpenNccl(file);
  ASSERT_TRUE(api.ok()) << api.status();
  int version = 0;
  ASSERT_EQ(api->GetVersion(&version), ncclSuccess);
  EXPECT_GT(version, 20000);
  EXPECT_NE(api->path.find("libnccl"), std::string::npos) << api->path;
  EXPECT_STRNE(api->GetErrorString(ncclInvalidArgument), "");
}

}  // namespace
}  // namespace ragshard::gpu

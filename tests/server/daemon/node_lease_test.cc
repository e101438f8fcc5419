#include "server/daemon/node_lease.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;

TEST(NodeLeaseTest, ANodeIsFencedOnceItsLeaseRunsOutAndFreedByTheNextAcknowledgement) {
  NodeLease lease;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  // No lease before the first acknowledgement: nothing to fence.
  EXPECT_FALSE(lease.Expire(t0 + absl::Hours(1)));
  EXPECT_FALSE(lease.Acknowledged(t0, 1500));
  // The lease counts from the acknowledged heartbeat's sending, not its answer.
  EXPECT_FALSE(lease.Expire(t0 + absl::Milliseconds(1500)));
  EXPECT_TRUE(lease.Fenced().ok());
  EXPECT_TRUE(lease.Expire(t0 + absl::Milliseconds(1501)));
  const absl::Status fenced = lease.Fenced();
  EXPECT_TRUE(absl::IsUnavailable(fenced));
  EXPECT_THAT(fenced.message(), HasSubstr("fenced: the planner acknowledged no heartbeat for "
                                          "1501 ms (its lease is 1500 ms"));
  // Once: the jobs are failed one time.
  EXPECT_FALSE(lease.Expire(t0 + absl::Seconds(5)));
  // An older heartbeat answered late does not move the lease back.
  EXPECT_TRUE(lease.Acknowledged(t0 + absl::Seconds(4), 1500));
  EXPECT_TRUE(lease.Fenced().ok());
  EXPECT_FALSE(lease.Acknowledged(t0 + absl::Seconds(2), 1500));
  EXPECT_FALSE(lease.Expire(t0 + absl::Milliseconds(5400)));
  EXPECT_TRUE(lease.Expire(t0 + absl::Milliseconds(5501)));
  // A planner that gives no lease (0) fences nothing.
  EXPECT_TRUE(lease.Acknowledged(t0 + absl::Seconds(6), 0));
  EXPECT_FALSE(lease.Expire(t0 + absl::Hours(2)));
}

}  // namespace
}  // namespace ragshard::daemon

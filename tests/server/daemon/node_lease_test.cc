#include "server/daemon/node_lease.h"

#include <thread>

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

TEST(NodeLeaseTest, AWaitForTheFenceEndsWithItOrWhenThePlannerCountsTheNodeLost) {
  NodeLease lease;
  const absl::Time far = absl::Now() + absl::Hours(1);
  EXPECT_TRUE(lease.AwaitUnfenced(far).ok());  // not fenced: at once
  // Fenced 2 s after the last acknowledged heartbeat was sent with a 1.5 s lease: the planner's
  // node timeout (2 s) has passed, so the wait ends at once with the fence, whatever its deadline.
  const absl::Time sent = absl::Now() - absl::Seconds(2);
  lease.Acknowledged(sent, 1500);
  ASSERT_TRUE(lease.Expire(sent + absl::Seconds(2)));
  EXPECT_TRUE(absl::IsUnavailable(lease.AwaitUnfenced(far)));
  // A long lease: the wait ends at its own deadline, still fenced...
  const absl::Time now = absl::Now();
  lease.Acknowledged(now, 3600 * 1000);
  ASSERT_TRUE(lease.Expire(now + absl::Hours(2)));
  EXPECT_TRUE(absl::IsUnavailable(lease.AwaitUnfenced(absl::Now() + absl::Milliseconds(10))));
  // ... or when a heartbeat is acknowledged again: OK.
  std::thread heartbeat([&] { lease.Acknowledged(absl::Now(), 3600 * 1000); });
  EXPECT_TRUE(lease.AwaitUnfenced(far).ok());
  heartbeat.join();
}

}  // namespace
}  // namespace ragshard::daemon

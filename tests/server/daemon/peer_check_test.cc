#include "server/daemon/peer_check.h"

#include <unistd.h>

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;
constexpr gid_t kNoGroup = static_cast<gid_t>(-1);

TEST(PeerCheckTest, TheDaemonsUserRootAndTheGroupsMembersMayAttach) {
  const PeerCredentials self{100, 1000, 1000};
  EXPECT_TRUE(CheckPeer(self, {}, 1000, kNoGroup, "").ok());
  EXPECT_TRUE(CheckPeer({101, 0, 0}, {}, 1000, kNoGroup, "").ok());
  // The group as the primary group, or as a supplementary one.
  EXPECT_TRUE(CheckPeer({102, 2000, 500}, {}, 1000, 500, "ragshard").ok());
  EXPECT_TRUE(CheckPeer({103, 2000, 2000}, {7, 500}, 1000, 500, "ragshard").ok());
}

TEST(PeerCheckTest, AStrangerIsRefusedNamingItsUidAndWhatItLacks) {
  absl::Status s = CheckPeer({104, 2000, 2000}, {7}, 1000, 500, "ragshard");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("process 104 of uid 2000"));
  EXPECT_THAT(s.message(), HasSubstr("uid 1000"));
  EXPECT_THAT(s.message(), HasSubstr("group 'ragshard'"));
  // Without a group, only the daemon's user (and root).
  s = CheckPeer({105, 2000, 500}, {500}, 1000, kNoGroup, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("group")));
}

TEST(PeerCheckTest, SupplementaryGroupsAreThoseOfTheProcess) {
  std::vector<gid_t> expected(static_cast<size_t>(::getgroups(0, nullptr)));
  ASSERT_EQ(::getgroups(static_cast<int>(expected.size()), expected.data()),
            static_cast<int>(expected.size()));
  std::vector<gid_t> got = SupplementaryGroups(::getpid());
  std::sort(expected.begin(), expected.end());
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, expected);
  EXPECT_TRUE(SupplementaryGroups(-1).empty());
}

}  // namespace
}  // namespace ragshard::daemon

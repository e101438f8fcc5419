// The unsharded view (protocol/unsharded_view.h) over a memfd, as the daemon and its ranks map it.
#include "protocol/unsharded_view.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "infra/fd.h"

namespace ragshard {
namespace {

constexpr int64_t kPage = kViewPageBytes;

class UnshardedViewTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fd_ = ScopedFd(::memfd_create("view-test", MFD_CLOEXEC));
    ASSERT_TRUE(fd_.valid());
    ASSERT_EQ(::ftruncate(fd_.get(), 16 * kPage), 0);
    void* p = ::mmap(nullptr, 16 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    ASSERT_NE(p, MAP_FAILED);
    arena_ = static_cast<char*>(p);
    for (int64_t page = 0; page < 16; ++page) std::memset(arena_ + page * kPage, 'a' + page, kPage);
  }
  void TearDown() override { ::munmap(arena_, 16 * kPage); }

  // Four pages: the own page (arena page `own`) at position `at`, the others from page `rest` on.
  static ViewLayout Layout(int64_t at, int64_t own, int64_t rest) {
    ViewLayout l;
    l.bytes = 4 * kPage;
    l.own_at = at * kPage;
    l.own_bytes = kPage;
    l.own_offset = own * kPage;
    l.rest_offset = rest * kPage;
    return l;
  }

  ScopedFd fd_;
  char* arena_ = nullptr;
};

TEST_F(UnshardedViewTest, MapsTheShardBetweenTheRestInOrder) {
  UnshardedView v;
  ASSERT_TRUE(v.Map(fd_.get(), Layout(2, 9, 4), /*private_own=*/false).ok());
  // Rest pages 4, 5 before the own page, 6 after it.
  EXPECT_EQ(v.data()[0], 'e');
  EXPECT_EQ(v.data()[kPage], 'f');
  EXPECT_EQ(v.data()[2 * kPage], 'j');
  EXPECT_EQ(v.data()[3 * kPage + kPage - 1], 'g');
  // Shared: a write through the view is the arena's.
  v.data()[kPage] = 'X';
  EXPECT_EQ(arena_[5 * kPage], 'X');
}

TEST_F(UnshardedViewTest, PrivateOwnPartNeverWritesTheShardAndDropsItsCopies) {
  UnshardedView v;
  ASSERT_TRUE(v.Map(fd_.get(), Layout(0, 9, 4), /*private_own=*/true).ok());
  EXPECT_EQ(v.data()[0], 'j');
  v.data()[0] = 'Z';
  EXPECT_EQ(v.data()[0], 'Z');
  EXPECT_EQ(arena_[9 * kPage], 'j');  // the shard is untouched
  // The shard changes (an optimizer step) while this rank holds a private copy of its page:
  // dropping the copies shows the shard again.
  arena_[9 * kPage] = 'k';
  ASSERT_TRUE(v.DropPrivateCopies().ok());
  EXPECT_EQ(v.data()[0], 'k');
  // Unwritten pages follow the shard without a drop.
  arena_[9 * kPage + 1] = 'm';
  EXPECT_EQ(v.data()[1], 'm');
}

TEST_F(UnshardedViewTest, KeepsItsAddressAndRemapsOnlyWhatMoved) {
  UnshardedView v;
  ASSERT_TRUE(v.Map(fd_.get(), Layout(1, 9, 4), false).ok());
  char* const at = v.data();
  ASSERT_TRUE(v.Map(fd_.get(), Layout(1, 9, 4), false).ok());
  EXPECT_EQ(v.data(), at);
  // The rest moved to pages 12..14.
  ASSERT_TRUE(v.Map(fd_.get(), Layout(1, 9, 12), false).ok());
  EXPECT_EQ(v.data(), at);
  EXPECT_EQ(v.data()[0], 'm');
  EXPECT_EQ(v.data()[kPage], 'j');
  EXPECT_EQ(v.data()[2 * kPage], 'n');
  EXPECT_EQ(v.data()[3 * kPage], 'o');
  EXPECT_EQ(v.layout(), Layout(1, 9, 12));
}

TEST_F(UnshardedViewTest, AllOwnWhenTheNodeHoldsTheWholeGroup) {
  UnshardedView v;
  ViewLayout l;
  l.bytes = l.own_bytes = 2 * kPage;
  l.own_offset = l.rest_offset = 3 * kPage;
  ASSERT_TRUE(v.Map(fd_.get(), l, true).ok());
  EXPECT_EQ(v.data()[0], 'd');
  EXPECT_EQ(v.data()[kPage], 'e');
}

TEST_F(UnshardedViewTest, RefusesLayoutsThatAreNotPageAlignedOrChangeSize) {
  UnshardedView v;
  ViewLayout l = Layout(1, 9, 4);
  l.own_offset += 256;
  absl::Status s = v.Map(fd_.get(), l, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("page-aligned"), std::string::npos) << s;
  l = Layout(1, 9, 4);
  l.own_at = 4 * kPage;  // past the end with its page
  EXPECT_EQ(v.Map(fd_.get(), l, false).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(v.Map(fd_.get(), Layout(1, 9, 4), false).ok());
  l = Layout(1, 9, 4);
  l.bytes = 8 * kPage;
  EXPECT_EQ(v.Map(fd_.get(), l, false).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(v.mapped());  // the refused layout left the view as it was
}

TEST_F(UnshardedViewTest, AFailedMapLeavesNoView) {
  UnshardedView v;
  // A descriptor that is not open: the first part's mmap fails.
  EXPECT_EQ(v.Map(-1, Layout(1, 9, 4), false).code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(v.mapped());
  EXPECT_EQ(v.data(), nullptr);
}

TEST(AliasesShardsTest, NeedsWholePagesForTheNodesShards) {
  EXPECT_TRUE(AliasesShards(1, 1024, 4));
  EXPECT_TRUE(AliasesShards(2, 1024, 2));
  EXPECT_FALSE(AliasesShards(1, 1000, 4));
  EXPECT_FALSE(AliasesShards(1, 0, 4));
}

}  // namespace
}  // namespace ragshard

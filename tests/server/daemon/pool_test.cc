#include "server/daemon/pool.h"

#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstring>
#include <random>

#include "protocol/fd_passing.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;

TEST(PoolTest, BestFitReusesTheSmallestHoleAndMerges) {
  auto pool = Pool::Create(1 << 20, 256);
  ASSERT_TRUE(pool.ok());
  Pool& p = **pool;
  auto a = p.Allocate(1000);  // rounds to 1024
  auto b = p.Allocate(4096);
  auto c = p.Allocate(512);
  auto d = p.Allocate(8192);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  EXPECT_EQ(a->size(), 1024);
  EXPECT_EQ(b->offset(), 1024);
  const int64_t b_off = b->offset(), d_off = d->offset();
  b->Release();  // hole of 4096
  d->Release();  // hole of 8192 (merges with the tail)
  auto e = p.Allocate(3000);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->offset(), b_off);  // the smallest hole that fits
  PoolStats s = p.Stats();
  EXPECT_EQ(s.used, 1024 + 512 + 3072);
  EXPECT_EQ(s.peak, 1024 + 4096 + 512 + 8192);
  EXPECT_EQ(s.leases, 3);
  EXPECT_GT(s.fragmentation, 0.0);  // a 1024-byte hole besides the tail
  e->Release();
  a->Release();
  c->Release();
  s = p.Stats();
  EXPECT_EQ(s.used, 0);
  EXPECT_EQ(s.largest_free, 1 << 20);
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.0);
  (void)d_off;
}

TEST(PoolTest, ACommittedPoolHoldsItsPagesFromTheStart) {
  // A pool's memfd takes pages only as they are touched, unless committed at its creation.
  constexpr int64_t kBytes = int64_t{16} << 20;
  auto lazy = Pool::Create(kBytes);
  auto committed = Pool::Create(kBytes, 256, 1 << 16, /*commit=*/true);
  ASSERT_TRUE(lazy.ok() && committed.ok());
  struct stat a {
  }, b{};
  ASSERT_EQ(fstat((*lazy)->arena().fd(), &a), 0);
  ASSERT_EQ(fstat((*committed)->arena().fd(), &b), 0);
  EXPECT_LT(static_cast<int64_t>(a.st_blocks) * 512, kBytes / 4);
  EXPECT_GE(static_cast<int64_t>(b.st_blocks) * 512, kBytes);
}

TEST(PoolTest, RequestsBeyondCapacityAreResourceExhausted) {
  auto pool = Pool::Create(64 * 1024, 256);
  ASSERT_TRUE(pool.ok());
  auto big = (*pool)->Allocate(1 << 20);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(big.status().message()), HasSubstr("capacity"));
  auto a = (*pool)->Allocate(40 * 1024);
  ASSERT_TRUE(a.ok());
  auto b = (*pool)->Allocate(40 * 1024);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("largest free block"));
  EXPECT_EQ((*pool)->Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PoolTest, RandomAllocationsNeverOverlapAndAccountingHolds) {
  auto pool = Pool::Create(1 << 22, 64, 4096);
  ASSERT_TRUE(pool.ok());
  std::mt19937 rng(3);
  std::vector<Lease> live;
  for (int i = 0; i < 20000; ++i) {
    if (!live.empty() && (rng() % 3 == 0 || live.size() > 200)) {
      live.erase(live.begin() + static_cast<long>(rng() % live.size()));
    } else {
      auto l = (*pool)->Allocate(1 + rng() % 40000);
      if (l.ok()) live.push_back(std::move(*l));
    }
    if (i % 1000 == 0) {
      std::vector<std::pair<int64_t, int64_t>> spans;
      int64_t used = 0;
      for (const auto& l : live) {
        spans.push_back({l.offset(), l.offset() + l.size()});
        used += l.size();
      }
      std::sort(spans.begin(), spans.end());
      for (size_t k = 1; k < spans.size(); ++k) ASSERT_LE(spans[k - 1].second, spans[k].first);
      ASSERT_EQ((*pool)->Stats().used, used);
    }
  }
  live.clear();
  EXPECT_EQ((*pool)->Stats().largest_free, 1 << 22);
}

TEST(PoolTest, LeaseCountIsBoundedSoTheFreeListNeverGrows) {
  auto pool = Pool::Create(1 << 16, 64, 8);
  ASSERT_TRUE(pool.ok());
  std::vector<Lease> live;
  for (int i = 0; i < 8; ++i) live.push_back(std::move(*(*pool)->Allocate(64)));
  EXPECT_EQ((*pool)->Allocate(64).status().code(), absl::StatusCode::kResourceExhausted);
}

std::vector<std::string> ShmEntries() {
  std::vector<std::string> out;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) out.push_back(e->d_name);
    closedir(d);
  }
  return out;
}

// A client process receives the pool's memfd over SCM_RIGHTS, maps it and writes into a lease:
// the daemon sees the bytes without any copy. Then the "daemon" is killed with -9 and nothing
// named is left in /dev/shm.
TEST(PoolTest, MemfdIsSharedThroughScmRightsAndLeavesNothingInDevShm) {
  const auto before = ShmEntries();
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  pid_t daemon = fork();
  if (daemon == 0) {
    close(sv[1]);
    auto pool = Pool::Create(1 << 20);
    if (!pool.ok()) _exit(1);
    auto lease = (*pool)->Allocate(4096);
    std::string payload = std::to_string(lease->offset());
    if (!SendWithFds(sv[0], payload, {(*pool)->arena().fd()}).ok()) _exit(2);
    // Wait for the client's word, check the bytes, report, then hang until killed.
    char ack = 0;
    if (read(sv[0], &ack, 1) != 1) _exit(3);
    char ok = std::memcmp(lease->data(), "written by the client", 21) == 0 ? 'y' : 'n';
    if (write(sv[0], &ok, 1) != 1) _exit(4);
    pause();
    _exit(0);
  }
  close(sv[0]);
  auto got = ReceiveWithFds(sv[1]);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->fds.size(), 1u);
  const int64_t offset = std::stoll(got->payload);
  void* map = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, got->fds[0].get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  std::memcpy(static_cast<char*>(map) + offset, "written by the client", 21);
  char go = 'g', ok = 0;
  ASSERT_EQ(write(sv[1], &go, 1), 1);
  ASSERT_EQ(read(sv[1], &ok, 1), 1);
  EXPECT_EQ(ok, 'y');
  kill(daemon, SIGKILL);
  waitpid(daemon, nullptr, 0);
  munmap(map, 1 << 20);
  close(sv[1]);
  EXPECT_EQ(ShmEntries(), before);
}

TEST(FdPassingTest, RejectsTooManyDescriptorsAndBadPaths) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  std::vector<int> fds(8, sv[0]);
  ASSERT_TRUE(SendWithFds(sv[0], "x", fds).ok());
  auto got = ReceiveWithFds(sv[1], 2);
  EXPECT_FALSE(got.ok());
  close(sv[0]);
  close(sv[1]);
  EXPECT_EQ(ConnectUnix(std::string(200, 'a')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ConnectUnix("/nonexistent/socket").ok());
}

}  // namespace
}  // namespace ragshard::daemon

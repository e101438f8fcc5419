// Where redundancy puts each chunk and parity (server/daemon/parity_layout.h) and the state blob's
// checksum (server/daemon/state_blob.h).
#include "server/daemon/parity_layout.h"

#include <zlib.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/redundancy.h"
#include "gtest/gtest.h"
#include "server/daemon/state_blob.h"

namespace ragshard::daemon {
namespace {

TEST(RedundancySchemeTest, EveryChunkHasOneHolderOnAnotherNode) {
  for (auto [text, nodes] : std::vector<std::pair<std::string, int>>{
           {"parity:1", 2}, {"parity:2", 3}, {"parity:2", 6}, {"parity:3", 8}, {"replica", 3}}) {
    const RedundancyScheme s = SchemeOf(*ParseRedundancy("redundancy", text));
    std::map<std::pair<int, int>, int> held;  // (node, chunk) -> holders
    for (int h = 0; h < nodes; ++h) {
      const std::vector<ChunkRef> sources = ParitySources(s, nodes, h);
      EXPECT_EQ(static_cast<int>(sources.size()), s.replica ? 1 : s.k);
      for (const ChunkRef& c : sources) {
        EXPECT_NE(c.node, h) << text;
        EXPECT_EQ(ParityHolder(s, nodes, c.node, c.chunk), h) << text;
        ++held[{c.node, c.chunk}];
      }
    }
    EXPECT_EQ(static_cast<int>(held.size()), nodes * s.k) << text;
    for (const auto& [chunk, holders] : held) EXPECT_EQ(holders, 1) << text;
  }
}

TEST(StateBlobTest, Crc32IsZlibsCrc32ExtendedOverAnyCuts) {
  // The parities' CRC-32 (ISA-L's) against zlib's, over random bytes cut at random points
  // (lengths that are not multiples of the vector width, and empty pieces), and whole.
  std::mt19937 rng(5);
  std::string bytes(size_t{3} << 20, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  const auto zlib = [](const std::string& b) {
    return static_cast<uint32_t>(
        crc32_z(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(b.data()), b.size()));
  };
  EXPECT_EQ(Crc32(bytes.data(), static_cast<int64_t>(bytes.size())), zlib(bytes));
  EXPECT_EQ(Crc32(nullptr, 0), zlib(""));
  EXPECT_EQ(Crc32("a", 1), zlib("a"));
  for (int trial = 0; trial < 20; ++trial) {
    uint32_t crc = Crc32(nullptr, 0);
    size_t at = 0;
    while (at < bytes.size()) {
      const size_t n = std::min<size_t>(bytes.size() - at, rng() % (trial < 10 ? 100 : 300000));
      crc = Crc32Extend(crc, bytes.data() + at, static_cast<int64_t>(n));
      at += n;
    }
    ASSERT_EQ(crc, zlib(bytes)) << "trial " << trial;
  }
}

TEST(RedundancyStripesTest, UnevenBlobsMakeParitiesOfOneKthOfTheGroupsState) {
  const RedundancyScheme parity2 = SchemeOf(*ParseRedundancy("redundancy", "parity:2"));
  // Node 2 holds much less than the others (a ragged plan's last ranks): the stripes even it out.
  const std::vector<int64_t> blob = {5200, 5200, 2070, 64, 64, 64};
  const std::vector<int64_t> stripes = StripeBytes(parity2, blob);
  EXPECT_EQ(stripes[0] + stripes[1] + stripes[2], (5200 + 5200 + 2070 + 1) / 2);
  EXPECT_EQ(stripes[3] + stripes[4] + stripes[5], 96);
  // A node holding more than the rest of its group together: its blob sets the parities.
  const std::vector<int64_t> lopsided = StripeBytes(parity2, {10000, 100, 100});
  EXPECT_EQ(lopsided, (std::vector<int64_t>{0, 5000, 5000}));
  // Replica: each node holds the blob of the one before.
  const RedundancyScheme replica = SchemeOf(*ParseRedundancy("redundancy", "replica"));
  EXPECT_EQ(StripeBytes(replica, {10, 20, 30}), (std::vector<int64_t>{30, 10, 20}));
  // Every node's chunks tile its blob, each no longer than the parity that covers it.
  for (const std::vector<int64_t>& b : {blob, std::vector<int64_t>{10000, 100, 100, 0, 0, 7}}) {
    const std::vector<int64_t> st = StripeBytes(parity2, b);
    for (int n = 0; n < static_cast<int>(b.size()); ++n) {
      int64_t at = 0;
      for (int c = 0; c < parity2.k; ++c) {
        const ChunkSpan span = ChunkOf(parity2, st, b, n, c);
        EXPECT_EQ(span.offset, at) << n << " " << c;
        EXPECT_LE(span.bytes, st[ParityHolder(parity2, 6, n, c)]);
        at += span.bytes;
      }
      EXPECT_EQ(at, b[n]) << n;
    }
  }
}

}  // namespace
}  // namespace ragshard::daemon

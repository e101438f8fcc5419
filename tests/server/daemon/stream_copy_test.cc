// StreamCopy against memcpy at every alignment of both ends and sizes around its 64-byte steps.
#include "server/daemon/stream_copy.h"

#include <gtest/gtest.h>

#include <vector>

namespace ragshard::daemon {
namespace {

TEST(StreamCopyTest, CopiesEveryByteAtEveryAlignmentAndSize) {
  std::vector<char> src(4096 + 64), dst(4096 + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 131 + 7);
  for (size_t src_off = 0; src_off < 17; ++src_off) {
    for (size_t dst_off = 0; dst_off < 17; ++dst_off) {
      for (size_t bytes : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{63}, size_t{64},
                           size_t{65}, size_t{127}, size_t{200}, size_t{4000}}) {
        std::fill(dst.begin(), dst.end(), static_cast<char>(0x5a));
        StreamCopy(dst.data() + dst_off, src.data() + src_off, bytes);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= dst_off && i < dst_off + bytes;
          const char want = inside ? src[src_off + i - dst_off] : static_cast<char>(0x5a);
          ASSERT_EQ(dst[i], want) << "src+" << src_off << " dst+" << dst_off << " " << bytes
                                  << " bytes, byte " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ragshard::daemon

#include "client/block_dequant.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;

std::vector<float> Int8Values() {
  std::vector<float> v(256);
  for (int b = 0; b < 256; ++b) v[b] = static_cast<float>(static_cast<int8_t>(b));
  return v;
}

std::vector<float> TableValues() {  // not int8's: the lookup path
  std::vector<float> v(256);
  for (int b = 0; b < 256; ++b) v[b] = 0.25f * static_cast<float>(b) - 3.0f;
  return v;
}

// Two bands of 3 rows x 5 columns, blocks 2 columns wide (3 per band, the last 1 column):
// element (band, row, col) is in block 1 + band * 3 + col / 2. The element before the chunk and
// the one after it are not the chunk's.
TEST(BlockDequantTest, EachElementTakesItsBlocksScaleAndNothingElseIsWritten) {
  constexpr int64_t kPos = 1, kBands = 2, kRows = 3, kCols = 5;
  const int64_t n = kPos + kBands * kRows * kCols + 1;
  std::vector<uint8_t> codes(n);
  for (int64_t e = 0; e < n; ++e) codes[e] = static_cast<uint8_t>(e * 37 + 11);
  std::vector<float> scales(1 + kBands * 3);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.5f + static_cast<float>(i);
  const BlockChunk chunk{kPos, kBands, kRows, kCols, 2, 1, 3};
  for (const std::vector<float>& values : {Int8Values(), TableValues()}) {
    std::vector<float> out(n, -7.0f);
    ASSERT_TRUE(DequantizeChunks(codes, scales, values, {chunk}, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out[0], -7.0f);
    EXPECT_EQ(out[n - 1], -7.0f);
    for (int64_t b = 0; b < kBands; ++b) {
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t j = 0; j < kCols; ++j) {
          const int64_t e = kPos + (b * kRows + r) * kCols + j;
          EXPECT_EQ(out[e], values[codes[e]] * scales[1 + b * 3 + j / 2]) << "element " << e;
        }
      }
    }
  }
}

TEST(BlockDequantTest, ChunksThatDoNotFitAreRefusedByNameAndNothingIsWritten) {
  std::vector<uint8_t> codes(100, 3);
  std::vector<float> scales(4, 2.0f);
  const std::vector<float> values = Int8Values();
  std::vector<float> out(100, -1.0f);
  const BlockChunk fits{0, 1, 1, 50, 50, 0, 1};
  struct Case {
    BlockChunk chunk;
    const char* says;
  } cases[] = {
      {{60, 1, 1, 50, 50, 0, 1}, "past the 100 codes"},
      {{0, 1, 1, 50, 50, 4, 1}, "past the 4 given"},
      {{0, 1, 1, 50, 0, 0, 1}, "not positive"},
      {{-1, 1, 1, 50, 50, 0, 1}, "negative"},
      {{0, 1, 1, 50, 10, 0, 1}, "one block per width"},
      {{0, int64_t{1} << 40, int64_t{1} << 30, 1, 1, 0, 1}, "larger than any buffer"},
  };
  for (const Case& c : cases) {
    const absl::Status s =
        DequantizeChunks(codes, scales, values, {fits, c.chunk}, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_THAT(s.message(), HasSubstr("block chunk 1")) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says)) << s;
  }
  for (float v : out) ASSERT_EQ(v, -1.0f);  // the chunk that fits was not written either
  EXPECT_THAT(DequantizeChunks(codes, scales, absl::MakeConstSpan(values.data(), 255), {fits},
                               absl::MakeSpan(out))
                  .message(),
              HasSubstr("255 code values"));
  EXPECT_THAT(
      DequantizeChunks(codes, scales, values, {fits}, absl::MakeSpan(out.data(), 99)).message(),
      HasSubstr("99 output elements for 100 codes"));
}

}  // namespace
}  // namespace ragshard

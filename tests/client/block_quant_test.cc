#include "client/block_quant.h"

#include <cmath>
#include <cstdint>
#include <limits>
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
      {{60, 1, 1, 50, 50, 0, 1}, "past the 100 elements"},
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

// One run of n elements, one block.
BlockChunk OneRun(int64_t n) { return {0, 1, 1, n, n, 0, 1}; }

TEST(BlockQuantTest, AmaxFoldsEachBlocksLargestMagnitudeAndNaNWins) {
  // 37 elements: the SIMD lanes and the tail both see the largest.
  std::vector<float> x(37, 0.5f);
  x[35] = -9.0f;
  std::vector<float> amax = {2.0f};
  ASSERT_TRUE(BlockAmax(x, {OneRun(37)}, absl::MakeSpan(amax)).ok());
  EXPECT_EQ(amax[0], 9.0f);
  amax = {20.0f};  // folded: a larger maximum already there stays
  ASSERT_TRUE(BlockAmax(x, {OneRun(37)}, absl::MakeSpan(amax)).ok());
  EXPECT_EQ(amax[0], 20.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(BlockAmax(x, {OneRun(37)}, absl::MakeSpan(amax)).ok());
  EXPECT_TRUE(std::isnan(amax[0]));
}

TEST(BlockQuantTest, Int8CodesRoundTiesToEvenAndClamp) {
  // 20 elements: 16 through the SIMD lanes, 4 through the tail, the same cases in both.
  const std::vector<float> base = {0.5f,   1.5f,  -2.5f, 300.0f, -300.0f,
                                   126.6f, -0.4f, 3.0f,  2.5f,   -0.5f};
  std::vector<float> x;
  for (int i = 0; i < 2; ++i) x.insert(x.end(), base.begin(), base.end());
  const std::vector<int8_t> want = {0, 2, -2, 127, -127, 127, 0, 3, 2, 0};
  std::vector<uint8_t> codes(x.size());
  const std::vector<float> scale = {1.0f};
  ASSERT_TRUE(EncodeChunks(x, scale, {OneRun(static_cast<int64_t>(x.size()))}, CodeKind::kInt8,
                           absl::MakeSpan(codes))
                  .ok());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(static_cast<int8_t>(codes[i]), want[i % want.size()]) << "x = " << x[i];
  }
}

TEST(BlockQuantTest, Fp8CodesAreE4m3fnBytes) {
  // 1 = 0x38, 448 (the largest) = 0x7e, past it clamps to 448, 2^-9 (the least subnormal) =
  // 0x01, -2 = 0xc0, 0 = 0x00; twice, through the lanes and the tail.
  const std::vector<float> base = {1.0f, 448.0f, 1000.0f, 0.001953125f, -2.0f,
                                   0.0f, 1.0f,   1.0f,    1.0f,         1.0f};
  const std::vector<uint8_t> want = {0x38, 0x7e, 0x7e, 0x01, 0xc0, 0x00, 0x38, 0x38, 0x38, 0x38};
  std::vector<float> x;
  for (int i = 0; i < 2; ++i) x.insert(x.end(), base.begin(), base.end());
  std::vector<uint8_t> codes(x.size());
  const std::vector<float> scale = {1.0f};
  ASSERT_TRUE(EncodeChunks(x, scale, {OneRun(static_cast<int64_t>(x.size()))}, CodeKind::kFp8E4m3fn,
                           absl::MakeSpan(codes))
                  .ok());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(codes[i], want[i % want.size()]) << x[i];
}

TEST(BlockQuantTest, QuantizerPassesRefuseChunksThatDoNotFit) {
  const std::vector<float> x(10, 1.0f);
  std::vector<float> amax(1);
  std::vector<uint8_t> codes(10);
  EXPECT_THAT(BlockAmax(x, {OneRun(11)}, absl::MakeSpan(amax)).message(),
              HasSubstr("past the 10 elements"));
  EXPECT_THAT(EncodeChunks(x, amax, {OneRun(10)}, CodeKind::kInt8, absl::MakeSpan(codes.data(), 9))
                  .message(),
              HasSubstr("9 codes for 10 elements"));
}

}  // namespace
}  // namespace ragshard

#include "client/block_dequant.h"

#include <algorithm>
#include <cstddef>

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

absl::Status CheckChunk(const BlockChunk& c, size_t index, size_t elems, size_t blocks) {
  const auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("block chunk ", index, " (pos ", c.pos, ", ", c.bands, " bands of ", c.rows,
                     " x ", c.cols, ", blocks of width ", c.width, " from block ", c.first_block,
                     ", ", c.tiles, " per band) ", why));
  };
  if (c.pos < 0 || c.bands < 0 || c.rows < 0 || c.cols < 0 || c.width <= 0 || c.first_block < 0 ||
      c.tiles <= 0) {
    return bad("has a negative size or a width or tiles that is not positive");
  }
  if (c.tiles != (c.cols + c.width - 1) / c.width) {
    return bad("does not have one block per width of its columns");
  }
  // Each factor is below 2^40 or the products would not describe memory: check before
  // multiplying, so that nothing overflows.
  constexpr int64_t kMax = int64_t{1} << 40;
  if (c.bands > kMax || c.rows > kMax || c.cols > kMax || c.tiles > kMax || c.pos > kMax ||
      c.first_block > kMax) {
    return bad("is larger than any buffer");
  }
  if (c.bands != 0 && c.rows != 0 && c.cols != 0 &&
      (c.rows > kMax / c.cols || c.bands > kMax / (c.rows * c.cols))) {
    return bad("is larger than any buffer");
  }
  const int64_t end = c.pos + c.bands * c.rows * c.cols;
  if (static_cast<uint64_t>(end) > elems) {
    return bad(absl::StrCat("ends at element ", end, ", past the ", elems, " codes").c_str());
  }
  if (c.bands > 0 && static_cast<uint64_t>(c.first_block + c.bands * c.tiles) > blocks) {
    return bad(absl::StrCat("needs ", c.first_block + c.bands * c.tiles, " scales, past the ",
                            blocks, " given")
                   .c_str());
  }
  return absl::OkStatus();
}

// True where values are the int8 codes' own values (what a conversion gives).
bool IsInt8(absl::Span<const float> values) {
  for (int b = 0; b < 256; ++b) {
    if (values[b] != static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(b)))) {
      return false;
    }
  }
  return true;
}

// Calls row(in, dst, n, scale) for each stretch of a row that one block covers.
template <typename Row>
void ForEachRow(absl::Span<const uint8_t> codes, absl::Span<const float> scales,
                absl::Span<const BlockChunk> chunks, absl::Span<float> out, const Row& row) {
  for (const BlockChunk& c : chunks) {
    const uint8_t* in = codes.data() + c.pos;
    float* dst = out.data() + c.pos;
    for (int64_t b = 0; b < c.bands; ++b) {
      const float* band_scales = scales.data() + c.first_block + b * c.tiles;
      for (int64_t r = 0; r < c.rows; ++r, in += c.cols, dst += c.cols) {
        for (int64_t t = 0; t < c.tiles; ++t) {
          const int64_t j0 = t * c.width;
          row(in + j0, dst + j0, std::min(c.cols, j0 + c.width) - j0, band_scales[t]);
        }
      }
    }
  }
}

}  // namespace

absl::Status DequantizeChunks(absl::Span<const uint8_t> codes, absl::Span<const float> scales,
                              absl::Span<const float> values, absl::Span<const BlockChunk> chunks,
                              absl::Span<float> out) {
  if (values.size() != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("dequantize: ", values.size(), " code values; a byte has 256"));
  }
  if (out.size() < codes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("dequantize: ", out.size(), " output elements for ", codes.size(), " codes"));
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (absl::Status s = CheckChunk(chunks[i], i, codes.size(), scales.size()); !s.ok()) return s;
  }
  if (IsInt8(values)) {
    ForEachRow(codes, scales, chunks, out, [](const uint8_t* in, float* dst, int64_t n, float s) {
      // Converted, not looked up: the compiler vectorizes it.
      for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(static_cast<int8_t>(in[j])) * s;
    });
  } else {
    const float* table = values.data();
    ForEachRow(codes, scales, chunks, out,
               [table](const uint8_t* in, float* dst, int64_t n, float s) {
                 for (int64_t j = 0; j < n; ++j) dst[j] = table[in[j]] * s;
               });
  }
  return absl::OkStatus();
}

}  // namespace ragshard

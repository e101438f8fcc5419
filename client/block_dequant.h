// Dequantization of block-quantized codes (python/ragshard/quant.py's layout) into fp32: the
// quantized all-gather's hot loop, one pass over memory where the torch ops it replaces make
// three (decode, gather the scales, multiply).
#ifndef RAGSHARD_CLIENT_BLOCK_DEQUANT_H_
#define RAGSHARD_CLIENT_BLOCK_DEQUANT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace ragshard {

// A run of whole blocks: elements [pos, pos + bands * rows * cols) viewed as `bands` bands of
// `rows` rows x `cols` columns; element (b, r, j) is in block first_block + b * tiles + j / width.
// A 128 x 128 tiling of a 2-D piece has rows = width = 128; a flat run of 16,384 elements has
// rows = 1, cols = width = 16,384, tiles = 1.
struct BlockChunk {
  int64_t pos = 0;
  int64_t bands = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t width = 0;
  int64_t first_block = 0;
  int64_t tiles = 0;
};
inline constexpr int kBlockChunkFields = 7;  // the int64 fields of a BlockChunk, in order

// out[e] = values[codes[e]] * scales[block of e] for every element e of every chunk; `values`
// are the 256 fp32 values of the code bytes (int8 or FP8 e4m3fn). Elements outside the chunks
// are not touched, and each element of a chunk is written once, with its final value (`out` may
// be a buffer that other processes fill with the same values at the same time). A chunk that
// does not fit `codes`, `out` or `scales` is INVALID_ARGUMENT, naming it, and nothing is written.
absl::Status DequantizeChunks(absl::Span<const uint8_t> codes, absl::Span<const float> scales,
                              absl::Span<const float> values, absl::Span<const BlockChunk> chunks,
                              absl::Span<float> out);

}  // namespace ragshard

#endif  // RAGSHARD_CLIENT_BLOCK_DEQUANT_H_

// Block quantization kernels (python/ragshard/quant.py's layout: 128 x 128 tiles and runs of
// 16,384): the quantized all-gather's hot loops, one pass over memory each where the torch ops
// they replace make several.
#ifndef RAGSHARD_CLIENT_BLOCK_QUANT_H_
#define RAGSHARD_CLIENT_BLOCK_QUANT_H_

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

// The largest |x| of each block's elements in the chunks, folded into amax (NaN wins): the
// quantizer's first pass. A chunk that does not fit `x` or `amax` is INVALID_ARGUMENT.
absl::Status BlockAmax(absl::Span<const float> x, absl::Span<const BlockChunk> chunks,
                       absl::Span<float> amax);

enum class CodeKind { kInt8, kFp8E4m3fn };

// codes[e] = the code of x[e] / scales[block of e], clamped to the format's range (±127, ±448),
// for every element e of the chunks: int8 rounded to nearest even, or FP8 e4m3fn rounded to
// nearest even (torch's conversions, bit for bit). Elements outside the chunks are not
// touched. A chunk that does not fit is INVALID_ARGUMENT, naming it, and nothing is written.
absl::Status EncodeChunks(absl::Span<const float> x, absl::Span<const float> scales,
                          absl::Span<const BlockChunk> chunks, CodeKind kind,
                          absl::Span<uint8_t> codes);

}  // namespace ragshard

#endif  // RAGSHARD_CLIENT_BLOCK_QUANT_H_

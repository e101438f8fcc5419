#include "client/block_quant.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "absl/base/casts.h"
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
    return bad(absl::StrCat("ends at element ", end, ", past the ", elems, " elements").c_str());
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

absl::Status CheckChunks(absl::Span<const BlockChunk> chunks, size_t elems, size_t blocks) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (absl::Status s = CheckChunk(chunks[i], i, elems, blocks); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Calls stretch(in, out, n, block) for each stretch of a row that one block covers: n elements
// from in and out, both at the stretch's element.
template <typename In, typename Out, typename Stretch>
void ForEachStretch(const In* in, Out* out, absl::Span<const BlockChunk> chunks,
                    const Stretch& stretch) {
  for (const BlockChunk& c : chunks) {
    for (int64_t b = 0; b < c.bands; ++b) {
      for (int64_t r = 0; r < c.rows; ++r) {
        const int64_t row = c.pos + (b * c.rows + r) * c.cols;
        for (int64_t t = 0; t < c.tiles; ++t) {
          const int64_t j0 = t * c.width;
          stretch(in + row + j0, out + row + j0, std::min(c.cols, j0 + c.width) - j0,
                  c.first_block + b * c.tiles + t);
        }
      }
    }
  }
}

// float -> float8_e4m3fn with round to nearest even, as c10::Float8_e4m3fn converts (torch's
// .to(torch.float8_e4m3fn)), written without branches so that the compiler vectorizes the
// loop; |f| <= 448 here (the caller clamps), so no NaN is made.
inline uint8_t ToE4m3fn(float f) {
  constexpr uint32_t kFp8Max = UINT32_C(1087) << 20;
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;
  const uint32_t all = absl::bit_cast<uint32_t>(f);
  const uint32_t sign = all & UINT32_C(0x80000000);
  const uint32_t bits = all ^ sign;
  // Below 2^-6: the sum's low bits are the subnormal code, rounded by the addition.
  const uint32_t sub =
      absl::bit_cast<uint32_t>(absl::bit_cast<float>(bits) + absl::bit_cast<float>(kDenormMask)) -
      kDenormMask;
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(7 - 127) << 23) + UINT32_C(0x7FFFF) + ((bits >> 20) & 1)) >>
      20;
  // bits < 2^31: the comparisons hold as signed ones, which SSE2 has.
  const auto below = static_cast<int32_t>(UINT32_C(121) << 23);
  uint32_t r = static_cast<int32_t>(bits) < below ? sub : normal;
  r = static_cast<int32_t>(bits) >= static_cast<int32_t>(kFp8Max) ? UINT32_C(0x7f) : r;
  return static_cast<uint8_t>(r | (sign >> 24));
}

// x rounded to the nearest integer, ties to even (std::nearbyint under the default rounding
// mode), for |x| <= 2^22: adding and taking away 1.5 * 2^23 leaves no fraction bits, so the
// addition rounds (without -ffast-math the compiler keeps both operations). A library call per
// element otherwise, where this vectorizes.
inline float RoundEven(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (x + kMagic) - kMagic;
}

// The larger of a running maximum and a new one, NaN winning (torch's amax).
inline float FoldAmax(float have, float a) {
  if (have != have) return have;
  return a > have || a != a ? a : have;
}

// The largest |in[j]| of a stretch (NaN if any is NaN), in eight running maxima with the NaNs
// counted apart, so that the loop vectorizes.
float StretchAmax(const float* __restrict in, int64_t n) {
  constexpr int kLanes = 8;
  float v[kLanes] = {};
  int nan = 0;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float a = std::fabs(in[j + k]);
      nan |= static_cast<int>(a != a);
      v[k] = a > v[k] ? a : v[k];
    }
  }
  for (; j < n; ++j) {
    const float a = std::fabs(in[j]);
    nan |= static_cast<int>(a != a);
    v[0] = a > v[0] ? a : v[0];
  }
  float m = v[0];
  for (int k = 1; k < kLanes; ++k) m = v[k] > m ? v[k] : m;
  return nan != 0 ? std::numeric_limits<float>::quiet_NaN() : m;
}

// y = x / s clamped to [-q, q], NaN kept (torch's div and clamp).
inline float ScaledClamped(float x, float s, float q) {
  const float y = x / s;
  if (y != y) return y;
  return y < -q ? -q : (y > q ? q : y);
}

#ifdef __SSE2__
// Four lanes of ScaledClamped: SSE2's min and max return their second operand where either is
// NaN, so NaN lanes are put back from the quotient.
inline __m128 ScaledClamped4(__m128 x, __m128 s, __m128 q) {
  const __m128 y = _mm_div_ps(x, s);
  const __m128 c = _mm_min_ps(_mm_max_ps(y, _mm_sub_ps(_mm_setzero_ps(), q)), q);
  const __m128 nan = _mm_cmpunord_ps(y, y);
  return _mm_or_ps(_mm_and_ps(nan, y), _mm_andnot_ps(nan, c));
}

// ToE4m3fn on four lanes (|f| <= 448 or NaN), the same integer steps.
inline __m128i ToE4m3fn4(__m128 f) {
  const __m128i all = _mm_castps_si128(f);
  const __m128i sign = _mm_and_si128(all, _mm_set1_epi32(static_cast<int>(0x80000000U)));
  const __m128i bits = _mm_xor_si128(all, sign);
  const __m128i denorm = _mm_set1_epi32(141 << 23);
  const __m128i sub = _mm_sub_epi32(
      _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(bits), _mm_castsi128_ps(denorm))), denorm);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 20), _mm_set1_epi32(1));
  const __m128i normal = _mm_srli_epi32(
      _mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(static_cast<int>(
                                            (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFU))),
                    odd),
      20);
  const __m128i small = _mm_cmplt_epi32(bits, _mm_set1_epi32(121 << 23));
  __m128i r = _mm_or_si128(_mm_and_si128(small, sub), _mm_andnot_si128(small, normal));
  const __m128i big = _mm_cmpgt_epi32(bits, _mm_set1_epi32((1087 << 20) - 1));
  r = _mm_or_si128(_mm_and_si128(big, _mm_set1_epi32(0x7f)), _mm_andnot_si128(big, r));
  return _mm_and_si128(_mm_or_si128(r, _mm_srli_epi32(sign, 24)), _mm_set1_epi32(0xff));
}
#endif

void EncodeInt8(const float* in, uint8_t* dst, int64_t n, float s) {
  int64_t j = 0;
#ifdef __SSE2__
  const __m128 vs = _mm_set1_ps(s);
  const __m128 q = _mm_set1_ps(127.0f);
  const __m128 magic = _mm_set1_ps(12582912.0f);
  for (; j + 16 <= n; j += 16) {
    __m128i lanes[4];
    for (int k = 0; k < 4; ++k) {
      const __m128 y = ScaledClamped4(_mm_loadu_ps(in + j + 4 * k), vs, q);
      const __m128 nan = _mm_cmpunord_ps(y, y);
      const __m128 r = _mm_sub_ps(_mm_add_ps(y, magic), magic);  // RoundEven
      lanes[k] = _mm_cvttps_epi32(_mm_andnot_ps(nan, r));        // NaN: 0
    }
    const __m128i w =
        _mm_packs_epi16(_mm_packs_epi32(lanes[0], lanes[1]), _mm_packs_epi32(lanes[2], lanes[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), w);
  }
#endif
  for (; j < n; ++j) {
    const float y = ScaledClamped(in[j], s, 127.0f);
    // NaN (a NaN input) has no int8 code: 0, where a conversion would be undefined.
    dst[j] =
        y == y ? static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>(RoundEven(y)))) : 0;
  }
}

void EncodeE4m3fn(const float* in, uint8_t* dst, int64_t n, float s) {
  int64_t j = 0;
#ifdef __SSE2__
  const __m128 vs = _mm_set1_ps(s);
  const __m128 q = _mm_set1_ps(448.0f);
  for (; j + 16 <= n; j += 16) {
    __m128i lanes[4];
    for (int k = 0; k < 4; ++k) {
      lanes[k] = ToE4m3fn4(ScaledClamped4(_mm_loadu_ps(in + j + 4 * k), vs, q));
    }
    // Every lane is 0..255: the saturating packs keep it.
    const __m128i w =
        _mm_packus_epi16(_mm_packs_epi32(lanes[0], lanes[1]), _mm_packs_epi32(lanes[2], lanes[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), w);
  }
#endif
  for (; j < n; ++j) dst[j] = ToE4m3fn(ScaledClamped(in[j], s, 448.0f));
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
  if (absl::Status s = CheckChunks(chunks, codes.size(), scales.size()); !s.ok()) return s;
  const float* sc = scales.data();
  if (IsInt8(values)) {
    ForEachStretch(codes.data(), out.data(), chunks,
                   [sc](const uint8_t* in, float* dst, int64_t n, int64_t block) {
                     // Converted, not looked up: the compiler vectorizes it.
                     const float s = sc[block];
                     for (int64_t j = 0; j < n; ++j) {
                       dst[j] = static_cast<float>(static_cast<int8_t>(in[j])) * s;
                     }
                   });
  } else {
    const float* table = values.data();
    ForEachStretch(codes.data(), out.data(), chunks,
                   [sc, table](const uint8_t* in, float* dst, int64_t n, int64_t block) {
                     const float s = sc[block];
                     for (int64_t j = 0; j < n; ++j) dst[j] = table[in[j]] * s;
                   });
  }
  return absl::OkStatus();
}

absl::Status BlockAmax(absl::Span<const float> x, absl::Span<const BlockChunk> chunks,
                       absl::Span<float> amax) {
  if (absl::Status s = CheckChunks(chunks, x.size(), amax.size()); !s.ok()) return s;
  float* m = amax.data();
  ForEachStretch(x.data(), x.data(), chunks,
                 [m](const float* in, const float*, int64_t n, int64_t block) {
                   m[block] = FoldAmax(m[block], StretchAmax(in, n));
                 });
  return absl::OkStatus();
}

absl::Status EncodeChunks(absl::Span<const float> x, absl::Span<const float> scales,
                          absl::Span<const BlockChunk> chunks, CodeKind kind,
                          absl::Span<uint8_t> codes) {
  if (codes.size() < x.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize: ", codes.size(), " codes for ", x.size(), " elements"));
  }
  if (absl::Status s = CheckChunks(chunks, x.size(), scales.size()); !s.ok()) return s;
  const float* sc = scales.data();
  if (kind == CodeKind::kInt8) {
    ForEachStretch(x.data(), codes.data(), chunks,
                   [sc](const float* in, uint8_t* dst, int64_t n, int64_t block) {
                     EncodeInt8(in, dst, n, sc[block]);
                   });
  } else {
    ForEachStretch(x.data(), codes.data(), chunks,
                   [sc](const float* in, uint8_t* dst, int64_t n, int64_t block) {
                     EncodeE4m3fn(in, dst, n, sc[block]);
                   });
  }
  return absl::OkStatus();
}

}  // namespace ragshard

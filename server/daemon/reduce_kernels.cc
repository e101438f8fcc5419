#include "server/daemon/reduce_kernels.h"

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ragshard::daemon {
namespace {

// Elements per block: each block's results are formed in registers (a local array) before any is
// stored, so `out` may be an input, and the compiler vectorizes the block without alias checks.
constexpr size_t kBlock = 16;

inline float Bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float Fp16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// out[i] = f(i) for i in [0, count), by blocks: all of a block's values before its stores.
template <typename F>
inline void Blocks(size_t count, float* out, F f) {
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    float v[kBlock];
    for (size_t k = 0; k < kBlock; ++k) v[k] = f(i + k);
    for (size_t k = 0; k < kBlock; ++k) out[i + k] = v[k];
  }
  for (; i < count; ++i) out[i] = f(i);
}

// A source of elements of one dtype, read as fp32: s(i). kBlocks: its loop vectorizes by
// blocks (fp32, bf16); fp16's subnormal loop does not, and runs element by element.
struct Fp32Source {
  static constexpr bool kBlocks = true;
  const float* p;
  float operator()(size_t i) const { return p[i]; }
};
struct Bf16Source {
  static constexpr bool kBlocks = true;
  const uint16_t* p;
  float operator()(size_t i) const { return Bf16(p[i]); }
};
struct Fp16Source {
  static constexpr bool kBlocks = false;
  const uint16_t* p;
  float operator()(size_t i) const { return Fp16(p[i]); }
};

// Calls `kernel(source)` with the source of `src`'s dtype; nothing for a dtype that is not
// reduced (the data plane moves those as bytes).
template <typename Kernel>
inline void WithSource(const void* src, v1::DType dtype, Kernel kernel) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      kernel(Fp32Source{static_cast<const float*>(src)});
      break;
    case v1::DTYPE_BF16:
      kernel(Bf16Source{static_cast<const uint16_t*>(src)});
      break;
    case v1::DTYPE_FP16:
      kernel(Fp16Source{static_cast<const uint16_t*>(src)});
      break;
    default:
      break;
  }
}

// out[i] = f(i) for i in [0, count): by blocks where Source's loop vectorizes.
template <typename Source, typename F>
inline void ForEach(size_t count, float* out, F f) {
  if constexpr (Source::kBlocks) {
    Blocks(count, out, f);
  } else {
    for (size_t i = 0; i < count; ++i) out[i] = f(i);
  }
}

// Sums whose output is at least this long, apart from both inputs and 16-byte aligned, store it
// with non-temporal stores: the output is not read first (a cached store reads each line before
// writing it), so the sum moves 3 streams, not 4. Measured on this machine (8 M elements, two
// inputs and an output of 32 MiB each): 5.3 ms cached, 3.8 ms streamed. Below it the output
// stays in the cache, where the next step reads it.
constexpr size_t kStreamMinBytes = size_t{256} << 10;

// out[i] = base[i] + src[i] with the output streamed; false where it does not apply.
inline bool AddStreamed(const float* base, const float* src, size_t count, float* out) {
#if defined(__SSE2__)
  if (count * sizeof(float) < kStreamMinBytes || out == base || out == src ||
      reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    return false;
  }
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m128 x0 = _mm_add_ps(_mm_loadu_ps(base + i), _mm_loadu_ps(src + i));
    const __m128 x1 = _mm_add_ps(_mm_loadu_ps(base + i + 4), _mm_loadu_ps(src + i + 4));
    const __m128 x2 = _mm_add_ps(_mm_loadu_ps(base + i + 8), _mm_loadu_ps(src + i + 8));
    const __m128 x3 = _mm_add_ps(_mm_loadu_ps(base + i + 12), _mm_loadu_ps(src + i + 12));
    _mm_stream_ps(out + i, x0);
    _mm_stream_ps(out + i + 4, x1);
    _mm_stream_ps(out + i + 8, x2);
    _mm_stream_ps(out + i + 12, x3);
  }
  _mm_sfence();  // the streamed stores are visible before whatever follows (a send, an answer)
  for (; i < count; ++i) out[i] = base[i] + src[i];
  return true;
#else
  (void)base, (void)src, (void)count, (void)out;
  return false;
#endif
}

}  // namespace

float Bf16ToFloat(uint16_t v) { return Bf16(v); }

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return 0x7fc0;  // NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Fp16ToFloat(uint16_t h) { return Fp16(h); }

void Accumulate(const void* src, v1::DType dtype, size_t count, float* acc) {
  WithSource(src, dtype, [&](auto s) {
    ForEach<decltype(s)>(count, acc, [&](size_t i) { return acc[i] + s(i); });
  });
}

void Convert(const void* src, v1::DType dtype, size_t count, float* out) {
  if (dtype == v1::DTYPE_FP32) {
    const float* s = static_cast<const float*>(src);
    if (s != out) std::copy(s, s + count, out);
    return;
  }
  WithSource(src, dtype, [&](auto s) { ForEach<decltype(s)>(count, out, s); });
}

void Add(const float* base, const void* src, v1::DType dtype, size_t count, float* out) {
  if (dtype == v1::DTYPE_FP32 && AddStreamed(base, static_cast<const float*>(src), count, out)) {
    return;
  }
  WithSource(src, dtype, [&](auto s) {
    ForEach<decltype(s)>(count, out, [&](size_t i) { return base[i] + s(i); });
  });
}

}  // namespace ragshard::daemon

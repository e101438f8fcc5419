// The reductions' element kernels (server/daemon/reduce_kernels.h) against element-by-element
// references, at counts around their 16-element blocks, out of place and in place.
#include "server/daemon/reduce_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace ragshard::daemon {
namespace {

// Values exact in bf16 and fp16, with a sign, a fraction and a few fp16 subnormals.
float Value(size_t i, int seed) {
  if (i % 23 == 5) return 3.0e-5f * static_cast<float>(seed);  // fp16 subnormal range
  return static_cast<float>((static_cast<int>(i) * 7 + seed * 13) % 41 - 20) / 4;
}

// `count` elements of `dtype` holding Value(i, seed), and their fp32 values.
std::vector<char> Encode(v1::DType dtype, size_t count, int seed, std::vector<float>* as_fp32) {
  as_fp32->resize(count);
  std::vector<char> out(count * (dtype == v1::DTYPE_FP32 ? 4 : 2));
  for (size_t i = 0; i < count; ++i) {
    const float v = Value(i, seed);
    if (dtype == v1::DTYPE_FP32) {
      std::memcpy(out.data() + 4 * i, &v, 4);
      (*as_fp32)[i] = v;
    } else if (dtype == v1::DTYPE_BF16) {
      const uint16_t h = FloatToBf16(v);
      std::memcpy(out.data() + 2 * i, &h, 2);
      (*as_fp32)[i] = Bf16ToFloat(h);
    } else {
      // fp16 by hand: sign, exponent and 10 mantissa bits of values these tests use.
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint32_t sign = (bits >> 16) & 0x8000u;
      const float a = v < 0 ? -v : v;
      uint16_t h;
      if (a == 0) {
        h = static_cast<uint16_t>(sign);
      } else if (a < 6.103515625e-05f) {  // subnormal: a = m * 2^-24
        h = static_cast<uint16_t>(sign | static_cast<uint32_t>(a * 16777216.0f + 0.5f));
      } else {
        const int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
        h = static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) |
                                  ((bits >> 13) & 0x3ffu));
      }
      std::memcpy(out.data() + 2 * i, &h, 2);
      (*as_fp32)[i] = Fp16ToFloat(h);
    }
  }
  return out;
}

class ReduceKernelsTest : public ::testing::TestWithParam<v1::DType> {};

TEST_P(ReduceKernelsTest, MatchTheElementByElementSumsAtEveryCount) {
  const v1::DType dtype = GetParam();
  for (size_t count :
       {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{33}, size_t{1000}}) {
    SCOPED_TRACE(count);
    std::vector<float> src32, base(count), expect(count);
    const std::vector<char> src = Encode(dtype, count, 1, &src32);
    for (size_t i = 0; i < count; ++i) base[i] = Value(i, 5);

    std::vector<float> out(count, -1.0f);
    Convert(src.data(), dtype, count, out.data());
    EXPECT_EQ(out, src32);

    for (size_t i = 0; i < count; ++i) expect[i] = base[i] + src32[i];
    Add(base.data(), src.data(), dtype, count, out.data());
    EXPECT_EQ(out, expect);
    std::vector<float> in_place = base;  // out is base
    Add(in_place.data(), src.data(), dtype, count, in_place.data());
    EXPECT_EQ(in_place, expect);

    std::vector<float> acc = base;
    Accumulate(src.data(), dtype, count, acc.data());
    EXPECT_EQ(acc, expect);
  }
}

// Long enough for the streamed output (kStreamMinBytes, 256 KiB), with a tail past the last
// 16-element block; out apart from both inputs, and in place (then not streamed).
TEST(ReduceKernelsFp32Test, ALongSumIsTheSameStreamedOrInPlace) {
  const size_t count = (size_t{256} << 10) / sizeof(float) + 37;
  std::vector<float> base(count), src(count), expect(count);
  for (size_t i = 0; i < count; ++i) {
    base[i] = Value(i, 4);
    src[i] = Value(i, 6);
    expect[i] = base[i] + src[i];
  }
  std::vector<float> out(count, -1.0f);
  Add(base.data(), src.data(), v1::DTYPE_FP32, count, out.data());
  EXPECT_EQ(out, expect);
  std::vector<float> in_place = base;
  Add(in_place.data(), src.data(), v1::DTYPE_FP32, count, in_place.data());
  EXPECT_EQ(in_place, expect);
  // An output 4 bytes off a 16-byte boundary takes the cached path.
  std::vector<float> shifted(count + 1, -1.0f);
  Add(base.data(), src.data(), v1::DTYPE_FP32, count, shifted.data() + 1);
  EXPECT_TRUE(std::equal(expect.begin(), expect.end(), shifted.begin() + 1));
}

TEST(ReduceKernelsFp32Test, AddAndConvertMayWriteOverTheirSource) {
  std::vector<float> src(37), base(37), expect(37);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = Value(i, 1);
    base[i] = Value(i, 2);
    expect[i] = base[i] + src[i];
  }
  std::vector<float> s = src;
  Add(base.data(), s.data(), v1::DTYPE_FP32, s.size(), s.data());  // out is src
  EXPECT_EQ(s, expect);
  s = src;
  Convert(s.data(), v1::DTYPE_FP32, s.size(), s.data());
  EXPECT_EQ(s, src);
}

INSTANTIATE_TEST_SUITE_P(DTypes, ReduceKernelsTest,
                         ::testing::Values(v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16));

}  // namespace
}  // namespace ragshard::daemon

// The element kernels of the reductions: dtype conversions to fp32 and fp32 sums, in blocks the
// compiler vectorizes (reduce_kernels.cc is built at -O3).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ragshard/v1/plan.pb.h"

namespace ragshard::daemon {

float Bf16ToFloat(uint16_t v);
uint16_t FloatToBf16(float f);  // round to nearest even
float Fp16ToFloat(uint16_t v);
// Adds `count` elements of `dtype` at `src` into `acc`.
void Accumulate(const void* src, v1::DType dtype, size_t count, float* acc);
// out = src as fp32; out = base + src. `out` may be `base` or `src` (fp32): each element is read
// before it is written.
void Convert(const void* src, v1::DType dtype, size_t count, float* out);
void Add(const float* base, const void* src, v1::DType dtype, size_t count, float* out);

}  // namespace ragshard::daemon

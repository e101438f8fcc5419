#include "engine/dtype.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ragshard {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  int64_t size;
};

constexpr std::array<DTypeInfo, 9> kDTypes = {{
    {v1::DTYPE_FP32, "fp32", 4},
    {v1::DTYPE_BF16, "bf16", 2},
    {v1::DTYPE_FP16, "fp16", 2},
    {v1::DTYPE_FP8E4M3, "fp8e4m3", 1},
    {v1::DTYPE_FP8E5M2, "fp8e5m2", 1},
    {v1::DTYPE_INT8, "int8", 1},
    {v1::DTYPE_INT32, "int32", 4},
    {v1::DTYPE_INT64, "int64", 8},
    {v1::DTYPE_UINT8, "uint8", 1},
}};

const DTypeInfo& Info(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  LOG(FATAL) << "unknown dtype " << static_cast<int>(dtype);
  return kDTypes[0];  // unreachable
}

}  // namespace

int64_t DTypeSize(DType dtype) { return Info(dtype).size; }

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name, "' (expected fp32, bf16, fp16, fp8e4m3, fp8e5m2, int8, int32, ",
      "int64 or uint8)"));
}

}  // namespace ragshard

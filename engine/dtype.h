// Element types of the plan model.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

using DType = ::ragshard::v1::DType;

// Bytes per element. CHECK-fails on DTYPE_UNSPECIFIED (a bug: parsed specs never hold it).
int64_t DTypeSize(DType dtype);

// The name used in inventory files and on the command line: "fp32", "bf16", ...
absl::string_view DTypeName(DType dtype);

// Parses a name written by DTypeName. The error names the value and the accepted set.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace ragshard

// Parameter inventories: the units and tensors a training process registers, the JSON file
// format users write or export, and the checks every inventory passes before it is planned.
//
// JSON format:
//   {"units": [{"name": "layers.0", "tensors": [{"name": "layers.0.q_proj.weight",
//     "shape": [4096, 4096], "dtype": "bf16", "granule": "rows:128", "optimizer": "matrix"}]}]}
// `granule` is "element" (default), "rows:K" or "whole"; `optimizer` is "elementwise" (default),
// "matrix" (Muon) or "shampoo" ("shampoo:B": preconditioned in blocks of at most B x B). Unknown
// keys are rejected so that a misspelt key is not silently ignored.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

using Inventory = ::ragshard::v1::Inventory;
using TensorSpec = ::ragshard::v1::TensorSpec;
using UnitSpec = ::ragshard::v1::UnitSpec;

struct Granule {
  v1::GranuleKind kind = v1::GRANULE_ELEMENT;
  int64_t rows = 0;  // only for GRANULE_ROWS
};

// Parses "element", "rows:K" (K >= 1) or "whole". The error names the value.
absl::StatusOr<Granule> ParseGranule(absl::string_view text);
std::string GranuleName(const TensorSpec& spec);

// The largest block side "shampoo:B" accepts.
inline constexpr int64_t kMaxShampooBlock = int64_t{1} << 20;

// Parses "elementwise", "matrix", "shampoo" or "shampoo:B" (1 <= B <= kMaxShampooBlock) into
// spec's optimizer and shampoo_block. The error names the value.
absl::Status ParseOptimizer(absl::string_view text, TensorSpec* spec);
std::string OptimizerName(const TensorSpec& spec);

// Muon's and Shampoo's tensors: an owner rank takes the whole matrix at step time.
inline bool WholeMatrix(v1::OptimizerKind kind) {
  return kind == v1::OPTIMIZER_MATRIX || kind == v1::OPTIMIZER_SHAMPOO;
}

// Limits on what an inventory may hold. The defaults fit DeepSeek-V3 (about 45k tensors) with
// room to spare.
struct InventoryLimits {
  int64_t max_tensors = 1'000'000;
  int64_t max_units = 100'000;
  int64_t max_tensors_per_unit = 200'000;
  int64_t max_name_length = 512;
  int64_t max_rank = 8;
  // Every unit's total must stay far from int64 overflow, so that offsets, W * S and byte
  // counts are representable: 2^52 elements (4.5e15).
  int64_t max_unit_elems = int64_t{1} << 52;
};

// Number of elements, or an error when a dimension is not positive or the product overflows.
absl::StatusOr<int64_t> TensorNumel(const TensorSpec& spec);

// The granule in elements: 1, min(rows * shape[-1], numel), or numel. Requires a valid spec.
int64_t GranuleElems(const TensorSpec& spec);

// Checks every rule: at least one unit, no empty unit, unique unit and tensor names, names made
// of [A-Za-z0-9_.:/-], positive dimensions, no overflow, a dtype, a granule of at least one row.
// The error names the field, e.g. "units[2].tensors[5] 'layers.1.mlp.w1' shape[1]: ...".
absl::Status ValidateInventory(const Inventory& inventory, const InventoryLimits& limits = {});

// Parses and validates the JSON inventory format above.
absl::StatusOr<Inventory> ParseInventoryJson(absl::string_view json,
                                             const InventoryLimits& limits = {});
absl::StatusOr<Inventory> LoadInventoryFile(const std::string& path,
                                            const InventoryLimits& limits = {});
std::string InventoryToJson(const Inventory& inventory);

// Sets `granule` on every tensor with two or more dimensions; vectors keep "element".
void ApplyGranule(Inventory* inventory, const Granule& granule);

}  // namespace ragshard

namespace ragshard {

// SHA-256 (32 raw bytes) of the deterministic serialization of `inventory`: the canonical
// inventory hash of planner.proto.
std::string InventorySha256(const Inventory& inventory);

// Lowercase hex of bytes (for messages).
std::string HexString(const std::string& bytes);

// Empty when the inventories are equal; otherwise a sentence naming the first unit or tensor that
// differs and how, e.g. "tensor 'layers.0.q.weight' (units[1].tensors[2]): shape [4096, 4096]
// differs from the reference's [4096, 1024]".
std::string FirstInventoryDifference(const Inventory& reference, const Inventory& other);

}  // namespace ragshard

// The model zoo of docs/design.md, generated in code. Units are "embed", "layers.<i>" and
// "head" (final norm plus lm_head when untied). Weights are [out, in] and bf16; matrices inside
// decoder layers use the matrix optimizer (Muon convention), everything else is element-wise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/inventory.h"

namespace ragshard {

struct ModelInfo {
  std::string name;
  int64_t total_params = 0;  // as published with the model
  int64_t tensors = 0;       // 0 when no count is published
  // Mixture of experts: routed experts per layer and how many each token uses (the published
  // configs' num_experts_per_tok); 0 for dense models. Tensors named "*.experts.*" are routed.
  int64_t routed_experts = 0;
  int64_t experts_per_token = 0;
};

// The zoo entry of NAME (variants ":grouped" and ":fused" allowed), or nullptr.
const ModelInfo* FindModel(absl::string_view name);

// The zoo, in docs/design.md's order.
const std::vector<ModelInfo>& ModelZoo();

// NAME is a zoo name, optionally with variants: "NAME:grouped" stores each layer's experts as
// one [E, I, H] tensor per projection, "NAME:fused" fuses QKV and gate/up ("NAME:grouped:fused"
// does both). Every tensor gets granule "element"; apply another with ApplyGranule.
// Errors name the model and list the known ones.
absl::StatusOr<Inventory> GenerateModel(absl::string_view name);

}  // namespace ragshard

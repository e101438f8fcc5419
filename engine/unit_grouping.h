// A model's layer structure, read from its inventory for the strategy search: unit grouping
// (k consecutive decoder layers "layers.<i>" form one FSDP unit, optionally after a lead block
// of distinct first layers) and the shape the cost model needs.
//
// Thread-safe: the functions are pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "engine/inventory.h"

namespace ragshard {

// True for "layers.<i>" with i >= 0, which it stores in *index.
bool IsLayerUnit(const std::string& name, int64_t* index);

// True for a unit of layer i: "layers.<i>", or "attn.<i>" (layer i's attention, a unit of its
// own before its MLP's "layers.<i>" where one unit of both would pad too much).
bool IsLayerPart(const std::string& name, int64_t* index);

// Groups consecutive layers k at a time ("layers.0-3" holding the tensors of layers.0..3, in
// order, a layer's "attn.<i>" unit included); other units stay as they are. `members` gets, per
// grouped unit, the names of the inventory units it covers.
// With lead > 0 the first `lead` layer units form one unit first.
Inventory GroupUnits(const Inventory& inventory, int64_t k,
                     std::vector<std::vector<std::string>>* members = nullptr, int64_t lead = 0);
// The same into `out` (empty; it may live on an arena, where the search keeps its groupings).
void GroupUnitsInto(const Inventory& inventory, int64_t k,
                    std::vector<std::vector<std::string>>* members, int64_t lead, Inventory* out);

// The number of leading layer units whose tensors differ from the last layer's (0 when the
// layers are alike): the lead groupings worth trying.
int64_t DistinctLeadingLayers(const Inventory& inventory);

// What the cost model knows about the model besides its inventory.
struct ModelShape {
  int64_t hidden = 0;                     // H: from the embedding table (or the widest vector)
  int64_t layers = 0;                     // units named layers.<i>
  double active_fraction_of_experts = 1;  // experts_per_token / routed_experts
};
// Derives the shape; `model` is a zoo name (or empty for an inventory file: dense).
ModelShape DeriveModelShape(const Inventory& inventory, absl::string_view model);

}  // namespace ragshard

#include "engine/unit_grouping.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/models.h"

namespace ragshard {

bool IsLayerUnit(const std::string& name, int64_t* index) {
  if (!absl::StartsWith(name, "layers.")) return false;
  return absl::SimpleAtoi(absl::string_view(name).substr(7), index) && *index >= 0;
}

bool IsLayerPart(const std::string& name, int64_t* index) {
  if (IsLayerUnit(name, index)) return true;
  if (!absl::StartsWith(name, "attn.")) return false;
  return absl::SimpleAtoi(absl::string_view(name).substr(5), index) && *index >= 0;
}

Inventory GroupUnits(const Inventory& inventory, int64_t k,
                     std::vector<std::vector<std::string>>* members, int64_t lead) {
  Inventory out;
  GroupUnitsInto(inventory, k, members, lead, &out);
  return out;
}

void GroupUnitsInto(const Inventory& inventory, int64_t k,
                    std::vector<std::vector<std::string>>* members, int64_t lead, Inventory* out) {
  int64_t layers_seen = 0;
  if (members != nullptr) members->clear();
  UnitSpec* open = nullptr;
  int64_t first = 0, last = 0, count = 0, seen = -1;  // seen: the last layer part's index
  std::vector<std::string> names;
  auto close = [&] {
    if (open == nullptr) return;
    open->set_name(names.size() == 1 ? names.front()
                   : count == 1      ? absl::StrCat("layers.", first)
                                     : absl::StrCat("layers.", first, "-", last));
    if (members != nullptr) members->push_back(names);
    open = nullptr;
    names.clear();
    count = 0;
  };
  for (const UnitSpec& u : inventory.units()) {
    int64_t index = 0;
    const bool is_layer = IsLayerPart(u.name(), &index);
    // A second unit of the layer just seen (its MLP after its attention) joins that layer.
    const bool same_layer = is_layer && index == seen;
    if (is_layer) seen = index;
    const bool in_lead = is_layer && layers_seen - (same_layer ? 1 : 0) < lead;
    if (is_layer && !same_layer) ++layers_seen;
    const int64_t size = in_lead ? lead : k;
    const bool layer = is_layer && (size > 1);
    // The lead block closes when it is complete; groups of k do not mix with it.
    const bool lead_done = is_layer && !same_layer && layers_seen == lead + 1 && lead > 0;
    if (!layer || lead_done ||
        (open != nullptr && !same_layer && (count == size || index != last + 1))) {
      close();
    }
    if (!layer) {
      *out->add_units() = u;
      if (members != nullptr) members->push_back({u.name()});
      continue;
    }
    if (open == nullptr) {
      open = out->add_units();
      first = index;
    }
    if (!same_layer || count == 0) ++count;
    last = index;
    names.push_back(u.name());
    for (const TensorSpec& t : u.tensors()) *open->add_tensors() = t;
  }
  close();
}

int64_t DistinctLeadingLayers(const Inventory& inventory) {
  std::vector<const UnitSpec*> layers;
  for (const UnitSpec& u : inventory.units()) {
    int64_t i = 0;
    if (IsLayerUnit(u.name(), &i)) layers.push_back(&u);
  }
  auto shapes = [](const UnitSpec& u) {
    std::vector<int64_t> v;
    for (const TensorSpec& t : u.tensors()) {
      v.push_back(-1);
      v.insert(v.end(), t.shape().begin(), t.shape().end());
    }
    return v;
  };
  if (layers.size() < 3) return 0;
  const auto last = shapes(*layers.back());
  int64_t n = 0;
  while (n + 1 < static_cast<int64_t>(layers.size()) && shapes(*layers[n]) != last) ++n;
  return n < static_cast<int64_t>(layers.size()) / 2 ? n : 0;
}

ModelShape DeriveModelShape(const Inventory& inventory, absl::string_view model) {
  ModelShape shape;
  for (const UnitSpec& u : inventory.units()) {
    int64_t i = 0;
    if (IsLayerUnit(u.name(), &i)) ++shape.layers;
    for (const TensorSpec& t : u.tensors()) {
      // The hidden size: the embedding table's row width, else the widest vector (a norm).
      if (u.name() == "embed" && t.shape_size() == 2) shape.hidden = t.shape(1);
      if (shape.hidden == 0 && t.shape_size() == 1) {
        shape.hidden = std::max<int64_t>(shape.hidden, t.shape(0));
      }
    }
  }
  if (const ModelInfo* info = FindModel(model); info != nullptr && info->routed_experts > 0) {
    shape.active_fraction_of_experts =
        static_cast<double>(info->experts_per_token) / static_cast<double>(info->routed_experts);
  }
  return shape;
}

}  // namespace ragshard

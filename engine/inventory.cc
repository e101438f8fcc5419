#include "engine/inventory.h"

#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "infra/status_macros.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

using json = nlohmann::json;

bool ValidNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == ':' || c == '/' || c == '-';
}

absl::Status CheckName(absl::string_view where, absl::string_view name, int64_t max_len) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ".name: empty"));
  if (static_cast<int64_t>(name.size()) > max_len) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".name: longer than ", max_len, " characters (", name.size(), ")"));
  }
  for (char c : name) {
    if (!ValidNameChar(c)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".name: character 0x", absl::Hex(static_cast<unsigned char>(c)),
                       " not allowed (allowed: letters, digits and _ . : / -)"));
    }
  }
  return absl::OkStatus();
}

std::string TensorWhere(int u, int t, const TensorSpec& spec) {
  return absl::StrCat("units[", u, "].tensors[", t, "] '", spec.name(), "'");
}

}  // namespace

absl::StatusOr<Granule> ParseGranule(absl::string_view text) {
  if (text == "element") return Granule{v1::GRANULE_ELEMENT, 0};
  if (text == "whole") return Granule{v1::GRANULE_WHOLE, 0};
  constexpr absl::string_view kRows = "rows:";
  if (text.substr(0, kRows.size()) == kRows) {
    int64_t rows = 0;
    if (!absl::SimpleAtoi(text.substr(kRows.size()), &rows)) {
      return absl::InvalidArgumentError(
          absl::StrCat("granule '", text, "': the row count after 'rows:' is not an integer"));
    }
    if (rows < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("granule '", text, "': the row count must be at least 1"));
    }
    return Granule{v1::GRANULE_ROWS, rows};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("granule '", text, "': expected element, rows:K or whole"));
}

std::string GranuleName(const TensorSpec& spec) {
  switch (spec.granule_kind()) {
    case v1::GRANULE_ROWS:
      return absl::StrCat("rows:", spec.granule_rows());
    case v1::GRANULE_WHOLE:
      return "whole";
    default:
      return "element";
  }
}

absl::Status ParseOptimizer(absl::string_view text, TensorSpec* spec) {
  spec->set_shampoo_block(0);
  if (text == "elementwise") {
    spec->set_optimizer(v1::OPTIMIZER_ELEMENTWISE);
  } else if (text == "matrix") {
    spec->set_optimizer(v1::OPTIMIZER_MATRIX);
  } else if (text == "shampoo") {
    spec->set_optimizer(v1::OPTIMIZER_SHAMPOO);
  } else if (absl::StartsWith(text, "shampoo:")) {
    int64_t block = 0;
    if (!absl::SimpleAtoi(text.substr(8), &block) || block < 1 || block > kMaxShampooBlock) {
      return absl::InvalidArgumentError(absl::StrCat("'", text,
                                                     "': the block side after 'shampoo:' must be "
                                                     "an integer in [1, ",
                                                     kMaxShampooBlock, "]"));
    }
    spec->set_optimizer(v1::OPTIMIZER_SHAMPOO);
    spec->set_shampoo_block(block);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "': expected \"elementwise\", \"matrix\", \"shampoo\" or \"shampoo:B\""));
  }
  return absl::OkStatus();
}

std::string OptimizerName(const TensorSpec& spec) {
  switch (spec.optimizer()) {
    case v1::OPTIMIZER_MATRIX:
      return "matrix";
    case v1::OPTIMIZER_SHAMPOO:
      return spec.shampoo_block() > 0 ? absl::StrCat("shampoo:", spec.shampoo_block()) : "shampoo";
    default:
      return "elementwise";
  }
}

absl::StatusOr<int64_t> TensorNumel(const TensorSpec& spec) {
  if (spec.shape_size() == 0) return absl::InvalidArgumentError("shape: must have rank >= 1");
  int64_t numel = 1;
  for (int d = 0; d < spec.shape_size(); ++d) {
    int64_t dim = spec.shape(d);
    if (dim <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape[", d, "]: dimension must be positive, got ", dim));
    }
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape: the element count overflows int64 at shape[", d, "]"));
    }
  }
  return numel;
}

int64_t GranuleElems(const TensorSpec& spec) {
  int64_t numel = *TensorNumel(spec);
  switch (spec.granule_kind()) {
    case v1::GRANULE_ROWS: {
      int64_t row = spec.shape(spec.shape_size() - 1);
      int64_t g = 0;
      if (__builtin_mul_overflow(row, spec.granule_rows(), &g) || g > numel) return numel;
      return g;
    }
    case v1::GRANULE_WHOLE:
      return numel;
    default:
      return 1;
  }
}

absl::Status ValidateInventory(const Inventory& inventory, const InventoryLimits& limits) {
  if (inventory.units_size() == 0) return absl::InvalidArgumentError("units: no units");
  if (inventory.units_size() > limits.max_units) {
    return absl::InvalidArgumentError(absl::StrCat("units: more than ", limits.max_units,
                                                   " units (", inventory.units_size(), ")"));
  }
  std::set<absl::string_view> unit_names;
  std::set<absl::string_view> tensor_names;
  int64_t tensors = 0;
  for (int u = 0; u < inventory.units_size(); ++u) {
    const UnitSpec& unit = inventory.units(u);
    std::string where = absl::StrCat("units[", u, "]");
    RAGSHARD_RETURN_IF_ERROR(CheckName(where, unit.name(), limits.max_name_length));
    if (!unit_names.insert(unit.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".name: duplicate unit name '", unit.name(), "'"));
    }
    if (unit.tensors_size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " '", unit.name(), "': empty unit (no tensors)"));
    }
    if (unit.tensors_size() > limits.max_tensors_per_unit) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".tensors: more than ", limits.max_tensors_per_unit, " tensors"));
    }
    tensors += unit.tensors_size();
    if (tensors > limits.max_tensors) {
      return absl::InvalidArgumentError(
          absl::StrCat("units: more than ", limits.max_tensors, " tensors in the inventory"));
    }
    int64_t unit_elems = 0;
    for (int t = 0; t < unit.tensors_size(); ++t) {
      const TensorSpec& spec = unit.tensors(t);
      std::string twhere = absl::StrCat(where, ".tensors[", t, "]");
      RAGSHARD_RETURN_IF_ERROR(CheckName(twhere, spec.name(), limits.max_name_length));
      twhere = TensorWhere(u, t, spec);
      if (!tensor_names.insert(spec.name()).second) {
        return absl::InvalidArgumentError(absl::StrCat(twhere, ": duplicate tensor name"));
      }
      if (spec.shape_size() > limits.max_rank) {
        return absl::InvalidArgumentError(
            absl::StrCat(twhere, " shape: rank ", spec.shape_size(), " exceeds ", limits.max_rank));
      }
      auto numel = TensorNumel(spec);
      if (!numel.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(twhere, " ", numel.status().message()));
      }
      if (__builtin_add_overflow(unit_elems, *numel, &unit_elems) ||
          unit_elems > limits.max_unit_elems) {
        return absl::InvalidArgumentError(absl::StrCat(
            twhere, " shape: the unit's element count exceeds ", limits.max_unit_elems));
      }
      if (spec.dtype() == v1::DTYPE_UNSPECIFIED || !v1::DType_IsValid(spec.dtype())) {
        return absl::InvalidArgumentError(absl::StrCat(twhere, " dtype: missing or unknown"));
      }
      if (!v1::GranuleKind_IsValid(spec.granule_kind())) {
        return absl::InvalidArgumentError(absl::StrCat(twhere, " granule: unknown kind"));
      }
      if (spec.granule_kind() == v1::GRANULE_ROWS && spec.granule_rows() < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(twhere, " granule: rows must be at least 1, got ", spec.granule_rows()));
      }
      if (spec.granule_kind() != v1::GRANULE_ROWS && spec.granule_rows() != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(twhere, " granule: granule_rows set without GRANULE_ROWS"));
      }
      if (!v1::OptimizerKind_IsValid(spec.optimizer())) {
        return absl::InvalidArgumentError(absl::StrCat(twhere, " optimizer: unknown kind"));
      }
      if (spec.shampoo_block() < 0 ||
          (spec.shampoo_block() != 0 && spec.optimizer() != v1::OPTIMIZER_SHAMPOO)) {
        return absl::InvalidArgumentError(
            absl::StrCat(twhere, " optimizer: shampoo_block ", spec.shampoo_block(),
                         " is invalid (a positive block side, for OPTIMIZER_SHAMPOO only)"));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<TensorSpec> ParseTensor(const json& j, const std::string& where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  TensorSpec spec;
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".name: not a string"));
      }
      spec.set_name(value.get<std::string>());
    } else if (key == "shape") {
      if (!value.is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".shape: not an array"));
      }
      for (size_t d = 0; d < value.size(); ++d) {
        const json& dim = value[d];
        if (!dim.is_number_integer()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".shape[", d, "]: not an integer (", dim.dump(), ")"));
        }
        if (dim.is_number_unsigned() &&
            dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ".shape[", d, "]: does not fit int64"));
        }
        spec.add_shape(dim.get<int64_t>());
      }
    } else if (key == "dtype") {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".dtype: not a string"));
      }
      auto dtype = ParseDType(value.get<std::string>());
      if (!dtype.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".dtype: ", dtype.status().message()));
      }
      spec.set_dtype(*dtype);
    } else if (key == "granule") {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".granule: not a string"));
      }
      auto g = ParseGranule(value.get<std::string>());
      if (!g.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".granule: ", g.status().message()));
      }
      spec.set_granule_kind(g->kind);
      spec.set_granule_rows(g->rows);
    } else if (key == "optimizer") {
      absl::Status st = value.is_string() ? ParseOptimizer(value.get<std::string>(), &spec)
                                          : absl::InvalidArgumentError("not a string");
      if (!st.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".optimizer: ", st.message(), " (got ", value.dump(), ")"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(where, ": unknown key '", key, "'"));
    }
  }
  if (!j.contains("name")) return absl::InvalidArgumentError(absl::StrCat(where, ".name: missing"));
  if (!j.contains("shape")) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".shape: missing"));
  }
  if (!j.contains("dtype")) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".dtype: missing"));
  }
  return spec;
}

}  // namespace

absl::StatusOr<Inventory> ParseInventoryJson(absl::string_view text,
                                             const InventoryLimits& limits) {
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("inventory: malformed JSON");
  if (!root.is_object()) return absl::InvalidArgumentError("inventory: top level is not an object");
  for (const auto& [key, value] : root.items()) {
    if (key != "units") {
      return absl::InvalidArgumentError(absl::StrCat("inventory: unknown key '", key, "'"));
    }
  }
  if (!root.contains("units") || !root["units"].is_array()) {
    return absl::InvalidArgumentError("units: missing or not an array");
  }
  Inventory inventory;
  const json& units = root["units"];
  for (size_t u = 0; u < units.size(); ++u) {
    const json& unit = units[u];
    std::string where = absl::StrCat("units[", u, "]");
    if (!unit.is_object())
      return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
    UnitSpec* out = inventory.add_units();
    for (const auto& [key, value] : unit.items()) {
      if (key == "name") {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".name: not a string"));
        }
        out->set_name(value.get<std::string>());
      } else if (key == "tensors") {
        if (!value.is_array()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".tensors: not an array"));
        }
        for (size_t t = 0; t < value.size(); ++t) {
          RAGSHARD_ASSIGN_OR_RETURN(
              *out->add_tensors(), ParseTensor(value[t], absl::StrCat(where, ".tensors[", t, "]")));
        }
      } else {
        return absl::InvalidArgumentError(absl::StrCat(where, ": unknown key '", key, "'"));
      }
    }
    if (!unit.contains("name")) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".name: missing"));
    }
  }
  RAGSHARD_RETURN_IF_ERROR(ValidateInventory(inventory, limits));
  return inventory;
}

absl::StatusOr<Inventory> LoadInventoryFile(const std::string& path,
                                            const InventoryLimits& limits) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("inventory file '", path, "': cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto inventory = ParseInventoryJson(buffer.str(), limits);
  if (!inventory.ok()) {
    return absl::Status(inventory.status().code(),
                        absl::StrCat(path, ": ", inventory.status().message()));
  }
  return inventory;
}

std::string InventoryToJson(const Inventory& inventory) {
  json root;
  root["units"] = json::array();
  for (const UnitSpec& unit : inventory.units()) {
    json ju;
    ju["name"] = unit.name();
    ju["tensors"] = json::array();
    for (const TensorSpec& spec : unit.tensors()) {
      json jt;
      jt["name"] = spec.name();
      jt["shape"] = std::vector<int64_t>(spec.shape().begin(), spec.shape().end());
      jt["dtype"] = std::string(DTypeName(spec.dtype()));
      jt["granule"] = GranuleName(spec);
      jt["optimizer"] = OptimizerName(spec);
      ju["tensors"].push_back(std::move(jt));
    }
    root["units"].push_back(std::move(ju));
  }
  return root.dump(1);
}

void ApplyGranule(Inventory* inventory, const Granule& granule) {
  for (UnitSpec& unit : *inventory->mutable_units()) {
    for (TensorSpec& spec : *unit.mutable_tensors()) {
      if (spec.shape_size() >= 2) {
        spec.set_granule_kind(granule.kind);
        spec.set_granule_rows(granule.rows);
      } else {
        spec.set_granule_kind(v1::GRANULE_ELEMENT);
        spec.set_granule_rows(0);
      }
    }
  }
}

}  // namespace ragshard

#include <openssl/sha.h>

#include "absl/strings/str_join.h"
#include "infra/proto_text.h"

namespace ragshard {

std::string InventorySha256(const Inventory& inventory) {
  const std::string bytes = DeterministicBytes(inventory);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), SHA256_DIGEST_LENGTH);
}

std::string HexString(const std::string& bytes) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

namespace {

std::string ShapeString(const TensorSpec& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

std::string TensorDifference(const TensorSpec& ref, const TensorSpec& got) {
  if (ref.name() != got.name())
    return absl::StrCat("name '", got.name(), "' instead of '", ref.name(), "'");
  if (!std::equal(ref.shape().begin(), ref.shape().end(), got.shape().begin(), got.shape().end())) {
    return absl::StrCat("shape ", ShapeString(got), " differs from the reference's ",
                        ShapeString(ref));
  }
  if (ref.dtype() != got.dtype()) {
    return absl::StrCat("dtype ", v1::DType_Name(got.dtype()), " differs from the reference's ",
                        v1::DType_Name(ref.dtype()));
  }
  if (ref.granule_kind() != got.granule_kind() || ref.granule_rows() != got.granule_rows()) {
    return absl::StrCat("granule ", GranuleName(got), " differs from the reference's ",
                        GranuleName(ref));
  }
  if (ref.optimizer() != got.optimizer() || ref.shampoo_block() != got.shampoo_block()) {
    return absl::StrCat("optimizer ", OptimizerName(got), " differs from the reference's ",
                        OptimizerName(ref));
  }
  return "";
}

}  // namespace

std::string FirstInventoryDifference(const Inventory& reference, const Inventory& other) {
  const int units = std::min(reference.units_size(), other.units_size());
  for (int u = 0; u < units; ++u) {
    const UnitSpec& a = reference.units(u);
    const UnitSpec& b = other.units(u);
    if (a.name() != b.name()) {
      return absl::StrCat("units[", u, "] is named '", b.name(), "' where the reference has '",
                          a.name(), "'");
    }
    const int tensors = std::min(a.tensors_size(), b.tensors_size());
    for (int t = 0; t < tensors; ++t) {
      std::string d = TensorDifference(a.tensors(t), b.tensors(t));
      if (!d.empty()) {
        return absl::StrCat("tensor '", a.tensors(t).name(), "' (units[", u, "].tensors[", t,
                            "]): ", d);
      }
    }
    if (a.tensors_size() > tensors) {
      return absl::StrCat("tensor '", a.tensors(tensors).name(), "' of unit '", a.name(),
                          "' is missing");
    }
    if (b.tensors_size() > tensors) {
      return absl::StrCat("tensor '", b.tensors(tensors).name(), "' of unit '", b.name(),
                          "' is not in the reference");
    }
  }
  if (reference.units_size() > units) {
    return absl::StrCat("unit '", reference.units(units).name(), "' is missing");
  }
  if (other.units_size() > units) {
    return absl::StrCat("unit '", other.units(units).name(), "' is not in the reference");
  }
  return "";
}

}  // namespace ragshard

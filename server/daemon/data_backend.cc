#include "server/daemon/data_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/inventory.h"

namespace ragshard::daemon {

absl::StatusOr<std::vector<MatrixPiece>> MatrixPieces(const v1::UnitPlan& unit, int64_t f,
                                                      std::vector<int64_t>* packed_elems) {
  std::vector<MatrixPiece> out;
  std::vector<int64_t> packed(static_cast<size_t>(std::max<int64_t>(f, 0)), 0);
  const int64_t s = std::max<int64_t>(unit.shard_elems(), 1);
  for (const v1::TensorPlacement& t : unit.tensors()) {
    if (!WholeMatrix(t.optimizer()) || t.numel() == 0) continue;
    if (t.owner_rank() < 0 || t.owner_rank() >= f) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name(), "': owner_rank ",
                                                     t.owner_rank(), " is not in [0, ", f, ")"));
    }
    const int64_t start = packed[static_cast<size_t>(t.owner_rank())];
    packed[static_cast<size_t>(t.owner_rank())] += t.numel();
    for (int64_t p = t.offset() / s; p * s < t.offset() + t.numel(); ++p) {
      const int64_t lo = std::max(t.offset(), p * s);
      const int64_t hi = std::min(t.offset() + t.numel(), (p + 1) * s);
      out.push_back({static_cast<int>(t.owner_rank()), static_cast<int>(p), lo, hi - lo,
                     start + (lo - t.offset())});
    }
  }
  if (packed_elems != nullptr) *packed_elems = std::move(packed);
  return out;
}

absl::StatusOr<BackendKind> ParseBackendKind(const std::string& name) {
  if (name == "host") return BackendKind::kHost;
  if (name == "device-shaped") return BackendKind::kDeviceShaped;
  if (name == "cuda") return BackendKind::kCuda;
  if (name == "auto") return BackendKind::kAuto;
  return absl::InvalidArgumentError(
      absl::StrCat("backend: '", name, "' is not one of host, device-shaped, cuda, auto"));
}

}  // namespace ragshard::daemon

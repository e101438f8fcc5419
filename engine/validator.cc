#include "engine/validator.h"

#include <algorithm>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "engine/sharding.h"

namespace ragshard {
namespace {

absl::Status Violation(int invariant, absl::string_view what, const v1::UnitPlan& up,
                       absl::string_view tensor, absl::string_view detail) {
  return absl::FailedPreconditionError(
      absl::StrCat("invariant ", invariant, " (", what, "): unit '", up.unit(), "' (",
                   DTypeName(up.dtype()), ") tensor '", tensor, "': ", detail));
}

// The invariants over one factor's plan; `owners` false: the owners of whole-matrix tensors
// are another factor's (os), and this plan must name none.
absl::Status Validate(const v1::Plan& plan, const Inventory* inventory, bool owners) {
  const int64_t w = plan.world_size();
  if (w < 1) return absl::FailedPreconditionError("plan: world_size must be at least 1");
  const int64_t align = plan.align_bytes();
  if (align < 1) return absl::FailedPreconditionError("plan: align_bytes must be at least 1");
  std::map<std::string, const v1::TensorPlacement*> placed;
  for (const v1::UnitPlan& up : plan.units()) {
    if (up.dtype() == v1::DTYPE_UNSPECIFIED || !v1::DType_IsValid(up.dtype())) {
      return absl::FailedPreconditionError(absl::StrCat("unit '", up.unit(), "': bad dtype"));
    }
    const int64_t s = up.shard_elems();
    const int64_t item = DTypeSize(up.dtype());
    if (s < 1) return Violation(3, "equal shard size", up, "-", "shard_elems must be positive");
    if (up.align_bytes() != align) {
      return Violation(
          3, "alignment", up, "-",
          absl::StrCat("unit alignment ", up.align_bytes(), " differs from the plan's ", align));
    }
    if ((s * item) % align != 0) {
      return Violation(
          3, "alignment", up, "-",
          absl::StrCat("S * itemsize = ", s * item, " bytes is not a multiple of ", align));
    }
    int64_t total = 0;
    if (__builtin_mul_overflow(s, w, &total)) {
      return Violation(4, "bounds", up, "-", "W * S overflows int64");
    }
    std::vector<const v1::TensorPlacement*> order;
    for (const v1::TensorPlacement& tp : up.tensors()) order.push_back(&tp);
    std::sort(order.begin(), order.end(),
              [](auto* a, auto* b) { return a->offset() < b->offset(); });
    int64_t prev_end = 0;
    std::string prev_name;
    for (const v1::TensorPlacement* tp : order) {
      const int64_t off = tp->offset(), e = tp->numel(), g = tp->granule_elems();
      if (e < 1 || off < 0 || g < 1 || g > e) {
        return Violation(1, "ownership", up, tp->name(),
                         absl::StrCat("bad offset ", off, ", numel ", e, " or granule ", g));
      }
      if (off < prev_end) {
        return Violation(
            1, "no overlap", up, tp->name(),
            absl::StrCat("starts at ", off, " inside '", prev_name, "', which ends at ", prev_end));
      }
      if (off > total - e) {
        return Violation(4, "bounds", up, tp->name(),
                         absl::StrCat("ends at ", off + e, " beyond W * S = ", total));
      }
      if ((off * item) % align != 0) {
        return Violation(
            3, "alignment", up, tp->name(),
            absl::StrCat("starts at byte ", off * item, ", not a multiple of ", align));
      }
      // The sparse split must be exactly what offset, numel and S give.
      const int64_t first = off / s, last = (off + e - 1) / s;
      if (tp->first_rank() != first || tp->rank_elems_size() != last - first + 1) {
        return Violation(1, "ownership", up, tp->name(),
                         absl::StrCat("split names ranks ", tp->first_rank(), "..",
                                      tp->first_rank() + tp->rank_elems_size() - 1,
                                      " but the tensor spans ranks ", first, "..", last));
      }
      int64_t sum = 0;
      for (int64_t r = first; r <= last; ++r) {
        const int64_t expect = std::min(off + e, (r + 1) * s) - std::max(off, r * s);
        const int64_t got = tp->rank_elems(static_cast<int>(r - first));
        if (got != expect) {
          return Violation(
              1, "ownership", up, tp->name(),
              absl::StrCat("rank ", r, " holds ", got, " elements, expected ", expect));
        }
        sum += got;
      }
      if (sum != e) {
        return Violation(1, "ownership", up, tp->name(),
                         absl::StrCat("split sums to ", sum, ", numel is ", e));
      }
      for (int64_t cut = (first + 1) * s; cut < off + e; cut += s) {
        if ((cut - off) % g != 0) {
          return Violation(2, "granule cuts", up, tp->name(),
                           absl::StrCat("cut at ", cut, " is ", (cut - off) % g,
                                        " elements into a ", g, "-element granule"));
        }
      }
      if (tp->owner_rank() < -1 || tp->owner_rank() >= w ||
          (owners ? WholeMatrix(tp->optimizer()) : false) != (tp->owner_rank() >= 0)) {
        return absl::FailedPreconditionError(
            absl::StrCat("unit '", up.unit(), "' tensor '", tp->name(), "': owner rank ",
                         tp->owner_rank(), " is invalid for its optimizer kind"));
      }
      if (!placed.emplace(tp->name(), tp).second) {
        return Violation(1, "ownership", up, tp->name(), "tensor appears twice in the plan");
      }
      prev_end = off + e;
      prev_name = tp->name();
    }
  }
  if (inventory != nullptr) {
    size_t count = 0;
    for (const UnitSpec& unit : inventory->units()) {
      for (const TensorSpec& spec : unit.tensors()) {
        ++count;
        auto it = placed.find(spec.name());
        if (it == placed.end()) {
          return absl::FailedPreconditionError(absl::StrCat("invariant 1 (ownership): unit '",
                                                            unit.name(), "' tensor '", spec.name(),
                                                            "' is missing from the plan"));
        }
        const v1::TensorPlacement& tp = *it->second;
        if (tp.numel() != *TensorNumel(spec) || tp.granule_elems() != GranuleElems(spec) ||
            !std::equal(tp.shape().begin(), tp.shape().end(), spec.shape().begin(),
                        spec.shape().end())) {
          return absl::FailedPreconditionError(
              absl::StrCat("unit '", unit.name(), "' tensor '", spec.name(),
                           "': the plan's numel, granule or shape differs from the inventory"));
        }
      }
    }
    if (count != placed.size()) {
      return absl::FailedPreconditionError("plan holds tensors that the inventory does not have");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePlan(const v1::Plan& plan, const Inventory* inventory) {
  if (!plan.has_sharding() && plan.factors_size() == 0) return Validate(plan, inventory, true);
  // Separate factors (engine/sharding.h): each factor's plan holds the invariants over its own
  // positions, the os plan names the owners, and the plans nest.
  if (absl::Status st = CheckFactorPlans(plan); !st.ok()) {
    return absl::FailedPreconditionError(st.message());
  }
  for (const v1::FactorPlan& fp : plan.factors()) {
    v1::Plan one;
    one.set_world_size(fp.world_size());
    one.set_align_bytes(plan.align_bytes());
    *one.mutable_units() = fp.units();
    if (absl::Status st = Validate(one, inventory, fp.component() == "os"); !st.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the '", fp.component(), "' plan: ", st.message()));
    }
  }
  v1::Plan p = plan;
  p.clear_sharding();
  p.clear_factors();
  return Validate(p, inventory, false);
}

}  // namespace ragshard

// Why a candidate cannot pad less than its bound (StrategyModel::ExplainPaddingBound;
// engine/strategy_model.h): the units that pad most over |os| positions, the shard size the
// planner's LB2 forces on them, and the tensors whose granules force it (docs/design.md, LB2).
#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/dtype.h"
#include "engine/planner.h"
#include "engine/strategy_model.h"
#include "engine/strategy_model_internal.h"
#include "engine/unit_grouping.h"
#include "engine/unit_solver.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

std::string ShapeText(const TensorSpec& t) {
  std::vector<std::string> dims;
  for (int64_t d : t.shape()) dims.push_back(absl::StrCat(d));
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

// One dtype's tensors of a unit over n positions: what LB2 is and what forces it.
std::string ExplainGroup(const UnitSpec& unit, v1::DType dtype, int64_t n, int32_t align_bytes) {
  std::vector<UnitItem> items;
  std::vector<const TensorSpec*> specs;
  for (const TensorSpec& t : unit.tensors()) {
    if (t.dtype() != dtype) continue;
    items.push_back({*TensorNumel(t), GranuleElems(t)});
    specs.push_back(&t);
  }
  const int64_t align = AlignElems(align_bytes, dtype);
  int64_t sum = 0, gmax = 1;
  const TensorSpec* widest = nullptr;
  for (size_t i = 0; i < items.size(); ++i) {
    sum += items[i].numel;
    if (items[i].granule > gmax) {
      gmax = items[i].granule;
      widest = specs[i];
    }
  }
  const int64_t even = (sum + n - 1) / n;
  const int64_t lb2 = LowerBound2(items, n, align);
  // The tensors long enough to hold two cuts at that shard size: the shard is a multiple of
  // each one's granule (two cuts inside a tensor both fall on its granules).
  int64_t multiple = align;
  std::map<int64_t, std::string> forcing;  // granule -> an example tensor
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].numel < 2 * lb2) continue;
    multiple = std::lcm(multiple, items[i].granule);
    forcing.emplace(items[i].granule, absl::StrCat(specs[i]->name(), " ", ShapeText(*specs[i]),
                                                   ": granule ", items[i].granule));
  }
  std::string out = absl::StrCat("an even share is ", even, " elements");
  if (widest != nullptr && gmax > even) {
    absl::StrAppend(&out, ", but a shard holds at least the largest granule, ", gmax, " (",
                    widest->name(), " ", ShapeText(*widest), ")");
  }
  if (!forcing.empty() && multiple > align) {
    std::vector<std::string> why;
    why.reserve(forcing.size());
    for (const auto& [g, text] : forcing) why.push_back(text);
    absl::StrAppend(&out, ", and a multiple of ", multiple,
                    ", the least common multiple of the granules of the tensors long enough to "
                    "hold two cuts (",
                    absl::StrJoin(why, "; "), ")");
  }
  absl::StrAppend(&out, ": at least ", lb2, " elements");
  return out;
}

}  // namespace

absl::StatusOr<std::string> StrategyModel::ExplainPaddingBound(const Strategy& s) {
  const int64_t key = s.grouping();
  if (!grouped_.count(key)) AddGrouping(key);
  const int64_t n = s.os.size();
  RAGSHARD_ASSIGN_OR_RETURN(const GroupStats* st, Stats(key, n));
  const Inventory& g = *grouped_.at(key);
  const Signatures& sig = *signatures_.at(key);
  // Units with the same tensors pad the same: one line per kind, the most padding first.
  struct Kind {
    int first = -1, count = 0;
    double numel = 0, lb2 = 0, padding = 0;
  };
  std::map<int, Kind> kinds;
  const double positions = static_cast<double>(n);
  for (size_t u = 0; u < sig.of_unit.size(); ++u) {
    Kind& k = kinds[sig.of_unit[u]];
    if (k.first < 0) k.first = static_cast<int>(u);
    ++k.count;
    k.numel = st->numel[u];
    k.lb2 = st->lb2_elems[u];
    k.padding += positions * st->lb2_elems[u] - st->numel[u];
  }
  std::vector<Kind> order;
  order.reserve(kinds.size());
  for (const auto& [id, k] : kinds) order.push_back(k);
  std::sort(order.begin(), order.end(),
            [](const Kind& a, const Kind& b) { return a.padding > b.padding; });
  const double total = st->total_elems, padding = st->lb_padding_elems;
  std::string out = absl::StrFormat(
      "%s: its units over |os| = %d positions pad at least %.0f elements, %.3f%% of the model's "
      "%.0f",
      StrategyName(s), n, padding, total > 0 ? 100 * padding / total : 0.0, total);
  int shown = 0;
  for (const Kind& k : order) {
    if (shown == 3 || k.padding <= 0.02 * padding) break;
    ++shown;
    const UnitSpec& unit = g.units(k.first);
    std::vector<v1::DType> dtypes;
    for (const TensorSpec& t : unit.tensors()) {
      if (std::find(dtypes.begin(), dtypes.end(), t.dtype()) == dtypes.end()) {
        dtypes.push_back(t.dtype());
      }
    }
    std::vector<std::string> groups;
    groups.reserve(dtypes.size());
    for (v1::DType d : dtypes) groups.push_back(ExplainGroup(unit, d, n, options_.align_bytes));
    absl::StrAppendFormat(
        &out,
        "; %d unit%s like %s (%.0f elements%s): %s, so %.0f elements of "
        "padding%s (%.3f%% of %s)",
        k.count, k.count == 1 ? "" : "s", unit.name(), k.numel, k.count == 1 ? "" : " each",
        absl::StrJoin(groups, "; "), k.padding / k.count, k.count == 1 ? "" : " each",
        100 * (positions * k.lb2 - k.numel) / k.numel, k.count == 1 ? "it" : "each");
  }
  return out;
}

}  // namespace ragshard

namespace ragshard {

StrategyModel::GroupingBound StrategyModel::PaddingBoundAnyGrouping() const {
  const int64_t d = profile_.devices_per_node, nodes = profile_.nodes;
  std::set<int64_t> sizes;
  for (int64_t a = 1; a <= d; ++a) {
    if (d % a != 0 || (options_.whole_nodes && a != d)) continue;
    for (int64_t b = 1; b <= nodes; ++b) {
      if (nodes % b == 0) sizes.insert(a * b);
    }
  }
  const int prefetch =
      *std::min_element(options_.prefetch_depths.begin(), options_.prefetch_depths.end());
  double total_bytes = 0;
  for (double b : unit_bytes_) total_bytes += b;
  // n * LB2 - numel of the units [first, last] as one unit over n positions, and n * LB2 in
  // bytes: no plan's unsharded buffer of that unit is smaller.
  auto padding = [&](int first, int last, int64_t n) {
    std::map<v1::DType, std::vector<UnitItem>> by_dtype;
    double numel = 0;
    for (int u = first; u <= last; ++u) {
      for (const TensorSpec& t : inventory_.units(u).tensors()) {
        by_dtype[t.dtype()].push_back({*TensorNumel(t), GranuleElems(t)});
        numel += static_cast<double>(by_dtype[t.dtype()].back().numel);
      }
    }
    double padded = 0, bytes = 0;
    for (const auto& [dtype, items] : by_dtype) {
      const double elems =
          static_cast<double>(n) *
          static_cast<double>(LowerBound2(items, n, AlignElems(options_.align_bytes, dtype)));
      padded += elems;
      bytes += elems * static_cast<double>(DTypeSize(dtype));
    }
    return std::make_pair(padded - numel, bytes);
  };
  GroupingBound best;
  std::vector<std::string> lines;
  const int units = inventory_.units_size();
  // Shard bytes per element of padding, at least: fp32 gradients and optimizer state (Muon's
  // matrices keep 8 bytes, Adam 12), over n.
  const double state_bytes =
      options_.grad_shard_bytes + (options_.optimizer == OptimizerKind::kMuon ? 8.0 : 12.0);
  struct Window {
    int first, last;  // within the run
    double padding, bytes;
  };
  for (int64_t n : sizes) {
    Strategy s;
    s.p = s.g = s.os = {n, 1};
    s.prefetch = prefetch;
    // The unpadded shards, activations and Muon's owner buffer; what is left is for the
    // unsharded buffers in flight and the gradient buffer of the largest unit, and for the
    // padding of the shards.
    const double base = UnpaddedMemoryOf(s, total_bytes, 0).total();
    const double room = (static_cast<double>(budget_) - base) / (prefetch + 2);
    double alone_padding = 0, alone_bytes = 0;
    std::vector<std::vector<Window>> runs;  // per run of layer units: the windows that may fit
    std::vector<int> run_length;
    for (int u = 0; u < units && room > 0;) {
      int64_t index = 0;
      if (!IsLayerPart(inventory_.units(u).name(), &index)) {
        const auto [x, bytes] = padding(u, u, n);
        alone_padding += x;
        alone_bytes = std::max(alone_bytes, bytes);
        ++u;
        continue;
      }
      int end = u;  // the run of layer units [u, end)
      while (end < units && IsLayerPart(inventory_.units(end).name(), &index)) ++end;
      std::vector<Window>& w = runs.emplace_back();
      run_length.push_back(end - u);
      for (int i = 0; i < end - u; ++i) {
        double bytes = 0;
        for (int j = i; j < end - u; ++j) {
          bytes += unit_bytes_[u + j];
          if (bytes > room) break;  // larger units need more even unpadded
          const auto [x, padded_bytes] = padding(u + i, u + j, n);
          if (padded_bytes <= room) w.push_back({i, j, x, padded_bytes});
        }
      }
      u = end;
    }
    // For each cap on a unit's padded bytes, the least padding of groupings within it (dynamic
    // programming over each run); a cap is possible when the padded shards and buffers of that
    // size fit. Any grouping that fits passes at the cap of its largest unit, so the least
    // padding over the caps that pass bounds them all.
    std::vector<double> caps = {alone_bytes};
    for (const auto& w : runs) {
      for (const Window& x : w) caps.push_back(std::max(x.bytes, alone_bytes));
    }
    std::sort(caps.begin(), caps.end());
    caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
    double least_padding = -1;
    int64_t largest = 0;
    for (double cap : caps) {
      if (room <= 0 || cap > room) break;
      double total = alone_padding;
      int64_t widest = 0;
      for (size_t r = 0; r < runs.size() && total >= 0; ++r) {
        std::vector<double> least(static_cast<size_t>(run_length[r] + 1), -1);
        least[0] = 0;
        for (const Window& x : runs[r]) {  // in order of their first unit
          if (x.bytes > cap || least[x.first] < 0) continue;
          widest = std::max<int64_t>(widest, x.last - x.first + 1);
          double& to = least[x.last + 1];
          if (to < 0 || least[x.first] + x.padding < to) to = least[x.first] + x.padding;
        }
        total = least.back() < 0 ? -1 : total + least.back();
      }
      if (total < 0) continue;
      const double memory =
          base + total * state_bytes / static_cast<double>(n) + (prefetch + 2) * cap;
      if (memory > static_cast<double>(budget_)) continue;
      if (least_padding < 0 || total < least_padding) {
        least_padding = total;
        largest = widest;
      }
    }
    if (least_padding < 0) {
      lines.push_back(absl::StrFormat("|os| = %d: no grouping fits", n));
      continue;
    }
    const double pct = inventory_elems_ > 0 ? 100 * least_padding / inventory_elems_ : 0;
    lines.push_back(absl::StrFormat("|os| = %d: at least %.3f%% (units of at most %d layer unit%s)",
                                    n, pct, largest, largest == 1 ? "" : "s"));
    if (best.pct < 0 || pct < best.pct) {
      best.pct = pct;
      best.os = n;
    }
  }
  best.why = absl::StrJoin(lines, "; ");
  return best;
}

}  // namespace ragshard

#include "ctl/ctl_format.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/dtype.h"

namespace ragshard {

double Pct(int64_t part, int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

std::string Human(int64_t n) {
  const char* units[] = {"", "K", "M", "G", "T", "P"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1000.0 && u < 5) {
    v /= 1000.0;
    ++u;
  }
  return u == 0 ? absl::StrCat(n) : absl::StrFormat("%.2f%s", v, units[u]);
}

std::string OneLine(absl::string_view msg) {
  std::string out(msg);
  for (char& c : out) {
    if (c == '\n') c = ' ';
  }
  return out;
}

void PrintPlanTable(const PolicyResult& r, std::ostream& out) {
  const v1::LayoutMetrics& m = r.metrics;
  out << absl::StrFormat("policy %s\n", PolicyName(r.policy));
  if (r.plan) {
    out << absl::StrFormat("%-22s %-6s %8s %14s %10s %10s %9s %9s\n", "unit", "dtype", "tensors",
                           "shard_elems", "padding%", "imbalance", "blk128", "LB2gap%");
    for (const v1::UnitPlan& up : r.plan->units()) {
      const auto& um = up.metrics();
      out << absl::StrFormat("%-22s %-6s %8d %14d %10.3f %10.3f %9d %9.3f\n", up.unit(),
                             DTypeName(up.dtype()), up.tensors_size(), up.shard_elems(),
                             um.padding_pct(), um.imbalance(), um.blocks128_split(),
                             um.lb2_gap_pct());
    }
  } else {
    out << absl::StrFormat("%-22s %-6s %14s %8s\n", "group", "dtype", "per_rank_elems", "tensors");
    for (const GroupLayout& g : r.layout.groups) {
      out << absl::StrFormat("%-22s %-6s %14d %8d\n", g.name, DTypeName(g.dtype), g.per_rank_elems,
                             g.tensors.size());
    }
  }
  out << absl::StrFormat(
      "total: %s elements, padding %s (%.3f%%), imbalance %.4f, 128x128 blocks split %d/%d "
      "(%.2f%%), 32x32 blocks split %d/%d (%.2f%%), matrices split %d/%d, copy %s B/step/rank, "
      "gap to LB1 %.3f%%, gap to LB2 %.3f%%",
      Human(m.total_elems()), Human(m.padding_elems()), m.padding_pct(), m.imbalance(),
      m.blocks128_split(), m.blocks128_total(), Pct(m.blocks128_split(), m.blocks128_total()),
      m.blocks32_split(), m.blocks32_total(), Pct(m.blocks32_split(), m.blocks32_total()),
      m.matrices_split(), m.matrices_total(), Human(m.copy_bytes_per_step()), m.lb1_gap_pct(),
      m.lb2_gap_pct());
  if (m.owner_load_max_over_mean() > 0) {
    out << absl::StrFormat(", owner load max/mean %.3f (locality %.1f%%)",
                           m.owner_load_max_over_mean(), 100.0 * m.owner_locality());
  }
  out << absl::StrFormat("\nplan time %.3f s\n", r.plan_seconds);
}

}  // namespace ragshard

#include "engine/layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/dtype.h"

namespace ragshard {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tensor-relative offset of the first cut (rank change) at or after x, or numel when none.
int64_t NextCut(const TensorLayout& t, int64_t x) {
  if (x <= 0) x = 1;
  int64_t v = t.start + x;
  int64_t rem = v % t.period;
  int64_t c = rem == 0 ? x : x + (t.period - rem);
  return c < t.numel ? c : t.numel;
}

// Tensor-relative offset of the last cut at or before x (x > 0), or 0 when none.
int64_t PrevCut(const TensorLayout& t, int64_t x) {
  if (x >= t.numel) x = t.numel - 1;
  int64_t v = t.start + x;
  int64_t c = x - v % t.period;
  return c > 0 ? c : 0;
}

struct MatrixView {
  int64_t count = 0;  // matrices (product of leading dims)
  int64_t rows = 0;
  int64_t cols = 0;
};

bool MatrixOf(const TensorLayout& t, MatrixView* m) {
  if (t.shape == nullptr || t.shape->size() < 2) return false;
  int n = t.shape->size();
  m->rows = t.shape->Get(n - 2);
  m->cols = t.shape->Get(n - 1);
  m->count = t.numel / (m->rows * m->cols);
  return true;
}

void AddLoads(const TensorLayout& t, std::vector<int64_t>* diff) {
  // diff is a difference array of length W + 1 over per-rank loads.
  int64_t r0 = t.start / t.period;
  int64_t r1 = (t.start + t.numel - 1) / t.period;
  auto add = [&](int64_t lo, int64_t hi, int64_t v) {  // ranks [lo, hi)
    (*diff)[t.rank_base + lo] += v;
    (*diff)[t.rank_base + hi] -= v;
  };
  if (r0 == r1) {
    add(r0, r0 + 1, t.numel);
    return;
  }
  add(r0, r0 + 1, (r0 + 1) * t.period - t.start);
  if (r1 > r0 + 1) add(r0 + 1, r1, t.period);
  add(r1, r1 + 1, t.start + t.numel - r1 * t.period);
}

}  // namespace

std::vector<Segment> TensorSegments(const TensorLayout& t) {
  std::vector<Segment> out;
  int64_t x = 0;
  while (x < t.numel) {
    int64_t end = NextCut(t, x + 1);
    out.push_back({t.rank_base + (t.start + x) / t.period, x, end - x});
    x = end;
  }
  return out;
}

BlockCount CountSplitBlocks(const TensorLayout& t, int64_t block) {
  BlockCount bc;
  MatrixView m;
  if (!MatrixOf(t, &m)) return bc;
  const int64_t bands = CeilDiv(m.rows, block);
  const int64_t col_blocks = CeilDiv(m.cols, block);
  bc.total = m.count * bands * col_blocks;
  if (t.period >= t.numel && t.start % t.period + t.numel <= t.period) return bc;  // no cut
  const int64_t mat = m.rows * m.cols;
  for (int64_t k = 0; k < m.count; ++k) {
    const int64_t base = k * mat;
    // Skip matrices with no cut strictly inside.
    if (NextCut(t, base + 1) >= base + mat) continue;
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t rf = b * block;                         // first row of the band
      const int64_t rl = std::min(m.rows, rf + block) - 1;  // last row
      const int64_t lo = base + rf * m.cols;                // first element
      const int64_t hi = base + (rl + 1) * m.cols;          // one past the last element
      int64_t first = NextCut(t, lo + 1);
      if (first >= hi) continue;  // no cut strictly inside the band's element range
      if (rl > rf) {
        // A cut in an interior row splits every block of the band.
        if (rl - rf >= 2 && NextCut(t, base + (rf + 1) * m.cols) < base + rl * m.cols) {
          bc.split += col_blocks;
          continue;
        }
        // A cut at column c of the first row splits blocks [0, ceil(c / block)); the last cut
        // there decides. A cut at column c of the last row splits blocks [floor(c / block), nb);
        // the first cut there decides. A cut at the start of the last row splits all blocks.
        int64_t prefix = 0, suffix_from = col_blocks;
        int64_t last_first_row = PrevCut(t, base + (rf + 1) * m.cols - 1);
        if (last_first_row > lo) prefix = CeilDiv(last_first_row - lo, block);
        int64_t first_last_row = NextCut(t, base + rl * m.cols);
        if (first_last_row < hi) suffix_from = (first_last_row - (base + rl * m.cols)) / block;
        bc.split += prefix >= suffix_from ? col_blocks : prefix + (col_blocks - suffix_from);
      } else {
        // A one-row band: a cut at column c splits the block holding c unless c starts it.
        int64_t last_block = -1;
        for (int64_t c = first; c < hi; c = NextCut(t, c + 1)) {
          int64_t col = c - lo;
          if (col % block != 0 && col / block != last_block) {
            ++bc.split;
            last_block = col / block;
          }
        }
      }
    }
  }
  return bc;
}

absl::Status ComputeGroupMetrics(const Layout& layout, size_t group, v1::LayoutMetrics* out) {
  Layout one;
  one.world = layout.world;
  one.groups.push_back(layout.groups[group]);
  return ComputeLayoutMetrics(one, out);
}

absl::Status ComputeLayoutMetrics(const Layout& layout, v1::LayoutMetrics* out) {
  const int64_t w = layout.world;
  std::vector<int64_t> diff(static_cast<size_t>(w) + 1, 0);
  int64_t total = 0, allocated = 0, copy = 0;
  BlockCount b128, b32;
  int64_t mats_split = 0, mats_total = 0;
  for (const GroupLayout& g : layout.groups) {
    allocated += g.per_rank_elems * w;
    copy += g.copy_bytes_per_step;
    for (const TensorLayout& t : g.tensors) {
      const int64_t last = t.rank_base + (t.start + t.numel - 1) / t.period;
      if (t.rank_base < 0 || t.start < 0 || t.period < 1 || last >= w) {
        return absl::InternalError(absl::StrCat("group '", g.name, "' tensor '",
                                                t.name ? *t.name : "?", "' lies outside ranks [0, ",
                                                w, ")"));
      }
      total += t.numel;
      AddLoads(t, &diff);
      BlockCount a = CountSplitBlocks(t, 128), c = CountSplitBlocks(t, 32);
      b128.split += a.split;
      b128.total += a.total;
      b32.split += c.split;
      b32.total += c.total;
      MatrixView m;
      if (MatrixOf(t, &m)) {
        const int64_t mat = m.rows * m.cols;
        for (int64_t k = 0; k < m.count; ++k) {
          ++mats_total;
          if (NextCut(t, k * mat + 1) < (k + 1) * mat) ++mats_split;
        }
      }
    }
  }
  int64_t load = 0, max_load = 0;
  for (int64_t r = 0; r < w; ++r) {
    load += diff[r];
    max_load = std::max(max_load, load);
  }
  out->set_total_elems(total);
  out->set_padding_elems(allocated - total);
  out->set_padding_pct(total > 0 ? 100.0 * static_cast<double>(allocated - total) /
                                       static_cast<double>(total)
                                 : 0.0);
  out->set_imbalance(total > 0 ? static_cast<double>(max_load) * static_cast<double>(w) /
                                     static_cast<double>(total)
                               : 0.0);
  out->set_blocks128_split(b128.split);
  out->set_blocks128_total(b128.total);
  out->set_blocks32_split(b32.split);
  out->set_blocks32_total(b32.total);
  out->set_matrices_split(mats_split);
  out->set_matrices_total(mats_total);
  out->set_copy_bytes_per_step(copy);
  return absl::OkStatus();
}

}  // namespace ragshard

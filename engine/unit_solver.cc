#include "engine/unit_solver.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

constexpr int64_t kInf = std::numeric_limits<int64_t>::max();

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// lcm that saturates at kInf instead of overflowing.
int64_t SatLcm(int64_t a, int64_t b) {
  if (a == kInf || b == kInf) return kInf;
  int64_t g = std::gcd(a, b);
  int64_t out = 0;
  if (__builtin_mul_overflow(a / g, b, &out)) return kInf;
  return out;
}

// Enumerates the candidate shard sizes: S such that lcm(align, granules of items with
// numel >= 2S) divides S. Every feasible S is a candidate.
class CandidateSet {
 public:
  CandidateSet(const std::vector<UnitItem>& items, int64_t align) : align_(align) {
    for (const auto& it : items) by_threshold_.push_back({it.numel / 2, it.granule});
    std::sort(by_threshold_.begin(), by_threshold_.end());
    suffix_lcm_.assign(by_threshold_.size() + 1, align);
    for (int i = static_cast<int>(by_threshold_.size()) - 1; i >= 0; --i) {
      suffix_lcm_[i] = SatLcm(suffix_lcm_[i + 1], by_threshold_[i].second);
    }
  }

  // Smallest candidate >= s, or kInf.
  int64_t Next(int64_t s) const {
    while (true) {
      // D(s) = items with numel/2 >= s: a suffix of the sorted list.
      auto it =
          std::lower_bound(by_threshold_.begin(), by_threshold_.end(),
                           std::pair<int64_t, int64_t>{s, std::numeric_limits<int64_t>::min()});
      size_t k = static_cast<size_t>(it - by_threshold_.begin());
      int64_t m = suffix_lcm_[k];
      int64_t end =
          (k < by_threshold_.size()) ? by_threshold_[k].first : kInf;  // D constant on [s, end]
      if (m != kInf && s <= kInf - m) {
        int64_t c = RoundUp(s, m);
        if (c <= end) return c;
      }
      if (end == kInf) return kInf;
      s = end + 1;
    }
  }

 private:
  int64_t align_;
  std::vector<std::pair<int64_t, int64_t>> by_threshold_;  // (numel / 2, granule)
  std::vector<int64_t> suffix_lcm_;
};

// Append-only greedy: each item at its earliest valid offset after the previous one.
bool PlaceAppend(const std::vector<UnitItem>& items, const std::vector<int>& order, int64_t shard,
                 int64_t world, int64_t align, std::vector<int64_t>* offsets) {
  const int64_t total = shard * world;
  int64_t cur = 0;
  for (int idx : order) {
    const UnitItem& it = items[idx];
    int64_t p = EarliestPlacement(cur, total, it.numel, it.granule, shard, align);
    if (p < 0) return false;
    (*offsets)[idx] = p;
    cur = p + it.numel;
  }
  return true;
}

// First fit with holes: each item at the earliest valid offset in any free interval, so small
// tensors fill the gaps that alignment to granule boundaries leaves behind large ones.
bool PlaceHoles(const std::vector<UnitItem>& items, const std::vector<int>& order, int64_t shard,
                int64_t world, int64_t align, std::vector<int64_t>* offsets) {
  std::vector<std::pair<int64_t, int64_t>> free = {{0, shard * world}};
  // Per kind of item (numel, granule): the free intervals before `start` are known not to fit
  // it. Intervals only shrink or split, and a piece of an interval that did not fit does not fit
  // either, so the scan for the next item of a kind resumes there. Same placements as a scan
  // from the start, without its quadratic cost on units of thousands of equal tensors (MoE).
  struct Kind {
    int64_t numel, granule;
    size_t start;
  };
  std::vector<Kind> kinds;
  for (int idx : order) {
    const UnitItem& it = items[idx];
    auto kind = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) {
      return k.numel == it.numel && k.granule == it.granule;
    });
    if (kind == kinds.end()) {
      kinds.push_back({it.numel, it.granule, 0});
      kind = kinds.end() - 1;
    }
    bool placed = false;
    for (size_t f = kind->start; f < free.size(); ++f) {
      auto [lo, hi] = free[f];
      if (hi - lo < it.numel) continue;
      int64_t p = EarliestPlacement(lo, hi, it.numel, it.granule, shard, align);
      if (p < 0) continue;
      (*offsets)[idx] = p;
      std::pair<int64_t, int64_t> left{lo, p}, right{p + it.numel, hi};
      free.erase(free.begin() + static_cast<std::ptrdiff_t>(f));
      std::ptrdiff_t delta = -1;
      bool has_left = false;
      if (right.second > RoundUp(right.first, align)) {
        free.insert(free.begin() + static_cast<std::ptrdiff_t>(f), right);
        ++delta;
      }
      if (left.second > RoundUp(left.first, align)) {
        free.insert(free.begin() + static_cast<std::ptrdiff_t>(f), left);
        ++delta;
        has_left = true;
      }
      for (Kind& k : kinds) {
        if (k.start > f)
          k.start = static_cast<size_t>(static_cast<std::ptrdiff_t>(k.start) + delta);
      }
      // The left piece lies before the earliest valid offset: it cannot hold this kind either.
      kind->start = f + (has_left ? 1 : 0);
      placed = true;
      break;
    }
    if (!placed) return false;
    if (kind->start > free.size()) kind->start = free.size();
  }
  return true;
}

struct Orders {
  std::vector<int> model;
  std::vector<int> by_granule;  // granule desc, numel desc
  std::vector<int> by_size;     // numel desc
};

Orders MakeOrders(const std::vector<UnitItem>& items) {
  Orders o;
  o.model.resize(items.size());
  std::iota(o.model.begin(), o.model.end(), 0);
  o.by_granule = o.model;
  std::stable_sort(o.by_granule.begin(), o.by_granule.end(), [&](int a, int b) {
    if (items[a].granule != items[b].granule) return items[a].granule > items[b].granule;
    return items[a].numel > items[b].numel;
  });
  o.by_size = o.model;
  std::stable_sort(o.by_size.begin(), o.by_size.end(),
                   [&](int a, int b) { return items[a].numel > items[b].numel; });
  return o;
}

bool FeasiblePaper(const std::vector<UnitItem>& items, const Orders& orders, int64_t s,
                   int64_t world, int64_t align, std::vector<int64_t>* offsets) {
  return PlaceAppend(items, orders.model, s, world, align, offsets);
}

bool FeasibleHeuristic(const std::vector<UnitItem>& items, const Orders& orders, int64_t s,
                       int64_t world, int64_t align, std::vector<int64_t>* offsets) {
  // Items longer than S must cross a cut; try them first, largest granule first.
  return PlaceAppend(items, orders.model, s, world, align, offsets) ||
         PlaceHoles(items, orders.by_granule, s, world, align, offsets) ||
         PlaceHoles(items, orders.by_size, s, world, align, offsets) ||
         PlaceHoles(items, orders.model, s, world, align, offsets) ||
         PlaceAppend(items, orders.by_granule, s, world, align, offsets);
}

// Exact for a given S: for a fixed order, the earliest valid offset of each tensor is optimal
// (its validity depends on its own offset only, and an earlier end never constrains the rest
// more), so trying every order with append-only placement decides feasibility exactly. Tensors
// with the same (numel, granule) are interchangeable, so only distinct orders of the multiset
// are tried.
class ExactChecker {
 public:
  explicit ExactChecker(const std::vector<UnitItem>& items) : items_(items) {
    std::vector<std::pair<int64_t, int64_t>> kinds;
    kinds.reserve(items.size());
    for (const auto& it : items) kinds.push_back({it.numel, it.granule});
    std::vector<std::pair<int64_t, int64_t>> distinct = kinds;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    members_.resize(distinct.size());
    for (size_t i = 0; i < items.size(); ++i) {
      size_t k = static_cast<size_t>(std::lower_bound(distinct.begin(), distinct.end(), kinds[i]) -
                                     distinct.begin());
      members_[k].push_back(static_cast<int>(i));
      types_.push_back(static_cast<int>(k));
    }
    std::sort(types_.begin(), types_.end());
    // Number of distinct orders n! / prod(c!), saturating.
    double count = 1;
    int n = 0;
    for (const auto& m : members_) {
      for (size_t c = 1; c <= m.size(); ++c) count = count * (++n) / static_cast<double>(c);
    }
    orders_ = count;
  }

  double orders() const { return orders_; }

  // Depth-first over the distinct orders, remembering (tensors left, end so far) states that
  // failed: different prefixes often reach the same state.
  bool Feasible(int64_t s, int64_t world, int64_t align, std::vector<int64_t>* offsets) const {
    std::vector<size_t> left(members_.size());
    for (size_t k = 0; k < members_.size(); ++k) left[k] = members_[k].size();
    std::set<std::pair<std::vector<size_t>, int64_t>> failed;
    const int64_t total = s * world;
    std::function<bool(int64_t, size_t)> dfs = [&](int64_t cur, size_t placed) {
      if (placed == items_.size()) return true;
      if (failed.count({left, cur})) return false;
      for (size_t k = 0; k < members_.size(); ++k) {
        if (left[k] == 0) continue;
        const int idx = members_[k][members_[k].size() - left[k]];
        const UnitItem& it = items_[idx];
        const int64_t p = EarliestPlacement(cur, total, it.numel, it.granule, s, align);
        if (p < 0) continue;
        --left[k];
        const bool ok = dfs(p + it.numel, placed + 1);
        ++left[k];
        if (ok) {
          (*offsets)[idx] = p;
          return true;
        }
      }
      failed.insert({left, cur});
      return false;
    };
    return dfs(0, 0);
  }

 private:
  const std::vector<UnitItem>& items_;
  std::vector<std::vector<int>> members_;  // item indices of each distinct (numel, granule)
  std::vector<int> types_;                 // the multiset of kinds, sorted
  double orders_ = 0;
};

int64_t AlwaysFeasible(const std::vector<UnitItem>& items, int64_t align) {
  // With S >= the aligned sum, everything fits on rank 0 and no cut falls inside a tensor.
  int64_t sum = 0;
  for (const auto& it : items) sum += RoundUp(it.numel, align);
  return RoundUp(sum, align);
}

}  // namespace

int64_t EarliestPlacement(int64_t lo, int64_t hi, int64_t numel, int64_t granule, int64_t shard,
                          int64_t align) {
  int64_t p0 = RoundUp(lo, align);
  // lcm(granule, align): b - p must be a multiple of it, since b (a shard start) is aligned.
  const int64_t step = SatLcm(granule, align);
  // Two shards suffice: from the second one on, the situation relative to the shard start
  // repeats, so a failure there fails everywhere.
  for (int iter = 0; iter < 2; ++iter) {
    if (p0 > hi - numel) return -1;
    const int64_t b = (p0 / shard + 1) * shard;  // first cut after p0
    if (p0 + numel <= b) return p0;
    const int64_t span = b - p0;
    const int64_t d = step == kInf ? 0 : span / step * step;
    if (d > 0) {
      const int64_t p = b - d;  // the earliest offset whose first cut falls on a granule
      // Further cuts (every `shard` elements) fall on granules only if the granule divides S.
      if (p + numel <= b + shard || shard % granule == 0) return p + numel <= hi ? p : -1;
    }
    p0 = b;
  }
  return -1;
}

int64_t LowerBound1(const std::vector<UnitItem>& items, int64_t world, int64_t align) {
  int64_t sum = 0, gmax = 1;
  for (const auto& it : items) {
    sum += it.numel;
    gmax = std::max(gmax, it.granule);
  }
  return RoundUp(std::max((sum + world - 1) / world, gmax), align);
}

int64_t LowerBound2(const std::vector<UnitItem>& items, int64_t world, int64_t align) {
  return CandidateSet(items, align).Next(LowerBound1(items, world, align));
}

absl::StatusOr<UnitSolution> SolveUnit(const std::vector<UnitItem>& items, int64_t world,
                                       int64_t align, SolverMode mode) {
  if (items.empty()) return absl::InvalidArgumentError("unit has no tensors");
  if (world < 1) return absl::InvalidArgumentError("world size must be at least 1");
  if (align < 1) return absl::InvalidArgumentError("alignment must be at least 1 element");
  for (const auto& it : items) {
    if (it.numel < 1 || it.granule < 1 || it.granule > it.numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad tensor size: numel ", it.numel, ", granule ", it.granule));
    }
  }
  const int64_t upper = AlwaysFeasible(items, align);
  int64_t wmax = 0;
  if (__builtin_mul_overflow(upper, world, &wmax)) {
    return absl::OutOfRangeError(absl::StrCat("world size ", world, " times the unit's ", upper,
                                              " elements overflows int64"));
  }

  UnitSolution sol;
  sol.lb1 = LowerBound1(items, world, align);
  const CandidateSet candidates(items, align);
  sol.lb2 = candidates.Next(sol.lb1);
  const Orders orders = MakeOrders(items);
  std::vector<int64_t> offsets(items.size());

  auto test = [&](int64_t s, auto&& feasible) {
    ++sol.feasibility_tests;
    return feasible(s);
  };
  // The smallest feasible candidate in (lo, hi], by bisection, given that `hi` is feasible and
  // `lo` is not (feasibility assumed monotone).
  auto bisect = [&](int64_t lo, int64_t hi, auto&& feasible) {
    while (true) {
      const int64_t mid = candidates.Next(lo + (hi - lo) / 2 + 1);
      if (mid >= hi) return hi;
      if (test(mid, feasible)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
  };
  auto paper = [&](int64_t s) { return FeasiblePaper(items, orders, s, world, align, &offsets); };

  // The paper's search: binary search over the shard sizes that are multiples of
  // L = lcm(granules of the tensors that contain a whole shard). Which tensors contain a whole
  // shard depends on S (numel >= 2S), so the candidates are those S that are multiples of the L
  // of their own; feasibility is the greedy earliest placement in model order, assumed monotone.
  int64_t paper_s = 0;
  {
    int64_t lo = sol.lb2;  // the first candidate
    int64_t hi = lo;
    int64_t delta = std::max<int64_t>(align, lo);
    while (hi < upper && !test(hi, paper)) {
      lo = hi;
      hi = candidates.Next(hi + delta);
      delta *= 2;
    }
    if (hi >= upper) hi = upper;  // `upper` is always feasible
    paper_s = bisect(lo, hi, paper);
  }
  if (mode == SolverMode::kPaper) {
    sol.shard_elems = paper_s;
    if (!FeasiblePaper(items, orders, paper_s, world, align, &offsets)) {
      return absl::InternalError("paper planner lost the placement of its chosen shard size");
    }
    sol.offsets = offsets;
    sol.exact = paper_s == sol.lb2;
    return sol;
  }

  // ragged: candidates from LB2 upward, below the paper's S.
  const ExactChecker checker(items);
  const bool exact = mode == SolverMode::kRagged && checker.orders() <= kExactMaxOrders;
  auto feasible = [&](int64_t s) {
    return exact ? checker.Feasible(s, world, align, &offsets)
                 : FeasibleHeuristic(items, orders, s, world, align, &offsets);
  };
  // Exact units scan as many candidates as about 2^18 order evaluations allow.
  constexpr int kLinearProbes = 16;
  const int exact_probes =
      exact ? static_cast<int>(std::max(16.0, std::min(4096.0, 262144.0 / checker.orders()))) : 0;
  int64_t best = paper_s;
  int64_t s = sol.lb2;
  int probes = 0;
  bool exhausted = true;  // every candidate below `best` was tested
  int64_t last_infeasible = sol.lb2 - 1;
  while (s < best) {
    if (probes >= (exact ? exact_probes : kLinearProbes)) {
      exhausted = false;
      break;
    }
    ++probes;
    if (test(s, feasible)) {
      best = s;
      break;
    }
    last_infeasible = s;
    s = candidates.Next(s + 1);
  }
  if (!exhausted) {
    // Structured candidates: shard sizes that are multiples of the granules of every tensor
    // longer than f*S, for f = 1 (the tensors that must cross a cut), 1/2, 1/4 and 0 (all), taken
    // at their fixed point from LB2. When every size is a multiple of the granules, such an S
    // makes every aligned offset valid.
    for (const int64_t shift : {0, 1, 2, 62}) {
      auto lcm_of_long = [&](int64_t at) {
        int64_t l = align;
        for (const auto& it : items) {
          if (shift == 62 || it.numel >= (at >> shift)) l = SatLcm(l, it.granule);
        }
        return l;
      };
      int64_t c = sol.lb2;
      while (true) {
        const int64_t l = lcm_of_long(c);
        if (l == kInf || l >= best) {
          c = kInf;
          break;
        }
        const int64_t next = RoundUp(c, l);
        if (next == c || lcm_of_long(next) == l) {
          c = next;
          break;
        }
        c = next;
      }
      if (c < best && test(c, feasible)) best = c;
    }
    // Gallop, then bisect in value space between the last infeasible and the first feasible S.
    int64_t delta = std::max<int64_t>(align, (s - sol.lb2) / 4 + 1);
    int64_t lo = last_infeasible;
    int64_t hi = best;
    while (true) {
      int64_t c = candidates.Next(lo + delta);
      if (c >= hi) break;
      if (test(c, feasible)) {
        hi = c;
        break;
      }
      lo = c;
      delta *= 2;
    }
    best = bisect(lo, hi, feasible);
  }
  sol.shard_elems = best;
  sol.exact = (exact && exhausted) || best == sol.lb2;
  // Recompute the placement of the chosen S.
  bool ok =
      best == paper_s ? FeasiblePaper(items, orders, best, world, align, &offsets) : feasible(best);
  if (!ok) return absl::InternalError("planner lost the placement of its chosen shard size");
  sol.offsets = offsets;
  return sol;
}

}  // namespace ragshard

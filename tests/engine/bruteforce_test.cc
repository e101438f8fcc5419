// Checks the `ragged` planner against brute force over orders and offsets on random small units
// (at most 6 tensors, W <= 4, mixed granules and alignments).
#include <gtest/gtest.h>

#include <cstdint>
#include <iostream>
#include <random>
#include <set>
#include <vector>

#include "engine/unit_solver.h"

namespace ragshard {
namespace {

struct Instance {
  std::vector<UnitItem> items;
  int64_t world = 1;
  int64_t align = 1;
};

// The cut rule, written out directly from the invariant: every cut k*S strictly inside
// [p, p + e) lies a multiple of g from p.
bool CutsOk(int64_t p, int64_t e, int64_t g, int64_t s) {
  for (int64_t cut = (p / s + 1) * s; cut < p + e; cut += s) {
    if ((cut - p) % g != 0) return false;
  }
  return true;
}

// Is there any arrangement (any order, any aligned offsets) for shard size s? Arrangements are
// enumerated in increasing offset order; (placed set, end of the last one) states that failed
// are remembered.
bool BruteFeasible(const Instance& in, int64_t s) {
  const int n = static_cast<int>(in.items.size());
  const int64_t total = s * in.world;
  std::set<std::pair<int, int64_t>> failed;
  std::function<bool(int, int64_t)> dfs = [&](int mask, int64_t cur) {
    if (mask == (1 << n) - 1) return true;
    if (failed.count({mask, cur})) return false;
    for (int i = 0; i < n; ++i) {
      if (mask & (1 << i)) continue;
      const UnitItem& it = in.items[i];
      for (int64_t p = (cur + in.align - 1) / in.align * in.align; p + it.numel <= total;
           p += in.align) {
        if (CutsOk(p, it.numel, it.granule, s) && dfs(mask | (1 << i), p + it.numel)) return true;
      }
    }
    failed.insert({mask, cur});
    return false;
  };
  return dfs(0, 0);
}

int64_t BruteOptimum(const Instance& in) {
  for (int64_t s = in.align;; s += in.align) {
    if (BruteFeasible(in, s)) return s;
  }
}

bool SolutionValid(const Instance& in, const UnitSolution& sol) {
  const int64_t s = sol.shard_elems;
  if (s % in.align != 0) return false;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t i = 0; i < in.items.size(); ++i) {
    const int64_t p = sol.offsets[i], e = in.items[i].numel;
    if (p < 0 || p % in.align != 0 || p + e > s * in.world) return false;
    if (!CutsOk(p, e, in.items[i].granule, s)) return false;
    spans.push_back({p, p + e});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return false;
  }
  return true;
}

std::vector<Instance> RandomSuite(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<Instance> out;
  for (int k = 0; k < count; ++k) {
    Instance in;
    in.world = uni(1, 4);
    in.align = std::vector<int64_t>{1, 1, 2, 4}[uni(0, 3)];
    const int n = uni(1, 6);
    for (int i = 0; i < n; ++i) {
      const int64_t rows = uni(1, 4), cols = uni(1, 3);
      const int64_t numel = rows * cols;
      int64_t g = 1;
      switch (uni(0, 2)) {
        case 0:
          g = 1;  // element
          break;
        case 1:
          g = std::min<int64_t>(uni(1, 3) * cols, numel);  // rows:K
          break;
        default:
          g = numel;  // whole
      }
      in.items.push_back({numel, g});
    }
    out.push_back(std::move(in));
  }
  return out;
}

constexpr int kSuiteSize = 400;
constexpr uint32_t kSeed = 20261122;

TEST(BruteForceTest, RaggedIsNeverWorseThanTheOptimum) {
  int exact_cases = 0;
  for (const Instance& in : RandomSuite(kSuiteSize, kSeed)) {
    const int64_t opt = BruteOptimum(in);
    auto sol = SolveUnit(in.items, in.world, in.align, SolverMode::kRagged);
    ASSERT_TRUE(sol.ok()) << sol.status();
    ASSERT_TRUE(SolutionValid(in, *sol));
    ASSERT_LE(sol->shard_elems, opt) << "ragged S " << sol->shard_elems << " > optimum " << opt;
    // It can never be below the optimum: a smaller S would contradict brute force.
    ASSERT_EQ(sol->shard_elems, opt);
    ASSERT_LE(sol->lb1, opt);
    ASSERT_LE(sol->lb2, opt);
    ++exact_cases;
  }
  EXPECT_EQ(exact_cases, kSuiteSize);
}

TEST(BruteForceTest, HeuristicPathFindsTheOptimumInAtLeast95Percent) {
  int optimal = 0, total = 0, paper_optimal = 0;
  for (const Instance& in : RandomSuite(kSuiteSize, kSeed)) {
    const int64_t opt = BruteOptimum(in);
    auto heur = SolveUnit(in.items, in.world, in.align, SolverMode::kRaggedHeuristic);
    auto paper = SolveUnit(in.items, in.world, in.align, SolverMode::kPaper);
    ASSERT_TRUE(heur.ok() && paper.ok());
    ASSERT_TRUE(SolutionValid(in, *heur));
    ASSERT_TRUE(SolutionValid(in, *paper));
    ASSERT_GE(heur->shard_elems, opt);
    ASSERT_LE(heur->shard_elems, paper->shard_elems);
    ++total;
    if (heur->shard_elems == opt) ++optimal;
    if (paper->shard_elems == opt) ++paper_optimal;
  }
  const double pct = 100.0 * optimal / total;
  const double paper_pct = 100.0 * paper_optimal / total;
  std::cout << "heuristic path optimal in " << optimal << "/" << total << " cases (" << pct
            << "%); ragged-paper optimal in " << paper_optimal << "/" << total << " (" << paper_pct
            << "%)\n";
  RecordProperty("heuristic_optimal_pct", std::to_string(pct));
  RecordProperty("paper_optimal_pct", std::to_string(paper_pct));
  EXPECT_GE(pct, 95.0);
}

TEST(BruteForceTest, EarliestPlacementIsTheEarliestValidOffset) {
  std::mt19937 rng(7);
  for (int k = 0; k < 3000; ++k) {
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int64_t s = uni(1, 12), align = std::vector<int64_t>{1, 2, 4}[uni(0, 2)];
    const int64_t shard = (s + align - 1) / align * align;
    const int64_t e = uni(1, 30), g = std::min<int64_t>(uni(1, 10), e), lo = uni(0, 20);
    const int64_t hi = lo + uni(0, 60);
    int64_t expect = -1;
    for (int64_t p = (lo + align - 1) / align * align; p + e <= hi; p += align) {
      if (CutsOk(p, e, g, shard)) {
        expect = p;
        break;
      }
    }
    ASSERT_EQ(EarliestPlacement(lo, hi, e, g, shard, align), expect)
        << "lo=" << lo << " hi=" << hi << " e=" << e << " g=" << g << " S=" << shard
        << " a=" << align;
  }
}

}  // namespace
}  // namespace ragshard

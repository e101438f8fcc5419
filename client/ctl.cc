#include "client/ctl.h"

#include <cstdio>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/inventory.h"
#include "common/models.h"
#include "common/plan_json.h"
#include "common/planner.h"

namespace ragshard {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

struct Source {
  std::string model;
  std::string inventory;
  int64_t world = 0;
  std::string granule;
  int64_t align_bytes = 16;
};

void AddSourceFlags(CLI::App* cmd, Source* src) {
  auto* model = cmd->add_option(
      "--model", src->model, "zoo model (llama3-8b, deepseek-v3, ...; NAME:grouped, NAME:fused)");
  auto* inv = cmd->add_option("--inventory", src->inventory, "inventory JSON file");
  model->excludes(inv);
  cmd->add_option("--world", src->world, "world size W (1..1048576)")->required();
  cmd->add_option("--granule", src->granule,
                  "granule for every tensor of 2+ dimensions: element, rows:K or whole");
  cmd->add_option("--align-bytes", src->align_bytes, "alignment in bytes (16; 1 turns it off)");
}

// Loads the inventory and options; on failure writes the error and returns the exit code.
std::optional<int> Prepare(const Source& src, Inventory* inventory, PlanOptions* options,
                           std::ostream& err) {
  auto fail = [&](const absl::Status& s) {
    err << "error: " << s.message() << "\n";
    return kExitBadInput;
  };
  if (src.model.empty() == src.inventory.empty()) {
    return fail(absl::InvalidArgumentError("give exactly one of --model and --inventory"));
  }
  if (src.world < 1 || src.world > kMaxWorld) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--world: must be in [1, ", kMaxWorld, "], got ", src.world)));
  }
  if (src.align_bytes < 1 || src.align_bytes > 4096) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--align-bytes: must be in [1, 4096], got ", src.align_bytes)));
  }
  auto inv = src.model.empty() ? LoadInventoryFile(src.inventory) : GenerateModel(src.model);
  if (!inv.ok()) {
    return fail(absl::Status(
        inv.status().code(),
        absl::StrCat(src.model.empty() ? "--inventory " : "--model: ", inv.status().message())));
  }
  *inventory = std::move(*inv);
  if (!src.granule.empty()) {
    auto g = ParseGranule(src.granule);
    if (!g.ok()) return fail(absl::InvalidArgumentError(absl::StrCat("--", g.status().message())));
    ApplyGranule(inventory, *g);
  }
  options->world = src.world;
  options->align_bytes = static_cast<int32_t>(src.align_bytes);
  return std::nullopt;
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

double Pct(int64_t part, int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
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

int RunPlan(const Source& src, const std::string& policy, bool as_json, int64_t max_segments,
            std::ostream& out, std::ostream& err) {
  Inventory inventory;
  PlanOptions options;
  if (auto rc = Prepare(src, &inventory, &options, err)) return *rc;
  auto p = ParsePolicy(policy);
  if (!p.ok()) {
    err << "error: --policy: " << p.status().message() << "\n";
    return kExitBadInput;
  }
  options.policy = *p;
  auto result = RunPolicy(inventory, options);
  if (!result.ok()) {
    err << "error: " << result.status().message() << "\n";
    return absl::IsInvalidArgument(result.status()) || absl::IsOutOfRange(result.status())
               ? kExitBadInput
               : kExitFailure;
  }
  if (as_json) {
    out << PolicyResultToJson(*result, max_segments).dump(1) << "\n";
  } else {
    PrintPlanTable(*result, out);
  }
  return kExitOk;
}

int RunCompare(const Source& src, bool as_json, std::ostream& out, std::ostream& err) {
  Inventory inventory;
  PlanOptions options;
  if (auto rc = Prepare(src, &inventory, &options, err)) return *rc;
  nlohmann::json rows = nlohmann::json::array();
  if (!as_json) {
    out << absl::StrFormat("%s, W=%d, granule %s, align %d B\n",
                           src.model.empty() ? src.inventory : src.model, src.world,
                           src.granule.empty() ? "element" : src.granule, src.align_bytes);
    out << absl::StrFormat("%-14s %10s %10s %10s %10s %12s %14s %10s %10s %9s\n", "policy",
                           "padding%", "imbalance", "blk128%", "blk32%", "mat_split", "copy_B/step",
                           "LB1gap%", "LB2gap%", "plan_s");
  }
  for (Policy policy : AllPolicies()) {
    options.policy = policy;
    auto r = RunPolicy(inventory, options);
    if (!r.ok()) {
      err << "error: policy " << PolicyName(policy) << ": " << r.status().message() << "\n";
      return kExitFailure;
    }
    const v1::LayoutMetrics& m = r->metrics;
    if (as_json) {
      rows.push_back({{"policy", std::string(PolicyName(policy))},
                      {"metrics", MetricsToJson(m)},
                      {"timing", {{"plan_seconds", r->plan_seconds}}}});
    } else {
      out << absl::StrFormat(
          "%-14s %10.3f %10.4f %10.3f %10.3f %12s %14s %10.3f %10.3f %9.3f\n", PolicyName(policy),
          m.padding_pct(), m.imbalance(), Pct(m.blocks128_split(), m.blocks128_total()),
          Pct(m.blocks32_split(), m.blocks32_total()),
          absl::StrCat(m.matrices_split(), "/", m.matrices_total()), Human(m.copy_bytes_per_step()),
          m.lb1_gap_pct(), m.lb2_gap_pct(), r->plan_seconds);
    }
  }
  if (as_json) out << nlohmann::json{{"world", src.world}, {"policies", rows}}.dump(1) << "\n";
  return kExitOk;
}

}  // namespace

int RunCtl(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"ragshardctl: the ragshard admin CLI"};
  app.require_subcommand(1);
  Source plan_src, cmp_src;
  std::string policy = "ragged";
  bool plan_json = false, cmp_json = false;
  int64_t max_segments = 200000;

  CLI::App* plan = app.add_subcommand("plan", "plan a model offline and print its figures");
  AddSourceFlags(plan, &plan_src);
  plan->add_option("--policy", policy,
                   "ragged, ragged-paper, fsdp2, fsdp1, zero3, megatron-do or megatron-fsdp");
  plan->add_flag("--json", plan_json, "print the plan (or baseline segments) as JSON");
  plan->add_option("--max-segments", max_segments,
                   "baselines: print segment lists only when there are at most this many");

  CLI::App* cmp = app.add_subcommand("compare", "compare every policy side by side");
  AddSourceFlags(cmp, &cmp_src);
  cmp->add_flag("--json", cmp_json, "print JSON");

  if (argc > 1 && argv[1][0] != '-') {
    auto known = app.get_subcommands([&](CLI::App* sub) { return sub->check_name(argv[1]); });
    if (known.empty()) {
      err << "error: unknown command '" << argv[1] << "' (run ragshardctl --help for the list)\n";
      return kExitBadInput;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    out << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (char& c : msg) {
      if (c == '\n') c = ' ';
    }
    err << "error: " << msg << "\n";
    return kExitBadInput;
  }
  if (plan->parsed()) return RunPlan(plan_src, policy, plan_json, max_segments, out, err);
  if (cmp->parsed()) return RunCompare(cmp_src, cmp_json, out, err);
  err << "error: no command\n";
  return kExitBadInput;
}

}  // namespace ragshard

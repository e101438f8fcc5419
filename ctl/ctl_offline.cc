#include "ctl/ctl_offline.h"

#include <optional>

#include "absl/strings/str_format.h"
#include "ctl/ctl_format.h"
#include "engine/dtype.h"
#include "engine/inventory.h"
#include "engine/models.h"
#include "engine/plan_json.h"
#include "engine/planner.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

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

}  // namespace

void AddSourceFlags(CLI::App* cmd, Source* src) {
  auto* model = cmd->add_option(
      "--model", src->model, "zoo model (llama3-8b, deepseek-v3, ...; NAME:grouped, NAME:fused)");
  auto* inv = cmd->add_option("--inventory", src->inventory, "inventory JSON file");
  model->excludes(inv);
  cmd->add_option("--world", src->world, "world size W (1..1048576)");
  cmd->add_option("--granule", src->granule,
                  "granule for every tensor of 2+ dimensions: element, rows:K or whole");
  cmd->add_option("--align-bytes", src->align_bytes, "alignment in bytes (16; 1 turns it off)");
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

}  // namespace ragshard

#include "engine/strategy.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

absl::StatusOr<GroupShape> ParseShape(absl::string_view text, absl::string_view what) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, 'x');
  GroupShape s;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &s.intra) ||
      !absl::SimpleAtoi(parts[1], &s.inter) || s.intra < 1 || s.inter < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strategy: ", what, "='", text, "' is not A x B (devices per node x nodes), e.g. 8x4"));
  }
  return s;
}

}  // namespace

std::string StrategyName(const Strategy& s) {
  std::string out = s.uniform() ? absl::StrCat("k=", s.layers_per_unit, ",shard=", ShapeName(s.p))
                                : absl::StrCat("k=", s.layers_per_unit, ",p=", ShapeName(s.p),
                                               ",g=", ShapeName(s.g), ",os=", ShapeName(s.os));
  if (s.prefetch != 1) absl::StrAppend(&out, ",prefetch=", s.prefetch);
  if (s.lead > 0) absl::StrAppend(&out, ",lead=", s.lead);
  return out;
}

absl::StatusOr<Strategy> ParseStrategy(absl::string_view text) {
  Strategy s;
  bool have_k = false, have_shard = false, have_p = false, have_g = false, have_os = false;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("strategy: '", part, "' is not key=value (keys: k, shard, p, g, os)"));
    }
    if (kv[0] == "k") {
      if (!absl::SimpleAtoi(kv[1], &s.layers_per_unit) || s.layers_per_unit < 1 ||
          s.layers_per_unit > 4096) {
        return absl::InvalidArgumentError(
            absl::StrCat("strategy: k='", kv[1], "' is not a layer count in [1, 4096]"));
      }
      have_k = true;
    } else if (kv[0] == "lead") {
      if (!absl::SimpleAtoi(kv[1], &s.lead) || s.lead < 0 || s.lead > 4096) {
        return absl::InvalidArgumentError(
            absl::StrCat("strategy: lead='", kv[1], "' is not a layer count in [0, 4096]"));
      }
    } else if (kv[0] == "prefetch") {
      if (!absl::SimpleAtoi(kv[1], &s.prefetch) || s.prefetch < 0 || s.prefetch > 8) {
        return absl::InvalidArgumentError(
            absl::StrCat("strategy: prefetch='", kv[1], "' is not a depth in [0, 8]"));
      }
    } else if (kv[0] == "shard") {
      RAGSHARD_ASSIGN_OR_RETURN(s.p, ParseShape(kv[1], "shard"));
      s.g = s.os = s.p;
      have_shard = true;
    } else if (kv[0] == "p") {
      RAGSHARD_ASSIGN_OR_RETURN(s.p, ParseShape(kv[1], "p"));
      have_p = true;
    } else if (kv[0] == "g") {
      RAGSHARD_ASSIGN_OR_RETURN(s.g, ParseShape(kv[1], "g"));
      have_g = true;
    } else if (kv[0] == "os") {
      RAGSHARD_ASSIGN_OR_RETURN(s.os, ParseShape(kv[1], "os"));
      have_os = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy: unknown key '", kv[0], "' (keys: k, shard, p, g, os, prefetch, lead)"));
    }
  }
  if (!have_k) return absl::InvalidArgumentError("strategy: k (layers per unit) is missing");
  if (have_shard && (have_p || have_g || have_os)) {
    return absl::InvalidArgumentError("strategy: give either shard= or all of p=, g= and os=");
  }
  if (!have_shard && !(have_p && have_g && have_os)) {
    return absl::InvalidArgumentError("strategy: give shard=AxB, or all of p=, g= and os=");
  }
  return s;
}

absl::Status CheckStrategy(const Strategy& s, int64_t nodes, int64_t devices_per_node) {
  const GroupShape dp{devices_per_node, nodes};
  const std::array<std::pair<const char*, GroupShape>, 4> chain = {
      {{"p", s.p}, {"g", s.g}, {"os", s.os}, {"the cluster", dp}}};
  for (size_t i = 0; i + 1 < chain.size(); ++i) {
    const auto& [a, x] = chain[i];
    const auto& [b, y] = chain[i + 1];
    if (y.intra % x.intra != 0 || y.inter % x.inter != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy ", StrategyName(s), ": ", a, "=", ShapeName(x), " must divide ", b, "=",
          ShapeName(y), " at each level (AMSP: s_p <= s_g <= s_os <= s_dp, nested) on ",
          devices_per_node, " devices x ", nodes, " nodes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  if (name == "adam" || name == "adamw") return OptimizerKind::kAdam;
  if (name == "muon") return OptimizerKind::kMuon;
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer '", name, "' is not one of adam, muon"));
}

std::string FormatBytes(double bytes) {
  constexpr double kGib = static_cast<double>(int64_t{1} << 30);
  if (bytes >= kGib) return absl::StrFormat("%.2f GiB", bytes / kGib);
  if (bytes >= (1 << 20)) return absl::StrFormat("%.2f MiB", bytes / (1 << 20));
  if (bytes >= (1 << 10)) return absl::StrFormat("%.2f KiB", bytes / (1 << 10));
  return absl::StrFormat("%.0f B", bytes);
}

}  // namespace ragshard

#include "engine/cluster.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "infra/status_macros.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

using json = nlohmann::json;

constexpr std::array<absl::string_view, kNumCollectives> kCollectiveNames = {
    "all_gather", "reduce_scatter", "all_reduce", "broadcast"};

absl::Status Err(const std::string& where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("cluster profile: ", where, ": ", what));
}

// Every figure names where it comes from: exactly one non-empty "source" or "assumption".
absl::Status CheckProvenance(const json& obj, const std::string& where) {
  int found = 0;
  for (const char* key : {"source", "assumption"}) {
    if (!obj.contains(key)) continue;
    if (!obj[key].is_string() || obj[key].get<std::string>().empty()) {
      return Err(absl::StrCat(where, ".", key), "must be a non-empty string");
    }
    ++found;
  }
  if (found != 1) {
    return Err(where, "needs exactly one of \"source\" or \"assumption\" (no figure without one)");
  }
  return absl::OkStatus();
}

absl::Status CheckKeys(const json& obj, const std::string& where,
                       std::initializer_list<absl::string_view> allowed) {
  if (!obj.is_object()) return Err(where, "not an object");
  for (const auto& item : obj.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) == allowed.end()) {
      return Err(where, absl::StrCat("unknown key '", item.key(), "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> Figure(const json& root, const std::string& key, bool positive = true) {
  if (!root.contains(key)) return Err(key, "missing");
  const json& f = root[key];
  RAGSHARD_RETURN_IF_ERROR(CheckKeys(f, key, {"value", "source", "assumption"}));
  if (!f.contains("value") || !f["value"].is_number()) return Err(key + ".value", "not a number");
  RAGSHARD_RETURN_IF_ERROR(CheckProvenance(f, key));
  double v = f["value"].get<double>();
  if (!std::isfinite(v) || (positive && v <= 0)) return Err(key + ".value", "must be positive");
  return v;
}

absl::StatusOr<BandwidthCurve> ParseCurve(const json& arr, const std::string& where) {
  if (!arr.is_array() || arr.empty()) return Err(where, "must be a non-empty array of points");
  BandwidthCurve curve;
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string w = absl::StrCat(where, "[", i, "]");
    const json& p = arr[i];
    RAGSHARD_RETURN_IF_ERROR(CheckKeys(p, w, {"bytes", "gbps", "source", "assumption"}));
    if (!p.contains("bytes") || !p["bytes"].is_number()) return Err(w + ".bytes", "not a number");
    if (!p.contains("gbps") || !p["gbps"].is_number()) return Err(w + ".gbps", "not a number");
    RAGSHARD_RETURN_IF_ERROR(CheckProvenance(p, w));
    CurvePoint pt{p["bytes"].get<double>(), p["gbps"].get<double>()};
    if (!(pt.bytes >= 1) || !std::isfinite(pt.bytes)) return Err(w + ".bytes", "must be >= 1");
    if (!(pt.gbps > 0) || !std::isfinite(pt.gbps)) return Err(w + ".gbps", "must be positive");
    if (!curve.points.empty() && pt.bytes <= curve.points.back().bytes) {
      return Err(w + ".bytes", "points must be in strictly increasing size");
    }
    curve.points.push_back(pt);
  }
  return curve;
}

}  // namespace

absl::string_view CollectiveName(Collective c) { return kCollectiveNames[static_cast<int>(c)]; }

std::string ShapeName(const GroupShape& s) { return absl::StrCat(s.intra, "x", s.inter); }

double BandwidthCurve::BusBandwidth(double bytes) const {
  const auto& p = points;
  if (bytes <= p.front().bytes) return p.front().gbps * 1e9;
  if (bytes >= p.back().bytes) return p.back().gbps * 1e9;
  size_t i = 1;
  while (p[i].bytes < bytes) ++i;
  const double t = std::log(bytes / p[i - 1].bytes) / std::log(p[i].bytes / p[i - 1].bytes);
  return (p[i - 1].gbps + t * (p[i].gbps - p[i - 1].gbps)) * 1e9;
}

double ClusterProfile::BusBandwidth(Collective c, const GroupShape& group, double bytes) const {
  const int ci = static_cast<int>(c);
  if (group.inter <= 1) return intra[ci].BusBandwidth(bytes);
  const auto& curves = inter[ci];
  auto hi = curves.lower_bound(group.intra);
  if (hi == curves.end()) return std::prev(hi)->second.BusBandwidth(bytes);
  if (hi->first == group.intra || hi == curves.begin()) return hi->second.BusBandwidth(bytes);
  auto lo = std::prev(hi);
  const double t =
      static_cast<double>(group.intra - lo->first) / static_cast<double>(hi->first - lo->first);
  const double at_lo = lo->second.BusBandwidth(bytes);
  return at_lo + t * (hi->second.BusBandwidth(bytes) - at_lo);
}

double ClusterProfile::CollectiveSeconds(Collective c, const GroupShape& group,
                                         double bytes) const {
  const int64_t n = group.size();
  if (n <= 1 || bytes <= 0) return 0;
  const double ring = static_cast<double>(n - 1) / static_cast<double>(n);
  double factor = 1;
  if (c == Collective::kAllGather || c == Collective::kReduceScatter) factor = ring;
  if (c == Collective::kAllReduce) factor = 2 * ring;
  // The latency floor of the curve applies to the message as measured.
  const int ci = static_cast<int>(c);
  double floor_bytes = group.inter <= 1 ? intra[ci].points.front().bytes
                                        : inter[ci].begin()->second.points.front().bytes;
  const double b = std::max(bytes, floor_bytes);
  return b * factor / BusBandwidth(c, group, b);
}

absl::StatusOr<ClusterProfile> ParseClusterProfile(absl::string_view text) {
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Err("file", "malformed JSON");
  RAGSHARD_RETURN_IF_ERROR(
      CheckKeys(root, "top level",
                {"name", "description", "nodes", "devices_per_node", "device_memory_bytes",
                 "peak_flops", "mfu", "collectives", "notes"}));
  ClusterProfile p;
  if (!root.contains("name") || !root["name"].is_string() ||
      root["name"].get<std::string>().empty()) {
    return Err("name", "missing or not a non-empty string");
  }
  p.name = root["name"].get<std::string>();
  if (root.contains("description")) {
    if (!root["description"].is_string()) return Err("description", "not a string");
    p.description = root["description"].get<std::string>();
  }
  for (const char* key : {"nodes", "devices_per_node"}) {
    if (!root.contains(key) || !root[key].is_number_integer() || root[key].get<int64_t>() < 1 ||
        root[key].get<int64_t>() > (int64_t{1} << 20)) {
      return Err(key, "missing or not an integer in [1, 1048576]");
    }
  }
  p.nodes = root["nodes"].get<int64_t>();
  p.devices_per_node = root["devices_per_node"].get<int64_t>();
  RAGSHARD_ASSIGN_OR_RETURN(double mem, Figure(root, "device_memory_bytes"));
  p.device_memory_bytes = static_cast<int64_t>(mem);
  RAGSHARD_ASSIGN_OR_RETURN(p.peak_flops, Figure(root, "peak_flops"));
  RAGSHARD_ASSIGN_OR_RETURN(p.mfu, Figure(root, "mfu"));
  if (p.mfu > 1) return Err("mfu.value", "must be in (0, 1]");
  if (!root.contains("collectives")) return Err("collectives", "missing");
  const json& cols = root["collectives"];
  RAGSHARD_RETURN_IF_ERROR(
      CheckKeys(cols, "collectives", {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}));
  for (int c = 0; c < kNumCollectives; ++c) {
    const std::string name(kCollectiveNames[c]);
    const std::string where = "collectives." + name;
    if (!cols.contains(name)) return Err(where, "missing");
    const json& col = cols[name];
    RAGSHARD_RETURN_IF_ERROR(CheckKeys(col, where, {"intra_node", "inter_node"}));
    if (!col.contains("intra_node")) return Err(where + ".intra_node", "missing");
    RAGSHARD_ASSIGN_OR_RETURN(p.intra[c], ParseCurve(col["intra_node"], where + ".intra_node"));
    if (!col.contains("inter_node") || !col["inter_node"].is_object() ||
        col["inter_node"].empty()) {
      return Err(where + ".inter_node",
                 "missing, or not an object of curves keyed by devices per node");
    }
    for (const auto& item : col["inter_node"].items()) {
      const std::string w = absl::StrCat(where, ".inter_node.", item.key());
      int64_t per_node = 0;
      if (!absl::SimpleAtoi(item.key(), &per_node) || per_node < 1 ||
          per_node > p.devices_per_node) {
        return Err(w,
                   absl::StrCat("the key must be a device count in [1, ", p.devices_per_node, "]"));
      }
      RAGSHARD_ASSIGN_OR_RETURN(p.inter[c][per_node], ParseCurve(item.value(), w));
    }
  }
  return p;
}

absl::StatusOr<ClusterProfile> LoadClusterProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cluster profile '", path, "': cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto p = ParseClusterProfile(ss.str());
  if (!p.ok()) {
    return absl::Status(p.status().code(), absl::StrCat(path, ": ", p.status().message()));
  }
  return p;
}

absl::StatusOr<ClusterProfile> WithWorld(const ClusterProfile& profile, int64_t world) {
  if (world < 1 || world > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", world, " is outside [1, 1048576]"));
  }
  ClusterProfile p = profile;
  if (world < p.devices_per_node) {
    p.devices_per_node = world;
    p.nodes = 1;
  } else if (world % p.devices_per_node != 0) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", world,
                                                   " is not a multiple of the profile's ",
                                                   p.devices_per_node, " devices per node"));
  } else {
    p.nodes = world / p.devices_per_node;
  }
  return p;
}

}  // namespace ragshard

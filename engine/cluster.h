// Cluster profiles: what the strategy search knows about the machines a job runs on.
//
// A profile is a JSON file (profiles/*.json):
//   {"name": "h100-8x-nvlink-ib400", "description": "...",
//    "nodes": 128, "devices_per_node": 8,
//    "device_memory_bytes": {"value": 85899345920, "source": "..."},
//    "peak_flops": {"value": 989e12, "source": "..."},        // dense bf16, per device
//    "mfu": {"value": 0.4, "assumption": "..."},
//    "collectives": {
//      "all_gather": {"intra_node": [{"bytes": 1048576, "gbps": 80, "source": "..."}, ...],
//                     "inter_node": {"1": [points...], "8": [points...]}},
//      "reduce_scatter": {...}, "all_reduce": {...}, "broadcast": {...}}}
//
// Bandwidths are bus bandwidths as nccl-tests reports them (busbw, GB/s = 1e9 B/s) for a
// message of `bytes` (the full gathered or reduced buffer). "intra_node" is a group inside one
// node; "inter_node" is keyed by how many devices of each node the group holds (a group of a
// devices on each of b > 1 nodes uses the curve of a, interpolated linearly between the keys
// given). Every figure carries a "source" (a document or address) or an "assumption" (why the
// figure is what it is); a figure with neither is rejected, so nothing in a profile is silent.
//
// Thread-safe: immutable after loading.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ragshard {

enum class Collective { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2, kBroadcast = 3 };
inline constexpr int kNumCollectives = 4;
absl::string_view CollectiveName(Collective c);

struct CurvePoint {
  double bytes = 0;
  double gbps = 0;
};

// Bus bandwidth against message size, interpolated linearly in log(bytes). Below the first
// point the time stays that of the first point (latency bound); above the last, the last
// bandwidth holds.
struct BandwidthCurve {
  std::vector<CurvePoint> points;           // strictly increasing bytes
  double BusBandwidth(double bytes) const;  // bytes per second
};

// A group of devices: `intra` devices on each of `inter` nodes.
struct GroupShape {
  int64_t intra = 1;
  int64_t inter = 1;
  int64_t size() const { return intra * inter; }
  bool operator==(const GroupShape& o) const { return intra == o.intra && inter == o.inter; }
};
std::string ShapeName(const GroupShape& s);  // "8x4"

struct ClusterProfile {
  std::string name;
  std::string description;
  int64_t nodes = 1;
  int64_t devices_per_node = 1;
  int64_t device_memory_bytes = 0;
  double peak_flops = 0;  // per device
  double mfu = 0;         // assumed model FLOPs utilisation of the compute
  std::array<BandwidthCurve, kNumCollectives> intra;
  std::array<std::map<int64_t, BandwidthCurve>, kNumCollectives> inter;
  int64_t world() const { return nodes * devices_per_node; }

  // Seconds for one collective over `group` of a buffer of `bytes` (the full buffer):
  //   all-gather and reduce-scatter: bytes * (n-1)/n / busbw; all-reduce: 2 * (n-1)/n; broadcast:
  //   bytes / busbw. 0 for a group of one.
  double CollectiveSeconds(Collective c, const GroupShape& group, double bytes) const;
  double BusBandwidth(Collective c, const GroupShape& group, double bytes) const;
};

// Parses and checks a profile; errors name the field, e.g.
// "collectives.all_gather.inter_node.8[2].gbps: must be positive".
absl::StatusOr<ClusterProfile> ParseClusterProfile(absl::string_view json);
absl::StatusOr<ClusterProfile> LoadClusterProfile(const std::string& path);

// The same cluster with `world` devices: nodes = world / devices_per_node (world must be a
// multiple of it, or smaller than one node, which then becomes a node of `world` devices).
absl::StatusOr<ClusterProfile> WithWorld(const ClusterProfile& profile, int64_t world);

}  // namespace ragshard

// A cluster profile for the strategy tests: 2 nodes x 2 devices, 1 MB each; flat curves: 1 GB/s
// inside a node, 0.5 GB/s across nodes.
#ifndef RAGSHARD_TESTS_COMMON_TINY_PROFILE_H_
#define RAGSHARD_TESTS_COMMON_TINY_PROFILE_H_

namespace ragshard {

inline constexpr char kTinyProfile[] = R"({
  "name": "tiny", "nodes": 2, "devices_per_node": 2,
  "device_memory_bytes": {"value": 1000000, "assumption": "test"},
  "peak_flops": {"value": 1e9, "assumption": "test"},
  "mfu": {"value": 1.0, "assumption": "test"},
  "collectives": {
    "all_gather": {"intra_node": [{"bytes": 1, "gbps": 1.0, "source": "test"}],
                   "inter_node": {"1": [{"bytes": 1, "gbps": 0.5, "source": "test"}],
                                  "2": [{"bytes": 1, "gbps": 0.5, "source": "test"}]}},
    "reduce_scatter": {"intra_node": [{"bytes": 1, "gbps": 1.0, "source": "test"}],
                       "inter_node": {"1": [{"bytes": 1, "gbps": 0.5, "source": "test"}],
                                      "2": [{"bytes": 1, "gbps": 0.5, "source": "test"}]}},
    "all_reduce": {"intra_node": [{"bytes": 1, "gbps": 1.0, "source": "test"}],
                   "inter_node": {"1": [{"bytes": 1, "gbps": 0.5, "source": "test"}]}},
    "broadcast": {"intra_node": [{"bytes": 1, "gbps": 1.0, "source": "test"}],
                  "inter_node": {"1": [{"bytes": 1, "gbps": 0.5, "source": "test"}]}}}})";

}  // namespace ragshard

#endif  // RAGSHARD_TESTS_COMMON_TINY_PROFILE_H_

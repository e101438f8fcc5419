// The plan's compact form: one zstd frame of its deterministic serialization, on the wire
// (WatchPlanEvent.plan_zstd) and in the planner's store. A DeepSeek-V3 plan at rows:128 is
// 4.07 MB serialized and about 0.1 MB compressed (docs/benchmarks/control_plane.md), because
// the bytes that dominate, tensor names and repeated placements, are highly regular.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

// The zstd level of plans: level 1 compresses a DeepSeek-V3 plan in about 8 ms, and no higher
// level below 19 makes it smaller.
inline constexpr int kPlanZstdLevel = 1;

// One zstd frame of `bytes`, with its content size.
std::string ZstdCompress(absl::string_view bytes, int level = kPlanZstdLevel);

// True when `bytes` starts with a zstd frame's magic number. A serialized Plan never does: its
// first byte is job_id's tag (0x0a).
bool IsZstdFrame(absl::string_view bytes);

// The content of one zstd frame; refuses frames that do not state their size or state more than
// `max_bytes` (a hostile peer's decompression bomb), and corrupt ones, naming why.
absl::StatusOr<std::string> ZstdDecompress(absl::string_view frame, int64_t max_bytes);

// The deterministic serialization of `plan`, compressed.
std::string CompressPlan(const v1::Plan& plan);

// A plan from its compact form or, for stores written before plans were compressed, from its
// plain serialization. `what` names the source in errors.
absl::StatusOr<v1::Plan> DecodePlan(absl::string_view bytes, absl::string_view what);

}  // namespace ragshard

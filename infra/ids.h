// Ids (job ids, node ids, rendezvous keys) as every service checks them: non-empty, at most
// `max_len` characters of [A-Za-z0-9_.:/-]. The planner and the daemon share this check.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ragshard {

inline constexpr int64_t kMaxIdLength = 128;

// INVALID_ARGUMENT naming `field` and what is wrong with `value`.
absl::Status ValidateId(absl::string_view field, const std::string& value,
                        int64_t max_len = kMaxIdLength);

}  // namespace ragshard

// Secrets: random bytes from the kernel, and the data-plane credential a job's daemons derive
// from the job's secret (the planner makes the secret; each daemon derives the same credential).
//
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace ragshard {

// `n` bytes from getrandom(2) (the kernel's CSPRNG; blocks only before it is seeded at boot).
std::string RandomBytes(size_t n);

// The 64-bit credential of job `job`'s data plane: the first 8 bytes of
// HMAC-SHA256(secret, "ragshard data plane v1\0" + job), never 0. Every daemon of the job presents
// it when it connects to another's data port (UCX's client id) and accepts only connections
// that present it.
uint64_t DataPlaneCredential(absl::string_view secret, absl::string_view job);

}  // namespace ragshard

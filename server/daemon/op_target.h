// What a rank's operations start on: a job's runtime (JobRuntime), or a fake in tests. The
// gRPC handlers and the command queue's poller (command_poller.h) both call it.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ragshard/v1/daemon.pb.h"

namespace ragshard::daemon {

// When the job's thread ran an operation, in nanoseconds of CLOCK_MONOTONIC (the same clock in
// every process of the node: std::chrono::steady_clock, Python's time.monotonic_ns); 0 where
// it did not run (a failure before it, a wait that ended first).
struct OpTimes {
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
};

class OpTarget {
 public:
  virtual ~OpTarget() = default;
  // Local rank `local` starts the operation `req` names: its sequence number, or why not.
  virtual absl::StatusOr<uint64_t> StartOp(int local, const v1::StartRequest& req) = 0;
  // Calls `done(true, status, placement, times)` once operation `seq` completes (placement:
  // where `local`'s buffers are then, or nullptr), or `done(false, OK, nullptr, {})` at
  // `deadline`. Never blocks; `done` never runs under the target's locks.
  using WaitCallback =
      std::function<void(bool, const absl::Status&, const v1::UnitBuffers*, OpTimes)>;
  virtual void AddWaiter(uint64_t seq, int local, absl::Time deadline, WaitCallback done) = 0;
};

}  // namespace ragshard::daemon

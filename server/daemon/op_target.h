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

// An operation as a rank starts it, checked once at the boundary it came in through (the gRPC
// handler, the command queue's poller): its kind names an operation (OP_NOOP included) and its
// reduce kind is one ragshard.v1 has. The unit is checked by the job, which knows its units.
struct OpRequest {
  v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
  int unit = 0;
  v1::ReduceKind reduce = v1::REDUCE_SUM;
  int64_t keep_ranks = 0;
  bool accumulate = false;  // OP_REDUCE_SCATTER: add into the gradient shards
  int64_t timeout_ms = 0;   // 0: 60 s
};

// The request from its raw fields; INVALID_ARGUMENT names a kind or reduce kind that is not one.
absl::StatusOr<OpRequest> MakeOpRequest(int kind, int unit, int reduce, int64_t keep_ranks,
                                        bool accumulate, int64_t timeout_ms);
// The same, from the gRPC Start request.
absl::StatusOr<OpRequest> MakeOpRequest(const v1::StartRequest& req);

class OpTarget {
 public:
  virtual ~OpTarget() = default;
  // Local rank `local` starts the operation `req` names: its sequence number, or why not.
  virtual absl::StatusOr<uint64_t> StartOp(int local, const OpRequest& req) = 0;
  // Calls `done(true, status, placement, times)` once operation `seq` completes (placement:
  // where `local`'s buffers are then, or nullptr), or `done(false, OK, nullptr, {})` at
  // `deadline`. Never blocks; `done` never runs under the target's locks.
  using WaitCallback =
      std::function<void(bool, const absl::Status&, const v1::UnitBuffers*, OpTimes)>;
  virtual void AddWaiter(uint64_t seq, int local, absl::Time deadline, WaitCallback done) = 0;
};

}  // namespace ragshard::daemon

// A point-to-point communicator among the `size()` members of a process group, the one thing
// the collectives need from a transport. The UCX implementation is ucx_comm.h; tests also use an
// in-memory one.
//
// Thread-compatible: one collective at a time per communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ragshard::daemon {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Posts a send or a receive of exactly `bytes` bytes matched by (peer, tag); tags must fit in
  // 48 bits. The buffer must stay valid until the request completes or WaitAll returns.
  virtual absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                            size_t bytes) = 0;
  virtual absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  // Waits for every request. On a lost peer or at the deadline it cancels the requests that are
  // still pending and returns UNAVAILABLE or DEADLINE_EXCEEDED naming the peer.
  virtual absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline) = 0;
};

}  // namespace ragshard::daemon

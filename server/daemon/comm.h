// A point-to-point communicator among the `size()` members of a process group, the one thing
// the collectives need from a transport. The UCX implementation is ucx_comm.h; tests also use an
// in-memory one.
//
// Thread-compatible: one collective at a time per communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
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

// The members `members` (ranks of `base`, in group order) of a larger communicator, as a
// communicator of their own: a shard group or a replicate group of an HSDP mesh. `base` must
// outlive it and its rank must be one of the members.
class SubComm final : public Comm {
 public:
  SubComm(Comm* base, std::vector<int> members) : base_(base), members_(std::move(members)) {
    for (size_t i = 0; i < members_.size(); ++i) {
      if (members_[i] == base_->rank()) rank_ = static_cast<int>(i);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    return base_->PostSend(members_[peer], tag, data, bytes);
  }
  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return base_->PostRecv(members_[peer], tag, data, bytes);
  }
  absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline) override {
    return base_->WaitAll(requests, deadline);
  }

 private:
  Comm* base_;
  std::vector<int> members_;
  int rank_ = -1;
};

}  // namespace ragshard::daemon

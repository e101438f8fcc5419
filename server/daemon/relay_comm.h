// The communicator a job's data plane holds: it relays every call to the job's current
// connection to the other nodes' daemons, which a recovery in place replaces with a new one of
// the next epoch (docs/recovery.md). The old connection's messages die with it, so an operation
// cut short by the recovery leaves nothing behind for the next epoch's operations to match.
//
// Thread-compatible like every Comm: the job's thread calls it, closes the connection and
// replaces it; waiting_for() may be called from any thread (ragshardctl job why). Between Close
// and Replace no operation runs (the job is recovering): only Abort, SetDescriber, sent_bytes,
// waiting_for and Interrupt (any thread) are called then, and they do nothing.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/daemon/comm.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

class RelayComm final : public Comm {
 public:
  // `worker` (may be null for in-memory comms) must outlive `comm`; both are kept.
  RelayComm(std::unique_ptr<UcxWorker> worker, std::unique_ptr<Comm> comm)
      : worker_(std::move(worker)), comm_(std::move(comm)) {}
  ~RelayComm() override {
    comm_.reset();  // before its worker
    worker_.reset();
  }

  // Closes the connection (its endpoints: what the peers still send or wait for on it fails at
  // once); only Replace may follow.
  void Close() {
    absl::MutexLock lock(&mu_);
    if (comm_ != nullptr) sent_before_ += comm_->sent_bytes();
    comm_.reset();
    worker_.reset();
  }

  // The next epoch's connection (same members, same ranks); the old one closes first.
  void Replace(std::unique_ptr<UcxWorker> worker, std::unique_ptr<Comm> comm) {
    Close();
    absl::MutexLock lock(&mu_);
    worker_ = std::move(worker);
    comm_ = std::move(comm);
    if (describe_) comm_->SetDescriber(describe_);
  }

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    return comm_->PostSend(peer, tag, data, bytes);
  }
  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return comm_->PostRecv(peer, tag, data, bytes);
  }
  using Comm::WaitAll;
  absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline,
                       const IdleWork& idle) override {
    return comm_->WaitAll(requests, deadline, idle);
  }
  absl::StatusOr<bool> Poll(const std::vector<uint64_t>& requests, absl::Time deadline) override {
    return comm_->Poll(requests, deadline);
  }
  void Abort(const std::string& why) override {
    if (comm_ != nullptr) comm_->Abort(why);
  }
  void Interrupt(const std::string& why) override {
    absl::MutexLock lock(&mu_);  // (against Close and Replace in the job's thread)
    if (comm_ != nullptr) comm_->Interrupt(why);
  }
  void SetDescriber(TagDescriber describe) override {
    describe_ = describe;
    if (comm_ != nullptr) comm_->SetDescriber(std::move(describe));
  }
  int64_t sent_bytes() const override {
    return sent_before_ + (comm_ != nullptr ? comm_->sent_bytes() : 0);
  }
  std::string waiting_for() const override {
    absl::MutexLock lock(&mu_);
    return comm_ != nullptr ? comm_->waiting_for() : "";
  }

 private:
  mutable absl::Mutex mu_;  // held by Replace and by calls from other threads
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<Comm> comm_;
  TagDescriber describe_;
  int64_t sent_before_ = 0;
};

}  // namespace ragshard::daemon

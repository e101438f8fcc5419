// An in-memory Comm for testing collectives: members are threads of one process; sends are
// buffered in a shared fabric. A member can be marked lost.
#pragma once

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/daemon/comm.h"

namespace ragshard::daemon::testing {

class MemFabric {
 public:
  explicit MemFabric(int size) : size_(size) {}
  int size() const { return size_; }
  void Lose(int rank) {
    absl::MutexLock lock(&mu_);
    lost_.insert(rank);
  }

 private:
  friend class MemComm;
  using Key = std::tuple<int, int, uint64_t>;  // src, dst, tag
  const int size_;
  absl::Mutex mu_;
  std::map<Key, std::deque<std::string>> mail_ ABSL_GUARDED_BY(mu_);
  std::set<int> lost_ ABSL_GUARDED_BY(mu_);
};

class MemComm final : public Comm {
 public:
  MemComm(MemFabric* fabric, int rank) : fabric_(fabric), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return fabric_->size(); }

  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    absl::MutexLock lock(&fabric_->mu_);
    fabric_->mail_[{rank_, peer, tag}].emplace_back(static_cast<const char*>(data), bytes);
    reqs_.push_back({false, peer, tag, nullptr, 0});
    return reqs_.size() - 1;
  }
  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    reqs_.push_back({true, peer, tag, data, bytes});
    return reqs_.size() - 1;
  }
  absl::Status WaitAll(const std::vector<uint64_t>& ids, absl::Time deadline) override {
    for (uint64_t id : ids) {
      Req& r = reqs_[id];
      if (!r.recv) continue;
      absl::MutexLock lock(&fabric_->mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(fabric_->mu_) {
        auto it = fabric_->mail_.find({r.peer, rank_, r.tag});
        return (it != fabric_->mail_.end() && !it->second.empty()) ||
               fabric_->lost_.count(r.peer) > 0;
      };
      if (!fabric_->mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("peer ", r.peer, " did not answer"));
      }
      auto& q = fabric_->mail_[{r.peer, rank_, r.tag}];
      if (q.empty()) return absl::UnavailableError(absl::StrCat("peer ", r.peer, " lost"));
      if (q.front().size() != r.bytes) return absl::DataLossError("size mismatch");
      std::memcpy(r.data, q.front().data(), r.bytes);
      q.pop_front();
    }
    return absl::OkStatus();
  }

 private:
  struct Req {
    bool recv;
    int peer;
    uint64_t tag;
    void* data;
    size_t bytes;
  };
  MemFabric* fabric_;
  const int rank_;
  std::vector<Req> reqs_;
};

}  // namespace ragshard::daemon::testing

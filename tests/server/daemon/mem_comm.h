// An in-memory Comm for testing collectives: members are threads of one process; sends are
// buffered in a shared fabric. A member can be marked lost. Matching and checking follow
// comm.h: a receive takes the next message from its peer with the same index, then compares the
// whole tag and the size. Receives take their messages in the order they were posted, as UCX's
// tag matching does: a receive waited for after a later-posted one of the same index (a
// background protect's window in flight across another operation) still gets the earlier
// message.
//
// A send completes (its WaitAll returns) only once its receiver has taken it, as a large
// message over a real transport does, and the receiver then checks that the sender's buffer
// still holds what was posted: a collective that writes a buffer while a send from it is in
// flight fails with INTERNAL naming the message.
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
  using Key = std::tuple<int, int, uint64_t>;  // src, dst, index
  struct Message {
    uint64_t tag;
    std::string bytes;
    const char* source;  // the sender's buffer, which must not change until delivered
    bool* delivered;     // set by the receiver (the sender's request outlives it)
  };
  const int size_;
  absl::Mutex mu_;
  std::map<Key, std::deque<Message>> mail_ ABSL_GUARDED_BY(mu_);
  std::set<int> lost_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> notices_ ABSL_GUARDED_BY(mu_);  // by receiver
};

class MemComm final : public Comm {
 public:
  MemComm(MemFabric* fabric, int rank) : fabric_(fabric), rank_(rank) {}
  ~MemComm() override { Orphan(); }
  int rank() const override { return rank_; }
  int size() const override { return fabric_->size(); }

  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    absl::MutexLock lock(&fabric_->mu_);
    reqs_.push_back(
        {false, peer, tag, nullptr, bytes, std::make_unique<bool>(false), false, absl::OkStatus()});
    fabric_->mail_[{rank_, peer, tag & MessageStamp::kMatchMask}].push_back(
        {tag, std::string(static_cast<const char*>(data), bytes), static_cast<const char*>(data),
         reqs_.back().delivered.get()});
    return reqs_.size() - 1;
  }
  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    reqs_.push_back({true, peer, tag, data, bytes, nullptr, false, absl::OkStatus()});
    posted_[{peer, rank_, tag & MessageStamp::kMatchMask}].push_back(reqs_.size() - 1);
    return reqs_.size() - 1;
  }
  using Comm::WaitAll;
  // Runs one step of `idle` before each receive, as a transport would while a message is on
  // its way.
  absl::Status WaitAll(const std::vector<uint64_t>& ids, absl::Time deadline,
                       const IdleWork& idle) override {
    absl::Status st = WaitFor(ids, deadline, idle, nullptr);
    // A failed wait returns with sends in flight, whose buffers its caller may free: they are
    // delivered from their copies, unchecked.
    if (!st.ok()) Orphan();
    return st;
  }
  // Takes what has arrived, without waiting.
  absl::StatusOr<bool> Poll(const std::vector<uint64_t>& ids, absl::Time deadline) override {
    bool pending = false;
    absl::Status st = WaitFor(ids, absl::Now(), IdleWork(), &pending);
    if (st.ok() && pending && absl::Now() >= deadline) {
      st = absl::DeadlineExceededError("a polled transfer did not complete before the deadline");
    }
    if (!st.ok()) {
      Orphan();
      return st;
    }
    return !pending;
  }
  // Waits for `ids` until `deadline`; where `pending` is given, a request not complete at the
  // deadline sets it instead of failing.
  absl::Status WaitFor(const std::vector<uint64_t>& ids, absl::Time deadline, const IdleWork& idle,
                       bool* pending) {
    bool idle_left = static_cast<bool>(idle);
    for (uint64_t id : ids) {
      if (idle_left) idle_left = idle();
      Req& r = reqs_[id];
      if (!r.recv) {
        absl::MutexLock lock(&fabric_->mu_);
        bool* delivered = r.delivered.get();
        auto taken = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(fabric_->mu_) {
          return *delivered || fabric_->lost_.count(r.peer) > 0 ||
                 fabric_->notices_.count(rank_) > 0;
        };
        if (!fabric_->mu_.AwaitWithDeadline(absl::Condition(&taken), deadline)) {
          if (pending != nullptr) {
            *pending = true;
            continue;
          }
          return absl::DeadlineExceededError(absl::StrCat("peer ", r.peer, " did not receive"));
        }
        if (!*delivered) {
          if (auto n = fabric_->notices_.find(rank_); n != fabric_->notices_.end()) {
            return absl::AbortedError(n->second);
          }
          return absl::UnavailableError(absl::StrCat("peer ", r.peer, " lost"));
        }
        continue;
      }
      // The receives of this index posted before this one take their messages first.
      const MemFabric::Key key{r.peer, rank_, r.tag & MessageStamp::kMatchMask};
      std::deque<uint64_t>& order = posted_[key];
      while (!reqs_[id].landed) {
        Req& q = reqs_[order.front()];
        absl::MutexLock lock(&fabric_->mu_);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(fabric_->mu_) {
          auto it = fabric_->mail_.find(key);
          return (it != fabric_->mail_.end() && !it->second.empty()) ||
                 fabric_->lost_.count(r.peer) > 0 || fabric_->notices_.count(rank_) > 0;
        };
        if (!fabric_->mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
          if (pending != nullptr) {
            *pending = true;
            break;
          }
          return absl::DeadlineExceededError(absl::StrCat("peer ", r.peer, " did not answer"));
        }
        if (auto n = fabric_->notices_.find(rank_); n != fabric_->notices_.end()) {
          return absl::AbortedError(n->second);
        }
        auto& mail = fabric_->mail_[key];
        if (mail.empty()) return absl::UnavailableError(absl::StrCat("peer ", r.peer, " lost"));
        const MemFabric::Message m = std::move(mail.front());
        mail.pop_front();
        order.pop_front();
        q.landed = true;
        // (A lost sender's buffers may be gone: not checked.)
        const bool changed = m.source != nullptr && fabric_->lost_.count(r.peer) == 0 &&
                             std::memcmp(m.source, m.bytes.data(), m.bytes.size()) != 0;
        if (m.delivered != nullptr) *m.delivered = true;
        if (changed) {
          q.status =
              absl::InternalError(absl::StrCat("peer ", r.peer, " changed the buffer of ",
                                               DescribeTag(m.tag), " before it was received"));
        } else if (m.tag != q.tag || m.bytes.size() != q.bytes) {
          q.status = MismatchError(rank_, q.peer, m.tag, m.bytes.size(), q.tag, q.bytes, describe_);
        } else {
          std::memcpy(q.data, m.bytes.data(), q.bytes);
        }
        if (!q.status.ok()) {  // (this receive's, or one posted before it: the pairing is wrong)
          if (mismatched_.ok()) mismatched_ = q.status;
          break;
        }
      }
      const absl::Status st = mismatched_.ok() ? reqs_[id].status : mismatched_;
      if (!st.ok()) {
        Abort(std::string(st.message()));
        return st;
      }
    }
    return absl::OkStatus();
  }
  void Abort(const std::string& why) override {
    absl::MutexLock lock(&fabric_->mu_);
    for (int p = 0; p < fabric_->size(); ++p) {
      if (p != rank_)
        fabric_->notices_.emplace(p, absl::StrCat("node ", rank_, " stopped the job: ", why));
    }
  }
  void SetDescriber(TagDescriber describe) override { describe_ = std::move(describe); }

 private:
  // This communicator's sends not yet received: no longer checked against their buffers, nor
  // marked delivered.
  void Orphan() {
    absl::MutexLock lock(&fabric_->mu_);
    for (auto& [key, queue] : fabric_->mail_) {
      if (std::get<0>(key) != rank_) continue;
      for (MemFabric::Message& m : queue) {
        m.source = nullptr;
        m.delivered = nullptr;
      }
    }
  }
  struct Req {
    bool recv;
    int peer;
    uint64_t tag;
    void* data;
    size_t bytes;
    std::unique_ptr<bool> delivered;  // sends: set by the receiver, under the fabric's lock
    bool landed = false;              // receives: its message taken (in the order posted)
    absl::Status status;              // and how it compared
  };
  MemFabric* fabric_;
  const int rank_;
  std::vector<Req> reqs_;
  std::map<MemFabric::Key, std::deque<uint64_t>> posted_;  // receives not yet landed, by key
  absl::Status mismatched_;  // the first receive whose message did not match
  TagDescriber describe_;
};

}  // namespace ragshard::daemon::testing

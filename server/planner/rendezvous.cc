#include "server/planner/rendezvous.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "infra/rpc.h"

namespace ragshard::planner {

namespace {

// " (nor N more<noun>)" when more than one key is missing.
std::string More(const std::set<std::string>& missing, const char* noun) {
  return missing.size() > 1 ? absl::StrCat(" (nor ", missing.size() - 1, " more", noun, ")") : "";
}

}  // namespace

void Rendezvous::Load(const std::vector<StoredState::Kv>& kv) {
  absl::MutexLock lock(&mu_);
  for (const StoredState::Kv& k : kv) keys_[k.job_id][k.key] = k.value;
}

absl::Status Rendezvous::Put(const std::string& job_id, const std::string& key,
                             const std::string& value, Deferred* deferred) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = store_->PutKv(job_id, key, value); !s.ok()) return s;
  keys_[job_id][key] = value;
  auto waiters = by_key_.find({job_id, key});
  if (waiters == by_key_.end()) return absl::OkStatus();
  std::vector<WaitingList::iterator> calls = std::move(waiters->second);
  by_key_.erase(waiters);
  for (WaitingList::iterator w : calls) {
    w->missing.erase(key);
    if (w->missing.empty()) {
      deferred->push_back([this, job_id, keys = std::move(w->keys), answer = std::move(w->answer),
                           reactor = w->parked.reactor] {
        reactor->Finish(ToGrpcStatus(Fill(job_id, keys, answer)));
      });
      waiting_.erase(w);  // (in no other key's list: its other keys were put)
    }
  }
  return absl::OkStatus();
}

Rendezvous::WaitingList::iterator Rendezvous::Forget(WaitingList::iterator w) {
  for (const std::string& key : w->missing) {
    auto it = by_key_.find({w->job_id, key});
    if (it == by_key_.end()) continue;
    std::vector<WaitingList::iterator>& calls = it->second;
    calls.erase(std::remove(calls.begin(), calls.end(), w), calls.end());
    if (calls.empty()) by_key_.erase(it);
  }
  return waiting_.erase(w);
}

std::optional<absl::Status> Rendezvous::Park(const std::string& job_id,
                                             const std::vector<std::string>& keys, int64_t wait_ms,
                                             grpc::ServerUnaryReactor* reactor,
                                             const Answer& answer) {
  absl::MutexLock lock(&mu_);
  const Keys& kv = keys_[job_id];
  Waiting w;
  w.job_id = job_id;
  for (const std::string& key : keys) {
    if (!kv.count(key)) w.missing.insert(key);
  }
  if (w.missing.empty()) return absl::OkStatus();
  if (wait_ms == 0) {
    return absl::NotFoundError(absl::StrCat("key '", *w.missing.begin(), "' of job '", job_id,
                                            "' not found", More(w.missing, "")));
  }
  if (closed_) {
    return absl::Status(static_cast<absl::StatusCode>(closed_->error_code()),
                        closed_->error_message());
  }
  w.keys = keys;
  w.answer = answer;
  w.parked.reactor = reactor;
  w.parked.deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  auto it = waiting_.insert(waiting_.end(), std::move(w));
  for (const std::string& key : it->missing) by_key_[{job_id, key}].push_back(it);
  return std::nullopt;
}

absl::Status Rendezvous::Fill(const std::string& job_id, const std::vector<std::string>& keys,
                              const Answer& answer) const {
  absl::MutexLock lock(&mu_);
  auto job = keys_.find(job_id);
  for (const std::string& key : keys) {
    if (job == keys_.end() || !job->second.count(key)) {
      return absl::NotFoundError(
          absl::StrCat("key '", key, "' of job '", job_id, "' is gone (the job was deleted)"));
    }
  }
  answer(job->second);
  return absl::OkStatus();
}

void Rendezvous::ExpireWaits(Clock::time_point now, Deferred* deferred) {
  absl::MutexLock lock(&mu_);
  for (auto w = waiting_.begin(); w != waiting_.end();) {
    if (w->parked.deadline <= now) {
      FinishLater(deferred, w->parked.reactor,
                  grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                               absl::StrCat("key '", *w->missing.begin(), "' of job '", w->job_id,
                                            "' was not put before the wait ended",
                                            More(w->missing, " keys"))));
      w = Forget(w);
    } else {
      ++w;
    }
  }
}

void Rendezvous::DropJob(const std::string& job_id, const grpc::Status& status,
                         Deferred* deferred) {
  absl::MutexLock lock(&mu_);
  keys_.erase(job_id);
  for (auto w = waiting_.begin(); w != waiting_.end();) {
    if (w->job_id == job_id) {
      FinishLater(deferred, w->parked.reactor, status);
      w = Forget(w);
    } else {
      ++w;
    }
  }
}

void Rendezvous::AbortAll(const grpc::Status& status, Deferred* deferred) {
  absl::MutexLock lock(&mu_);
  for (Waiting& w : waiting_) FinishLater(deferred, w.parked.reactor, status);
  waiting_.clear();
  by_key_.clear();
  closed_ = status;
}

size_t Rendezvous::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_.size();
}

}  // namespace ragshard::planner

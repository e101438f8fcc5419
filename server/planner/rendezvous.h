// The planner's rendezvous: each job's keys (Put) and the Get and GetKeys calls waiting for them.
//
// Thread-safe: its own mutex guards the keys and the waiting calls, and a key's store row is
// written under it. The service calls it holding the job's lock (so that a job deleted meanwhile
// takes no key): lock order job -> rendezvous, and nothing else is locked under it. Calls are
// answered after its mutex is released (the Deferred the caller runs).
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/planner/parked.h"
#include "server/planner/store.h"

namespace ragshard::planner {

class Rendezvous {
 public:
  using Keys = std::map<std::string, std::string>;
  // Fills a waiting call's response from its job's keys once none is missing.
  using Answer = std::function<void(const Keys& kv)>;

  explicit Rendezvous(Store* store) : store_(store) {}

  void Load(const std::vector<StoredState::Kv>& kv);
  // Stores the key, then answers the calls it completes (their answers built in `deferred`, once
  // the locks are released: for a large job, every node's addresses for every node).
  absl::Status Put(const std::string& job_id, const std::string& key, const std::string& value,
                   Deferred* deferred);
  // OK when every one of `keys` of the job is stored (the caller then builds its answer with
  // Fill, outside the job's lock), else parks `reactor` until they are all put (the Put builds
  // the answer with `answer`) or `wait_ms` passes (std::nullopt: parked). NOT_FOUND naming the
  // first missing key when wait_ms is 0; after AbortAll, its status.
  std::optional<absl::Status> Park(const std::string& job_id, const std::vector<std::string>& keys,
                                   int64_t wait_ms, grpc::ServerUnaryReactor* reactor,
                                   const Answer& answer);
  // Fills an answer from the job's stored keys; NOT_FOUND naming a key that is gone (the job was
  // deleted since Park).
  absl::Status Fill(const std::string& job_id, const std::vector<std::string>& keys,
                    const Answer& answer) const;
  // Answers DEADLINE_EXCEEDED, naming the missing key, to every call whose wait has ended.
  void ExpireWaits(Clock::time_point now, Deferred* deferred);
  // Forgets the job's keys (the store's rows are purged with the job's data) and answers its
  // waiting calls with `status`.
  void DropJob(const std::string& job_id, const grpc::Status& status, Deferred* deferred);
  // Answers every waiting call with `status`, and every later one at once (shutdown).
  void AbortAll(const grpc::Status& status, Deferred* deferred);
  size_t waiting() const;

 private:
  struct Waiting {
    std::string job_id;
    std::vector<std::string> keys;  // as asked
    std::set<std::string> missing;
    Answer answer;
    Parked parked;
  };

  using WaitingList = std::list<Waiting>;
  // Removes a waiting call and its entries in by_key_.
  WaitingList::iterator Forget(WaitingList::iterator w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Store* const store_;
  mutable absl::Mutex mu_;
  std::map<std::string, Keys> keys_ ABSL_GUARDED_BY(mu_);  // by job id
  WaitingList waiting_ ABSL_GUARDED_BY(mu_);
  // The waiting calls missing each (job id, key): a Put visits only those, so N nodes each
  // waiting for N keys cost N^2 key checks in all, not N^3.
  std::map<std::pair<std::string, std::string>, std::vector<WaitingList::iterator>> by_key_
      ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> closed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard::planner

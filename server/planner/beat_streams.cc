#include "server/planner/beat_streams.h"

#include "infra/rpc.h"

namespace ragshard::planner {

// One stream: reads a heartbeat, answers it, reads the next. It keeps itself alive until gRPC
// is done with it (OnDone); the registry's copies keep it alive while CloseAll ends it. Finish
// is called outside the stream's mutex, and once.
class BeatStreams::Stream final : public BeatStreams::Reactor {
 public:
  Stream(BeatStreams* owner, Beat beat) : owner_(owner), beat_(std::move(beat)) {}
  void Start(std::shared_ptr<Stream> self) {
    grpc::Status ended;
    {
      absl::MutexLock lock(&mu_);
      self_ = std::move(self);
      if (!ended_) {
        StartRead(&request_);
        return;
      }
      ended = end_status_;  // CloseAll came first
    }
    Finish(ended);
  }
  // Ends the stream (once); a write in flight finishes first.
  void End(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (ended_) return;
      ended_ = true;
      if (writing_ || self_ == nullptr) {
        end_status_ = status;
        return;
      }
    }
    Finish(status);
  }

 private:
  void OnReadDone(bool ok) override {
    if (!ok) {  // the node closed its side, or the call was cancelled
      End(grpc::Status::OK);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (ended_) return;  // the planner shuts down: the beat is not counted
    }
    response_.Clear();
    const absl::Status s = beat_(request_, &response_);
    if (!s.ok()) {
      End(ToGrpcStatus(s));
      return;
    }
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    writing_ = true;
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    grpc::Status finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ended_ && ok) {
        StartRead(&request_);
        return;
      }
      if (!ended_) {
        ended_ = true;
        end_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the heartbeat stream broke");
      }
      finish = end_status_;
    }
    Finish(finish);
  }
  void OnDone() override {
    owner_->Remove(this);
    std::shared_ptr<Stream> self;
    absl::MutexLock lock(&mu_);
    self = std::move(self_);  // released after the lock
  }

  BeatStreams* const owner_;
  const Beat beat_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  absl::Mutex mu_;
  std::shared_ptr<Stream> self_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A stream refused before its first read.
class Refused final : public BeatStreams::Reactor {
 public:
  explicit Refused(const grpc::Status& why) { Finish(why); }
  void OnDone() override { delete this; }
};

}  // namespace

BeatStreams::Reactor* BeatStreams::Open(const absl::Status& refused, Beat beat) {
  if (!refused.ok()) return new Refused(ToGrpcStatus(refused));
  auto s = std::make_shared<Stream>(this, std::move(beat));
  {
    absl::MutexLock lock(&mu_);
    if (closed_) {
      return new Refused(grpc::Status(grpc::StatusCode::UNAVAILABLE, "planner shutting down"));
    }
    open_.emplace(s.get(), s);
  }
  s->Start(s);
  return s.get();
}

void BeatStreams::Remove(Stream* s) {
  absl::MutexLock lock(&mu_);
  open_.erase(s);
}

void BeatStreams::CloseAll(const grpc::Status& status) {
  std::vector<std::shared_ptr<Stream>> open;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    for (auto& [raw, s] : open_) open.push_back(s);
  }
  for (auto& s : open) s->End(status);
}

int64_t BeatStreams::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(open_.size());
}

}  // namespace ragshard::planner

#include "protocol/heartbeat_stream.h"

#include "absl/strings/str_cat.h"

namespace ragshard {

// The reactor of one HeartbeatStream call: a write and a read per beat, one beat at a time. A
// hold keeps gRPC from ending the call between beats (its stream object is freed at OnDone, and
// a beat starts its operations from the daemon's thread, outside any reaction); it is removed
// once, when the call failed or is given up, and OnDone follows.
class HeartbeatStream::Call final
    : public grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  Call(v1::Planner::Stub* stub, const ClientSecurity& security) {
    Authorize(&ctx_, security);
    stub->async()->HeartbeatStream(&ctx_, this);
    AddHold();
    StartCall();
  }
  ~Call() override { Release(/*cancel=*/true); }

  grpc::Status Beat(const v1::HeartbeatRequest& request, std::chrono::milliseconds timeout,
                    v1::HeartbeatResponse* response) {
    {
      absl::MutexLock lock(&mu_);
      if (!held_) return status_;  // (a failed call is not used again)
      request_ = request;
      read_ = written_ = false;
    }
    StartWrite(&request_);
    StartRead(&response_);
    bool settled = false, answered = false;
    {
      absl::MutexLock lock(&mu_);
      // The write's completion too: the next beat may not start a write before it.
      auto beat_done = [this] { return (read_ && written_) || (read_ && !read_ok_); };
      settled = mu_.AwaitWithTimeout(absl::Condition(&beat_done), absl::FromChrono(timeout));
      answered = settled && read_ok_;
      if (answered) *response = std::move(response_);
    }
    if (answered) return grpc::Status::OK;
    Release(/*cancel=*/!settled);  // the call ended (its read failed), or it is given up
    absl::MutexLock lock(&mu_);
    if (!settled) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("the planner did not answer a heartbeat on its stream "
                                       "within ",
                                       timeout.count(), " ms"));
    }
    return status_;
  }

  void OnWriteDone(bool /*ok*/) override {
    absl::MutexLock lock(&mu_);
    written_ = true;
  }
  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    read_ = true;
    read_ok_ = ok;
  }
  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status.ok() ? grpc::Status(grpc::StatusCode::ABORTED,
                                         "the planner ended the heartbeat stream")
                          : status;
    done_ = true;
  }

 private:
  // Removes the hold (once), cancelling the call first when asked, and waits for OnDone.
  void Release(bool cancel) {
    bool remove = false;
    {
      absl::MutexLock lock(&mu_);
      remove = held_;
      held_ = false;
    }
    if (cancel) ctx_.TryCancel();
    if (remove) RemoveHold();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

  grpc::ClientContext ctx_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = true;
  bool read_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool written_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

HeartbeatStream::HeartbeatStream(v1::Planner::Stub* stub, const ClientSecurity* security)
    : stub_(stub), security_(security) {}

HeartbeatStream::~HeartbeatStream() = default;

grpc::Status HeartbeatStream::Beat(const v1::HeartbeatRequest& request,
                                   std::chrono::milliseconds timeout,
                                   v1::HeartbeatResponse* response) {
  absl::MutexLock lock(&mu_);
  const bool reused = call_ != nullptr;
  if (call_ == nullptr) call_ = std::make_unique<Call>(stub_, *security_);
  grpc::Status st = call_->Beat(request, timeout, response);
  if (st.ok()) return st;
  call_.reset();  // the next beat opens a new call
  // A call that sat open since the last beat may have ended meanwhile (a planner that restarted,
  // a connection reset): this beat goes again on a new one rather than being missed.
  if (reused && (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                 st.error_code() == grpc::StatusCode::CANCELLED ||
                 st.error_code() == grpc::StatusCode::ABORTED)) {
    call_ = std::make_unique<Call>(stub_, *security_);
    st = call_->Beat(request, timeout, response);
    if (!st.ok()) call_.reset();
  }
  return st;
}

}  // namespace ragshard

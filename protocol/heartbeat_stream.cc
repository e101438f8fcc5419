#include "protocol/heartbeat_stream.h"

#include "absl/strings/str_cat.h"

namespace ragshard {

// The reactor of one HeartbeatStream call: a write and a read per beat, one beat at a time.
class HeartbeatStream::Call final
    : public grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  Call(v1::Planner::Stub* stub, const ClientSecurity& security) {
    Authorize(&ctx_, security);
    stub->async()->HeartbeatStream(&ctx_, this);
    StartCall();
  }
  // gRPC is done with the reactor only at OnDone.
  ~Call() override {
    ctx_.TryCancel();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

  bool done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  grpc::Status Beat(const v1::HeartbeatRequest& request, std::chrono::milliseconds timeout,
                    v1::HeartbeatResponse* response) {
    {
      absl::MutexLock lock(&mu_);
      if (done_) return status_;
      request_ = request;
      answered_ = false;
    }
    StartWrite(&request_);
    StartRead(&response_);
    absl::MutexLock lock(&mu_);
    auto settled = [this] { return answered_ || done_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&settled), absl::FromChrono(timeout))) {
      ctx_.TryCancel();
      mu_.Await(absl::Condition(&done_));
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("the planner did not answer a heartbeat on its stream "
                                       "within ",
                                       timeout.count(), " ms"));
    }
    if (!answered_) return status_;
    *response = std::move(response_);
    return grpc::Status::OK;
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    answered_ = ok;
  }
  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                         "the planner ended the heartbeat stream")
                          : status;
    done_ = true;
  }

 private:
  grpc::ClientContext ctx_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  absl::Mutex mu_;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
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
  if (call_ != nullptr && call_->done()) call_.reset();
  if (call_ == nullptr) call_ = std::make_unique<Call>(stub_, *security_);
  grpc::Status st = call_->Beat(request, timeout, response);
  if (!st.ok()) call_.reset();  // the next beat opens a new call
  return st;
}

}  // namespace ragshard

#include "server/planner/watch_channel.h"

#include <string>
#include <utility>

namespace ragshard::planner {

void WatchChannel::Push(Event event) {
  const grpc::ByteBuffer* start = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (closing_ || done_) return;
    queue_.push_back(std::move(event));
    if (!writing_) {
      writing_ = true;
      start = queue_.front().get();
    }
  }
  if (start != nullptr) reactor_->StartWrite(start);
}

void WatchChannel::Close(const grpc::Status& status) {
  bool finish = false;
  {
    absl::MutexLock lock(&mu_);
    if (closing_ || done_) return;
    closing_ = true;
    status_ = status;
    finish = !writing_ && !finished_;
    if (finish) finished_ = true;
  }
  if (finish) reactor_->Finish(status);
}

void WatchChannel::OnWriteDone(bool ok) {
  const grpc::ByteBuffer* next = nullptr;
  bool finish = false;
  grpc::Status status;
  {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (!ok) {
      closing_ = true;
      abandoned_ = true;
      status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream broken");
    }
    // A graceful Close still delivers what was queued before it (the final JOB_DELETED
    // event); a broken or cancelled stream drops it.
    if (!abandoned_ && !queue_.empty()) {
      next = queue_.front().get();
    } else {
      writing_ = false;
      if (closing_ && !finished_) {
        finished_ = true;
        finish = true;
        status = status_;
      }
    }
  }
  if (next != nullptr) reactor_->StartWrite(next);
  if (finish) reactor_->Finish(status);
}

void WatchChannel::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
  }
  Close(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
}

void WatchChannel::OnDone() {
  absl::MutexLock lock(&mu_);
  done_ = true;
}

bool WatchChannel::done() const {
  absl::MutexLock lock(&mu_);
  return done_ || closing_;
}

WatchChannel::Event ToBuffer(const v1::WatchPlanEvent& event) {
  std::string bytes;
  event.SerializeToString(&bytes);
  grpc::Slice slice(bytes);
  return std::make_shared<const grpc::ByteBuffer>(&slice, 1);
}

}  // namespace ragshard::planner

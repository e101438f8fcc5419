// The planner's WatchPlan streams: a channel per watcher that queues events and writes them one
// at a time, and the reactor that owns it. An event is serialized once (ToBuffer) and its slices
// are shared by every watcher's stream.
//
// Thread-safe: Push and Close may be called from any thread; the reactor's callbacks are made
// outside the channel's mutex.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "ragshard/v1/planner.pb.h"

namespace ragshard::planner {

class WatchChannel {
 public:
  using Event = std::shared_ptr<const grpc::ByteBuffer>;

  explicit WatchChannel(grpc::ServerWriteReactor<grpc::ByteBuffer>* reactor) : reactor_(reactor) {}

  // The plan version this watcher was last sent; touched only under the service's mutex.
  uint64_t sent_version = 0;
  // The watcher takes plans compact (WatchPlanRequest.accept_zstd); set before it is added.
  bool zstd = false;

  // Queues an event (shared between watchers: a DeepSeek-V3 plan is several MB).
  void Push(Event event);
  // Finishes the stream with `status` once the queued events are written.
  void Close(const grpc::Status& status);
  // True once the stream is finished or finishing: the service drops the channel.
  bool done() const;

  // The reactor's callbacks.
  void OnWriteDone(bool ok);
  void OnCancel();
  void OnDone();

 private:
  grpc::ServerWriteReactor<grpc::ByteBuffer>* const reactor_;
  mutable absl::Mutex mu_;
  std::deque<Event> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// The write reactor of one WatchPlan call; it deletes itself when gRPC is done with it.
class WatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  WatchReactor() : channel_(std::make_shared<WatchChannel>(this)) {}
  std::shared_ptr<WatchChannel> channel() const { return channel_; }
  void OnWriteDone(bool ok) override { channel_->OnWriteDone(ok); }
  void OnCancel() override { channel_->OnCancel(); }
  void OnDone() override {
    channel_->OnDone();
    delete this;
  }

 private:
  std::shared_ptr<WatchChannel> channel_;
};

// Serializes once; copies of the buffer share its slices.
WatchChannel::Event ToBuffer(const v1::WatchPlanEvent& event);

}  // namespace ragshard::planner

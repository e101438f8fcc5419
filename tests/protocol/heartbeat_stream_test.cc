// Heartbeats on a stream (protocol/heartbeat_stream.h, server/planner/beat_streams.h): many beats
// on one call, a stalled stream counted as a missed beat and replaced, a planner without the
// stream beaten with unary calls, and a planner's shutdown ending the open streams.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "protocol/planner_client.h"
#include "tests/server/planner/planner_fixture.h"

namespace ragshard {
namespace {

using namespace std::chrono_literals;

// A planner of the node calls only: a heartbeat stream that answers each beat with the number
// of streams opened so far as its lease, or, while `stall`, reads a beat and never answers it;
// and the unary call, counted.
class FakePlanner final : public v1::Planner::Service {
 public:
  explicit FakePlanner(bool with_stream) : with_stream_(with_stream) {}
  std::atomic<int> streams{0}, unary{0};
  std::atomic<bool> stall{false};

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse* resp) override {
    resp->set_lease_ms(++unary);
    return grpc::Status::OK;
  }
  grpc::Status HeartbeatStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest>* stream) override {
    if (!with_stream_) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
    const int n = ++streams;
    v1::HeartbeatRequest req;
    while (stream->Read(&req)) {
      if (stall.load()) {
        while (!ctx->IsCancelled()) std::this_thread::sleep_for(5ms);
        return grpc::Status::CANCELLED;
      }
      v1::HeartbeatResponse resp;
      resp.set_lease_ms(n);
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }

 private:
  const bool with_stream_;
};

class FakePlannerServer {
 public:
  explicit FakePlannerServer(bool with_stream) : service(with_stream) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service);
    server_ = b.BuildAndStart();
  }
  ~FakePlannerServer() { server_->Shutdown(std::chrono::system_clock::now() + 1s); }
  std::unique_ptr<GrpcPlannerClient> Client(std::chrono::milliseconds rpc_timeout) const {
    PlannerClientOptions o;
    o.address = "127.0.0.1:" + std::to_string(port_);
    o.rpc_timeout = rpc_timeout;
    return std::move(*GrpcPlannerClient::Create(o));
  }
  FakePlanner service;

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

v1::HeartbeatRequest Beat() {
  v1::HeartbeatRequest hb;
  hb.set_node_id("node-0");
  return hb;
}

TEST(HeartbeatStreamTest, ManyBeatsGoOnOneStreamAndAStalledOneIsAMissedBeatThenReplaced) {
  FakePlannerServer planner(/*with_stream=*/true);
  auto client = planner.Client(500ms);
  for (int i = 0; i < 5; ++i) {
    auto r = client->Heartbeat(Beat());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->lease_ms(), 1);  // answered on the first stream
  }
  EXPECT_EQ(planner.service.streams.load(), 1);
  EXPECT_EQ(planner.service.unary.load(), 0);

  planner.service.stall = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto missed = client->Heartbeat(Beat());
  EXPECT_EQ(missed.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(missed.status().message().find("did not answer a heartbeat"), std::string::npos)
      << missed.status();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 500ms);

  planner.service.stall = false;
  auto again = client->Heartbeat(Beat());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->lease_ms(), 2);  // on a new stream
  EXPECT_EQ(planner.service.streams.load(), 2);
}

TEST(HeartbeatStreamTest, APlannerWithoutTheStreamIsBeatenWithUnaryCalls) {
  FakePlannerServer planner(/*with_stream=*/false);
  auto client = planner.Client(5s);
  for (int i = 1; i <= 3; ++i) {
    auto r = client->Heartbeat(Beat());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->lease_ms(), i);
  }
  EXPECT_EQ(planner.service.unary.load(), 3);
}

using PlannerBeatStreamTest = testing::PlannerFixture;

// The planner answers beats on the stream as it answers unary ones, and its shutdown ends the
// open streams (UNAVAILABLE) rather than waiting for them.
TEST_F(PlannerBeatStreamTest, TheStreamAnswersAsTheUnaryCallAndShutdownEndsIt) {
  v1::RegisterNodeRequest reg;
  reg.set_node_id("node-0");
  reg.set_data_address("127.0.0.1:1");
  reg.set_incarnation(7);
  ASSERT_TRUE(client_->RegisterNode(reg).ok());
  v1::HeartbeatRequest hb = Beat();
  hb.set_incarnation(7);
  hb.add_jobs("gone");
  auto r = client_->Heartbeat(hb);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->release_jobs_size(), 1);
  EXPECT_EQ(r->release_jobs(0), "gone");
  EXPECT_GT(r->lease_ms(), 0);
  // Another incarnation ends the stream with the unary call's error; the next beat opens another.
  hb.set_incarnation(8);
  EXPECT_EQ(client_->Heartbeat(hb).status().code(), absl::StatusCode::kFailedPrecondition);
  hb.set_incarnation(7);
  ASSERT_TRUE(client_->Heartbeat(hb).ok());

  const auto t0 = std::chrono::steady_clock::now();
  server_->Shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);  // not the server's 2 s grace
  EXPECT_EQ(client_->Heartbeat(hb).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(PlannerBeatStreamTest, TheOpenStreamsAreCounted) {
  RestartWithMetrics();
  constexpr char kStreams[] = "ragshard_planner_heartbeat_streams";
  EXPECT_EQ(Figure(kStreams), 0);
  v1::RegisterNodeRequest reg;
  reg.set_node_id("node-0");
  reg.set_data_address("127.0.0.1:1");
  ASSERT_TRUE(client_->RegisterNode(reg).ok());
  ASSERT_TRUE(client_->Heartbeat(Beat()).ok());
  ASSERT_TRUE(client_->Heartbeat(Beat()).ok());
  EXPECT_EQ(Figure(kStreams), 1);  // one stream for both beats
  client_.reset();                 // the daemon goes: its stream ends
  EXPECT_TRUE(AwaitFigure(kStreams, 0));
}

}  // namespace
}  // namespace ragshard

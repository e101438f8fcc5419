// The daemon's job setup in one process: a planner service and two NodeDaemons in this test's
// process (no ragshardd or planner binary), ranks attached through the client library. Two jobs
// set up in opposite orders on two nodes: each node's first attach of a job sets it up (plan,
// peers' keys), and a setup must not wait for another job's, or each node waits for a job the
// other node has not set up yet and both stall until their 60 s deadline. A setup waits for the
// plan and then for its peers' data addresses: when one daemon set up one job at a time, node 0
// held A's setup waiting for node 1's address of A while node 1 held B's waiting for node 0's of
// B.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "server/daemon/daemon.h"
#include "tests/server/planner/planner_fixture.h"

namespace ragshard::testing {
namespace {

class JobSetupTest : public PlannerFixture {
 protected:
  void SetUp() override {
    PlannerFixture::SetUp();
    PlannerClientOptions o;
    o.address = server_->bound_address();
    planner_ = std::shared_ptr<PlannerClient>(std::move(*GrpcPlannerClient::Create(o)));
    for (int n = 0; n < 2; ++n) {
      daemon::DaemonOptions d;
      d.node_id = NodeId(n);
      d.socket_path = Socket(n);
      d.pool_bytes = 64 << 20;
      d.heartbeat_interval = std::chrono::milliseconds(200);
      auto started = daemon::NodeDaemon::Start(d, planner_);
      ASSERT_TRUE(started.ok()) << started.status();
      daemons_[n] = std::move(*started);
    }
  }
  void TearDown() override {
    for (auto& d : daemons_) {
      if (d) d->Shutdown();
    }
  }

  static std::string NodeId(int n) { return "node-" + std::to_string(n); }
  std::string Socket(int n) const { return dir_.path() + "/d" + std::to_string(n) + ".sock"; }

  std::shared_ptr<PlannerClient> planner_;
  std::unique_ptr<daemon::NodeDaemon> daemons_[2];
};

TEST_F(JobSetupTest, TwoJobsSetUpInOppositeOrdersOnTwoNodesAreBothReadyInSeconds) {
  for (const std::string job : {"a", "b"}) Create(job, 4);
  Inventory inv;
  auto* unit = inv.add_units();
  unit->set_name("layer");
  auto* t = unit->add_tensors();
  t->set_name("layer.w");
  t->add_shape(4096);
  t->set_dtype(v1::DTYPE_FP32);
  // (job, rank, node): the first wave sets up A on node 0 and B on node 1, the second B on node
  // 0 and A on node 1.
  struct Member {
    std::string job;
    int64_t rank;
    int node;
  };
  const std::vector<std::vector<Member>> waves = {
      {{"a", 0, 0}, {"a", 1, 0}, {"b", 0, 1}, {"b", 1, 1}},
      {{"a", 2, 1}, {"a", 3, 1}, {"b", 2, 0}, {"b", 3, 0}}};
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::unique_ptr<Client>> clients(8);
  // Joined on every way out, an assertion's too (an attach ends by its 60 s timeout at worst).
  struct Threads {
    std::vector<std::thread> list;
    ~Threads() {
      for (std::thread& t : list) {
        if (t.joinable()) t.join();
      }
    }
  } threads;
  const auto start = std::chrono::steady_clock::now();
  auto attach = [&](const Member& m, std::unique_ptr<Client>* slot) {
    ClientOptions o;
    o.daemon_socket = Socket(m.node);
    o.planner = planner_;
    o.job_id = m.job;
    o.rank = m.rank;
    o.node_id = NodeId(m.node);
    o.timeout = std::chrono::seconds(60);
    auto c = Client::Create(o);
    absl::Status st = c.ok() ? (*c)->Register(inv, m.rank == 0, /*local_ranks=*/2) : c.status();
    if (st.ok()) st = (*c)->Attach();
    std::lock_guard<std::mutex> lock(mu);
    if (!st.ok()) {
      errors.push_back(m.job + " rank " + std::to_string(m.rank) + ": " + st.ToString());
    } else {
      *slot = std::move(*c);
    }
  };
  int slot = 0;
  for (const Member& m : waves[0]) threads.list.emplace_back(attach, m, &clients[slot++]);
  // The second wave once the first has registered (each attaches right after registering): the
  // planner's figure, read until it holds.
  const auto registered = [&](const std::string& job) {
    auto j = client_->GetJob(job);
    return j.ok() ? j->registered_ranks() : -1;
  };
  for (const std::string job : {"a", "b"}) {
    while (registered(job) < 2) {
      ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60))
          << "the first wave did not register";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // a poll, not a bound
    }
  }
  for (const Member& m : waves[1]) threads.list.emplace_back(attach, m, &clients[slot++]);
  for (std::thread& th : threads.list) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_THAT(errors, ::testing::IsEmpty());
  std::printf("both jobs attached in %.2f s\n", seconds);
  // The attach deadline is 60 s; setups that wait for each other's job end only there (the
  // bound is far from both a loaded machine's seconds and that deadline).
  EXPECT_LT(seconds, 30.0) << "the two jobs' setups waited for each other";
  for (const std::string job : {"a", "b"}) {
    auto j = client_->GetJob(job);
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->status(), v1::JOB_READY) << job;
  }
}

}  // namespace
}  // namespace ragshard::testing

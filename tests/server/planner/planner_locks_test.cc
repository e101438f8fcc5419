// The planner's state has owners with their own locks (server/planner/service.h): a job's store
// write holds that job only, and calls on other jobs, on nodes and on other jobs' keys go on
// meanwhile; many jobs driven from many threads at once all end as they would one by one; a
// parked Get answered before its handler has returned hears the answer.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "tests/server/planner/planner_fixture.h"

namespace ragshard::testing {
namespace {

class PlannerLocksTest : public PlannerFixture {
 public:
  PlannerLocksTest() {
    // Job "stalled"'s first store write waits until the test releases it.
    before_job_write_ = [this](const std::string& job_id) {
      if (job_id != "stalled" || stalled_once_.exchange(true)) return;
      writing_.Notify();
      release_.WaitForNotification();
    };
    // Job "held"'s first parked Get stays in its handler (parked, its reactor not yet returned to
    // gRPC) until the test has answered it.
    after_park_ = [this](const std::string& job_id) {
      if (job_id != "held" || parked_once_.exchange(true)) return;
      parked_.Notify();
      answered_.WaitForNotification();
    };
  }

 protected:
  // Gets "held"'s key `key` (30 s wait) on a thread, and once it has parked, runs `answer` before
  // the Get's handler returns; the Get's answer.
  absl::StatusOr<std::string> GetAnsweredWhileParking(const std::string& key,
                                                      const std::function<void()>& answer) {
    absl::StatusOr<std::string> got;
    std::thread get([&] { got = client_->Get("held", key, std::chrono::seconds(30)); });
    absl::Cleanup join = [&] {
      if (!answered_.HasBeenNotified()) answered_.Notify();
      get.join();
    };
    parked_.WaitForNotification();
    answer();
    std::move(join).Invoke();
    return got;
  }

  std::atomic<bool> stalled_once_{false};
  absl::Notification writing_, release_;
  std::atomic<bool> parked_once_{false};
  absl::Notification parked_, answered_;
};

TEST_F(PlannerLocksTest, AJobStalledInItsStoreWriteHoldsUpNoOtherJobNodeOrKey) {
  Create("other", 1);
  ASSERT_TRUE(client_->Put("other", "addr", "a").ok());
  absl::StatusOr<v1::Job> stalled;
  std::thread create([&] {
    v1::CreateJobRequest req;
    req.set_job_id("stalled");
    req.mutable_mesh()->set_shard_size(1);
    req.mutable_mesh()->set_replicate_size(1);
    stalled = client_->CreateJob(req);
  });
  absl::Cleanup release = [&] {
    release_.Notify();
    create.join();
  };
  writing_.WaitForNotification();
  // Job "stalled" is inside its store write now, holding its own lock. Under one lock of the
  // whole service each call below would wait for it (the client's deadline, 30 s, would fail it).
  auto job = client_->GetJob("other");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_REGISTERING);
  Create("another", 1);  // another job's store write
  ASSERT_TRUE(client_->Put("other", "port", "p").ok());
  auto keys = client_->GetKeys("other", {"addr", "port"}, std::chrono::milliseconds(0));
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, (std::vector<std::string>{"a", "p"}));
  v1::RegisterNodeRequest node;
  node.set_node_id("n0");
  node.set_data_address("127.0.0.1:1");
  ASSERT_TRUE(client_->RegisterNode(node).ok());
  v1::HeartbeatRequest beat;
  beat.set_node_id("n0");
  beat.add_jobs("other");
  ASSERT_TRUE(client_->Heartbeat(beat).ok());
  auto registered = RegisterFull("other", 0, SmallInventory());
  ASSERT_TRUE(registered.ok()) << registered.status();
  auto plan = client_->WaitForPlan("other", std::chrono::seconds(30));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::move(release).Invoke();
  ASSERT_TRUE(stalled.ok()) << stalled.status();
  EXPECT_EQ(stalled->status(), v1::JOB_REGISTERING);
  auto listed = client_->ListJobs();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 3u);
}

TEST_F(PlannerLocksTest, ManyJobsFromManyThreadsEndAsTheyWouldOneByOne) {
  constexpr int kJobs = 12;
  const Inventory inv = SmallInventory();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kJobs);
  for (int j = 0; j < kJobs; ++j) {
    threads.emplace_back([&, j] {
      const std::string id = absl::StrCat("job-", j);
      auto fail = [&](const std::string& what, const absl::Status& s) {
        errors[j] = absl::StrCat(id, ": ", what, ": ", s.ToString());
      };
      v1::CreateJobRequest req;
      req.set_job_id(id);
      req.mutable_mesh()->set_shard_size(2);
      req.mutable_mesh()->set_replicate_size(1);
      if (auto c = client_->CreateJob(req); !c.ok()) return fail("create", c.status());
      // Rank 1 waits for rank 0's key while rank 0 registers, puts it and registers rank 1.
      absl::StatusOr<std::string> peer;
      std::thread waiter([&] { peer = client_->Get(id, "rank0", std::chrono::seconds(30)); });
      auto r0 = RegisterFull(id, 0, inv, absl::StrCat("node-", j));
      auto put = client_->Put(id, "rank0", absl::StrCat("addr-of-", id));
      auto r1 = RegisterFull(id, 1, inv, absl::StrCat("node-", j));
      waiter.join();
      if (!r0.ok()) return fail("register 0", r0.status());
      if (!put.ok()) return fail("put", put);
      if (!r1.ok()) return fail("register 1", r1.status());
      if (!peer.ok()) return fail("get", peer.status());
      if (*peer != absl::StrCat("addr-of-", id)) {
        return fail("get", absl::InternalError("another job's value: " + *peer));
      }
      auto plan = client_->WaitForPlan(id, std::chrono::seconds(60));
      if (!plan.ok()) return fail("plan", plan.status());
      if (j % 2 == 1) {
        // A deleted job answers a waiting Get at once and forgets its keys.
        absl::StatusOr<std::string> aborted;
        std::thread parked([&] { aborted = client_->Get(id, "never", std::chrono::seconds(30)); });
        // The Get is parked or not yet sent: either way it must end now, never at its deadline.
        auto deleted = client_->DeleteJob(id);
        parked.join();
        if (!deleted.ok()) return fail("delete", deleted);
        if (aborted.ok() || (aborted.status().code() != absl::StatusCode::kAborted &&
                             aborted.status().code() != absl::StatusCode::kNotFound)) {
          return fail("get of a deleted job", aborted.status());
        }
        auto gone = client_->Get(id, "rank0", std::chrono::milliseconds(0));
        if (gone.status().code() != absl::StatusCode::kNotFound) {
          return fail("key of a deleted job", gone.status());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  auto jobs = client_->ListJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), static_cast<size_t>(kJobs / 2));
  for (const v1::Job& job : *jobs) EXPECT_EQ(job.status(), v1::JOB_READY) << job.job_id();
}

// A Put that answers a Get between its parking and its handler's return: the Get hears it. (Its
// answer was once dropped, a second DefaultReactor() constructing the reactor anew, and the call
// never ended: a daemon's GetKeys of its peers' data addresses outlived its ranks' attaches.)
TEST_F(PlannerLocksTest, AGetAnsweredByAPutBeforeItsHandlerReturnsHearsTheValue) {
  Create("held", 1);
  auto got = GetAnsweredWhileParking("addr", [&] {
    auto put = client_->Put("held", "addr", "a");
    EXPECT_TRUE(put.ok()) << put;
  });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "a");
}

// The same for the job's deletion (an ABORTED answer, not the client's deadline), and the planner
// answers the calls after it.
TEST_F(PlannerLocksTest, AGetAnsweredByTheJobsDeletionBeforeItsHandlerReturnsHearsIt) {
  Create("held", 1);
  auto got = GetAnsweredWhileParking("never", [&] {
    auto deleted = client_->DeleteJob("held");
    EXPECT_TRUE(deleted.ok()) << deleted;
  });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_EQ(client_->Get("held", "never", std::chrono::milliseconds(0)).status().code(),
            absl::StatusCode::kNotFound);
  Create("held", 1);
  ASSERT_TRUE(client_->Put("held", "addr", "b").ok());
  auto again = client_->Get("held", "addr", std::chrono::seconds(30));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, "b");
}

}  // namespace
}  // namespace ragshard::testing

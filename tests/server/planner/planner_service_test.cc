// The planner service through its real gRPC server on 127.0.0.1:0 and the gRPC client.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "engine/models.h"
#include "engine/strategy_search.h"
#include "engine/validator.h"
#include "infra/proto_text.h"
#include "protocol/planner_client.h"
#include "server/planner/server.h"
#include "server/planner/store.h"
#include "tests/server/planner/planner_fixture.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

using PlannerServiceTest = testing::PlannerFixture;

TEST_F(PlannerServiceTest, JobsCanBeCreatedListedAndDeleted) {
  v1::Job job = Create("job-a", 4);
  EXPECT_EQ(job.status(), v1::JOB_REGISTERING);
  EXPECT_EQ(job.world_size(), 4);
  EXPECT_EQ(job.options().policy(), "ragged");
  EXPECT_EQ(client_
                ->CreateJob([] {
                  v1::CreateJobRequest r;
                  r.set_job_id("job-a");
                  r.mutable_mesh()->set_shard_size(2);
                  r.mutable_mesh()->set_replicate_size(1);
                  return r;
                }())
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
  Create("job-b", 2);
  auto jobs = client_->ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_EQ(jobs->size(), 2u);
  EXPECT_TRUE(client_->DeleteJob("job-a").ok());
  EXPECT_EQ(client_->GetJob("job-a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteJob("job-a").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ListJobs()->size(), 1u);
}

TEST_F(PlannerServiceTest, JobResponsesAreSummariesAtAnyWorldAndRanksComePaged) {
  // Ten jobs of the largest world: every response stays small, whatever the world size.
  constexpr int64_t kWorld = 131072;
  for (int i = 0; i < 10; ++i) {
    v1::Job job = Create("big-" + std::to_string(i), kWorld);
    EXPECT_LT(job.ByteSizeLong(), 64u * 1024) << job.DebugString();
    EXPECT_EQ(job.world_size(), kWorld);
    EXPECT_EQ(job.registered_ranks(), 0);
  }
  const Inventory inv = SmallInventory();
  ASSERT_TRUE(RegisterFull("big-3", 7, inv, "n7").ok());
  ASSERT_TRUE(RegisterHash("big-3", 9000, InventorySha256(inv), "n9").ok());
  auto job = client_->GetJob("big-3");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_LT(job->ByteSizeLong(), 64u * 1024);
  EXPECT_EQ(job->registered_ranks(), 2);

  v1::ListJobsRequest page;
  page.set_page_size(4);
  std::vector<std::string> ids;
  size_t bytes = 0;
  int pages = 0;
  do {
    auto got = client_->ListJobsPage(page);
    ASSERT_TRUE(got.ok()) << got.status();
    bytes += got->ByteSizeLong();
    for (const auto& j : got->jobs()) ids.push_back(j.job_id());
    page.set_page_token(got->next_page_token());
    ++pages;
  } while (!page.page_token().empty());
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(ids.size(), 10u);
  EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
  EXPECT_LT(bytes, 1u << 20);
  auto all = client_->ListJobs();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 10u);

  // Ranks come a page at a time, registered or not, and the walk covers the world.
  v1::ListRanksRequest rr;
  rr.set_job_id("big-3");
  rr.set_start_rank(8999);
  rr.set_page_size(3);
  auto ranks = client_->ListRanksPage(rr);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  ASSERT_EQ(ranks->ranks_size(), 3);
  EXPECT_EQ(ranks->next_start_rank(), 9002);
  EXPECT_FALSE(ranks->ranks(0).registered());
  EXPECT_TRUE(ranks->ranks(1).registered());
  EXPECT_EQ(ranks->ranks(1).rank(), 9000);
  EXPECT_EQ(ranks->ranks(1).node_id(), "n9");
  rr.set_page_size(0);  // the default page
  EXPECT_EQ(client_->ListRanksPage(rr)->ranks_size(), planner::kDefaultRanksPage);
  auto walk = client_->ListRanks("big-3");
  ASSERT_TRUE(walk.ok()) << walk.status();
  ASSERT_EQ(walk->size(), static_cast<size_t>(kWorld));
  int64_t registered = 0;
  for (size_t r = 0; r < walk->size(); ++r) {
    EXPECT_EQ((*walk)[r].rank(), static_cast<int64_t>(r));
    registered += (*walk)[r].registered();
  }
  EXPECT_EQ(registered, 2);
  EXPECT_EQ((*walk)[7].node_id(), "n7");

  // Bad pages name the field.
  rr.set_page_size(planner::kMaxRanksPage + 1);
  EXPECT_THAT(client_->ListRanksPage(rr).status().message(), HasSubstr("page_size"));
  rr.set_page_size(1);
  rr.set_start_rank(kWorld + 1);
  EXPECT_THAT(client_->ListRanksPage(rr).status().message(), HasSubstr("start_rank"));
  page.set_page_size(-1);
  EXPECT_THAT(client_->ListJobsPage(page).status().message(), HasSubstr("page_size"));
}

TEST_F(PlannerServiceTest, RegistrationsAndPlansSurviveARestartFromTheStore) {
  Create("j", 4);
  const Inventory inv = SmallInventory();
  ASSERT_TRUE(RegisterFull("j", 0, inv, "n0").ok());
  ASSERT_TRUE(RegisterHash("j", 2, InventorySha256(inv), "n1").ok());
  server_.reset();
  Start();
  auto job = client_->GetJob("j");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->registered_ranks(), 2);
  auto ranks = client_->ListRanks("j");
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  EXPECT_EQ((*ranks)[2].node_id(), "n1");
  EXPECT_FALSE((*ranks)[1].registered());
  ASSERT_TRUE(RegisterHash("j", 1, InventorySha256(inv), "n0").ok());
  ASSERT_TRUE(RegisterHash("j", 3, InventorySha256(inv), "n1").ok());
  auto plan = client_->WaitForPlan("j", 30s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  server_.reset();
  Start();
  job = client_->GetJob("j");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->plan_version(), plan->version());
}

TEST_F(PlannerServiceTest, AStoredPlanNewerThanItsJobIsPlannedAgainAndLegacyRanksLoad) {
  // What an older planner killed between its two writes left: every rank registered (in the
  // schema-1 job row), the plan stored, the job still registering. It is planned at the start.
  server_.reset();
  const Inventory inv = SmallInventory();
  v1::Plan stale;
  {
    auto store = planner::Store::Open(dir_.path());
    ASSERT_TRUE(store.ok()) << store.status();
    v1::Job job;
    job.set_job_id("old");
    job.mutable_mesh()->set_shard_size(2);
    job.mutable_mesh()->set_replicate_size(1);
    job.set_world_size(2);
    job.mutable_options()->set_policy("ragged");
    job.mutable_options()->set_align_bytes(16);
    job.mutable_options()->set_registration_timeout_ms(60000);
    job.set_status(v1::JOB_REGISTERING);
    job.set_inventory_sha256(InventorySha256(inv));
    job.set_created_unix_ms(1);
    job.set_registration_deadline_unix_ms(4102444800000);  // 2100
    for (int r = 0; r < 2; ++r) {
      v1::RankState* s = job.add_legacy_ranks();
      s->set_rank(r);
      s->set_registered(true);
      s->set_node_id("n" + std::to_string(r));
      s->set_inventory_sha256(InventorySha256(inv));
    }
    ASSERT_TRUE((*store)->PutJob(job).ok());
    ASSERT_TRUE((*store)->PutInventory("old", DeterministicBytes(inv)).ok());
    stale.set_version(1);
    stale.set_job_id("old");
    ASSERT_TRUE((*store)->PutPlan("old", 1, DeterministicBytes(stale)).ok());
  }
  Start();
  auto plan = client_->WaitForPlan("old", 30s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->version(), 1u);
  EXPECT_EQ(plan->world_size(), 2);
  EXPECT_TRUE(ValidatePlan(*plan, &inv).ok()) << ValidatePlan(*plan, &inv);
  auto job = client_->GetJob("old");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->registered_ranks(), 2);
  EXPECT_EQ(job->legacy_ranks_size(), 0);
  EXPECT_EQ((*client_->ListRanks("old"))[1].node_id(), "n1");
}

TEST_F(PlannerServiceTest, OneFullInventoryAndHashesMakeTheJobReady) {
  Create("j", 4);
  Inventory inv = SmallInventory();
  const std::string sha = InventorySha256(inv);
  ASSERT_TRUE(RegisterFull("j", 0, inv).ok());
  for (int r = 1; r < 4; ++r) ASSERT_TRUE(RegisterHash("j", r, sha, r < 2 ? "n0" : "n1").ok());
  auto plan = client_->WaitForPlan("j", 10s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->world_size(), 4);
  EXPECT_EQ(plan->job_id(), "j");
  EXPECT_TRUE(ValidatePlan(*plan, &inv).ok()) << ValidatePlan(*plan, &inv);
  auto job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_READY);
  EXPECT_EQ(job->plan_version(), 1u);
  // Registration is closed, but an identical re-registration (a restarted rank) is accepted.
  EXPECT_TRUE(RegisterHash("j", 2, sha, "n1").ok());
  EXPECT_EQ(RegisterHash("j", 2, std::string(32, 'x'), "n1").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(PlannerServiceTest, HashBeforeAnyFullInventoryWaitsForIt) {
  RestartWithMetrics();
  Create("j", 2);
  Inventory inv = SmallInventory();
  auto waiting =
      std::async(std::launch::async, [&] { return RegisterHash("j", 1, InventorySha256(inv)); });
  // The planner reports the hash-only registration parked before the full inventory comes.
  ASSERT_TRUE(AwaitFigure(kParkedRegistrations, 1));
  EXPECT_EQ(waiting.wait_for(0ms), std::future_status::timeout);
  ASSERT_TRUE(RegisterFull("j", 0, inv).ok());
  auto r = waiting.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Figure(kParkedRegistrations), 0);
  EXPECT_TRUE(client_->WaitForPlan("j", 10s).ok());
}

TEST_F(PlannerServiceTest, AMismatchNamesTheFirstDifferingTensorAndCanBeCorrected) {
  Create("j", 2);
  Inventory inv = SmallInventory();
  ASSERT_TRUE(RegisterFull("j", 0, inv).ok());
  Inventory other = inv;
  other.mutable_units(1)->mutable_tensors(0)->set_shape(0, 128);
  auto r = RegisterFull("j", 1, other);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("layers.1.w"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("shape [128, 64]"));
  EXPECT_THAT(client_->GetJob("j")->error(), HasSubstr("layers.1.w"));
  auto h = RegisterHash("j", 1, InventorySha256(other));
  ASSERT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr(HexString(InventorySha256(other))));
  // The rank registers again with the right inventory.
  ASSERT_TRUE(RegisterFull("j", 1, inv).ok());
  EXPECT_TRUE(client_->WaitForPlan("j", 10s).ok());
}

TEST_F(PlannerServiceTest, NoFullInventoryBeforeTheDeadlineFailsTheJob) {
  Create("j", 2, /*timeout_ms=*/300);
  auto r = RegisterHash("j", 1, std::string(32, 'a'));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no rank sent a full inventory"));
  auto job = client_->GetJob("j");
  EXPECT_EQ(job->status(), v1::JOB_FAILED);
  EXPECT_THAT(job->error(), HasSubstr("registration deadline"));
  auto plan = client_->WaitForPlan("j", 5s);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PlannerServiceTest, WatchStreamsStatusChangesAndThePlan) {
  Create("j", 2);
  absl::Mutex mu;
  std::vector<v1::WatchPlanEvent> events;
  auto watch = client_->WatchPlan("j", [&](const absl::Status& s, const v1::WatchPlanEvent* ev) {
    absl::MutexLock lock(&mu);
    if (ev) events.push_back(*ev);
  });
  {
    // The watch is asynchronous: its first event is the state when the server took it.
    absl::MutexLock lock(&mu);
    auto first = [&] { return !events.empty(); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&first), absl::Seconds(10)));
  }
  Inventory inv = SmallInventory();
  ASSERT_TRUE(RegisterFull("j", 0, inv).ok());
  ASSERT_TRUE(RegisterFull("j", 1, inv).ok());
  {
    absl::MutexLock lock(&mu);
    auto has_plan = [&] { return !events.empty() && events.back().has_plan(); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&has_plan), absl::Seconds(10)));
    EXPECT_EQ(events.front().status(), v1::JOB_REGISTERING);
    EXPECT_EQ(events.back().status(), v1::JOB_READY);
    EXPECT_EQ(events.back().plan_version(), 1u);
  }
  ASSERT_TRUE(client_->DeleteJob("j").ok());
  absl::MutexLock lock(&mu);
  auto deleted = [&] { return events.back().status() == v1::JOB_DELETED; };
  EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&deleted), absl::Seconds(10)));
}

TEST_F(PlannerServiceTest, BadRequestsAreInvalidArgumentNamingTheField) {
  auto expect = [](const absl::Status& s, const std::string& field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(field));
  };
  v1::CreateJobRequest c;
  c.set_job_id("bad id");
  c.mutable_mesh()->set_shard_size(2);
  c.mutable_mesh()->set_replicate_size(1);
  expect(client_->CreateJob(c).status(), "job_id");
  c.set_job_id(std::string(500, 'a'));
  expect(client_->CreateJob(c).status(), "job_id");
  c.set_job_id("ok");
  c.mutable_mesh()->set_shard_size(0);
  expect(client_->CreateJob(c).status(), "mesh.shard_size");
  c.mutable_mesh()->set_shard_size(1 << 20);
  c.mutable_mesh()->set_replicate_size(2);
  expect(client_->CreateJob(c).status(), "mesh");
  // A world past --max-world (131,072 by default) is refused before anything is stored.
  c.mutable_mesh()->set_shard_size(65536);
  c.mutable_mesh()->set_replicate_size(3);
  expect(client_->CreateJob(c).status(), "shard_size * replicate_size = 196608 exceeds 131072");
  c.mutable_mesh()->set_replicate_size(1);
  c.mutable_options()->set_policy("fsdp2");
  expect(client_->CreateJob(c).status(), "options.policy");
  c.mutable_options()->set_policy("ragged");
  c.mutable_options()->set_default_granule("rows:0");
  expect(client_->CreateJob(c).status(), "options.default_granule");

  Create("j", 2);
  expect(RegisterHash("j", 0, "short").status(), "inventory_sha256");
  expect(RegisterHash("j", 5, std::string(32, 'a')).status(), "rank");
  Inventory bad = SmallInventory();
  bad.mutable_units(0)->mutable_tensors(0)->set_shape(0, -1);
  expect(RegisterFull("j", 0, bad).status(), "inventory");
  bad = SmallInventory();
  bad.mutable_units(0)->mutable_tensors(1)->set_name("layers.0.w");
  expect(RegisterFull("j", 0, bad).status(), "duplicate tensor name");
  v1::RegisterRankRequest none;
  none.set_job_id("j");
  none.set_node_id("n");
  expect(client_->RegisterRank(none).status(), "inventory_or_hash");
  expect(client_->Put("j", "", "v"), "key");
  expect(client_->Put("j", "k", std::string((1 << 20) + 1, 'v')), "value");
  expect(client_->Get("j", "k", std::chrono::milliseconds(-1)).status(), "wait_ms");
  v1::RegisterNodeRequest n;
  n.set_node_id("n\n1");
  expect(client_->RegisterNode(n).status(), "node_id");
  EXPECT_EQ(client_->GetPlan("j").status().code(), absl::StatusCode::kFailedPrecondition);
}

// Issue 26: a thread per planned job, joined only at shutdown, kept a stack mapping per job
// until the planner ran out of maps. Plans now run on the bounded executor: planning many jobs
// leaves the process's mappings and threads where they were.
int CountLines(const char* path) {
  std::ifstream f(path);
  int n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}
int CountThreads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST_F(PlannerServiceTest, PlanningManyJobsKeepsThreadsAndMappingsBounded) {
  const Inventory inv = SmallInventory();
  auto plan_one = [&](const std::string& id) {
    Create(id, 1);
    ASSERT_TRUE(RegisterFull(id, 0, inv).ok());
    ASSERT_TRUE(client_->WaitForPlan(id, 30s).ok());
    ASSERT_TRUE(client_->DeleteJob(id).ok());
  };
  for (int i = 0; i < 20; ++i) plan_one("warm-" + std::to_string(i));  // gRPC's own threads
  const int maps = CountLines("/proc/self/maps"), threads = CountThreads();
  for (int i = 0; i < 300; ++i) plan_one("job-" + std::to_string(i));
  // A leaked thread costs at least one mapping (its stack); 300 jobs leaked 300 or more.
  EXPECT_LT(CountLines("/proc/self/maps") - maps, 60);
  EXPECT_LE(CountThreads() - threads, 4);
}

TEST_F(PlannerServiceTest, HealthIsServing) { EXPECT_TRUE(client_->Health().ok()); }

TEST_F(PlannerServiceTest, DeepSeekV3InventoryFitsTheMessageLimits) {
  auto inv = GenerateModel("deepseek-v3");
  ASSERT_TRUE(inv.ok());
  ApplyGranule(&*inv, *ParseGranule("rows:128"));
  Create("ds", 64);
  ASSERT_TRUE(RegisterFull("ds", 0, *inv).ok());
  const std::string sha = InventorySha256(*inv);
  for (int r = 1; r < 64; ++r)
    ASSERT_TRUE(RegisterHash("ds", r, sha, "n" + std::to_string(r / 8)).ok());
  auto plan = client_->WaitForPlan("ds", 60s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->metrics().blocks128_split(), 0);
  EXPECT_TRUE(ValidatePlan(*plan, &*inv).ok());
}

TEST_F(PlannerServiceTest, PolicyAutoFollowsTheRecommendationAndRecordsIt) {
  v1::CreateJobRequest req;
  req.set_job_id("auto");
  req.mutable_mesh()->set_shard_size(4);
  req.mutable_mesh()->set_replicate_size(1);
  req.mutable_options()->set_policy("auto");
  // Without a cluster profile the planner cannot search.
  auto refused = client_->CreateJob(req);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--cluster-profile"));
  server_.reset();
  auto profile = LoadClusterProfile(RAGSHARD_SOURCE_DIR "/profiles/host-2x2-loopback.json");
  ASSERT_TRUE(profile.ok()) << profile.status();
  profile_ = std::make_shared<const ClusterProfile>(*profile);
  Start();
  // Bad strategy options are refused at creation, naming the field.
  v1::CreateJobRequest bad = req;
  bad.mutable_options()->set_strategy("k=1,shard=two");
  auto b = client_->CreateJob(bad);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("options.strategy"));
  bad = req;
  bad.mutable_options()->set_policy("ragged");
  bad.mutable_options()->set_optimizer("muon");
  EXPECT_EQ(client_->CreateJob(bad).status().code(), absl::StatusCode::kInvalidArgument);

  Inventory inv;
  for (int l = 0; l < 4; ++l) {
    UnitSpec* u = inv.add_units();
    u->set_name(absl::StrCat("layers.", l));
    for (int t = 0; t < 3; ++t) {
      TensorSpec* spec = u->add_tensors();
      spec->set_name(absl::StrCat("layers.", l, ".w", t));
      spec->add_shape(96 + 32 * t);
      spec->add_shape(64);
      spec->set_dtype(v1::DTYPE_BF16);
      spec->set_granule_kind(v1::GRANULE_ROWS);
      spec->set_granule_rows(32);
    }
  }
  ASSERT_TRUE(client_->CreateJob(req).ok());
  const std::vector<std::string> nodes = {"n0", "n0", "n1", "n1"};
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(RegisterFull("auto", r, inv, nodes[r]).ok());
  auto plan = client_->WaitForPlan("auto", 10s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The same search run here gives the same plan, byte for byte, and the mesh follows it.
  PlanOptions po;
  po.job_id = "auto";
  po.version = 1;
  po.align_bytes = 16;
  auto expected = PlanAuto(inv, "", *profile, 2, 2, CostOptions{}, "", po);
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(plan->SerializeAsString(), expected->plan.SerializeAsString());
  EXPECT_EQ(plan->strategy().executed(), plan->strategy().recommended());
  EXPECT_THAT(plan->strategy().reason(), HasSubstr("best of"));
  EXPECT_EQ(plan->world_size(), expected->shard);
  auto job = client_->GetJob("auto");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->mesh().shard_size(), expected->shard);
  EXPECT_EQ(job->mesh().replicate_size(), expected->replicate);
  EXPECT_EQ(job->mesh().shard_size() * job->mesh().replicate_size(), 4);

  // A pinned strategy groups units; their plan units list the members.
  v1::CreateJobRequest pinned = req;
  pinned.set_job_id("pinned");
  pinned.mutable_options()->set_strategy("k=2,shard=2x1");
  ASSERT_TRUE(client_->CreateJob(pinned).ok());
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(RegisterFull("pinned", r, inv, nodes[r]).ok());
  auto p2 = client_->WaitForPlan("pinned", 10s);
  ASSERT_TRUE(p2.ok()) << p2.status();
  ASSERT_EQ(p2->units_size(), 2);
  EXPECT_EQ(p2->units(0).unit(), "layers.0-1");
  EXPECT_THAT(p2->units(1).members(), ::testing::ElementsAre("layers.2", "layers.3"));
  EXPECT_EQ(p2->strategy().executed(), "k=2,shard=2x1");
  EXPECT_EQ(client_->GetJob("pinned")->mesh().replicate_size(), 2);

  // Ranks not numbered node by node cannot form whole-node shard groups: the job fails, saying so.
  v1::CreateJobRequest mixed = req;
  mixed.set_job_id("mixed");
  ASSERT_TRUE(client_->CreateJob(mixed).ok());
  const std::vector<std::string> interleaved = {"n0", "n1", "n0", "n1"};
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(RegisterFull("mixed", r, inv, interleaved[r]).ok());
  auto p3 = client_->WaitForPlan("mixed", 10s);
  ASSERT_FALSE(p3.ok());
  EXPECT_THAT(client_->GetJob("mixed")->error(), HasSubstr("numbered node by node"));
}

}  // namespace
}  // namespace ragshard

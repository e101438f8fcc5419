// Runs the real ragshardctl binary and checks its output and exit codes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "ctl/ctl_recovery.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

using ::testing::HasSubstr;

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

class CtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ragshardctl_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string Write(const std::string& name, const std::string& body) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << body;
    return path;
  }

  Result Run(const std::string& args) {
    const std::string out = dir_ + "/stdout", err = dir_ + "/stderr";
    const std::string cmd = std::string(RAGSHARDCTL_PATH) + " " + args + " >" + out + " 2>" + err;
    int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::stringstream a, b;
    a << std::ifstream(out).rdbuf();
    b << std::ifstream(err).rdbuf();
    r.out = a.str();
    r.err = b.str();
    return r;
  }

  // Bad input: exit code 2 and exactly one line on stderr that names the field.
  void ExpectBadInput(const std::string& args, const std::string& field) {
    Result r = Run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(field)) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_THAT(r.err, HasSubstr("error: "));
  }

  std::string Inventory(const std::string& tensors) {
    return Write("inv.json", "{\"units\": [{\"name\": \"u\", \"tensors\": [" + tensors + "]}]}");
  }

  std::string dir_;
};

TEST_F(CtlTest, PlanJsonHasThePlanMetricsAndTiming) {
  Result r = Run("plan --model llama3-8b --world 8 --granule rows:128 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["units"].size(), 34u);
  for (const auto& u : j["units"]) {
    ASSERT_TRUE(u.contains("name") && u.contains("dtype") && u.contains("shard_elems"));
    for (const auto& t : u["tensors"]) {
      int64_t sum = 0;
      for (const auto& c : t["rank_elems"]) sum += c.get<int64_t>();
      EXPECT_EQ(sum, t["numel"].get<int64_t>());
      EXPECT_TRUE(t.contains("offset") && t.contains("granule_elems") && t.contains("first_rank"));
    }
  }
  for (const char* key :
       {"padding_elems", "padding_pct", "imbalance", "blocks128_split", "blocks32_split",
        "matrices_split", "copy_bytes_per_step", "lower_bound_gap_pct"}) {
    EXPECT_TRUE(j["metrics"].contains(key)) << key;
  }
  EXPECT_EQ(j["metrics"]["blocks128_split"], 0);
  EXPECT_TRUE(j["timing"].contains("plan_seconds"));
  EXPECT_FALSE(j["units"][0].contains("plan_seconds"));
}

TEST_F(CtlTest, BaselineJsonHasSegmentLists) {
  std::string inv = Inventory("{\"name\": \"w\", \"shape\": [10, 4], \"dtype\": \"bf16\"}");
  Result r = Run("plan --inventory " + inv + " --world 4 --policy fsdp2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["metrics"]["padding_elems"], 8);
  const auto& segs = j["groups"][0]["segments"];
  ASSERT_EQ(segs.size(), 4u);
  EXPECT_EQ(segs[3]["segments"][0], nlohmann::json::array({"w", 36, 4}));
}

TEST_F(CtlTest, HumanPlanPrintsUnitsAndTotals) {
  Result r = Run("plan --model mixtral-8x7b --world 64 --granule rows:128 --policy ragged-paper");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("layers.31"));
  EXPECT_THAT(r.out, HasSubstr("total:"));
  EXPECT_THAT(r.out, HasSubstr("plan time"));
}

TEST_F(CtlTest, CompareDeepSeekV3PrintsEveryPolicy) {
  Result r = Run("compare --model deepseek-v3 --world 1024 --granule rows:128");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* p :
       {"ragged ", "ragged-paper", "fsdp2", "fsdp1", "zero3", "megatron-do", "megatron-fsdp"}) {
    EXPECT_THAT(r.out, HasSubstr(p));
  }
  Result j = Run("compare --model llama-7b --world 64 --json");
  ASSERT_EQ(j.code, 0);
  EXPECT_EQ(nlohmann::json::parse(j.out)["policies"].size(), 7u);
}

TEST_F(CtlTest, BadFlagsAreRejected) {
  ExpectBadInput("plan --model gpt5 --world 8", "unknown model 'gpt5'");
  ExpectBadInput("plan --model llama3-8b --world 8 --policy fsdp3", "--policy");
  ExpectBadInput("plan --model llama3-8b --world 0", "--world");
  ExpectBadInput("plan --model llama3-8b --world=-4", "--world");
  ExpectBadInput("plan --model llama3-8b --world 1048577", "--world");
  ExpectBadInput("plan --model llama3-8b --world abc", "--world");
  ExpectBadInput("plan --model llama3-8b", "--world");
  ExpectBadInput("plan --world 8", "--model");
  ExpectBadInput("plan --model llama3-8b --world 8 --granule rows:0", "granule");
  ExpectBadInput("plan --model llama3-8b --world 8 --granule rows:-3", "granule");
  ExpectBadInput("plan --model llama3-8b --world 8 --granule tiles", "granule");
  ExpectBadInput("plan --model llama3-8b --world 8 --align-bytes 0", "--align-bytes");
  ExpectBadInput("compare --model llama3-8b --world 99999999", "--world");
  ExpectBadInput("frobnicate", "frobnicate");
}

TEST_F(CtlTest, BadInventoriesAreRejected) {
  ExpectBadInput("plan --inventory " + Write("bad.json", "{\"units\": [") + " --world 4",
                 "malformed JSON");
  ExpectBadInput("plan --inventory " + dir_ + "/missing.json --world 4", "cannot open");
  ExpectBadInput("plan --inventory " +
                     Inventory("{\"name\": \"a\", \"shape\": [0, 4], \"dtype\": \"bf16\"}") +
                     " --world 4",
                 "shape[0]");
  ExpectBadInput("plan --inventory " +
                     Inventory("{\"name\": \"a\", \"shape\": [4, -4], \"dtype\": \"bf16\"}") +
                     " --world 4",
                 "shape[1]");
  ExpectBadInput(
      "plan --inventory " +
          Inventory("{\"name\": \"a\", \"shape\": [9223372036854775807, 2], \"dtype\": \"bf16\"}") +
          " --world 4",
      "overflows int64");
  ExpectBadInput("plan --inventory " +
                     Inventory("{\"name\": \"a\", \"shape\": [4, 4], \"dtype\": \"bf16\", "
                               "\"granule\": \"rows:0\"}") +
                     " --world 4",
                 "granule");
  ExpectBadInput("plan --inventory " + Inventory("") + " --world 4", "empty unit");
  ExpectBadInput("plan --inventory " +
                     Inventory("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\"},"
                               "{\"name\": \"a\", \"shape\": [4], \"dtype\": \"bf16\"}") +
                     " --world 4",
                 "duplicate tensor name");
  ExpectBadInput("plan --inventory " +
                     Inventory("{\"name\": \"a\", \"shape\": [4], \"dtype\": \"complex64\"}") +
                     " --world 4",
                 "dtype");
}

TEST_F(CtlTest, OverflowingPlansAreBadInputNotCrashes) {
  std::string inv = Inventory(
      "{\"name\": \"a\", \"shape\": [1048576, 1048576, 1024], \"dtype\": \"bf16\", \"granule\": "
      "\"whole\"}");
  ExpectBadInput("plan --inventory " + inv + " --world 1048576", "overflows");
}

TEST_F(CtlTest, HelpExitsZero) {
  Result r = Run("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("plan"));
}

TEST_F(CtlTest, AdvisePrintsTheRecommendationAsJson) {
  const std::string h100 = std::string(RAGSHARD_SOURCE_DIR) + "/profiles/h100-8x-nvlink-ib400.json";
  Result r = Run("advise --model llama3-70b --cluster " + h100 + " --granule rows:128 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  const auto& rec = j["recommendation"];
  for (const char* key : {"padding_pct", "predicted_step_seconds", "memory_bytes", "strategy"}) {
    EXPECT_TRUE(rec.contains(key)) << key;
  }
  EXPECT_LT(rec["padding_pct"].get<double>(), 1.0);
  EXPECT_LE(rec["memory_bytes"].get<double>(), 80.0 * (int64_t{1} << 30));
  EXPECT_GE(j["candidates"].size(), 1u);
  EXPECT_EQ(j["cluster"]["world"], 1024);
  EXPECT_TRUE(rec.contains("exposed_comm_seconds"));
  // Nothing fits: the error names the smallest candidate and its memory, in bytes.
  r = Run("advise --model deepseek-v3 --cluster " + h100 +
          " --granule rows:128 --memory-budget 40GiB --json");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.err, HasSubstr("the smallest needs"));
  // The human form names the recommendation too.
  r = Run("advise --model llama-7b --cluster " + h100 + " --world 64");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("recommendation: k="));
  EXPECT_THAT(r.out, HasSubstr("candidates considered"));
}

TEST_F(CtlTest, AdviseSaysWhenThePaddingTargetCannotBeMetAndWhy) {
  const std::string h100 = std::string(RAGSHARD_SOURCE_DIR) + "/profiles/h100-8x-nvlink-ib400.json";
  const std::string args = "advise --model llama3.1-405b --cluster " + h100 +
                           " --world 1024 --granule rows:128 --memory-budget 80GiB";
  Result r = Run(args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("padding target 1.00% cannot be met within the budget: best "
                               "reachable padding 9.397%, lower bound 9.397%"));
  EXPECT_THAT(r.out, HasSubstr("a multiple of 27262976"));
  EXPECT_THAT(r.out, HasSubstr("beyond the search: any grouping"));
  r = Run(args + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["padding_target_met"].get<bool>());
  EXPECT_GE(j["padding_bound_pct"].get<double>(), 1.0);
  EXPECT_GE(j["any_grouping_bound_pct"].get<double>(), 1.0);
  EXPECT_NEAR(j["best_padding_pct"].get<double>(), j["recommendation"]["padding_pct"].get<double>(),
              1e-9);
  // A budget below every strategy's need: exit code 1, naming the smallest need in bytes.
  r = Run("advise --model llama3.1-405b --cluster " + h100 +
          " --world 1024 --granule rows:128 --memory-budget 10GiB");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("no strategy fits the memory budget of 10.00 GiB"));
  EXPECT_THAT(r.err, HasSubstr("the smallest needs"));
}

TEST_F(CtlTest, SimulatePrintsBreakdownTimelineAndPng) {
  const std::string h100 = std::string(RAGSHARD_SOURCE_DIR) + "/profiles/h100-8x-nvlink-ib400.json";
  const std::string png = dir_ + "/step.png";
  Result r = Run("simulate --model llama-7b --cluster " + h100 +
                 " --world 64 --strategy k=2,p=8x1,g=8x2,os=8x8 --png " + png);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("layers.0-1"));
  EXPECT_THAT(r.out, HasSubstr("peak memory per device"));
  EXPECT_THAT(r.out, HasSubstr("compute |"));
  EXPECT_THAT(r.out, HasSubstr("comm    |"));
  std::ifstream f(png, std::ios::binary);
  std::string head(8, '\0');
  f.read(&head[0], 8);
  EXPECT_EQ(head, std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST_F(CtlTest, StrategyCommandsRejectBadInput) {
  const std::string h100 = std::string(RAGSHARD_SOURCE_DIR) + "/profiles/h100-8x-nvlink-ib400.json";
  ExpectBadInput("advise --model llama-7b", "--cluster");
  ExpectBadInput("advise --model llama-7b --cluster /nonexistent.json", "--cluster");
  ExpectBadInput("advise --model llama-7b --cluster " + Write("p.json", "{\"name\": 1}"), "name");
  ExpectBadInput("advise --model llama-7b --cluster " + h100 + " --optimizer sgd", "--optimizer");
  ExpectBadInput("advise --model llama-7b --cluster " + h100 + " --memory-budget lots",
                 "--memory-budget");
  ExpectBadInput("advise --model llama-7b --cluster " + h100 + " --world 12", "--world");
  ExpectBadInput("advise --model nope --cluster " + h100, "unknown model");
  ExpectBadInput("simulate --model llama-7b --cluster " + h100 + " --strategy k=1,shard=3x1",
                 "--strategy");
  ExpectBadInput("simulate --model llama-7b --cluster " + h100 + " --strategy bogus", "--strategy");
  // Nothing fits: exit code 1 and the smallest memory named.
  Result r = Run("advise --model llama-7b --cluster " + h100 + " --memory-budget 1GiB");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("the smallest needs"));
}

TEST(CtlRecoveryTest, ARecoveryReadsAsLostRecoveredRejoiningAndTheDeadline) {
  v1::Job job;
  job.set_status(v1::JOB_RECOVERING);
  job.set_recoveries(1);
  job.set_recovery_seconds(2.5);
  v1::JobRecovery& r = *job.mutable_recovery();
  r.set_epoch(2);
  r.set_lost("rank 3 of job 'j' on node 'n1' exited");
  r.set_reporter_node_id("n1");
  r.set_started_unix_ms(10'000);
  r.set_deadline_unix_ms(130'000);
  r.add_recovered_node_ids("n0");
  const std::string lines = RecoveryLines(job, {"n0", "n1", "n2"}, 40'000);
  EXPECT_THAT(lines, HasSubstr("recovery:     epoch 2, reported by node 'n1' 30.0 s ago\n"));
  EXPECT_THAT(lines, HasSubstr("lost:         rank 3 of job 'j' on node 'n1' exited\n"));
  EXPECT_THAT(lines, HasSubstr("recovered:    n0 (1/3 nodes)\n"));
  EXPECT_THAT(lines, HasSubstr("rejoining:    n1, n2 (their ranks re-attach"));
  EXPECT_THAT(lines, HasSubstr("deadline:     in 90.0 s\n"));
  EXPECT_THAT(lines, HasSubstr("recoveries:   1 recovery, 2.5 s lost before\n"));
  EXPECT_EQ(RecoveryNote(job, 40'000), "epoch 2, 1 node(s) recovered, 90.0 s left");
  EXPECT_THAT(RecoveryLines(job, {"n0", "n1"}, 131'000), HasSubstr("passed 1.0 s ago"));
  EXPECT_THAT(RecoveryNote(job, 131'000), HasSubstr("deadline passed"));
  job.set_status(v1::JOB_READY);
  EXPECT_EQ(RecoveryNote(job, 0), "1 recovery, 2.5 s lost");
  EXPECT_THAT(RecoveryLines(job, {}, 0), HasSubstr("(the last: epoch 2, from rank 3"));
  job.set_recoveries(0);
  EXPECT_EQ(RecoveryNote(job, 0), "");
  EXPECT_EQ(RecoveryLines(job, {}, 0), "");
}

TEST(CtlRecoveryTest, ARedundantJobShowsItsRedundancyTheNodeBeingRebuiltAndItsRebuilds) {
  v1::Job job;
  job.set_status(v1::JOB_RECOVERING);
  job.mutable_options()->set_redundancy("parity:2");
  v1::JobRecovery& r = *job.mutable_recovery();
  r.set_epoch(1);
  r.set_lost("node 'n1' lost (no heartbeat for 5000 ms)");
  r.set_lost_node_id("n1");
  r.set_started_unix_ms(10'000);
  r.set_deadline_unix_ms(130'000);
  r.add_recovered_node_ids("n0");
  EXPECT_EQ(RedundancyNote(job), "parity:2");
  EXPECT_EQ(RedundancyLines(job),
            "redundancy:   parity:2 (nodes in groups of 3, each node's state covered by parity on "
            "the others of its group; a lost node is rebuilt on a replacement daemon)\n"
            "rebuilds:     0 (0 bytes)\n");
  EXPECT_EQ(RecoveryNote(job, 40'000),
            "epoch 1, rebuilding node 'n1' on a replacement daemon, 1 node(s) recovered, 90.0 s "
            "left");
  const std::string lines = RecoveryLines(job, {"n0", "n1", "n2"}, 40'000);
  EXPECT_THAT(lines, HasSubstr("lost:         node 'n1' lost (no heartbeat for 5000 ms)\n"
                               "lost node:    rebuilding node 'n1' on a replacement daemon\n"));
  EXPECT_THAT(lines, HasSubstr("rejoining:    n1, n2"));
  r.set_rebuilt_bytes(4096);
  EXPECT_THAT(RecoveryLines(job, {"n0", "n1"}, 40'000),
              HasSubstr("lost node:    rebuilding node 'n1' on a replacement daemon (4096 bytes "
                        "rebuilt)\n"));

  job.set_status(v1::JOB_READY);
  job.set_recoveries(1);
  job.set_recovery_seconds(3);
  job.set_rebuilds(1);
  job.set_rebuilt_bytes(4096);
  job.mutable_options()->set_redundancy("replica");
  EXPECT_EQ(RedundancyNote(job), "replica, rebuilds: 1 (4096 bytes)");
  EXPECT_EQ(RedundancyLines(job),
            "redundancy:   replica (each node's state copied on another node; a lost node is "
            "rebuilt on a replacement daemon)\nrebuilds:     1 (4096 bytes)\n");
  EXPECT_THAT(RecoveryLines(job, {}, 0), HasSubstr("recoveries:   1 recovery, 3.0 s lost"));
  // A job without redundancy shows none of it.
  job.clear_options();
  job.set_rebuilds(0);
  EXPECT_EQ(RedundancyNote(job), "");
  EXPECT_EQ(RedundancyLines(job), "");
  job.mutable_options()->set_redundancy("none");
  EXPECT_EQ(RedundancyLines(job), "");
}

TEST(CtlRecoveryTest, AShrunkJobNamesItsSuccessorAndTheSuccessorItsPredecessor) {
  v1::Job job;
  job.set_status(v1::JOB_SHRUNK);
  job.set_successor_job_id("tiny/shrink-1");
  job.add_survivor_ranks(0);
  job.add_survivor_ranks(1);
  EXPECT_EQ(ShrinkLines(job), "shrunk to:    tiny/shrink-1 (ranks 0, 1 go on)\n");
  EXPECT_EQ(ShrinkNote(job), "");  // its error names the successor
  job.clear_survivor_ranks();
  for (int64_t r : {8, 9, 10, 11, 20}) job.add_survivor_ranks(r);
  EXPECT_EQ(ShrinkLines(job), "shrunk to:    tiny/shrink-1 (ranks 8-11, 20 go on)\n");
  job.clear_survivor_ranks();
  job.add_survivor_ranks(3);
  EXPECT_EQ(ShrinkLines(job), "shrunk to:    tiny/shrink-1 (rank 3 goes on)\n");

  v1::Job next;
  next.set_status(v1::JOB_READY);
  next.set_predecessor_job_id("tiny");
  next.set_shrinks(1);
  EXPECT_EQ(ShrinkLines(next), "shrunk from:  tiny (shrinks: 1)\n");
  EXPECT_EQ(ShrinkNote(next), "shrunk from tiny (shrinks: 1)");
  EXPECT_EQ(ShrinkLines(v1::Job()), "");
  EXPECT_EQ(ShrinkNote(v1::Job()), "");
}

TEST(CtlRecoveryTest, TheRanksJournalsNameTheStepBeingRedoneAndWhoIsNotBack) {
  v1::RankProgress a, b, c;
  a.set_committed_step(6);
  a.set_begun_step(7);
  b.set_committed_step(7);
  b.set_begun_step(7);
  c.set_committed_step(6);
  c.set_begun_step(6);
  c.set_rejoining(true);
  const std::map<int64_t, const v1::RankProgress*> progress = {{0, &a}, {1, &b}, {2, &c}};
  v1::Job job;
  job.set_status(v1::JOB_RECOVERING);
  EXPECT_EQ(StepLines(job, progress),
            "redoing:      step 7 (every rank completed step 6; some began or completed step 7, "
            "rolled back)\nnot back:     rank(s) 2\n");
  job.set_status(v1::JOB_READY);
  EXPECT_EQ(StepLines(job, progress), "steps:        6 completed by every rank, 7 begun\n");
  v1::RankProgress none;
  none.set_committed_step(-1);
  none.set_begun_step(-1);
  EXPECT_EQ(StepLines(job, {{0, &none}}), "");
}

}  // namespace
}  // namespace ragshard

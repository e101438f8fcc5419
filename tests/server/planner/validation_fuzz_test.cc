// Randomized fuzzing of the planner's request validators, bounded in time: random requests,
// requests with random strings and extreme numbers, and random bytes parsed as requests. No
// input may crash a validator, and every accepted request must satisfy what the service then
// relies on.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "google/protobuf/stubs/logging.h"
#include "server/planner/validation.h"

namespace ragshard::planner {
namespace {

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  std::string String() {
    static const std::string kAlphabet = "abcXYZ019_.:/- \n\t\0\xff\x80{}\"'\\";
    std::string s;
    const int len = Pick({0, 1, 3, 16, 128, 129, 300, 600});
    for (int i = 0; i < len; ++i) s.push_back(kAlphabet[Int(0, kAlphabet.size() - 1)]);
    return s;
  }
  int64_t Number() {
    static const int64_t kEdges[] = {
        0, 1, -1, 2, 7, 1 << 20, (1 << 20) + 1, INT64_MAX, INT64_MIN, INT32_MAX, -(1LL << 40)};
    return Int(0, 3) == 0 ? Int(-1000, 1000) : kEdges[Int(0, std::size(kEdges) - 1)];
  }
  std::string Bytes() {
    std::string s(Int(0, 200), '\0');
    for (char& c : s) c = static_cast<char>(Int(0, 255));
    return s;
  }
  int64_t Int(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  int Pick(std::initializer_list<int> v) { return *(v.begin() + Int(0, v.size() - 1)); }

  void Fill(Inventory* inv) {
    const int units = Pick({0, 1, 2, 5});
    for (int u = 0; u < units; ++u) {
      UnitSpec* unit = inv->add_units();
      unit->set_name(Int(0, 1) ? String() : "u" + std::to_string(u));
      const int tensors = Pick({0, 1, 3});
      for (int t = 0; t < tensors; ++t) {
        TensorSpec* spec = unit->add_tensors();
        spec->set_name(Int(0, 1) ? String() : "t" + std::to_string(u) + "_" + std::to_string(t));
        const int rank = Pick({0, 1, 2, 3, 9});
        for (int d = 0; d < rank; ++d) spec->add_shape(Int(0, 2) ? Int(1, 64) : Number());
        spec->set_dtype(static_cast<v1::DType>(Int(-1, 12)));
        spec->set_granule_kind(static_cast<v1::GranuleKind>(Int(-1, 4)));
        spec->set_granule_rows(Int(0, 1) ? Int(0, 8) : Number());
        spec->set_optimizer(static_cast<v1::OptimizerKind>(Int(-1, 3)));
      }
    }
  }

 private:
  std::mt19937_64 rng_;
};

TEST(ValidationFuzzTest, ValidatorsNeverCrashAndAcceptOnlySaneRequests) {
  google::protobuf::LogSilencer quiet;  // random bytes make protobuf log invalid UTF-8
  const auto budget = std::chrono::seconds(5);
  const auto start = std::chrono::steady_clock::now();
  Fuzzer f(20261122);
  ServiceLimits limits;
  int64_t iterations = 0, accepted = 0;
  while (std::chrono::steady_clock::now() - start < budget) {
    ++iterations;
    {
      v1::CreateJobRequest r;
      r.set_job_id(f.Int(0, 1) ? f.String() : "job");
      r.mutable_mesh()->set_shard_size(f.Number());
      r.mutable_mesh()->set_replicate_size(f.Int(0, 1) ? 1 : f.Number());
      r.mutable_options()->set_policy(f.Int(0, 1) ? f.String() : "ragged");
      r.mutable_options()->set_default_granule(f.Int(0, 1) ? f.String() : "rows:4");
      r.mutable_options()->set_align_bytes(static_cast<int32_t>(f.Number()));
      r.mutable_options()->set_registration_timeout_ms(f.Number());
      r.mutable_options()->set_recovery_deadline_ms(f.Int(0, 1) ? 0 : f.Number());
      if (ValidateCreateJob(r, limits).ok()) {
        ++accepted;
        ASSERT_GE(r.options().recovery_deadline_ms(), 0);
        ASSERT_GE(r.mesh().shard_size(), 1);
        ASSERT_LE(r.mesh().shard_size() * r.mesh().replicate_size(), limits.max_world);
        ASSERT_FALSE(r.job_id().empty());
      }
    }
    {
      v1::RegisterRankRequest r;
      r.set_job_id(f.Int(0, 3) ? "job" : f.String());
      r.set_rank(f.Int(0, 1) ? f.Int(0, 8) : f.Number());
      r.set_node_id(f.Int(0, 3) ? "node" : f.String());
      if (f.Int(0, 1)) {
        f.Fill(r.mutable_inventory());
      } else {
        r.set_inventory_sha256(f.Int(0, 1) ? std::string(32, 'h') : f.Bytes());
      }
      if (ValidateRegisterRank(r, limits).ok()) {
        ++accepted;
        ASSERT_GE(r.rank(), 0);
        if (r.has_inventory()) {
          for (const auto& u : r.inventory().units()) {
            ASSERT_GT(u.tensors_size(), 0);
            for (const auto& t : u.tensors()) {
              ASSERT_TRUE(TensorNumel(t).ok());
              ASSERT_GE(GranuleElems(t), 1);
            }
          }
        } else {
          ASSERT_EQ(r.inventory_sha256().size(), 32u);
        }
      }
    }
    {
      v1::PutRequest p;
      p.set_job_id(f.String());
      p.set_key(f.String());
      p.set_value(f.Bytes());
      (void)ValidatePut(p, limits);
      v1::GetRequest g;
      g.set_job_id(f.String());
      g.set_key(f.String());
      g.set_wait_ms(f.Number());
      if (ValidateGet(g, limits).ok()) ASSERT_GE(g.wait_ms(), 0);
      v1::HeartbeatRequest h;
      h.set_node_id(f.String());
      for (int i = f.Int(0, 3); i > 0; --i) h.add_jobs(f.String());
      h.mutable_figures()->set_pool_used_bytes(f.Number());
      (void)ValidateHeartbeat(h, limits);
      v1::RegisterNodeRequest n;
      n.set_node_id(f.String());
      n.set_data_address(f.String());
      n.set_capacity_bytes(f.Number());
      (void)ValidateRegisterNode(n, limits);
      v1::ReportFailureRequest rf;
      rf.set_job_id(f.String());
      rf.set_reporter_node_id(f.String());
      rf.set_message(f.String());
      rf.set_recoverable(f.Int(0, 1) == 1);
      rf.set_epoch(f.Number());
      if (ValidateReportFailure(rf, limits).ok()) ASSERT_GE(rf.epoch(), 0);
      v1::ReportRecoveredRequest rr;
      rr.set_job_id(f.Int(0, 3) ? "job" : f.String());
      rr.set_node_id(f.Int(0, 3) ? "node" : f.String());
      rr.set_epoch(f.Number());
      if (ValidateReportRecovered(rr, limits).ok()) {
        ++accepted;
        ASSERT_GE(rr.epoch(), 1);
        ASSERT_FALSE(rr.node_id().empty());
      }
    }
    {
      // Random bytes as wire messages.
      const std::string bytes = f.Bytes();
      v1::RegisterRankRequest r;
      if (r.ParseFromString(bytes)) (void)ValidateRegisterRank(r, limits);
      v1::CreateJobRequest c;
      if (c.ParseFromString(bytes)) (void)ValidateCreateJob(c, limits);
    }
  }
  std::cout << iterations << " fuzz iterations in " << budget.count() << " s, " << accepted
            << " accepted requests\n";
  EXPECT_GT(iterations, 1000);
  EXPECT_GT(accepted, 0);
}

// A heartbeat's operation figures: bounded in count, named kinds, no negative counts.
TEST(ValidationTest, HeartbeatOperationFiguresAreCheckedAndNamed) {
  ServiceLimits limits;
  v1::HeartbeatRequest h;
  h.set_node_id("n0");
  auto* k = h.mutable_figures()->add_operations_by_kind();
  k->set_kind("OP_UNSHARD");
  k->set_count(3);
  EXPECT_TRUE(ValidateHeartbeat(h, limits).ok());
  k->set_count(-1);
  absl::Status s = ValidateHeartbeat(h, limits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("figures.operations_by_kind[0].count"), std::string::npos)
      << s;
  k->set_count(1);
  k->set_kind("a b");
  s = ValidateHeartbeat(h, limits);
  EXPECT_NE(std::string(s.message()).find("figures.operations_by_kind[0].kind"), std::string::npos)
      << s;
  k->set_kind("OP_UNSHARD");
  for (int i = 0; i < 64; ++i) h.mutable_figures()->add_operations_by_kind()->set_kind("OP_X");
  s = ValidateHeartbeat(h, limits);
  EXPECT_NE(std::string(s.message()).find("more than 64 kinds"), std::string::npos) << s;
  h.mutable_figures()->clear_operations_by_kind();
  h.mutable_figures()->set_operations(-5);
  EXPECT_FALSE(ValidateHeartbeat(h, limits).ok());
}

TEST(ValidationTest, HeartbeatRankProgressIsBoundedAndNamed) {
  ServiceLimits limits;
  v1::HeartbeatRequest h;
  h.set_node_id("n0");
  v1::RankProgress* r = h.mutable_figures()->add_ranks();
  r->set_job_id("j");
  r->set_rank(2);
  r->set_pending_seq(7);
  r->set_pending("OP_UNSHARD of unit 0 'a'");
  r->set_waiting_on("peer 1 (node 'n1')");
  EXPECT_TRUE(ValidateHeartbeat(h, limits).ok());
  auto expect_named = [&](const std::string& field) {
    absl::Status s = ValidateHeartbeat(h, limits);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
  };
  r->set_job_id("bad id");
  expect_named("figures.ranks[0].job_id");
  r->set_job_id("j");
  r->set_rank(-1);
  expect_named("figures.ranks[0]");
  r->set_rank(2);
  r->set_waiting_on(std::string(513, 'x'));
  expect_named("figures.ranks[0].waiting_on");
  r->set_waiting_on("");
  limits.max_heartbeat_ranks = 1;
  h.mutable_figures()->add_ranks()->set_job_id("j");
  expect_named("figures.ranks");
}

}  // namespace
}  // namespace ragshard::planner

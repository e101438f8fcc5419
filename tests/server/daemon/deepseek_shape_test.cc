// The DeepSeek-V3 case of the strategy search (docs/benchmarks/strategy.md): `ragshardctl advise`
// at W = 1024 (128 nodes x 8 H100), rows:128, 80 GiB answers the same with and without
// --executable, and the strategy it names (its recommendation, or the smallest candidate when
// none fits the budget: plans nest at the os factor, whose padding every unsharded buffer
// carries) has a plan that passes the data plane's own shape check on every node (the mesh it
// would run: positions, groups and the nested plans).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

#include "engine/cluster.h"
#include "engine/inventory.h"
#include "engine/models.h"
#include "engine/strategy_search.h"
#include "engine/validator.h"
#include "nlohmann/json.hpp"
#include "server/daemon/host_transport.h"
#include "server/daemon/transport.h"

namespace ragshard::daemon {
namespace {

const std::string kProfile =
    std::string(RAGSHARD_SOURCE_DIR) + "/profiles/h100-8x-nvlink-ib400.json";

// What `ragshardctl advise ... --json` says: the recommendation's strategy and exposed
// communication, or, when nothing fits, the error (which names the smallest candidate).
struct Answer {
  std::string spec, error;
  double exposed = -1;
};
Answer Advise(const std::string& extra) {
  const std::string cmd = std::string(RAGSHARDCTL_PATH) + " advise --model deepseek-v3 --cluster " +
                          kProfile +
                          " --world 1024 --granule rows:128 --memory-budget 80GiB --json "
                          "--max-rejected 0 2>&1 " +
                          extra;
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  std::array<char, 4096> buf;
  while (pipe && fgets(buf.data(), buf.size(), pipe.get()) != nullptr) out += buf.data();
  Answer a;
  auto j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    a.error = out;
    // "... the smallest needs X GiB (N bytes): SPEC (params ...": the candidate it names.
    const size_t at = out.find("bytes): ");
    if (at != std::string::npos) {
      const size_t from = at + 8;
      a.spec = out.substr(from, out.find(' ', from) - from);
    }
    return a;
  }
  const auto& r = j["recommendation"];
  a.spec = r["strategy"]["spec"].get<std::string>();
  a.exposed = r["exposed_comm_seconds"].get<double>();
  return a;
}

TEST(DeepSeekV3Test, TheAdvisedStrategyIsTheSameWithExecutableAndPassesTheShapeCheck) {
  const Answer plain = Advise(""), executable = Advise("--executable");
  EXPECT_EQ(plain.spec, executable.spec);
  EXPECT_EQ(plain.error, executable.error);
  EXPECT_EQ(plain.exposed, executable.exposed);
  ASSERT_FALSE(plain.spec.empty()) << plain.error;
  if (plain.error.empty()) {
    EXPECT_GE(plain.exposed, 0);  // advise reports it
  }
  const std::string& spec = plain.spec;
  // Its plan, as policy auto makes it for 128 nodes of 8 ranks.
  auto inv = GenerateModel("deepseek-v3");
  ASSERT_TRUE(inv.ok());
  ApplyGranule(&*inv, *ParseGranule("rows:128"));
  auto profile = LoadClusterProfile(kProfile);
  ASSERT_TRUE(profile.ok()) << profile.status();
  CostOptions cost;
  cost.tokens_per_step = int64_t{1024} * 4096;
  PlanOptions po;
  po.job_id = "deepseek-v3";
  po.version = 1;
  auto plan = PlanAuto(*inv, "deepseek-v3", *profile, 128, 8, cost, spec, po);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->plan.strategy().executed(), spec);
  ASSERT_TRUE(ValidatePlan(plan->plan, &*inv).ok()) << ValidatePlan(plan->plan, &*inv);
  // The daemon's shape check on every node: the mesh, the transport, the groups.
  const int64_t replicas = 1024 / plan->plan.world_size();
  EXPECT_EQ(replicas, plan->replicate);
  for (int node = 0; node < 128; ++node) {
    std::vector<int64_t> local;
    for (int64_t l = 0; l < 8; ++l) local.push_back(node * 8 + l);
    auto mesh = NodeMesh::Of(plan->plan, local, node, 128, replicas);
    ASSERT_TRUE(mesh.ok()) << "node " << node << ": " << mesh.status();
    HostTransport host(*mesh, nullptr, nullptr, HostShape::kNode);
    EXPECT_TRUE(host.runs_sharding(*mesh));
  }
}

}  // namespace
}  // namespace ragshard::daemon

// The job status machine (server/planner/job_status.h): every transition of its table is allowed,
// every other pair of statuses is refused by name and leaves the job as it was; and no source of
// the planner sets a job's status but the machine.
#include "server/planner/job_status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace ragshard::planner {
namespace {

using ::testing::HasSubstr;

TEST(JobStatusMachineTest, EveryPairIsAllowedExactlyWhenTheTableListsIt) {
  int allowed = 0, refused = 0;
  for (int from = v1::JOB_STATUS_UNSPECIFIED; from <= v1::JobStatus_MAX; ++from) {
    for (int to = v1::JOB_REGISTERING; to <= v1::JobStatus_MAX; ++to) {
      const auto f = static_cast<v1::JobStatus>(from), t = static_cast<v1::JobStatus>(to);
      v1::Job job;
      job.set_job_id("j");
      job.set_status(f);
      const absl::Status s = JobStatusMachine::Move(&job, t);
      if (JobStatusMachine::Allowed(f, t)) {
        EXPECT_TRUE(s.ok()) << s;
        EXPECT_EQ(job.status(), t);
        ++allowed;
      } else {
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(std::string(s.message()),
                    HasSubstr(absl::StrCat("job 'j' cannot go from ", v1::JobStatus_Name(f), " to ",
                                           v1::JobStatus_Name(t))));
        EXPECT_EQ(job.status(), f) << "a refused transition changed the job";
        ++refused;
      }
    }
  }
  EXPECT_EQ(allowed, static_cast<int>(JobStatusMachine::Transitions().size()));
  EXPECT_GT(refused, 0);
  // What the planner relies on, spelled out.
  EXPECT_TRUE(JobStatusMachine::Allowed(v1::JOB_RECOVERING, v1::JOB_SHRUNK));
  EXPECT_FALSE(JobStatusMachine::Allowed(v1::JOB_SHRUNK, v1::JOB_READY));
  EXPECT_FALSE(JobStatusMachine::Allowed(v1::JOB_FAILED, v1::JOB_READY));
  EXPECT_FALSE(JobStatusMachine::Allowed(v1::JOB_DELETED, v1::JOB_DELETED));
  EXPECT_FALSE(JobStatusMachine::Allowed(v1::JOB_DEGRADED, v1::JOB_RECOVERING));
}

TEST(JobStatusMachineTest, NoPlannerSourceSetsAJobsStatusButTheMachine) {
  const std::filesystem::path dir = std::filesystem::path(RAGSHARD_SOURCE_DIR) / "server/planner";
  const std::regex set_status(R"(set_status\(\s*v1::JOB_)");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("job_status.", 0) == 0) continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_FALSE(std::regex_search(text.str(), set_status))
        << name << " sets a job's status itself (JobStatusMachine::Move)";
  }
}

}  // namespace
}  // namespace ragshard::planner

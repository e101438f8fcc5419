#include "server/daemon/metrics.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ragshard::daemon {
namespace {

// The value of each sample of family `name`, keyed by its labels "k=v,k=v".
std::map<std::string, double> Samples(const DaemonMetrics& m, const std::string& name,
                                      bool histogram_count = false) {
  std::map<std::string, double> out;
  for (const auto& family : m.registry()->Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric) {
      std::string key;
      for (const auto& l : metric.label) key += (key.empty() ? "" : ",") + l.name + "=" + l.value;
      out[key] = histogram_count ? static_cast<double>(metric.histogram.sample_count)
                                 : metric.counter.value;
    }
  }
  return out;
}

TEST(DaemonMetricsTest, ErrorsAreCountedByTheirCause) {
  EXPECT_STREQ(ErrorCause(absl::UnavailableError("peer 1 lost")), "peer_lost");
  EXPECT_STREQ(ErrorCause(absl::DeadlineExceededError("x")), "deadline");
  EXPECT_STREQ(ErrorCause(absl::AbortedError("x")), "aborted");
  EXPECT_STREQ(ErrorCause(absl::ResourceExhaustedError("x")), "out_of_memory");
  EXPECT_STREQ(ErrorCause(absl::NotFoundError("x")), "bad_request");
  EXPECT_STREQ(ErrorCause(absl::InvalidArgumentError("x")), "bad_request");
  EXPECT_STREQ(ErrorCause(absl::PermissionDeniedError("x")), "permission_denied");
  EXPECT_STREQ(ErrorCause(absl::InternalError("x")), "other");
}

TEST(DaemonMetricsTest, OperationsBytesAndErrorsAreCountedByTheirLabels) {
  DaemonMetrics m;
  m.OperationDone("unshard", 0.002, absl::OkStatus());
  m.OperationDone("unshard", 0.004, absl::OkStatus());
  m.OperationDone("reduce_scatter", 0.5, absl::UnavailableError("peer 1 lost"));
  m.BytesSent("unshard", "ucx", 1 << 20);
  m.BytesSent("unshard", "ucx", 1 << 20);
  m.BytesSent("reshard", "ucx", 0);  // nothing sent: no series
  m.Error(absl::DeadlineExceededError("attach"));
  EXPECT_EQ(Samples(m, "ragshard_daemon_operations_total"),
            (std::map<std::string, double>{{"kind=unshard,result=ok", 2},
                                           {"kind=reduce_scatter,result=error", 1}}));
  EXPECT_EQ(Samples(m, "ragshard_daemon_operation_seconds", true),
            (std::map<std::string, double>{{"kind=unshard", 2}, {"kind=reduce_scatter", 1}}));
  EXPECT_EQ(Samples(m, "ragshard_daemon_sent_bytes_total"),
            (std::map<std::string, double>{{"collective=unshard,transport=ucx", 2 << 20}}));
  EXPECT_EQ(Samples(m, "ragshard_daemon_errors_total"),
            (std::map<std::string, double>{{"cause=peer_lost", 1}, {"cause=deadline", 1}}));
}

TEST(DaemonMetricsTest, TheJobThreadsKindsLandInTheSameSeriesAsTheirLabels) {
  DaemonMetrics m;
  EXPECT_EQ(DaemonMetrics::KindLabel(v1::OP_REDUCE_SCATTER), "reduce_scatter");
  m.OperationDone(v1::OP_UNSHARD, 0.002, absl::OkStatus(), 0);  // nothing sent yet: no series
  m.OperationDone(v1::OP_UNSHARD, 0.004, absl::OkStatus(), 1 << 20);
  m.OperationDone("unshard", 0.001, absl::OkStatus());  // the series the kind keeps
  m.OperationDone(v1::OP_REDUCE_SCATTER, 0.5, absl::UnavailableError("peer 1 lost"), 4096);
  m.OperationDone(v1::OP_RESHARD, 0.001, absl::OkStatus(), 0);
  EXPECT_EQ(Samples(m, "ragshard_daemon_operations_total"),
            (std::map<std::string, double>{{"kind=unshard,result=ok", 3},
                                           {"kind=reduce_scatter,result=error", 1},
                                           {"kind=reshard,result=ok", 1}}));
  EXPECT_EQ(Samples(m, "ragshard_daemon_operation_seconds", true),
            (std::map<std::string, double>{
                {"kind=unshard", 3}, {"kind=reduce_scatter", 1}, {"kind=reshard", 1}}));
  EXPECT_EQ(Samples(m, "ragshard_daemon_sent_bytes_total"),
            (std::map<std::string, double>{{"collective=unshard,transport=ucx", 1 << 20},
                                           {"collective=reduce_scatter,transport=ucx", 4096}}));
  EXPECT_EQ(Samples(m, "ragshard_daemon_errors_total"),
            (std::map<std::string, double>{{"cause=peer_lost", 1}}));
}

}  // namespace
}  // namespace ragshard::daemon

// The daemon's Prometheus figures (served by --metrics-listen, infra/metrics.h): operations by
// kind and result with their latency, bytes sent to other daemons per collective and transport,
// and errors by cause, counted as the daemon works; the pool's capacity, use, peak and
// fragmentation, the jobs and the attachments, read when a scrape comes (NodeDaemon).
#pragma once

#include <array>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "infra/metrics.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "ragshard/v1/daemon.pb.h"

namespace ragshard::daemon {

// The cause an error is counted under: peer_lost (UNAVAILABLE), deadline, aborted (ranks that
// disagree, or a peer's abort), out_of_memory, permission_denied (a stranger on the side
// channel, a data-port connection from a host that is not a peer), unauthenticated (a data-port
// connection without the job's credential), bad_request (INVALID_ARGUMENT,
// FAILED_PRECONDITION, NOT_FOUND, OUT_OF_RANGE), other.
const char* ErrorCause(const absl::Status& status);

class DaemonMetrics final : public MetricsSet {
 public:
  DaemonMetrics();

  // An operation (kind: "unshard", "reduce_scatter", ...) ran for `seconds`; a failure also
  // counts as an error of its cause.
  void OperationDone(const std::string& kind, double seconds, const absl::Status& status);
  // `bytes` were sent to other daemons over `transport` ("ucx") by an operation of `kind`.
  void BytesSent(const std::string& kind, const std::string& transport, int64_t bytes);
  // The job thread's form of both: an operation of `kind` ran for `seconds` and sent `ucx_bytes`
  // to other daemons. A successful kind's series are looked up once and kept, so that an
  // operation builds no label strings and takes no family lock.
  void OperationDone(v1::OpKind kind, double seconds, const absl::Status& status,
                     int64_t ucx_bytes);
  // An error outside the operations (a failed attach, a refused peer), by cause.
  void Error(const absl::Status& status);
  // A job's recovery in place completed on this node.
  void Recovered();
  // This daemon, a replacement for a lost node, rebuilt `bytes` of its ranks' state.
  void Rebuilt(int64_t bytes);

  // "unshard" for OP_UNSHARD: the label value of an operation kind.
  static std::string KindLabel(v1::OpKind kind);

 private:
  // One kind's series of successful operations; bytes once it has sent any (no empty series).
  struct KindSeries {
    std::string label;
    prometheus::Counter* ok = nullptr;
    prometheus::Histogram* seconds = nullptr;
    prometheus::Counter* ucx_bytes = nullptr;
  };
  static constexpr int kKinds = 32;  // OpKind values below this are kept

  prometheus::Family<prometheus::Counter>* operations_ = nullptr;
  prometheus::Family<prometheus::Histogram>* seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* errors_ = nullptr;
  prometheus::Counter* recoveries_ = nullptr;
  prometheus::Counter* rebuilds_ = nullptr;
  prometheus::Counter* rebuilt_bytes_ = nullptr;
  absl::Mutex kinds_mu_;
  std::array<std::unique_ptr<KindSeries>, kKinds> kinds_ ABSL_GUARDED_BY(kinds_mu_);
};

}  // namespace ragshard::daemon

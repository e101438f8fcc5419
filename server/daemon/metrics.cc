#include "server/daemon/metrics.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "infra/metrics.h"

namespace ragshard::daemon {

const char* ErrorCause(const absl::Status& status) {
  using Code = absl::StatusCode;
  // Each cause and a code counted under it (metrics.h); any other code is "other".
  static constexpr std::pair<const char*, Code> kCauses[] = {
      {"peer_lost", Code::kUnavailable},
      {"deadline", Code::kDeadlineExceeded},
      {"aborted", Code::kAborted},
      {"out_of_memory", Code::kResourceExhausted},
      {"permission_denied", Code::kPermissionDenied},
      {"unauthenticated", Code::kUnauthenticated},
      {"bad_request", Code::kInvalidArgument},
      {"bad_request", Code::kFailedPrecondition},
      {"bad_request", Code::kNotFound},
      {"bad_request", Code::kOutOfRange}};
  for (const auto& [cause, code] : kCauses) {
    if (status.code() == code) return cause;
  }
  return "other";
}

DaemonMetrics::DaemonMetrics() {
  operations_ = &CounterFamily("ragshard_daemon_operations_total",
                               "Operations the daemon ran, by kind and result (ok, error)");
  seconds_ = &HistogramFamily("ragshard_daemon_operation_seconds",
                              "Time an operation took on the job's thread (seconds), by kind");
  bytes_ = &CounterFamily("ragshard_daemon_sent_bytes_total",
                          "Bytes sent to other daemons, by collective and transport");
  errors_ =
      &CounterFamily("ragshard_daemon_errors_total", "Failed operations and attaches, by cause");
  recoveries_ = Counter("ragshard_daemon_recoveries_total",
                        "Recoveries in place this daemon completed (docs/recovery.md)");
  rebuilds_ = Counter("ragshard_daemon_rebuilds_total",
                      "Lost nodes' state this daemon rebuilt as their replacement "
                      "(docs/recovery.md, \"A lost node\")");
  rebuilt_bytes_ = Counter("ragshard_daemon_rebuilt_bytes_total",
                           "Bytes of ranks' state this daemon rebuilt from redundancy");
}

void DaemonMetrics::Recovered() { recoveries_->Increment(); }

void DaemonMetrics::Rebuilt(int64_t bytes) {
  rebuilds_->Increment();
  rebuilt_bytes_->Increment(static_cast<double>(bytes));
}

namespace {

// From an allocation's microseconds to a large unit's gather across nodes.
const prometheus::Histogram::BucketBoundaries& Buckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30};
  return kBuckets;
}

}  // namespace

std::string DaemonMetrics::KindLabel(v1::OpKind kind) {
  std::string name = v1::OpKind_Name(kind);
  if (name.rfind("OP_", 0) == 0) name = name.substr(3);
  return absl::AsciiStrToLower(name);
}

void DaemonMetrics::OperationDone(const std::string& kind, double seconds,
                                  const absl::Status& status) {
  operations_->Add({{"kind", kind}, {"result", status.ok() ? "ok" : "error"}}).Increment();
  seconds_->Add({{"kind", kind}}, Buckets()).Observe(seconds);
  if (!status.ok()) Error(status);
}

void DaemonMetrics::OperationDone(v1::OpKind kind, double seconds, const absl::Status& status,
                                  int64_t ucx_bytes) {
  const int k = static_cast<int>(kind);
  if (!status.ok() || k < 0 || k >= kKinds) {  // rare: by label
    const std::string label = KindLabel(kind);
    OperationDone(label, seconds, status);
    BytesSent(label, "ucx", ucx_bytes);
    return;
  }
  KindSeries* series = nullptr;
  {
    absl::MutexLock lock(&kinds_mu_);
    std::unique_ptr<KindSeries>& slot = kinds_[static_cast<size_t>(k)];
    if (slot == nullptr) {
      slot = std::make_unique<KindSeries>();
      slot->label = KindLabel(kind);
      slot->ok = &operations_->Add({{"kind", slot->label}, {"result", "ok"}});
      slot->seconds = &seconds_->Add({{"kind", slot->label}}, Buckets());
    }
    if (ucx_bytes > 0 && slot->ucx_bytes == nullptr) {
      slot->ucx_bytes = &bytes_->Add({{"collective", slot->label}, {"transport", "ucx"}});
    }
    series = slot.get();
  }
  series->ok->Increment();
  series->seconds->Observe(seconds);
  if (ucx_bytes > 0) series->ucx_bytes->Increment(static_cast<double>(ucx_bytes));
}

void DaemonMetrics::BytesSent(const std::string& kind, const std::string& transport,
                              int64_t bytes) {
  if (bytes <= 0) return;
  bytes_->Add({{"collective", kind}, {"transport", transport}})
      .Increment(static_cast<double>(bytes));
}

void DaemonMetrics::Error(const absl::Status& status) {
  errors_->Add({{"cause", ErrorCause(status)}}).Increment();
}

}  // namespace ragshard::daemon

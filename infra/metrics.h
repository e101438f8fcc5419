// Prometheus metrics for the planner and the daemon, on prometheus-cpp (Debian's
// prometheus-cpp-dev): an HTTP endpoint that serves /metrics (`--metrics-listen`), and figures
// read when a scrape comes (gauges of state the servers already keep, such as jobs by state or
// the pool's use), besides the counters and histograms each server updates as it works.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace ragshard {

// "HOST:PORT", "[V6]:PORT" or a bare "PORT" (then 127.0.0.1: loopback unless an address is
// given); port 0 picks a free one. INVALID_ARGUMENT names what is wrong.
absl::StatusOr<std::string> MetricsBindAddress(const std::string& listen);

// Serves the collectables' figures as Prometheus text on http://ADDRESS/metrics.
class MetricsEndpoint {
 public:
  // UNAVAILABLE names the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // Serves `collectable` until it is destroyed (the endpoint holds it weakly).
  void Register(const std::weak_ptr<prometheus::Collectable>& collectable);
  // "http://127.0.0.1:40123/metrics": the address actually bound.
  const std::string& url() const { return url_; }

 private:
  MetricsEndpoint() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string url_;
};

// The registry of a program's counters and histograms, kept as the program works: its metrics
// class derives from this and registers its families in its constructor.
class MetricsSet {
 public:
  MetricsSet(const MetricsSet&) = delete;
  MetricsSet& operator=(const MetricsSet&) = delete;
  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 protected:
  MetricsSet() : registry_(std::make_shared<prometheus::Registry>()) {}
  ~MetricsSet() = default;

  // A counter or histogram family registered under `name` with `help`; the registry owns it.
  prometheus::Family<prometheus::Counter>& CounterFamily(const std::string& name,
                                                         const std::string& help);
  prometheus::Family<prometheus::Histogram>& HistogramFamily(const std::string& name,
                                                             const std::string& help);
  // The one counter of a family without labels.
  prometheus::Counter* Counter(const std::string& name, const std::string& help);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
};

// Figures computed when a scrape comes: `collect` returns the families (build them with
// GaugeFamily). It runs on the endpoint's thread and must be thread-safe.
class ScrapeCollectable final : public prometheus::Collectable {
 public:
  explicit ScrapeCollectable(std::function<std::vector<prometheus::MetricFamily>()> collect)
      : collect_(std::move(collect)) {}
  std::vector<prometheus::MetricFamily> Collect() const override { return collect_(); }

 private:
  std::function<std::vector<prometheus::MetricFamily>()> collect_;
};

// A gauge family: one series per entry of `values`, labelled `label`=key (or one unlabelled
// series under the key "" when `label` is empty).
prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help,
                                     const std::string& label,
                                     const std::map<std::string, double>& values);

}  // namespace ragshard

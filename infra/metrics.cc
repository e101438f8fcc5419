#include "infra/metrics.h"

#include <exception>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"

namespace ragshard {

absl::StatusOr<std::string> MetricsBindAddress(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? "127.0.0.1" : listen.substr(0, colon);
  const std::string port = colon == std::string::npos ? listen : listen.substr(colon + 1);
  int value = 0;
  if (!absl::SimpleAtoi(port, &value) || value < 0 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen '", listen,
                     "': the port must be a number in [0, 65535] (HOST:PORT or PORT)"));
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen '", listen, "': the host is empty (HOST:PORT or PORT)"));
  }
  return absl::StrCat(host, ":", value);
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen) {
  absl::StatusOr<std::string> address = MetricsBindAddress(listen);
  if (!address.ok()) return address.status();
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  try {
    // One serving thread: a scrape is small, and a server of ours should not spend threads on it.
    e->exposer_ = std::make_unique<prometheus::Exposer>(*address, 1);
  } catch (const std::exception& ex) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen ", *address, ": cannot listen there: ", ex.what()));
  }
  const std::vector<int> ports = e->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen ", *address, ": the endpoint bound no port"));
  }
  const std::string host = address->substr(0, address->rfind(':'));
  e->url_ = absl::StrCat("http://", host, ":", ports[0], "/metrics");
  return e;
}

MetricsEndpoint::~MetricsEndpoint() = default;

void MetricsEndpoint::Register(const std::weak_ptr<prometheus::Collectable>& collectable) {
  exposer_->RegisterCollectable(collectable);
}

prometheus::Family<prometheus::Counter>& MetricsSet::CounterFamily(const std::string& name,
                                                                   const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
}

prometheus::Counter* MetricsSet::Counter(const std::string& name, const std::string& help) {
  return &CounterFamily(name, help).Add({});
}

prometheus::Family<prometheus::Histogram>& MetricsSet::HistogramFamily(const std::string& name,
                                                                       const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
}

prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help,
                                     const std::string& label,
                                     const std::map<std::string, double>& values) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = prometheus::MetricType::Gauge;
  for (const auto& [key, value] : values) {
    prometheus::ClientMetric m;
    if (!label.empty()) m.label.push_back({label, key});
    m.gauge.value = value;
    family.metric.push_back(std::move(m));
  }
  return family;
}

}  // namespace ragshard

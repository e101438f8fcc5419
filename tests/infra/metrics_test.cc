#include "infra/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/numbers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;

// One HTTP/1.0 GET of http://127.0.0.1:PORT/PATH; the whole response, headers included.
std::string HttpGet(const std::string& url) {
  const std::string prefix = "http://127.0.0.1:";
  EXPECT_EQ(url.rfind(prefix, 0), 0u) << url;
  const size_t slash = url.find('/', prefix.size());
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(url.substr(prefix.size(), slash - prefix.size()), &port)) << url;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string request = "GET " + url.substr(slash) + " HTTP/1.0\r\n\r\n";
  EXPECT_EQ(::write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
  ::close(fd);
  return response;
}

TEST(MetricsBindAddressTest, APortAloneIsLoopbackAndBadInputIsNamed) {
  EXPECT_EQ(*MetricsBindAddress("9464"), "127.0.0.1:9464");
  EXPECT_EQ(*MetricsBindAddress("0"), "127.0.0.1:0");
  EXPECT_EQ(*MetricsBindAddress("0.0.0.0:9464"), "0.0.0.0:9464");
  EXPECT_EQ(*MetricsBindAddress("[::1]:9"), "[::1]:9");
  for (const char* bad : {"", "abc", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", ":80"}) {
    auto a = MetricsBindAddress(bad);
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr("--metrics-listen"));
  }
}

TEST(MetricsEndpointTest, ServesScrapeTimeFiguresOnThePortItBound) {
  int scrapes = 0;
  auto collectable = std::make_shared<ScrapeCollectable>([&scrapes] {
    ++scrapes;
    return std::vector<prometheus::MetricFamily>{
        GaugeFamily("ragshard_test_jobs", "Jobs by state", "state", {{"ready", 2}, {"failed", 0}}),
        GaugeFamily("ragshard_test_one", "One value", "", {{"", 7.5}})};
  });
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0");
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  EXPECT_THAT((*endpoint)->url(), ::testing::StartsWith("http://127.0.0.1:"));
  EXPECT_THAT((*endpoint)->url(), ::testing::Not(HasSubstr(":0/")));
  (*endpoint)->Register(collectable);
  const std::string body = HttpGet((*endpoint)->url());
  EXPECT_THAT(body, HasSubstr("200 OK"));
  EXPECT_THAT(body, HasSubstr("# TYPE ragshard_test_jobs gauge"));
  EXPECT_THAT(body, HasSubstr("ragshard_test_jobs{state=\"ready\"} 2"));
  EXPECT_THAT(body, HasSubstr("ragshard_test_jobs{state=\"failed\"} 0"));
  EXPECT_THAT(body, HasSubstr("ragshard_test_one 7.5"));
  EXPECT_EQ(scrapes, 1);
  // A collectable that is gone is no longer served, and the endpoint goes on.
  collectable.reset();
  EXPECT_THAT(HttpGet((*endpoint)->url()), ::testing::Not(HasSubstr("ragshard_test_one")));
}

TEST(MetricsEndpointTest, AnAddressItCannotBindIsNamed) {
  auto first = MetricsEndpoint::Start("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string url = (*first)->url();
  const std::string taken = url.substr(7, url.find('/', 7) - 7);  // 127.0.0.1:PORT
  auto second = MetricsEndpoint::Start(taken);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr(taken));
}

}  // namespace
}  // namespace ragshard

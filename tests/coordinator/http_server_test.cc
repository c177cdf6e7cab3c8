// The metrics port's pieces on their own: the HTTP server, /metrics against
// prometheus-cpp's own exposer, the step history and the dashboard URL.
#include "coordinator/service/http_server.h"

#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <unistd.h>

#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/step_history.h"
#include "coordinator/service/dashboard.h"
#include "gtest/gtest.h"
#include "tests/coordinator/http_test_client.h"

namespace hsdp::coordinator {
namespace {

using ::hsdp::testing::HttpRequestTo;
using ::hsdp::testing::HttpResult;

std::unique_ptr<HttpServer> StartOnFreePort(size_t max_body_bytes = 1024) {
  HttpServer::Options options;
  options.listen = "127.0.0.1:0";
  options.max_body_bytes = max_body_bytes;
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

HttpResponse Text(std::string body) {
  HttpResponse response;
  response.body = std::move(body);
  return response;
}

TEST(HttpServerTest, RoutesExactPathsAndMethods) {
  std::unique_ptr<HttpServer> server = StartOnFreePort();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->port(), 0);
  server->Handle("GET", "/a", [](const HttpRequest& r) {
    return Text("get a, since=" + QueryParam(r.query, "since"));
  });
  server->Handle("POST", "/a", [](const HttpRequest& r) {
    HttpResponse response =
        Text("posted " + r.body + " auth=" + r.authorization);
    response.status = 201;
    response.headers.emplace_back("X-Extra", "1");
    return response;
  });

  HttpResult get = HttpRequestTo(server->port(), "GET", "/a?x=1&since=42");
  EXPECT_EQ(get.status, 200) << get.raw;
  EXPECT_EQ(get.body, "get a, since=42");
  EXPECT_EQ(get.headers["content-length"], "15");

  HttpResult post = HttpRequestTo(server->port(), "POST", "/a",
                                  {{"Authorization", "Bearer t"}}, "hello");
  EXPECT_EQ(post.status, 201) << post.raw;
  EXPECT_EQ(post.body, "posted hello auth=Bearer t");
  EXPECT_EQ(post.headers["x-extra"], "1");

  HttpResult head = HttpRequestTo(server->port(), "HEAD", "/a");
  EXPECT_EQ(head.status, 200) << head.raw;
  EXPECT_EQ(head.body, "");

  HttpResult put = HttpRequestTo(server->port(), "PUT", "/a", {}, "x");
  EXPECT_EQ(put.status, 405) << put.raw;
  EXPECT_EQ(put.headers["allow"], "GET, POST");

  // civetweb hands "/a/b" to the "/a" handler; it is still not found.
  EXPECT_EQ(HttpRequestTo(server->port(), "GET", "/a/b").status, 404);
  EXPECT_EQ(HttpRequestTo(server->port(), "GET", "/nothing").status, 404);
}

TEST(HttpServerTest, RefusesBodiesOverTheLimit) {
  std::unique_ptr<HttpServer> server = StartOnFreePort(/*max_body_bytes=*/8);
  ASSERT_NE(server, nullptr);
  int calls = 0;
  server->Handle("POST", "/p", [&calls](const HttpRequest&) {
    ++calls;
    return Text("ok");
  });
  EXPECT_EQ(HttpRequestTo(server->port(), "POST", "/p", {}, "12345678").status,
            200);
  HttpResult big = HttpRequestTo(server->port(), "POST", "/p", {}, "123456789");
  EXPECT_EQ(big.status, 413) << big.raw;
  EXPECT_EQ(calls, 1);
}

TEST(HttpServerTest, ABoundPortIsRefusedWithItsAddress) {
  std::unique_ptr<HttpServer> first = StartOnFreePort();
  ASSERT_NE(first, nullptr);
  HttpServer::Options options;
  options.listen = absl::StrCat("127.0.0.1:", first->port());
  absl::StatusOr<std::unique_ptr<HttpServer>> second =
      HttpServer::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), options.listen))
      << second.status();
}

// What prometheus-cpp's Exposer serves for a registry, and what our /metrics
// serves for the same registry, must not differ: a scrape config or dashboard
// built against the old port keeps working.
TEST(MetricsScrapeTest, SameBytesAsPrometheusCppExposer) {
  Metrics metrics;
  metrics.SetWorkerCounts(3, 1, 0);
  metrics.SetGeneration(2);
  metrics.SetSealedStep(17);
  metrics.SetPolicyVersion(4);
  metrics.ObserveScheduleLatency(0.002);
  hsdp::v1::StepReport report;
  report.set_rank(1);
  report.set_step(17);
  report.set_loss(2.75);
  report.set_step_seconds(0.25);
  report.set_peak_memory_bytes(1 << 20);
  metrics.RecordReport(report);

  prometheus::Exposer exposer("127.0.0.1:0", /*num_threads=*/1);
  exposer.RegisterCollectable(metrics.registry());
  ASSERT_FALSE(exposer.GetListeningPorts().empty());
  const int exposer_port = exposer.GetListeningPorts().front();

  std::unique_ptr<HttpServer> server = StartOnFreePort();
  ASSERT_NE(server, nullptr);
  server->Handle("GET", "/metrics", [&metrics](const HttpRequest&) {
    HttpResponse response;
    response.content_type = Metrics::kScrapeContentType;
    response.body = metrics.Scrape();
    return response;
  });

  // First scrapes: every value, the scrape counters included, is the same.
  HttpResult want = HttpRequestTo(exposer_port, "GET", "/metrics");
  HttpResult got = HttpRequestTo(server->port(), "GET", "/metrics");
  ASSERT_EQ(want.status, 200) << want.raw;
  ASSERT_EQ(got.status, 200) << got.raw;
  EXPECT_EQ(got.headers["content-type"], want.headers["content-type"]);
  EXPECT_EQ(got.body, want.body);
  EXPECT_TRUE(absl::StrContains(got.body, "hsdp_rank_loss{rank=\"1\"} 2.75"))
      << got.body;

  // Later scrapes: the scrape counters count (their values now depend on
  // timing and sizes); every other line is still byte-identical.
  want = HttpRequestTo(exposer_port, "GET", "/metrics");
  got = HttpRequestTo(server->port(), "GET", "/metrics");
  auto without_values = [](const std::string& body) {
    std::vector<std::string> lines;
    for (absl::string_view line : absl::StrSplit(body, '\n')) {
      if (absl::StartsWith(line, "exposer_")) {
        line = line.substr(0, line.rfind(' '));
      }
      lines.emplace_back(line);
    }
    return lines;
  };
  EXPECT_EQ(without_values(got.body), without_values(want.body));
  EXPECT_TRUE(absl::StrContains(got.body, "exposer_scrapes_total 1\n"))
      << got.body;
}

hsdp::v1::StepReport Report(int rank, int64_t step, double loss,
                            double seconds) {
  hsdp::v1::StepReport report;
  report.set_rank(rank);
  report.set_step(step);
  report.set_loss(loss);
  report.set_step_seconds(seconds);
  report.set_tokens_per_second(100);
  report.set_peak_memory_bytes(1000 * (rank + 1));
  return report;
}

TEST(StepHistoryTest, OnePointPerStepAcrossRanks) {
  StepHistory history;
  history.Record(Report(0, 3, 2.0, 0.5));
  history.Record(Report(1, 3, 3.0, 0.75));
  // A rank's second report of a step (trained again) does not count twice.
  history.Record(Report(1, 3, 9.0, 9.0));
  std::vector<StepSample> points = history.Since(-1);
  ASSERT_EQ(points.size(), 1u);
  EXPECT_EQ(points[0].step, 3);
  EXPECT_DOUBLE_EQ(points[0].loss, 2.5);
  EXPECT_DOUBLE_EQ(points[0].step_seconds, 0.75);
  EXPECT_DOUBLE_EQ(points[0].tokens_per_second, 200);
  EXPECT_EQ(points[0].peak_memory_bytes, 2000);
  EXPECT_EQ(points[0].ranks, 2);
}

TEST(StepHistoryTest, KeepsTheNewestStepsInOrder) {
  StepHistory history(/*capacity=*/4);
  for (int64_t step : {5, 3, 4, 0, 1, 2, 6, 7}) {
    history.Record(Report(0, step, static_cast<double>(step), 0.1));
  }
  std::vector<int64_t> steps;
  for (const StepSample& p : history.Since(-1)) steps.push_back(p.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 5, 6, 7}));
  // Older than the window: dropped, not inserted.
  history.Record(Report(0, 1, 1.0, 0.1));
  steps.clear();
  for (const StepSample& p : history.Since(5)) steps.push_back(p.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(history.Since(-1).size(), 4u);
  EXPECT_TRUE(history.Since(7).empty());
  history.Record(Report(-1, 8, 1.0, 0.1));
  EXPECT_TRUE(history.Since(7).empty());
}

TEST(DashboardUrlTest, NamesAnAddressABrowserCanOpen) {
  EXPECT_EQ(DashboardUrl("127.0.0.1:0", 4242, ""), "http://127.0.0.1:4242/");
  EXPECT_EQ(DashboardUrl("[::1]:9090", 9090, ""), "http://[::1]:9090/");
  EXPECT_EQ(DashboardUrl("0.0.0.0:9090", 9090, "http://dash.example:80/"),
            "http://dash.example:80/");
  char host[HOST_NAME_MAX + 1] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  const std::string want = absl::StrCat("http://", host, ":9090/");
  EXPECT_EQ(DashboardUrl("0.0.0.0:9090", 9090, ""), want);
  EXPECT_EQ(DashboardUrl("[::]:9090", 9090, ""), want);
  EXPECT_EQ(DashboardUrl(":9090", 9090, ""), want);
  EXPECT_EQ(DashboardUrl("9090", 9090, ""), want);
}

}  // namespace
}  // namespace hsdp::coordinator

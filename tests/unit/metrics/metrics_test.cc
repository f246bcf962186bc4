// The Prometheus registry (rendering, collectors, bounds, misuse) and the
// HTTP exporter, driven by a raw socket client.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/common/logging.h"
#include "server/metrics/http_exporter.h"
#include "spdlog/sinks/ostream_sink.h"

namespace opjit::metrics {
namespace {

using std::chrono::steady_clock;

// Captures what Logger("metrics") writes while it lives.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(stream_)) {
    sink_->set_pattern("%v");
    Logger("metrics")->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = Logger("metrics")->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::string text() {
    Logger("metrics")->flush();
    return stream_.str();
  }
  int Count(const std::string& needle) {
    const std::string s = text();
    int n = 0;
    for (size_t pos = s.find(needle); pos != std::string::npos; pos = s.find(needle, pos + 1)) {
      ++n;
    }
    return n;
  }

 private:
  std::ostringstream stream_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

TEST(RegistryTest, RendersCounterWithEscapedLabels) {
  Registry r;
  r.DeclareCounter("opjit_rpc_total", "RPCs handled.", {"method", "code"});
  r.Inc("opjit_rpc_total", {"Run", "OK"});
  r.Inc("opjit_rpc_total", {"Run", "OK"}, 2);
  r.Inc("opjit_rpc_total", {"Compile", "INTERNAL"});
  r.Inc("opjit_rpc_total", {"we\\ird\"op\nname", "OK"}, 0.5);
  EXPECT_EQ(r.Render(),
            "# HELP opjit_rpc_total RPCs handled.\n"
            "# TYPE opjit_rpc_total counter\n"
            "opjit_rpc_total{method=\"Compile\",code=\"INTERNAL\"} 1\n"
            "opjit_rpc_total{method=\"Run\",code=\"OK\"} 3\n"
            "opjit_rpc_total{method=\"we\\\\ird\\\"op\\nname\",code=\"OK\"} 0.5\n");
}

TEST(RegistryTest, RendersGaugeWithoutLabelsAndEscapedHelp) {
  Registry r;
  r.DeclareGauge("opjit_up", "Line one\nback\\slash \"quotes\" stay.", {});
  r.Set("opjit_up", {}, 7);
  r.Set("opjit_up", {}, 3);
  r.Inc("opjit_up", {}, -1);
  EXPECT_EQ(r.Render(),
            "# HELP opjit_up Line one\\nback\\\\slash \"quotes\" stay.\n"
            "# TYPE opjit_up gauge\n"
            "opjit_up 2\n");
}

TEST(RegistryTest, RendersHistogramCumulatively) {
  Registry r;
  // Unsorted, duplicated and infinite bounds are normalised.
  r.DeclareHistogram("opjit_latency_seconds", "Latency.", {"op"},
                     {2.5, 0.5, 1, 1, std::numeric_limits<double>::infinity()});
  r.Observe("opjit_latency_seconds", {"add"}, 0.25);
  r.Observe("opjit_latency_seconds", {"add"}, 1);  // le is inclusive
  r.Observe("opjit_latency_seconds", {"add"}, 3);
  r.Observe("opjit_latency_seconds", {"mul"}, 0.5);
  EXPECT_EQ(r.Render(),
            "# HELP opjit_latency_seconds Latency.\n"
            "# TYPE opjit_latency_seconds histogram\n"
            "opjit_latency_seconds_bucket{op=\"add\",le=\"0.5\"} 1\n"
            "opjit_latency_seconds_bucket{op=\"add\",le=\"1\"} 2\n"
            "opjit_latency_seconds_bucket{op=\"add\",le=\"2.5\"} 2\n"
            "opjit_latency_seconds_bucket{op=\"add\",le=\"+Inf\"} 3\n"
            "opjit_latency_seconds_sum{op=\"add\"} 4.25\n"
            "opjit_latency_seconds_count{op=\"add\"} 3\n"
            "opjit_latency_seconds_bucket{op=\"mul\",le=\"0.5\"} 1\n"
            "opjit_latency_seconds_bucket{op=\"mul\",le=\"1\"} 1\n"
            "opjit_latency_seconds_bucket{op=\"mul\",le=\"2.5\"} 1\n"
            "opjit_latency_seconds_bucket{op=\"mul\",le=\"+Inf\"} 1\n"
            "opjit_latency_seconds_sum{op=\"mul\"} 0.5\n"
            "opjit_latency_seconds_count{op=\"mul\"} 1\n");
}

TEST(RegistryTest, HistogramWithoutLabels) {
  Registry r;
  r.DeclareHistogram("h", "", {}, {1});
  r.Observe("h", {}, 0.5);
  EXPECT_EQ(r.Render(),
            "# HELP h \n"
            "# TYPE h histogram\n"
            "h_bucket{le=\"1\"} 1\n"
            "h_bucket{le=\"+Inf\"} 1\n"
            "h_sum 0.5\n"
            "h_count 1\n");
}

TEST(RegistryTest, FamiliesInDeclarationOrderSeriesSorted) {
  Registry r;
  r.DeclareGauge("zeta", "Z.", {"k"});
  r.DeclareCounter("alpha", "A.", {});
  r.DeclareHistogram("empty", "No series yet.", {"k"}, {1});
  r.Set("zeta", {"b"}, 1);
  r.Set("zeta", {"a"}, 2);
  r.Set("zeta", {"c"}, 3);
  r.Inc("alpha", {});
  EXPECT_EQ(r.Render(),
            "# HELP zeta Z.\n"
            "# TYPE zeta gauge\n"
            "zeta{k=\"a\"} 2\n"
            "zeta{k=\"b\"} 1\n"
            "zeta{k=\"c\"} 3\n"
            "# HELP alpha A.\n"
            "# TYPE alpha counter\n"
            "alpha 1\n"
            "# HELP empty No series yet.\n"
            "# TYPE empty histogram\n");
}

TEST(RegistryTest, FormatsValues) {
  Registry r;
  r.DeclareGauge("g", "G.", {"k"});
  r.Set("g", {"a_int"}, 123456789);
  r.Set("g", {"b_frac"}, 0.1);
  r.Set("g", {"c_big"}, 1e20);
  r.Set("g", {"d_nan"}, std::nan(""));
  r.Set("g", {"e_inf"}, std::numeric_limits<double>::infinity());
  r.Set("g", {"f_ninf"}, -std::numeric_limits<double>::infinity());
  r.Set("g", {"g_neg"}, -42);
  EXPECT_EQ(r.Render(),
            "# HELP g G.\n"
            "# TYPE g gauge\n"
            "g{k=\"a_int\"} 123456789\n"
            "g{k=\"b_frac\"} 0.1\n"
            "g{k=\"c_big\"} 1e+20\n"
            "g{k=\"d_nan\"} NaN\n"
            "g{k=\"e_inf\"} +Inf\n"
            "g{k=\"f_ninf\"} -Inf\n"
            "g{k=\"g_neg\"} -42\n");
}

TEST(RegistryTest, CollectorsRefreshGaugesAndClearDropsVanishedSeries) {
  Registry r;
  r.DeclareGauge("opjit_namespace_bytes", "Bytes per namespace.", {"namespace"});
  std::map<std::string, double> bytes = {{"default", 100}, {"team", 5}};
  int runs = 0;
  r.AddCollector([&](Registry& reg) {
    ++runs;
    reg.ClearGauge("opjit_namespace_bytes");
    for (const auto& [ns, b] : bytes) reg.Set("opjit_namespace_bytes", {ns}, b);
  });
  EXPECT_EQ(r.Render(),
            "# HELP opjit_namespace_bytes Bytes per namespace.\n"
            "# TYPE opjit_namespace_bytes gauge\n"
            "opjit_namespace_bytes{namespace=\"default\"} 100\n"
            "opjit_namespace_bytes{namespace=\"team\"} 5\n");
  bytes.erase("team");
  bytes["default"] = 250;
  EXPECT_EQ(r.Render(),
            "# HELP opjit_namespace_bytes Bytes per namespace.\n"
            "# TYPE opjit_namespace_bytes gauge\n"
            "opjit_namespace_bytes{namespace=\"default\"} 250\n");
  EXPECT_EQ(runs, 2);
}

TEST(RegistryTest, CollectorsRunInOrderAndMayAddCollectors) {
  Registry r;
  r.DeclareGauge("g", "G.", {});
  std::vector<int> order;
  r.AddCollector([&](Registry& reg) {
    order.push_back(1);
    reg.Set("g", {}, 1);
  });
  r.AddCollector([&](Registry& reg) {
    order.push_back(2);
    reg.Set("g", {}, 2);  // later collectors win
    if (order.size() == 2) reg.AddCollector([&](Registry&) { order.push_back(3); });
  });
  EXPECT_NE(r.Render().find("\ng 2\n"), std::string::npos);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  r.Render();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 1, 2, 3}));
}

TEST(RegistryTest, SeriesCapFoldsNewLabelSetsIntoOther) {
  LogCapture log;
  Registry::Options options;
  options.max_series_per_family = 2;
  Registry r(options);
  r.DeclareCounter("ops_total", "Ops.", {"ns", "op"});
  r.Inc("ops_total", {"n", "a"});
  r.Inc("ops_total", {"n", "b"});
  for (int i = 0; i < 100; ++i) r.Inc("ops_total", {"n", "attacker" + std::to_string(i)});
  r.Inc("ops_total", {"n", "a"}, 5);  // existing series keep counting
  EXPECT_EQ(r.Render(),
            "# HELP ops_total Ops.\n"
            "# TYPE ops_total counter\n"
            "ops_total{ns=\"_other\",op=\"_other\"} 100\n"
            "ops_total{ns=\"n\",op=\"a\"} 6\n"
            "ops_total{ns=\"n\",op=\"b\"} 1\n");
  EXPECT_EQ(log.Count("reached 2 series"), 1);
}

TEST(RegistryTest, SeriesCapAppliesToHistogramsAndDefaultIsTenThousand) {
  Registry::Options options;
  EXPECT_EQ(options.max_series_per_family, 10000u);
  Registry r;
  r.DeclareHistogram("h", "H.", {"op"}, {1});
  for (int i = 0; i < 10050; ++i) r.Observe("h", {"op" + std::to_string(i)}, 0.5);
  const std::string text = r.Render();
  size_t series = 0;
  for (size_t pos = text.find("h_count{"); pos != std::string::npos;
       pos = text.find("h_count{", pos + 1)) {
    ++series;
  }
  EXPECT_EQ(series, 10001u);
  EXPECT_NE(text.find("h_count{op=\"_other\"} 50\n"), std::string::npos);
  EXPECT_NE(text.find("h_bucket{op=\"_other\",le=\"1\"} 50\n"), std::string::npos);
}

TEST(RegistryTest, LongLabelValuesAreTruncatedAtCharacterBoundary) {
  Registry::Options options;
  options.max_label_value_bytes = 4;
  Registry r(options);
  r.DeclareCounter("c", "C.", {"op"});
  r.Inc("c", {"abcdefgh"});
  r.Inc("c", {"abcdXYZ"});       // same first 4 bytes: same series
  r.Inc("c", {"abc\xC3\xA9"});   // "abcé": é would straddle byte 4
  r.Inc("c", {"ab\xC3\xA9xy"});  // "abéxy": é ends at byte 4
  EXPECT_EQ(r.Render(),
            "# HELP c C.\n"
            "# TYPE c counter\n"
            "c{op=\"abc\"} 1\n"
            "c{op=\"abcd\"} 2\n"
            "c{op=\"ab\xC3\xA9\"} 1\n");  // sorted bytewise
}

TEST(RegistryTest, InvalidUtf8IsReplaced) {
  Registry r;
  r.DeclareCounter("c", "Bad \xFF help.", {"op"});
  r.Inc("c", {"x\xFFy\xC3"});
  r.Inc("c", {"ok\xE2\x82\xAC"});  // "ok€" stays
  EXPECT_EQ(r.Render(),
            "# HELP c Bad \xEF\xBF\xBD help.\n"
            "# TYPE c counter\n"
            "c{op=\"ok\xE2\x82\xAC\"} 1\n"
            "c{op=\"x\xEF\xBF\xBDy\xEF\xBF\xBD\"} 1\n");
}

TEST(RegistryTest, MisuseIsIgnoredAndLoggedOnce) {
  LogCapture log;
  Registry r;
  r.DeclareCounter("c", "C.", {"op"});
  r.DeclareGauge("g", "G.", {});
  r.DeclareHistogram("h", "H.", {}, {1});
  for (int i = 0; i < 3; ++i) {
    r.Inc("undeclared_total", {"x"});
    r.Set("undeclared_total", {}, 1);
    r.Observe("undeclared_total", {}, 1);
    r.ClearGauge("undeclared_total");
    r.Inc("c", {});          // too few label values
    r.Inc("c", {"a", "b"});  // too many
    r.Inc("c", {"a"}, -1);   // counters only go up
    r.Inc("c", {"a"}, std::nan(""));
    r.Set("c", {"a"}, 1);   // not a gauge
    r.Observe("g", {}, 1);  // not a histogram
    r.Inc("h", {});         // not a counter or gauge
    r.Observe("h", {}, std::nan(""));
    r.ClearGauge("c");  // not a gauge
  }
  EXPECT_EQ(r.Render(),
            "# HELP c C.\n# TYPE c counter\n"
            "# HELP g G.\n# TYPE g gauge\n"
            "# HELP h H.\n# TYPE h histogram\n");
  EXPECT_EQ(log.Count("undeclared metric \"undeclared_total\""), 1);
  EXPECT_EQ(log.Count("label values"), 1);
  EXPECT_EQ(log.Count("ignoring Inc of counter \"c\""), 1);
  EXPECT_EQ(log.Count("ignoring Set of counter"), 1);
  EXPECT_EQ(log.Count("ignoring Observe of gauge"), 1);
  EXPECT_EQ(log.Count("ignoring Inc of histogram"), 1);
  EXPECT_EQ(log.Count("NaN in histogram"), 1);
  EXPECT_EQ(log.Count("ignoring ClearGauge of counter"), 1);
}

TEST(RegistryTest, RedeclarationIsIdempotentAndConflictsKeepTheFirst) {
  LogCapture log;
  Registry r;
  r.DeclareCounter("c", "C.", {"op"});
  r.Inc("c", {"a"});
  r.DeclareCounter("c", "C.", {"op"});  // identical: no-op, series kept
  r.DeclareGauge("c", "C.", {"op"});    // conflicting type
  r.DeclareCounter("c", "Other.", {"op", "ns"});
  r.Inc("c", {"a"});
  EXPECT_EQ(r.Render(),
            "# HELP c C.\n"
            "# TYPE c counter\n"
            "c{op=\"a\"} 2\n");
  EXPECT_EQ(log.Count("conflicting re-declaration of metric \"c\""), 1);
}

TEST(RegistryTest, InvalidDeclarationsAreIgnored) {
  LogCapture log;
  Registry r;
  r.DeclareCounter("1bad", "", {});
  r.DeclareCounter("bad-name", "", {});
  r.DeclareCounter("c1", "", {"bad-label"});
  r.DeclareCounter("c2", "", {"__reserved"});
  r.DeclareCounter("c3", "", {"a", "a"});
  r.DeclareHistogram("h", "", {"le"}, {1});
  r.DeclareGauge("ns:ok_name", "Colons are allowed.", {"_x1"});
  r.Inc("c1", {"v"});
  EXPECT_EQ(r.Render(),
            "# HELP ns:ok_name Colons are allowed.\n"
            "# TYPE ns:ok_name gauge\n");
  EXPECT_EQ(log.Count("ignoring declaration"), 6);
}

TEST(RegistryTest, ConcurrentUpdatesAreCounted) {
  Registry r;
  r.DeclareCounter("c", "C.", {"t"});
  r.DeclareHistogram("h", "H.", {}, {0.5});
  std::atomic<bool> done{false};
  std::thread renderer([&] {
    while (!done.load()) r.Render();
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&r, t] {
      for (int i = 0; i < 5000; ++i) {
        r.Inc("c", {t % 2 == 0 ? "even" : "odd"});
        r.Observe("h", {}, 1);
      }
    });
  }
  for (auto& t : threads) t.join();
  done = true;
  renderer.join();
  const std::string text = r.Render();
  EXPECT_NE(text.find("c{t=\"even\"} 20000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("c{t=\"odd\"} 20000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("h_count 40000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("h_bucket{le=\"0.5\"} 0\n"), std::string::npos) << text;
}

// ---------------------------------------------------------------------------
// HttpExporter

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

struct HttpResponse {
  std::string status_line;
  std::string headers;  // each "Name: value\r\n"
  std::string body;
};

// Sends `raw` on a fresh connection and reads the reply until EOF.
HttpResponse Fetch(int port, const std::string& raw) {
  HttpResponse r;
  const int fd = Connect(port);
  if (fd < 0) {
    ADD_FAILURE() << "connect failed";
    return r;
  }
  EXPECT_EQ(send(fd, raw.data(), raw.size(), MSG_NOSIGNAL), static_cast<ssize_t>(raw.size()));
  const std::string reply = ReadAll(fd);
  close(fd);
  const size_t line_end = reply.find("\r\n");
  const size_t head_end = reply.find("\r\n\r\n");
  if (line_end == std::string::npos || head_end == std::string::npos) {
    ADD_FAILURE() << "malformed reply: " << reply;
    return r;
  }
  r.status_line = reply.substr(0, line_end);
  r.headers = reply.substr(line_end + 2, head_end + 2 - (line_end + 2));
  r.body = reply.substr(head_end + 4);
  return r;
}

std::unique_ptr<HttpExporter> StartOrDie(std::function<std::string()> render,
                                         const HttpExporter::Options& options = {}) {
  auto exporter = HttpExporter::Start("127.0.0.1:0", std::move(render), options);
  EXPECT_TRUE(exporter.ok()) << exporter.status();
  return exporter.ok() ? std::move(*exporter) : nullptr;
}

TEST(HttpExporterTest, ServesMetrics) {
  Registry r;
  r.DeclareCounter("opjit_rpc_total", "RPCs.", {"method"});
  r.Inc("opjit_rpc_total", {"Run"}, 3);
  auto exporter = StartOrDie([&r] { return r.Render(); });
  ASSERT_NE(exporter, nullptr);
  EXPECT_GT(exporter->port(), 0);
  EXPECT_EQ(exporter->address(), "127.0.0.1:" + std::to_string(exporter->port()));

  const std::string expected_body =
      "# HELP opjit_rpc_total RPCs.\n"
      "# TYPE opjit_rpc_total counter\n"
      "opjit_rpc_total{method=\"Run\"} 3\n";
  HttpResponse resp = Fetch(exporter->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 200 OK");
  EXPECT_NE(resp.headers.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            std::string::npos)
      << resp.headers;
  EXPECT_NE(resp.headers.find("Content-Length: " + std::to_string(expected_body.size()) + "\r\n"),
            std::string::npos)
      << resp.headers;
  EXPECT_NE(resp.headers.find("Connection: close\r\n"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.body, expected_body);

  // Every scrape renders afresh; a query string is ignored; bare LF accepted.
  r.Inc("opjit_rpc_total", {"Run"});
  resp = Fetch(exporter->port(), "GET /metrics?x=1 HTTP/1.0\n\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 200 OK");
  EXPECT_NE(resp.body.find("opjit_rpc_total{method=\"Run\"} 4\n"), std::string::npos);
}

TEST(HttpExporterTest, IndexNotFoundWrongMethodBadRequest) {
  auto exporter = StartOrDie([] { return std::string("m 1\n"); });
  ASSERT_NE(exporter, nullptr);
  const int port = exporter->port();

  HttpResponse resp = Fetch(port, "GET / HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 200 OK");
  EXPECT_NE(resp.body.find("/metrics"), std::string::npos);

  resp = Fetch(port, "GET /other HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 404 Not Found");
  resp = Fetch(port, "GET /metrics/x HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 404 Not Found");

  resp = Fetch(port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 405 Method Not Allowed");
  EXPECT_NE(resp.headers.find("Allow: GET\r\n"), std::string::npos);
  resp = Fetch(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 405 Method Not Allowed");

  resp = Fetch(port, "garbage\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 400 Bad Request");
  resp = Fetch(port, "GET /metrics SMTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 400 Bad Request");

  // Still serving after all that.
  resp = Fetch(port, "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status_line, "HTTP/1.0 200 OK");
  EXPECT_EQ(resp.body, "m 1\n");
}

TEST(HttpExporterTest, OversizedRequestIsRefused) {
  auto exporter = StartOrDie([] { return std::string(); });
  ASSERT_NE(exporter, nullptr);
  std::string raw = "GET /metrics HTTP/1.0\r\nX-Big: " + std::string(9000, 'a') + "\r\n\r\n";
  HttpResponse resp = Fetch(exporter->port(), raw);
  EXPECT_EQ(resp.status_line, "HTTP/1.0 431 Request Header Fields Too Large");
  // Just under the cap is fine.
  raw = "GET /metrics HTTP/1.0\r\nX-Big: " + std::string(8000, 'a') + "\r\n\r\n";
  resp = Fetch(exporter->port(), raw);
  EXPECT_EQ(resp.status_line, "HTTP/1.0 200 OK");
}

TEST(HttpExporterTest, IdleClientIsDroppedAfterReadTimeout) {
  HttpExporter::Options options;
  options.read_timeout_ms = 200;
  auto exporter = StartOrDie([] { return std::string("m 1\n"); }, options);
  ASSERT_NE(exporter, nullptr);
  const int idle = Connect(exporter->port());
  ASSERT_GE(idle, 0);
  const auto start = steady_clock::now();
  EXPECT_EQ(ReadAll(idle), "");  // closed without a response
  const auto waited = steady_clock::now() - start;
  close(idle);
  EXPECT_GE(waited, std::chrono::milliseconds(150));
  EXPECT_LT(waited, std::chrono::seconds(3));
  EXPECT_EQ(Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").body, "m 1\n");
}

TEST(HttpExporterTest, DestructorReturnsPromptly) {
  auto exporter = StartOrDie([] { return std::string(); });
  ASSERT_NE(exporter, nullptr);
  auto start = steady_clock::now();
  exporter.reset();
  EXPECT_LT(steady_clock::now() - start, std::chrono::milliseconds(500));

  // Even while a client holds a connection open without sending anything
  // (the thread is waiting out the 2 s read timeout).
  exporter = StartOrDie([] { return std::string(); });
  ASSERT_NE(exporter, nullptr);
  const int port = exporter->port();
  const int idle = Connect(port);
  ASSERT_GE(idle, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  start = steady_clock::now();
  exporter.reset();
  EXPECT_LT(steady_clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_EQ(ReadAll(idle), "");
  close(idle);
  // The port is released.
  EXPECT_LT(Connect(port), 0);
}

TEST(HttpExporterTest, LocalhostAndAddressErrors) {
  auto exporter = HttpExporter::Start("localhost:0", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  EXPECT_EQ((*exporter)->address(), "127.0.0.1:" + std::to_string((*exporter)->port()));
  EXPECT_EQ(Fetch((*exporter)->port(), "GET /metrics HTTP/1.0\r\n\r\n").body, "x 1\n");

  // The port is taken.
  auto taken = HttpExporter::Start("127.0.0.1:" + std::to_string((*exporter)->port()),
                                   [] { return std::string(); });
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable) << taken.status();
  // Not a local address.
  auto foreign = HttpExporter::Start("192.0.2.1:0", [] { return std::string(); });
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kUnavailable) << foreign.status();

  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:", ":9464", "127.0.0.1:abc",
                          "127.0.0.1:70000", "127.0.0.1:-1", "127.0.0.1:123456", "[::1]:9464",
                          "::1:9464", "example.com:9464", "1.2.3:9464", "127.0.0.1:80 "}) {
    auto s = HttpExporter::Start(bad, [] { return std::string(); });
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s.status();
  }
  auto no_render = HttpExporter::Start("127.0.0.1:0", nullptr);
  EXPECT_EQ(no_render.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace opjit::metrics

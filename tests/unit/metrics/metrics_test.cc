// The Prometheus registry (rendering, collectors, bounds, misuse) and the
// HTTP exporter, driven by a raw socket client.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
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
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
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
            "alpha 1\n");  // "empty" has no series: no HELP/TYPE either
}

TEST(RegistryTest, EmptyFamiliesAppearWithTheirFirstSeries) {
  Registry r;
  r.DeclareCounter("c_total", "C.", {"op"});
  r.DeclareGauge("g", "G.", {"namespace"});
  EXPECT_EQ(r.Render(), "");
  r.Set("g", {"alice"}, 1);
  EXPECT_EQ(r.Render(), "# HELP g G.\n# TYPE g gauge\ng{namespace=\"alice\"} 1\n");
  r.ClearGauge("g");
  EXPECT_EQ(r.Render(), "");
}

TEST(RegistryTest, SetCounterMirrorsATotalKeptElsewhere) {
  LogCapture log;
  Registry r;
  r.DeclareCounter("compiles_total", "Compiles.", {"tier"});
  r.DeclareGauge("g", "G.", {});
  r.SetCounter("compiles_total", {"disk"}, 7);
  r.SetCounter("compiles_total", {"disk"}, 9);
  r.SetCounter("compiles_total", {"disk"}, -1);            // ignored
  r.SetCounter("compiles_total", {"disk"}, std::nan(""));  // ignored
  r.SetCounter("g", {}, 1);                                // not a counter
  r.Inc("compiles_total", {"disk"});
  EXPECT_EQ(r.Render(),
            "# HELP compiles_total Compiles.\n"
            "# TYPE compiles_total counter\n"
            "compiles_total{tier=\"disk\"} 10\n");
  EXPECT_EQ(log.Count("ignoring SetCounter of counter \"compiles_total\""), 1);
  EXPECT_EQ(log.Count("ignoring SetCounter of gauge"), 1);
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
  EXPECT_EQ(r.Render(), "");  // nothing was recorded
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
  r.Set("ns:ok_name", {"y"}, 1);
  EXPECT_EQ(r.Render(),
            "# HELP ns:ok_name Colons are allowed.\n"
            "# TYPE ns:ok_name gauge\n"
            "ns:ok_name{_x1=\"y\"} 1\n");
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

// Checks `text` line by line against the text exposition format 0.0.4 as
// Prometheus parses it: HELP then TYPE once per family, before its samples;
// every sample belongs to the family typed last (with _bucket/_sum/_count for
// histograms); label values are quoted with only \\, \" and \n escapes.
// Returns "" or the first problem.
std::string ExpositionProblem(const std::string& text) {
  static const std::regex kHelp(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .*)");
  static const std::regex kType(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram))");
  static const std::regex kSample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")*\})? (-?[0-9.e+]+|NaN|\+Inf|-Inf))");
  if (!text.empty() && text.back() != '\n') return "no final newline";
  std::set<std::string> seen;
  std::string help, family, type;
  std::istringstream in(text);
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_match(line, m, kHelp)) {
      if (!seen.insert(m[1]).second) return "family twice: " + line;
      help = m[1];
    } else if (std::regex_match(line, m, kType)) {
      if (m[1] != help) return "TYPE without its HELP: " + line;
      family = m[1];
      type = m[2];
    } else if (std::regex_match(line, m, kSample)) {
      const std::string name = m[1];
      const bool ok =
          name == family ||
          (type == "histogram" &&
           (name == family + "_bucket" || name == family + "_sum" || name == family + "_count"));
      if (!ok) return "sample outside its family: " + line;
    } else {
      return "unparsable line: " + line;
    }
  }
  return "";
}

// The families and series a daemon has: per-namespace ones, server-wide ones,
// a histogram with a namespace label, and one family only bob uses.
void DeclareTenantMetrics(Registry& r) {
  r.DeclareCounter("calls_total", "Calls.", {"method", "namespace", "op"});
  r.DeclareGauge("shm_bytes", "Shared memory.", {"namespace"});
  r.DeclareCounter("cache_hits_total", "Cache hits.", {"tier"});
  r.DeclareGauge("namespaces", "Namespaces.", {});
  r.DeclareHistogram("kernel_seconds", "Kernel time.", {"namespace"}, {1});
  r.DeclareCounter("bob_only_total", "Only bob has these.", {"op", "namespace"});
  r.DeclareCounter("nobody_total", "Declared, never updated.", {"namespace"});
  r.Inc("calls_total", {"Forward", "alice", "scale"}, 3);
  r.Inc("calls_total", {"Forward", "alice", "we\\ird\"op\nname"});
  r.Inc("calls_total", {"Forward", "bob", "secret_bob_op"}, 7);
  r.Inc("calls_total", {"Forward", "carol", "carols"}, 2);
  r.Set("shm_bytes", {"alice"}, 4096);
  r.Set("shm_bytes", {"bob"}, 8192);
  r.SetCounter("cache_hits_total", {"memory"}, 11);
  r.Set("namespaces", {}, 3);
  r.Observe("kernel_seconds", {"alice"}, 0.5);
  r.Observe("kernel_seconds", {"bob"}, 2);
  r.Inc("bob_only_total", {"secret_bob_op", "bob"});
}

TEST(RegistryTest, FilteredRenderShowsOnlyTheNamespacesSeries) {
  Registry r;
  DeclareTenantMetrics(r);
  const std::string alice = r.Render(Registry::RenderFilter::Namespaces({"alice"}));
  EXPECT_EQ(alice,
            "# HELP calls_total Calls.\n"
            "# TYPE calls_total counter\n"
            "calls_total{method=\"Forward\",namespace=\"alice\",op=\"scale\"} 3\n"
            "calls_total{method=\"Forward\",namespace=\"alice\",op=\"we\\\\ird\\\"op\\nname\"} 1\n"
            "# HELP shm_bytes Shared memory.\n"
            "# TYPE shm_bytes gauge\n"
            "shm_bytes{namespace=\"alice\"} 4096\n"
            "# HELP kernel_seconds Kernel time.\n"
            "# TYPE kernel_seconds histogram\n"
            "kernel_seconds_bucket{namespace=\"alice\",le=\"1\"} 1\n"
            "kernel_seconds_bucket{namespace=\"alice\",le=\"+Inf\"} 1\n"
            "kernel_seconds_sum{namespace=\"alice\"} 0.5\n"
            "kernel_seconds_count{namespace=\"alice\"} 1\n");
  EXPECT_EQ(ExpositionProblem(alice), "");
  for (const char* hidden : {"bob", "carol", "cache_hits", "namespaces ", "nobody_total"}) {
    EXPECT_EQ(alice.find(hidden), std::string::npos) << hidden;
  }

  // Several namespaces; the namespace label need not come first.
  const std::string two = r.Render(Registry::RenderFilter::Namespaces({"bob", "carol"}));
  EXPECT_EQ(ExpositionProblem(two), "");
  EXPECT_NE(two.find("calls_total{method=\"Forward\",namespace=\"bob\",op=\"secret_bob_op\"} 7\n"),
            std::string::npos)
      << two;
  EXPECT_NE(two.find("calls_total{method=\"Forward\",namespace=\"carol\",op=\"carols\"} 2\n"),
            std::string::npos)
      << two;
  EXPECT_NE(two.find("# TYPE bob_only_total counter\n"
                     "bob_only_total{op=\"secret_bob_op\",namespace=\"bob\"} 1\n"),
            std::string::npos)
      << two;
  EXPECT_EQ(two.find("alice"), std::string::npos) << two;
  EXPECT_EQ(two.find("# HELP shm_bytes"), two.rfind("# HELP shm_bytes"));

  // A namespace nobody used, and none at all: nothing, not even HELP lines.
  EXPECT_EQ(r.Render(Registry::RenderFilter::Namespaces({"dave"})), "");
  EXPECT_EQ(r.Render(Registry::RenderFilter::Namespaces({})), "");
}

TEST(RegistryTest, UnfilteredRenderStillShowsEverything) {
  Registry r;
  DeclareTenantMetrics(r);
  const std::string all = r.Render();
  EXPECT_EQ(all, r.Render(Registry::RenderFilter::Everything()));
  EXPECT_EQ(ExpositionProblem(all), "");
  for (const char* shown :
       {"namespace=\"alice\",op=\"scale\"} 3\n", "op=\"secret_bob_op\"} 7\n",
        "cache_hits_total{tier=\"memory\"} 11\n", "\nnamespaces 3\n",
        "kernel_seconds_count{namespace=\"bob\"} 1\n"}) {
    EXPECT_NE(all.find(shown), std::string::npos) << shown;
  }
  EXPECT_EQ(all.find("nobody_total"), std::string::npos) << all;  // no series, no HELP/TYPE
}

TEST(RegistryTest, FilteredRenderLeavesOutTheOverflowSeries) {
  Registry::Options options;
  options.max_series_per_family = 2;
  Registry r(options);
  r.DeclareCounter("calls_total", "Calls.", {"namespace", "op"});
  r.Inc("calls_total", {"alice", "a"});
  r.Inc("calls_total", {"bob", "b"});
  r.Inc("calls_total", {"bob", "c"}, 5);  // folded into _other/_other
  EXPECT_NE(r.Render().find("calls_total{namespace=\"_other\",op=\"_other\"} 5\n"),
            std::string::npos);
  // Even a principal of a namespace called "_other" does not see it: it sums
  // up other namespaces.
  EXPECT_EQ(r.Render(Registry::RenderFilter::Namespaces({"alice", "_other"})),
            "# HELP calls_total Calls.\n"
            "# TYPE calls_total counter\n"
            "calls_total{namespace=\"alice\",op=\"a\"} 1\n");
}

TEST(RegistryTest, FilteredRenderRunsCollectors) {
  Registry r;
  r.DeclareGauge("shm_bytes", "Shared memory.", {"namespace"});
  int runs = 0;
  r.AddCollector([&runs](Registry& reg) {
    ++runs;
    reg.Set("shm_bytes", {"alice"}, runs);
  });
  EXPECT_EQ(r.Render(Registry::RenderFilter::Namespaces({"alice"})),
            "# HELP shm_bytes Shared memory.\n"
            "# TYPE shm_bytes gauge\n"
            "shm_bytes{namespace=\"alice\"} 1\n");
  EXPECT_EQ(runs, 1);
}

// ---------------------------------------------------------------------------
// HttpExporter

// A connection to 127.0.0.1:`port`, from `source` (another loopback
// address, to tell clients apart) when given.
int Connect(int port, const char* source = nullptr) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (source != nullptr) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    inet_pton(AF_INET, source, &from.sin_addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
      close(fd);
      return -1;
    }
  }
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
  std::string status;   // the status line without its version, e.g. "200 OK"
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
  EXPECT_EQ(r.status_line.substr(0, 7), "HTTP/1.") << r.status_line;
  r.status = r.status_line.substr(std::min(r.status_line.size(), size_t{9}));
  r.headers = reply.substr(line_end + 2, head_end + 2 - (line_end + 2));
  r.body = reply.substr(head_end + 4);
  return r;
}

// Sends `raw` on a fresh connection; everything read back until EOF.
std::string RawReply(int port, const std::string& raw) {
  const int fd = Connect(port);
  if (fd < 0) {
    ADD_FAILURE() << "connect failed";
    return "";
  }
  EXPECT_EQ(send(fd, raw.data(), raw.size(), MSG_NOSIGNAL), static_cast<ssize_t>(raw.size()));
  std::string reply = ReadAll(fd);
  close(fd);
  return reply;
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
  EXPECT_EQ(resp.status, "200 OK");
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
  EXPECT_EQ(resp.status, "200 OK");
  EXPECT_NE(resp.body.find("opjit_rpc_total{method=\"Run\"} 4\n"), std::string::npos);
}

TEST(HttpExporterTest, IndexNotFoundWrongMethodBadRequest) {
  auto exporter = StartOrDie([] { return std::string("m 1\n"); });
  ASSERT_NE(exporter, nullptr);
  const int port = exporter->port();

  HttpResponse resp = Fetch(port, "GET / HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status, "200 OK");
  EXPECT_NE(resp.body.find("/metrics"), std::string::npos);

  resp = Fetch(port, "GET /other HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status, "404 Not Found");
  resp = Fetch(port, "GET /metrics/x HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status, "404 Not Found");

  resp = Fetch(port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(resp.status, "405 Method Not Allowed");
  EXPECT_NE(resp.headers.find("Allow: GET, HEAD\r\n"), std::string::npos) << resp.headers;
  resp = Fetch(port, "DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(resp.status, "405 Method Not Allowed");
  // A body is not read, and does not stop the answer.
  resp = Fetch(port, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
  EXPECT_EQ(resp.status, "405 Method Not Allowed");
  // HEAD: the headers of GET, no body.
  resp = Fetch(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status, "200 OK");
  EXPECT_NE(resp.headers.find("Content-Length: 4\r\n"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.body, "");

  // A request line that is not one is refused, or the connection closed
  // without an answer (libmicrohttpd does that for some).
  EXPECT_EQ(RawReply(port, "garbage\r\n\r\n").find("200"), std::string::npos);
  resp = Fetch(port, "GET /metrics SMTP/1.0\r\n\r\n");
  EXPECT_NE(resp.status.substr(0, 1), "2") << resp.status;
  EXPECT_EQ(resp.body.find("m 1"), std::string::npos);

  // Still serving after all that.
  resp = Fetch(port, "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status, "200 OK");
  EXPECT_EQ(resp.body, "m 1\n");
}

TEST(HttpExporterTest, OversizedRequestIsRefused) {
  auto exporter = StartOrDie([] { return std::string(); });
  ASSERT_NE(exporter, nullptr);
  std::string raw = "GET /metrics HTTP/1.0\r\nX-Big: " + std::string(9000, 'a') + "\r\n\r\n";
  HttpResponse resp = Fetch(exporter->port(), raw);
  EXPECT_EQ(resp.status, "431 Request Header Fields Too Large");
  // Just under the cap is fine.
  raw = "GET /metrics HTTP/1.0\r\nX-Big: " + std::string(8000, 'a') + "\r\n\r\n";
  resp = Fetch(exporter->port(), raw);
  EXPECT_EQ(resp.status, "200 OK");
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

// Whether the server has closed `fd` (EOF or reset), without waiting.
bool ClosedByServer(int fd) {
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

TEST(HttpExporterTest, IdleConnectionsDoNotDelayAScrape) {
  // The single-threaded exporter this replaced read one connection at a
  // time: each of these held it for the whole read timeout.
  HttpExporter::Options options;
  options.read_timeout_ms = 5000;
  auto exporter = StartOrDie([] { return std::string("m 1\n"); }, options);
  ASSERT_NE(exporter, nullptr);
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) {
    const int fd = Connect(exporter->port());
    ASSERT_GE(fd, 0);
    const std::string partial = i % 2 == 0 ? "GET /metrics HTTP/1.1\r\n" : "GET /met";
    EXPECT_EQ(send(fd, partial.data(), partial.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(partial.size()));
    idle.push_back(fd);
  }
  const auto start = steady_clock::now();
  EXPECT_EQ(Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").body, "m 1\n");
  EXPECT_LT(steady_clock::now() - start, std::chrono::milliseconds(options.read_timeout_ms - 1000));
  for (int fd : idle) {
    EXPECT_FALSE(ClosedByServer(fd));  // still within their read timeout
    close(fd);
  }
}

TEST(HttpExporterTest, ATricklingClientIsCutOffAtTheHeadDeadline) {
  // One byte every 50 ms is never idle for libmicrohttpd's own (whole-second)
  // timeout; the head deadline still ends it.
  HttpExporter::Options options;
  options.read_timeout_ms = 300;
  auto exporter = StartOrDie([] { return std::string("m 1\n"); }, options);
  ASSERT_NE(exporter, nullptr);
  const int fd = Connect(exporter->port());
  ASSERT_GE(fd, 0);
  const std::string head = "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(200, 'a');
  const auto start = steady_clock::now();
  bool cut = false;
  for (char c : head) {
    if (send(fd, &c, 1, MSG_NOSIGNAL) != 1 || ClosedByServer(fd)) {
      cut = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto waited = steady_clock::now() - start;
  close(fd);
  EXPECT_TRUE(cut) << "a client trickling its head for 10 s was never cut off";
  EXPECT_GE(waited, std::chrono::milliseconds(250));
  EXPECT_LT(waited, std::chrono::seconds(5));
  EXPECT_EQ(Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").body, "m 1\n");
}

TEST(HttpExporterTest, ConnectionsPastThePerAddressLimitAreClosedAtOnce) {
  HttpExporter::Options options;
  options.max_connections_per_address = 4;
  options.read_timeout_ms = 20000;  // none is closed for idling here
  auto exporter = StartOrDie([] { return std::string("m 1\n"); }, options);
  ASSERT_NE(exporter, nullptr);
  std::vector<int> held;
  for (int i = 0; i < 8; ++i) {
    const int fd = Connect(exporter->port(), "127.0.0.2");
    ASSERT_GE(fd, 0);
    held.push_back(fd);
  }
  // Another address is not affected.
  EXPECT_EQ(Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").body, "m 1\n");
  // Four of 127.0.0.2's eight are closed at once; the other four stay open.
  std::vector<bool> closed(held.size());
  const auto count = [&] {
    for (size_t i = 0; i < held.size(); ++i) closed[i] = closed[i] || ClosedByServer(held[i]);
    return std::count(closed.begin(), closed.end(), true);
  };
  const auto deadline = steady_clock::now() + std::chrono::seconds(10);
  while (count() < 4 && steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // no more follow
  EXPECT_EQ(count(), 4);
  for (int fd : held) close(fd);
}

TEST(HttpExporterTest, TheIndexIsServedWhileAScrapeRenders) {
  // Several threads: a render in progress holds only its own connection.
  absl::Notification entered, release;
  auto exporter = StartOrDie([&] {
    entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(30));
    return std::string("m 1\n");
  });
  ASSERT_NE(exporter, nullptr);
  std::string scraped;
  std::thread scrape(
      [&] { scraped = Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").body; });
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(Fetch(exporter->port(), "GET / HTTP/1.0\r\n\r\n").status, "200 OK");
  EXPECT_FALSE(release.HasBeenNotified());
  release.Notify();
  scrape.join();
  EXPECT_EQ(scraped, "m 1\n");
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
  auto no_render = HttpExporter::Start("127.0.0.1:0", std::function<std::string()>());
  EXPECT_EQ(no_render.status().code(), absl::StatusCode::kInvalidArgument);
  auto no_handler = HttpExporter::Start("127.0.0.1:0", HttpExporter::Handler());
  EXPECT_EQ(no_handler.status().code(), absl::StatusCode::kInvalidArgument);
}

std::unique_ptr<HttpExporter> StartHandlerOrDie(HttpExporter::Handler handler) {
  auto exporter = HttpExporter::Start("127.0.0.1:0", std::move(handler));
  EXPECT_TRUE(exporter.ok()) << exporter.status();
  return exporter.ok() ? std::move(*exporter) : nullptr;
}

// A handler like the daemon's: only the bearer token "good" gets the body.
HttpExporter::Response RequireToken(const HttpExporter::Request& request) {
  if (request.authorization != "Bearer good") return HttpExporter::Response::Unauthorized("opjit");
  return HttpExporter::Response::Metrics("m 1\n");
}

TEST(HttpExporterTest, HandlerRefusesWithoutAuthorization) {
  auto exporter = StartHandlerOrDie(RequireToken);
  ASSERT_NE(exporter, nullptr);
  const int port = exporter->port();
  for (const std::string& head :
       {std::string("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nAuthorization: Bearer bad\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nAuthorization: Basic Z29vZA==\r\n\r\n"),
        std::string("GET /metrics HTTP/1.1\r\nAuthorization:\r\n\r\n")}) {
    HttpResponse resp = Fetch(port, head);
    EXPECT_EQ(resp.status, "401 Unauthorized") << head;
    EXPECT_NE(resp.headers.find("WWW-Authenticate: Bearer realm=\"opjit\"\r\n"), std::string::npos)
        << resp.headers;
    EXPECT_NE(resp.headers.find("Content-Type: text/plain; charset=utf-8\r\n"), std::string::npos)
        << resp.headers;
    EXPECT_NE(resp.body.find("Bearer"), std::string::npos) << resp.body;
    EXPECT_EQ(resp.body.find("m 1"), std::string::npos) << resp.body;
  }
  // The index and unknown paths do not ask the handler.
  EXPECT_EQ(Fetch(port, "GET / HTTP/1.0\r\n\r\n").status, "200 OK");
  EXPECT_EQ(Fetch(port, "GET /x HTTP/1.0\r\n\r\n").status, "404 Not Found");

  HttpResponse resp = Fetch(port, "GET /metrics HTTP/1.1\r\nAuthorization: Bearer good\r\n\r\n");
  EXPECT_EQ(resp.status, "200 OK");
  EXPECT_NE(resp.headers.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            std::string::npos)
      << resp.headers;
  EXPECT_EQ(resp.headers.find("WWW-Authenticate"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.body, "m 1\n");
}

TEST(HttpExporterTest, AuthorizationHeaderIsPassedThroughCaseInsensitively) {
  std::vector<std::optional<std::string>> seen;
  auto exporter = StartHandlerOrDie([&seen](const HttpExporter::Request& request) {
    seen.push_back(request.authorization);
    return HttpExporter::Response::Metrics("m 1\n");
  });
  ASSERT_NE(exporter, nullptr);
  const int port = exporter->port();
  const std::vector<std::string> heads = {
      "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nauthorization: Bearer lower\r\nAccept: */*\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nAUTHORIZATION:\t  Bearer  padded \t\r\n\r\n",
      "GET /metrics?x=1 HTTP/1.0\nAuThOrIzAtIoN:Bearer bare-lf\n\n",
      "GET /metrics HTTP/1.1\r\nX-Authorization: Bearer other\r\nAuthorizations: y\r\n\r\n",
      "GET /metrics HTTP/1.1\r\n\r\nAuthorization: Bearer in-the-body\r\n",
  };
  for (const std::string& head : heads) {
    EXPECT_EQ(Fetch(port, head).status, "200 OK") << head;
  }
  ASSERT_EQ(seen.size(), heads.size());
  EXPECT_EQ(seen[0], std::optional<std::string>("Bearer abc"));
  EXPECT_EQ(seen[1], std::optional<std::string>("Bearer lower"));
  EXPECT_EQ(seen[2], std::optional<std::string>("Bearer  padded"));
  EXPECT_EQ(seen[3], std::optional<std::string>("Bearer bare-lf"));
  EXPECT_EQ(seen[4], std::nullopt);  // other headers that merely contain the name
  EXPECT_EQ(seen[5], std::nullopt);  // after the head: a body, never read
}

TEST(HttpExporterTest, MalformedHeadersAreBadRequests) {
  int calls = 0;
  auto exporter = StartHandlerOrDie([&calls](const HttpExporter::Request&) {
    ++calls;
    return HttpExporter::Response::Metrics("m 1\n");
  });
  ASSERT_NE(exporter, nullptr);
  for (const char* head : {
           // Two Authorization headers: which one counts is ambiguous.
           "GET /metrics HTTP/1.1\r\nAuthorization: Bearer a\r\nauthorization: Bearer b\r\n\r\n",
           "GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
           "GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n",
           "GET /metrics HTTP/1.1\r\nAuthorization : Bearer a\r\n\r\n",
           "GET /metrics HTTP/1.1\r\nAuthorization\t: Bearer a\r\n\r\n",
       }) {
    EXPECT_EQ(Fetch(exporter->port(), head).status, "400 Bad Request") << head;
  }
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").body, "m 1\n");
  EXPECT_EQ(calls, 1);
}

TEST(HttpExporterTest, AFoldedHeaderLineNeverYieldsAnAuthorization) {
  std::vector<std::optional<std::string>> seen;
  auto exporter = StartHandlerOrDie([&seen](const HttpExporter::Request& request) {
    seen.push_back(request.authorization);
    return HttpExporter::Response::Metrics("m 1\n");
  });
  ASSERT_NE(exporter, nullptr);
  // An obsolete folded continuation line (RFC 9112 5.2): refused, or the
  // handler sees no credential (libmicrohttpd 0.9.75 folds it into the name).
  const HttpResponse resp = Fetch(
      exporter->port(), "GET /metrics HTTP/1.1\r\nAuthorization: Bearer\r\n good\r\n\r\n");
  if (resp.status != "400 Bad Request") {
    EXPECT_EQ(resp.status, "200 OK");
    ASSERT_EQ(seen.size(), 1u);
    EXPECT_NE(seen[0], std::optional<std::string>("Bearer good"));
    EXPECT_NE(seen[0], std::optional<std::string>("Bearer  good"));
  }
}

TEST(HttpExporterTest, HandlerStatusHeadersAndContentType) {
  LogCapture log;
  HttpExporter::Response answer;
  auto exporter = StartHandlerOrDie([&answer](const HttpExporter::Request&) { return answer; });
  ASSERT_NE(exporter, nullptr);
  answer.status = 403;
  answer.content_type = "text/plain";
  answer.body = "no\n";
  answer.headers = {
      {"X-Fine", "yes"}, {"X-Split", "a\r\nSet-Cookie: injected"}, {"X-Bad\nName", "v"}, {"", "v"}};
  HttpResponse resp = Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(resp.status, "403 Forbidden");
  EXPECT_NE(resp.headers.find("Content-Type: text/plain\r\n"), std::string::npos);
  EXPECT_NE(resp.headers.find("X-Fine: yes\r\n"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.headers.find("X-Split"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.headers.find("Set-Cookie"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.headers.find("X-Bad"), std::string::npos) << resp.headers;
  EXPECT_EQ(resp.body, "no\n");
  EXPECT_GE(log.Count("dropping a malformed response header"), 3);

  answer = HttpExporter::Response{};
  answer.status = 299;  // not one the exporter knows
  EXPECT_EQ(Fetch(exporter->port(), "GET /metrics HTTP/1.0\r\n\r\n").status,
"500 Internal Server Error");
}

}  // namespace
}  // namespace opjit::metrics

// CompileWatch: a compile past the threshold is logged while it runs and when
// it ends; a quick one is not.
#include "server/compiler/compile_watch.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "server/common/logging.h"
#include "spdlog/sinks/ostream_sink.h"

namespace opjit::compiler {
namespace {

using namespace std::chrono_literals;

// Collects what the "compiler" logger writes while it lives.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(stream_)) {
    sink_->set_pattern("%l %v");
    Logger("compiler")->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = Logger("compiler")->sinks();
    for (auto it = sinks.begin(); it != sinks.end(); ++it) {
      if (*it == sink_) {
        sinks.erase(it);
        break;
      }
    }
  }
  std::string text() {
    sink_->flush();
    return stream_.str();
  }

 private:
  std::ostringstream stream_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

TEST(CompileWatchTest, SlowCompileIsLoggedWhileRunningAndAtItsEnd) {
  LogCapture log;
  CompileWatch watch(100ms, 200ms);
  const uint64_t quick = watch.Begin("ns/quick (CPU, key 111111111111)");
  watch.End(quick, true);
  const uint64_t slow = watch.Begin("ns/slow (CPU, key 222222222222)");
  // Not a timing assertion: wait (up to 20 s on a loaded machine) for the
  // report, then for a reminder.
  for (int i = 0; i < 2000 && watch.reported() == 0; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(watch.reported(), 1u);
  for (int i = 0; i < 2000 && Count(log.text(), "still running") < 2; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  watch.End(slow, false);
  const std::string text = log.text();
  EXPECT_NE(text.find("warning compile of ns/slow (CPU, key 222222222222) still running after "),
            std::string::npos)
      << text;
  EXPECT_GE(Count(text, "still running"), 2u) << text;  // a reminder
  EXPECT_NE(text.find("info compile of ns/slow (CPU, key 222222222222) failed after "),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("ns/quick"), std::string::npos) << text;
  EXPECT_EQ(watch.reported(), 1u);  // reminders count once
}

TEST(CompileWatchTest, EndPastTheThresholdLogsTheTotalEvenUnreported) {
  LogCapture log;
  CompileWatch watch(1ms, 1h);
  const uint64_t t = watch.Begin("f.cc (CPU, key 333333333333)");
  std::this_thread::sleep_for(5ms);
  watch.End(t, true);
  EXPECT_NE(log.text().find("compile of f.cc (CPU, key 333333333333) finished after"),
            std::string::npos)
      << log.text();
}

TEST(CompileWatchTest, OffMeansNoThreadAndNoLog) {
  LogCapture log;
  CompileWatch watch(0ms, 1s);
  const uint64_t t = watch.Begin("x");
  EXPECT_EQ(t, 0u);
  watch.End(t, true);
  watch.End(12345, true);  // unknown tickets are ignored
  EXPECT_EQ(log.text(), "");
}

}  // namespace
}  // namespace opjit::compiler

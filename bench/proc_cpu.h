// CPU time of processes from /proc, for the benchmarks' CPU columns.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace opjit::bench {

inline std::string ReadProcFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// CPU seconds (user + system) of process `pid`; 0 if unreadable.
inline double CpuSeconds(pid_t pid) {
  const std::string all = ReadProcFile("/proc/" + std::to_string(pid) + "/stat");
  const auto close = all.rfind(')');
  if (close == std::string::npos || close + 2 > all.size()) return 0;
  std::istringstream rest(all.substr(close + 2));
  std::string state;
  long skip = 0, utime = 0, stime = 0;
  rest >> state;
  for (int i = 0; i < 10; ++i) rest >> skip;
  rest >> utime >> stime;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU seconds of the executor processes (opjit-exec-worker) that are
// children of `daemon`: pool workers and fast channels' executors.
inline double ExecutorCpuSeconds(pid_t daemon) {
  double total = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = ReadProcFile((e.path() / "stat").string());
    const auto open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    if (stat.substr(open + 1, close - open - 1) != "opjit-exec-work") continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == daemon) total += CpuSeconds(std::stoi(name));
  }
  return total;
}

}  // namespace opjit::bench

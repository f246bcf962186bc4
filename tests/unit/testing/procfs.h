// A snapshot of /proc for tests that look for their own children (executors,
// compile workers, sandboxes). Processes come and go while it is read, so
// nothing here throws: a process that vanished mid-read is left out (or its
// unreadable files are empty).
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>

#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace opjit::testing {

struct ProcInfo {
  pid_t pid = 0;
  pid_t ppid = 0;
  std::string comm;     // from /proc/<pid>/stat, at most 15 characters
  long cpu_ticks = 0;   // utime + stime
  std::string cmdline;  // NUL-separated argv
  std::string status;   // /proc/<pid>/status as text

  // A field of `status` ("Uid", "NSpid", ...), or "" when absent.
  std::string StatusField(const std::string& key) const {
    std::istringstream in(status);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind(key + ":\t", 0) == 0) return line.substr(key.size() + 2);
    }
    return "";
  }
};

// The whole of a /proc file, or "" when it cannot be read. POSIX reads, not
// iostreams: libstdc++'s filebuf throws from underflow when read() fails
// (ESRCH from a process that exited after the open), and istreambuf_iterator
// passes that exception on whatever the stream's exception mask says.
inline std::string ReadProcFile(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fd);
  return out;
}

// Every process whose stat could be read right now.
inline std::vector<ProcInfo> ListProcesses() {
  std::vector<ProcInfo> out;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return out;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string base = "/proc/" + name;
    const std::string stat = ReadProcFile(base + "/stat");
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close + 2 > stat.size()) {
      continue;
    }
    ProcInfo p;
    p.pid = static_cast<pid_t>(std::atol(name.c_str()));
    p.comm = stat.substr(open + 1, close - open - 1);
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0, skip = 0, utime = 0, stime = 0;
    rest >> state >> ppid;
    for (int i = 0; i < 9; ++i) rest >> skip;
    rest >> utime >> stime;
    p.ppid = static_cast<pid_t>(ppid);
    p.cpu_ticks = utime + stime;
    p.cmdline = ReadProcFile(base + "/cmdline");
    p.status = ReadProcFile(base + "/status");
    out.push_back(std::move(p));
  }
  ::closedir(dir);
  return out;
}

}  // namespace opjit::testing

// The pieces every benchmark that starts its own opjitd needs: the daemon
// process (its own temp state dir, a unix socket and a TCP port), a signal
// handler that stops it, and medians.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/cpp/opjit_client.h"

extern char** environ;

namespace opjit::bench {

using Clock = std::chrono::steady_clock;
using client::Client;

inline double UsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// Nearest-rank percentile of `v` (sorted in place); p in (0, 1].
inline double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

inline double Median(std::vector<double> v) { return Percentile(v, 0.5); }

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string Tail(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(s.size() - n);
}

// The opjitd a benchmark starts: argv[2] when given, else the one next to
// the benchmark's own binary (the build tree's bin/).
inline std::string OpjitdPath(int argc, char** argv) {
  if (argc > 2) return argv[2];
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "opjitd";
  std::string dir(self, static_cast<size_t>(n));
  return dir.substr(0, dir.rfind('/') + 1) + "opjitd";
}

// The daemon's pid, for the signal handler: a Ctrl-C must not leave it running.
inline volatile sig_atomic_t g_daemon_pid = -1;

inline void OnFatalSignal(int sig) {
  if (g_daemon_pid > 0) kill(g_daemon_pid, SIGTERM);
  signal(sig, SIG_DFL);
  raise(sig);
}

// Waits for child `pid` to exit, for at most `patience`, then SIGKILLs it.
// Returns its wait status.
inline int WaitOrKill(pid_t pid, std::chrono::seconds patience) {
  int status = 0;
  const auto give_up = Clock::now() + patience;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > give_up) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status;
}

// ---------------------------------------------------------------------------
// The opjitd under test: its own temp state dir, a unix socket and a TCP port.

class DaemonProcess {
 public:
  DaemonProcess(std::string binary, std::string dir, std::vector<std::string> extra_args = {},
                std::string config = "")
      : binary_(std::move(binary)),
        dir_(std::move(dir)),
        extra_args_(std::move(extra_args)),
        config_(config.empty() ? dir_ + "/c.toml" : config) {}
  ~DaemonProcess() { Stop(); }

  // Starts opjitd and waits until it answers on the unix socket and has
  // written its TCP endpoint. On failure returns the reason (with the log's tail).
  std::optional<std::string> Start(bool with_config) {
    std::vector<std::string> argv = {binary_,        "--state-dir", dir_ + "/state", "--listen",
                                     unix_address(), "--listen",    "127.0.0.1:0"};
    if (with_config) {
      argv.push_back("--config");
      argv.push_back(config_);
    }
    argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
    log_path_ = dir_ + (with_config ? "/opjitd.log" : "/opjitd-noconfig.log");
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    int log_fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (log_fd >= 0) {
      posix_spawn_file_actions_adddup2(&fa, log_fd, 1);
      posix_spawn_file_actions_adddup2(&fa, log_fd, 2);
    }
    int rc = posix_spawn(&pid_, binary_.c_str(), &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (log_fd >= 0) close(log_fd);
    if (rc != 0) {
      pid_ = -1;
      return "cannot spawn " + binary_ + ": " + std::strerror(rc);
    }
    g_daemon_pid = pid_;
    auto c = Client::Connect({.address = unix_address()});
    if (!c.ok()) return c.status().ToString();
    const auto give_up = Clock::now() + std::chrono::seconds(60);
    bool answered = false;
    while (Clock::now() < give_up) {
      if ((*c)->WaitForReady(std::chrono::milliseconds(100)).ok() && (*c)->Info().ok()) {
        answered = true;
        break;
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        g_daemon_pid = -1;
        return "opjitd exited during startup: " + Tail(ReadFile(log_path_), 1500);
      }
    }
    if (!answered) return "opjitd did not answer within 60 s: " + Tail(ReadFile(log_path_), 1500);
    // The endpoints file is written once every address is bound.
    while (Clock::now() < give_up) {
      std::istringstream lines(ReadFile(dir_ + "/state/endpoints"));
      for (std::string line; std::getline(lines, line);) {
        if (!line.empty() && line.rfind("unix:", 0) != 0) tcp_address_ = line;
      }
      if (!tcp_address_.empty()) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return "opjitd answered but wrote no TCP endpoint to " + dir_ + "/state/endpoints";
  }

  // SIGTERM, then wait (SIGKILL after 20 s). Returns the exit status text.
  std::string Stop() {
    if (pid_ <= 0) return "";
    kill(pid_, SIGTERM);
    const int status = WaitOrKill(pid_, std::chrono::seconds(20));
    pid_ = -1;
    g_daemon_pid = -1;
    if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
    return "signal " + std::to_string(WIFSIGNALED(status) ? WTERMSIG(status) : -1);
  }

  std::string unix_address() const { return "unix:" + dir_ + "/s.sock"; }
  pid_t pid() const { return pid_; }
  const std::string& tcp_address() const { return tcp_address_; }
  const std::string& log_path() const { return log_path_; }

 private:
  const std::string binary_;
  const std::string dir_;
  const std::vector<std::string> extra_args_;
  const std::string config_;
  std::string log_path_;
  std::string tcp_address_;
  pid_t pid_ = -1;
};

}  // namespace opjit::bench

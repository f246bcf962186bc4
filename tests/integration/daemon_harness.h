// Test harness: runs the real opjitd binary in a temp state dir on a unix
// socket and drives it with the real clients (C++ library and opjit CLI).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "client/cpp/opjit_client.h"

namespace opjit::testing {

// A fresh temp directory, removed with its content on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct ProcessResult {
  int exit_code = -1;  // -1: killed by a signal
  std::string out, err;
};

// Runs `argv` to completion, capturing stdout and stderr.
ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env = {});

std::string BinDir();     // <build>/bin
std::string SourceDir();  // repository root

// An elementwise CPU op: one float32 input "x", one float32 output "y", the
// kernel `source` with its entry `entry`.
v1::OpDef FloatUnaryOp(const std::string& name, const std::string& entry, const std::string& source);

class Daemon {
 public:
  // `state_dir` holds the registry and cache; the socket is <state_dir>/opjitd.sock.
  explicit Daemon(std::string state_dir, std::vector<std::string> extra_args = {});
  ~Daemon();  // SIGTERM and wait, if still running

  // Starts opjitd and waits until it answers (false if it exited first).
  bool Start();
  // SIGTERM, then wait; returns the exit code.
  int Stop();
  // SIGKILL, then reap.
  void Kill9();
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  std::string address() const { return "unix:" + state_dir_ + "/opjitd.sock"; }
  const std::string& state_dir() const { return state_dir_; }
  // Everything the daemon wrote to stderr so far.
  std::string Log() const;

  std::unique_ptr<client::Client> NewClient() const;
  // Runs `opjit --server <address> args...`.
  ProcessResult Cli(const std::vector<std::string>& args) const;

 private:
  std::string state_dir_;
  std::vector<std::string> extra_args_;
  std::string log_path_;
  pid_t pid_ = -1;
};

}  // namespace opjit::testing

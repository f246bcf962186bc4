#include "tests/integration/daemon_harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

extern char** environ;

namespace opjit::testing {
namespace {

std::vector<char*> CArgs(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

int ExitCode(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

}  // namespace

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "opjit-test-XXXXXX").string();
  char* p = mkdtemp(tmpl.data());
  if (p == nullptr) abort();
  path_ = p;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string BinDir() { return std::string(OPJIT_BINARY_DIR) + "/bin"; }
std::string SourceDir() { return OPJIT_SOURCE_DIR; }

v1::OpDef FloatUnaryOp(const std::string& name, const std::string& entry, const std::string& source) {
  v1::OpDef op;
  op.set_name(name);
  auto* in = op.add_inputs();
  in->set_index(0);
  in->set_name("x");
  op.add_outputs()->set_name("y");
  auto* df = op.add_dtype_formats();
  df->add_dtypes("float32");
  df->add_dtypes("float32");
  auto* impl = op.add_implementations();
  impl->set_target("CPU");
  impl->set_entry(entry);
  impl->set_source(source);
  return op;
}

ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) abort();
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&fa, err_pipe[1], 2);
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.push_back(*e);
  for (const auto& e : extra_env) env.push_back(e);
  auto args = CArgs(argv);
  auto envp = CArgs(env);
  pid_t pid = -1;
  ProcessResult r;
  if (posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), envp.data()) != 0) {
    r.err = "spawn failed: " + argv[0];
    return r;
  }
  posix_spawn_file_actions_destroy(&fa);
  close(out_pipe[1]);
  close(err_pipe[1]);
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      } else {
        (i == 0 ? r.out : r.err).append(buf, n);
      }
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = ExitCode(status);
  return r;
}

Daemon::Daemon(std::string state_dir, std::vector<std::string> extra_args)
    : state_dir_(std::move(state_dir)), extra_args_(std::move(extra_args)) {
  std::filesystem::create_directories(state_dir_);
  log_path_ = state_dir_ + "/../" + std::filesystem::path(state_dir_).filename().string() +
              ".opjitd.log";
}

Daemon::~Daemon() {
  if (pid_ > 0) Stop();
}

bool Daemon::Start() {
  std::vector<std::string> argv = {BinDir() + "/opjitd", "--state-dir", state_dir_,
                                   "--listen", address(), "--log-level", "debug"};
  // The same suites run against both runners: ctest registers them a second
  // time with OPJIT_TEST_ISOLATION=in-daemon.
  if (const char* iso = std::getenv("OPJIT_TEST_ISOLATION"); iso != nullptr && *iso != '\0') {
    argv.push_back("--isolation");
    argv.push_back(iso);
  }
  argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
  int log_fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, log_fd, 2);
  posix_spawn_file_actions_adddup2(&fa, log_fd, 1);
  auto args = CArgs(argv);
  int rc = posix_spawn(&pid_, argv[0].c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(log_fd);
  if (rc != 0) {
    pid_ = -1;
    return false;
  }
  auto c = NewClient();
  // Wait for the daemon to answer, or to exit (then report failure at once).
  for (int i = 0; i < 600; ++i) {
    if (c->WaitForReady(std::chrono::milliseconds(100)).ok() && c->Info().ok()) return true;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
  }
  return false;
}

int Daemon::Stop() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return ExitCode(status);
}

void Daemon::Kill9() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

std::string Daemon::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<client::Client> Daemon::NewClient() const {
  auto c = client::Client::Connect({.address = address()});
  if (!c.ok()) abort();
  return *std::move(c);
}

ProcessResult Daemon::Cli(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {BinDir() + "/opjit", "--server", address()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

}  // namespace opjit::testing

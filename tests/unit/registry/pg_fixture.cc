#include "tests/unit/registry/pg_fixture.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace opjit::registry::testing {
namespace {

namespace fs = std::filesystem;

// The bin directory of the newest PostgreSQL installed the Debian way
// (/usr/lib/postgresql/<major>/bin), or $OPJIT_PG_BIN.
std::string FindBinDir() {
  if (const char* env = getenv("OPJIT_PG_BIN"); env != nullptr && *env != '\0') return env;
  std::string best;
  int best_major = -1;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/usr/lib/postgresql", ec)) {
    std::string bin = entry.path() / "bin";
    int major = std::atoi(entry.path().filename().c_str());
    if (major > best_major && fs::exists(bin + "/initdb") && fs::exists(bin + "/pg_ctl")) {
      best = bin;
      best_major = major;
    }
  }
  return best;
}

// Where a fresh initdb is kept for the next server to copy (initdb takes
// seconds; a copy a fraction of one, and ctest runs every test in its own
// process). In the build tree; empty when there is none.
std::string TemplateDir(const std::string& bin) {
#ifdef OPJIT_BINARY_DIR
  std::string tag = bin;
  std::replace(tag.begin(), tag.end(), '/', '_');
  return std::string(OPJIT_BINARY_DIR) + "/tests/pg_template" + tag;
#else
  (void)bin;
  return "";
#endif
}

// Hands `dir` and everything under it to nobody when we are root.
bool GiveToNobody(const std::string& dir) {
  if (geteuid() != 0) return true;
  passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) return false;
  if (lchown(dir.c_str(), nobody->pw_uid, nobody->pw_gid) != 0) return false;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (lchown(it->path().c_str(), nobody->pw_uid, nobody->pw_gid) != 0) return false;
  }
  return !ec;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// /proc/<pid>/stat: the state letter and the parent pid; false when the
// process is gone.
bool ReadStat(pid_t pid, char* state, pid_t* ppid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(f, line)) return false;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  long parent = 0;
  rest >> *state >> parent;
  *ppid = static_cast<pid_t>(parent);
  return !rest.fail();
}

std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    char state = 0;
    pid_t ppid = 0;
    if (ReadStat(static_cast<pid_t>(pid), &state, &ppid) && ppid == parent) {
      out.push_back(static_cast<pid_t>(pid));
    }
  }
  closedir(d);
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PgServer>> PgServer::Start() {
  std::string bin = FindBinDir();
  if (bin.empty()) {
    return absl::NotFoundError(
        "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb; set OPJIT_PG_BIN)");
  }
  if (geteuid() == 0 && access("/usr/bin/setpriv", X_OK) != 0) {
    return absl::NotFoundError(
        "running as root, and setpriv (to run PostgreSQL as nobody) is missing");
  }
  std::string tmpl = (fs::temp_directory_path() / "opjit_pg_XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) return absl::InternalError("mkdtemp failed");
  if (!GiveToNobody(tmpl)) {
    fs::remove_all(tmpl);
    return absl::InternalError("cannot hand the temp dir to nobody");
  }
  int port = FreePort();
  if (port <= 0) {
    fs::remove_all(tmpl);
    return absl::InternalError("no free port");
  }
  std::unique_ptr<PgServer> server(new PgServer(bin, tmpl, port));
  const std::string data = tmpl + "/data";
  const std::string cached = TemplateDir(bin);
  std::error_code ec;
  if (!cached.empty() && fs::exists(cached + "/PG_VERSION", ec)) {
    fs::copy(cached, data, fs::copy_options::recursive, ec);
    if (ec || !GiveToNobody(data)) {
      return absl::InternalError(absl::StrCat("cannot copy ", cached, ": ", ec.message()));
    }
  } else {
    absl::Status s =
        server->Run("initdb", "-D " + data + " -A trust -U postgres --no-sync -E UTF8");
    if (!s.ok()) return s;
    if (!cached.empty()) {
      // Publish it whole (rename), or not at all when another process won.
      std::string staging = absl::StrCat(cached, ".", getpid());
      fs::create_directories(fs::path(cached).parent_path(), ec);
      fs::copy(data, staging, fs::copy_options::recursive, ec);
      if (ec || rename(staging.c_str(), cached.c_str()) != 0) fs::remove_all(staging, ec);
    }
  }
  absl::Status s = server->Restart();
  if (!s.ok()) return s;
  return server;
}

PgServer::~PgServer() {
  (void)Thaw();
  if (running_) (void)Stop(/*immediate=*/true);
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

absl::Status PgServer::Run(const std::string& tool, const std::string& args) {
  std::vector<std::string> argv;
  if (geteuid() == 0) {
    argv = {"/usr/bin/setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"};
  }
  argv.push_back(bin_ + "/" + tool);
  // Our arguments hold no quoted spaces except pg_ctl's -o, passed whole.
  std::istringstream in(args);
  for (std::string a; in >> a;) {
    if (a == "-o") {
      argv.push_back(a);
      std::string rest;
      std::getline(in, rest, '\'');  // up to the opening quote
      std::getline(in, rest, '\'');  // the quoted options
      argv.push_back(rest);
      continue;
    }
    argv.push_back(a);
  }
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);

  std::string log = dir_ + "/tools.log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, cargv[0], &fa, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return absl::InternalError(absl::StrCat("cannot run ", tool, ": ", strerror(rc)));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(tool, " failed (status ", status, "):\n", LogTail()));
  }
  return absl::OkStatus();
}

std::string PgServer::LogTail() const {
  std::string out;
  for (const char* name : {"/tools.log", "/server.log"}) {
    std::ifstream f(dir_ + name);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string text = ss.str();
    if (text.size() > 3000) text = text.substr(text.size() - 3000);
    absl::StrAppend(&out, name, ":\n", text, "\n");
  }
  return out;
}

absl::Status PgServer::Stop(bool immediate) {
  absl::Status s = Run("pg_ctl", absl::StrCat("-D ", dir_, "/data -w -t 30 -m ",
                                              immediate ? "immediate" : "fast", " stop"));
  if (s.ok()) running_ = false;
  return s;
}

absl::Status PgServer::Restart() {
  absl::Status s =
      Run("pg_ctl", absl::StrCat("-D ", dir_, "/data -l ", dir_, "/server.log -w -t 30 -o '-k ",
                                 dir_, " -p ", port_,
                                 " -c listen_addresses=127.0.0.1 -c fsync=off "
                                 "-c full_page_writes=off -c max_connections=200' start"));
  if (s.ok()) running_ = true;
  return s;
}

absl::Status PgServer::Freeze() {
  if (!running_) return absl::FailedPreconditionError("the server is not running");
  if (!frozen_.empty()) return absl::FailedPreconditionError("already frozen");
  std::ifstream f(dir_ + "/data/postmaster.pid");
  long postmaster = 0;
  if (!(f >> postmaster) || postmaster <= 0) {
    return absl::InternalError("cannot read postmaster.pid");
  }
  const pid_t pm = static_cast<pid_t>(postmaster);
  // The postmaster first, so that it starts nothing new meanwhile.
  if (kill(pm, SIGSTOP) != 0) return absl::InternalError(absl::StrCat("kill: ", strerror(errno)));
  frozen_.push_back(pm);
  for (pid_t child : ChildrenOf(pm)) {
    if (kill(child, SIGSTOP) == 0) frozen_.push_back(child);
  }
  // A stop signal takes effect asynchronously: wait until every process is.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (pid_t pid : frozen_) {
    for (;;) {
      char state = 0;
      pid_t ppid = 0;
      // Stopped, or exited (a zombie: the frozen postmaster cannot reap it).
      if (!ReadStat(pid, &state, &ppid) || state == 'T' || state == 't' || state == 'Z' ||
          state == 'X') {
        break;
      }
      if (std::chrono::steady_clock::now() > until) {
        return absl::DeadlineExceededError(absl::StrCat("process ", pid, " did not stop"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return absl::OkStatus();
}

absl::Status PgServer::Thaw(bool postmaster) {
  if (frozen_.empty()) return absl::OkStatus();
  for (size_t i = 1; i < frozen_.size(); ++i) kill(frozen_[i], SIGCONT);
  frozen_.resize(1);
  if (postmaster) {
    kill(frozen_[0], SIGCONT);
    frozen_.clear();
  }
  return absl::OkStatus();
}

std::string PgServer::ServerLog() const {
  std::ifstream f(dir_ + "/server.log");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string PgServer::Url(const std::string& db) const {
  return absl::StrCat("postgresql://postgres@127.0.0.1:", port_, "/", db);
}

absl::StatusOr<std::string> PgServer::Query(const std::string& db, const std::string& sql) {
  PGconn* conn = PQconnectdb(Url(db).c_str());
  if (PQstatus(conn) != CONNECTION_OK) {
    std::string err = PQerrorMessage(conn);
    PQfinish(conn);
    return absl::UnavailableError(err);
  }
  PGresult* r = PQexec(conn, sql.c_str());
  absl::StatusOr<std::string> out;
  ExecStatusType st = PQresultStatus(r);
  if (st == PGRES_TUPLES_OK) {
    out = PQntuples(r) > 0 ? std::string(PQgetvalue(r, 0, 0)) : std::string();
  } else if (st == PGRES_COMMAND_OK) {
    out = std::string();
  } else {
    out = absl::InternalError(absl::StrCat(sql, ": ", PQresultErrorMessage(r)));
  }
  PQclear(r);
  PQfinish(conn);
  return out;
}

absl::StatusOr<std::string> PgServer::CreateDatabase(const std::string& name) {
  auto r = Query("postgres", "CREATE DATABASE " + name);
  if (!r.ok()) return r.status();
  return Url(name);
}

void PgTest::SetUpTestSuite() {
  auto server = PgServer::Start();
  if (server.ok()) {
    server_ = std::move(*server);
    start_status_ = absl::OkStatus();
  } else {
    start_status_ = server.status();
  }
}

void PgTest::TearDownTestSuite() { server_.reset(); }

void PgTest::SetUp() {
  if (start_status_.code() == absl::StatusCode::kNotFound) {
    GTEST_SKIP() << start_status_.message();
  }
  ASSERT_NE(server_, nullptr) << "PostgreSQL did not start: " << start_status_;
  ASSERT_TRUE(server_->Thaw().ok());
  // An earlier test that stopped the server and failed before restarting it.
  if (!server_->running()) ASSERT_TRUE(server_->Restart().ok());
}

std::string PgTest::NewDatabase() {
  auto url = server_->CreateDatabase(absl::StrCat("opjit_test_", ++databases_));
  EXPECT_TRUE(url.ok()) << url.status();
  return url.ok() ? *url : std::string();
}

}  // namespace opjit::registry::testing

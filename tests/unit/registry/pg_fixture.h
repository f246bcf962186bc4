// A throwaway PostgreSQL server for tests: initdb into a temp dir (trust
// auth), postgres on 127.0.0.1 and a free port, a unix socket in the same dir.
// When the test runs as root, the server runs as `nobody` (PostgreSQL refuses
// root). Everything is stopped and removed when the object dies.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace opjit::registry::testing {

class PgServer {
 public:
  // Starts a server. NOT_FOUND when the PostgreSQL binaries are not installed
  // (callers skip); other errors carry the tail of the server's log.
  static absl::StatusOr<std::unique_ptr<PgServer>> Start();

  // Stops the server (immediate) and removes its directory.
  ~PgServer();
  PgServer(const PgServer&) = delete;
  PgServer& operator=(const PgServer&) = delete;

  // A libpq URI for database `db` (as the superuser "postgres", no password).
  std::string Url(const std::string& db) const;

  // Creates a database; returns its URI.
  absl::StatusOr<std::string> CreateDatabase(const std::string& name);

  // Runs `sql` on database `db`; returns the first column of the first row
  // (empty when there is none).
  absl::StatusOr<std::string> Query(const std::string& db, const std::string& sql);

  // pg_ctl stop: `immediate` kills the server the way a crash would.
  absl::Status Stop(bool immediate);
  // Starts it again after Stop(), on the same port and data.
  absl::Status Restart();

  // Freezes the whole server (the postmaster, then every process it
  // started) with SIGSTOP, the way a hung host looks: the kernel still
  // accepts connections and ACKs data, nothing answers. Returns once every
  // process is stopped. Thaw() (or the destructor) resumes it.
  absl::Status Freeze();
  // SIGCONT to the processes the postmaster started (backends first), and
  // with `postmaster`, to the postmaster too. A frozen postmaster holds back
  // new connections and cancel requests.
  absl::Status Thaw(bool postmaster = true);
  bool frozen() const { return !frozen_.empty(); }

  // The server's log (errors, with the statement that raised them).
  std::string ServerLog() const;

  int port() const { return port_; }
  bool running() const { return running_; }

 private:
  PgServer(std::string bin, std::string dir, int port)
      : bin_(std::move(bin)), dir_(std::move(dir)), port_(port) {}
  // Runs one PostgreSQL tool (as nobody when we are root), output to the log.
  absl::Status Run(const std::string& tool, const std::string& args);
  std::string LogTail() const;

  const std::string bin_;
  const std::string dir_;
  const int port_;
  bool running_ = false;
  // What Freeze() stopped, the postmaster first; those not yet thawed.
  std::vector<pid_t> frozen_;
};

// A test suite base with one server for the whole suite (started in
// SetUpTestSuite). Tests skip when PostgreSQL is not installed and fail when
// it is but cannot start.
class PgTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override;

  // A fresh database for this test; returns its URI.
  std::string NewDatabase();

  static PgServer* server() { return server_.get(); }

 private:
  inline static std::unique_ptr<PgServer> server_;
  inline static absl::Status start_status_;
  inline static int databases_ = 0;
};

}  // namespace opjit::registry::testing

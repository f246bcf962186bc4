// opjitd's running daemon: every subsystem, built from a DaemonConfig in
// dependency order, served until SIGTERM or SIGINT, and stopped in the
// reverse of that order.
//
//   auto daemon = Daemon::Create(config);   // a problem: its status, logged by main
//   daemon->Serve();                        // until SIGTERM/SIGINT; SIGHUP reloads
//   daemon->Shutdown();                     // or let it go out of scope
//
// The stop order is the reverse of Daemon::Parts' member order below (C++
// destroys members bottom to top): nothing is reset by hand. A part goes
// where what it uses is above it and what uses it is below.
#pragma once

#include <signal.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "server/common/mutex.h"
#include "server/common/systemd_notify.h"
#include "server/config.h"

namespace opjit {

class HealthMonitor;
struct SubordinateIds;
namespace access {
class AccessControl;
class QuotaManager;
}  // namespace access
namespace autograd {
class Autograd;
}
namespace evaluate {
class Evaluator;
}
namespace compiler {
class KernelCompiler;
}
namespace exec {
class ChannelManager;
class Executor;
class HandleTable;
}  // namespace exec
namespace metrics {
class HttpExporter;
class Registry;
}  // namespace metrics
namespace registry {
class Registry;
}
namespace rpc {
class GrpcServer;
struct ServerFacts;
}
namespace runner {
class KernelRunner;
}
namespace tensor {
class RegionManager;
}

// Runs a function when it is destroyed: a step of the stop order that is
// not a destructor (draining the server, joining a thread), placed among
// the members where it must happen.
class OnExit {
 public:
  OnExit() = default;
  OnExit(const OnExit&) = delete;
  OnExit& operator=(const OnExit&) = delete;
  ~OnExit() {
    if (f_) f_();
  }
  void Set(std::function<void()> f) { f_ = std::move(f); }

 private:
  std::function<void()> f_;
};

class Daemon {
 public:
  // Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (before any
  // other thread exists, so every thread inherits the mask; Serve takes
  // them), then builds every part (Parts, top to bottom). Call it from the
  // thread that will call Serve. An error names the part that failed, as
  // main logs it ("registry: ...", "another opjitd (pid ...) ...").
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(const DaemonConfig& config);

  ~Daemon();  // Shutdown()
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Tells systemd the daemon is ready (once healthy), then waits for
  // signals: each SIGHUP reloads the --config file (what can change while
  // serving), SIGTERM or SIGINT returns. Returns the signal that ended it
  // (0 when waiting for signals failed, which is logged).
  int Serve();

  // Tells systemd the daemon is stopping and stops every part in the
  // reverse of Parts' order, then logs "bye". Idempotent; nothing but the
  // parts is stopped when Serve never ran (a failed Create).
  void Shutdown();

  // The parts, in the order they are built (Create, top to bottom), and
  // stopped in the reverse order as they are destroyed (bottom to top).
  struct Parts {
    ~Parts();
    // The state dir's lock (<state_dir>/opjitd.lock, holding the pid): let
    // go last, when the state dir is free for the next daemon.
    OnExit unlock_state_dir;
    // <state_dir>/endpoints: removed once nothing serves.
    OnExit remove_endpoints;
    // What the health probes saw, read by the metrics (and the health
    // monitor while it lives).
    std::atomic<bool> store_up{true};
    std::atomic<HealthMonitor*> health_view{nullptr};
    // Used by the server, the fast channels and the exporter: outlive them.
    std::unique_ptr<access::AccessControl> access;
    std::unique_ptr<access::QuotaManager> quotas;
    std::unique_ptr<metrics::Registry> metrics;
    // The core, each part using those above it.
    std::unique_ptr<registry::Registry> registry;
    std::unique_ptr<compiler::KernelCompiler> compiler;
    std::unique_ptr<tensor::RegionManager> regions;
    std::unique_ptr<runner::KernelRunner> runner;
    std::unique_ptr<exec::Executor> executor;
    std::unique_ptr<autograd::Autograd> autograd;
    std::unique_ptr<evaluate::Evaluator> evaluator;  // Verify, Benchmark
    std::unique_ptr<exec::HandleTable> handles;
    std::unique_ptr<exec::ChannelManager> channels;  // its destructor closes every channel
    OnExit unhook_channels;  // the registry stops telling the channels of changes
    // Releases lapsed leases and idle contexts once a second.
    Mutex reaper_mu;
    CondVar reaper_cv;
    bool reaper_stop ABSL_GUARDED_BY(reaper_mu) = false;
    std::thread reaper;
    OnExit stop_reaper;  // stops and joins the reaper
    // gRPC: stops accepting, then gives in-flight calls up to 5 s.
    std::unique_ptr<rpc::GrpcServer> server;
    OnExit drain_server;
    // Health, systemd and the metrics endpoint: the first to stop.
    systemd::ReadyGate ready;
    std::unique_ptr<HealthMonitor> health;
    OnExit hide_health;  // health_view = nullptr
    std::unique_ptr<metrics::HttpExporter> exporter;
    std::unique_ptr<systemd::WatchdogPinger> watchdog;
  };

 private:
  explicit Daemon(const DaemonConfig& config);
  // The steps of Create, in order; each fills its members of parts_.
  absl::Status BlockSignals();
  absl::Status PrepareStateDir();
  absl::Status StartRegistry();
  absl::Status StartCompiler();
  absl::Status StartRunner();
  absl::Status StartExecution();
  absl::Status StartAccess();
  absl::Status StartServer();
  void StartHealth();
  absl::Status StartMetricsExporter();

  std::unique_ptr<rpc::ServerFacts> DescribeHost();

  DaemonConfig cfg_;
  sigset_t signals_;
  bool served_ = false;
  std::unique_ptr<SubordinateIds> sub_ids_;     // StartCompiler's, for StartRunner
  std::string compile_worker_path_;             // for the health probe
  std::unique_ptr<rpc::ServerFacts> facts_;     // what GetServerInfo tells
  std::unique_ptr<Parts> parts_;
};

}  // namespace opjit
